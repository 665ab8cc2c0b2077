"""``dtrain submit/list/status/logs/stop``: parse, call ``dtrain.jobs.api``, print. No logic here.

``dtrain.cli.main`` registers ``COMMANDS`` on the main group.
"""

from __future__ import annotations

import re
import sys
import time
from typing import Any

import click
from dtrain.cli.common import OUTPUT_OPTION, TARGETS, echo_json, load_spec, spec_options
from dtrain.core.states import COMPLETED, FAILED, STOPPED

_RANK_ZERO = re.compile(r"^\[\S+ 0\]:")


def _fmt_time(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def progress_line(metrics: dict[str, float]) -> str:
    parts = [f"step {metrics['step']}"]
    if "loss" in metrics:
        parts.append(f"loss {metrics['loss']:.4f}")
    if "tokens_per_s" in metrics:
        parts.append(f"{metrics['tokens_per_s']:,.0f} tokens/s")
    return " · ".join(parts)


def _show_progress(job_id: str) -> None:
    """One progress line from rank 0's metric lines, rewritten in place on a terminal."""
    from dtrain.core.metrics_format import parse_metrics
    from dtrain.jobs import api as jobs

    tty = sys.stdout.isatty()
    shown = False
    for line in jobs.logs(job_id, follow=True, rank=0):
        metrics = parse_metrics(line)
        if metrics and "step" in metrics:
            text = progress_line(metrics)
            click.echo(f"\r\033[K{text}" if tty else text, nl=not tty)
            shown = True
    if shown and tty:
        click.echo()


def _finish(record: Any, output: str) -> None:
    from dtrain.core.errors import DtrainError
    from dtrain.jobs import api as jobs

    if output == "json":
        echo_json(record.to_dict())
    else:
        click.echo(f"{record.id} {record.name}: {record.status} after {record.duration}"
                   f" · output {record.output_location or '-'}")
    problem = jobs.not_completed(record)
    if problem:
        raise DtrainError(problem)


def _dry_run(spec: Any, output: str) -> None:
    """The resolved plan, the exact request the target's backend would send, and the files
    each source folder it uploads would pack (and the ones left out as secrets)."""
    from dtrain.core import secrets
    from dtrain.jobs import api as jobs
    from dtrain.planning.planner import plan

    resolved = plan(spec)
    request = jobs.build_request(spec)
    packed = jobs.packed_sources(request)
    # secrets given in plain text are sent, never printed
    shown = secrets.redact(request.to_dict(), secrets.plain_secrets(spec.environment))
    if output == "json":
        echo_json({"plan": resolved.to_dict(), "request": shown, "packed": packed})
        return
    from dtrain.planning.report import render_plan

    click.echo(render_plan(resolved))
    click.echo(f"\nrequest ({spec.compute.target}):")
    echo_json(shown)
    for folder, listing in packed.items():
        click.echo(f"\npacked from {folder} ({len(listing['files'])} files): "
                   + ", ".join(listing["files"]))
        if listing["secrets"]:
            click.echo("not packed, they look like secrets: " + ", ".join(listing["secrets"]))


def _submit_clients(spec: Any, yes: bool) -> dict[str, Any] | None:
    """EC2 asks before an expensive launch; the answer comes from --yes or the terminal."""
    if spec.compute.target != "ec2":
        return None

    def confirm(question: str) -> bool:
        try:
            return click.confirm(question, err=True)
        except click.Abort:  # no terminal to answer from (CI): the same as "no"
            click.echo(err=True)
            return False

    return {"assume_yes": yes, "confirm": confirm}


def _status_with_detail(record: Any) -> str:
    """The status, and while the job has not ended the target's finer one beside it
    (``Running (MonitorGone)``, ``Stopping (Interrupted)``)."""
    detail = (record.target_data or {}).get("secondary_status")
    if not detail or record.is_final or detail.casefold() == record.status.casefold():
        return record.status
    return f"{record.status} ({detail})"


def _print_transition(record: Any) -> None:
    """Status changes while waiting; cloud targets also report a finer secondary status."""
    if record.target != "local" and not record.is_final:
        click.echo(f"status: {_status_with_detail(record)}")


@click.command()
@spec_options(required=False)
@click.option("--resume", "resume", metavar="JOB", default=None,
              help="Continue JOB from its newest complete checkpoint: its own spec (or SPEC, "
                   "on the same target) with checkpoint.uri set to where JOB kept them.")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait for the job to end (and exit 1 unless it completed); on EC2, then up "
                   "to 5 min more until its nodes have terminated and its groups are removed.")
@click.option("--follow", "-f", is_flag=True, help="Stream every log line while it runs (to "
              "stderr with -o json, whose record stays alone on stdout).")
@click.option("--dry-run", is_flag=True, help="Print the plan and the request that would be sent; "
              "run nothing.")
@click.option("--yes", "-y", is_flag=True,
              help="EC2: launch without asking, even when max_run could cost more than "
                   "ec2.confirm_above_usd.")
@click.option("--stop-on-interrupt", is_flag=True,
              help="Ctrl-C (or a hang-up or SIGTERM) while waiting stops the job (SIGTERM, so "
                   "it checkpoints) instead of leaving it running.")
@OUTPUT_OPTION
def submit(spec_path: str | None, overrides: tuple[str, ...], target: str | None,
           resume: str | None, wait: bool, follow: bool, dry_run: bool, yes: bool,
           stop_on_interrupt: bool, output: str) -> None:
    """Run a job spec on its target (this machine by default).

    Waiting (the default) or --follow ends with the job; Ctrl-C then only stops the waiting:
    the job keeps running, and dtrain says how to follow or stop it. With --stop-on-interrupt,
    Ctrl-C stops the job too.
    """
    from dtrain.core.errors import SpecError
    from dtrain.jobs import api as jobs

    if spec_path is None and resume is None:
        raise SpecError("give a SPEC file, or --resume JOB to resubmit a job")
    if not wait and (follow or stop_on_interrupt):
        raise click.UsageError(f"{'--follow' if follow else '--stop-on-interrupt'} waits for the "
                               "job to end; drop --no-wait, or that flag")
    spec = load_spec(spec_path, overrides, target) if spec_path else None
    if resume:
        spec = jobs.resume_spec(resume, spec=spec, overrides=None if spec_path else
                                [*overrides, *([f"compute.target={target}"] if target else [])])
        click.echo(f"resuming {resume} from {spec.checkpoint.uri}", err=True)
    if dry_run:
        _dry_run(spec, output)
        return
    record = jobs.submit(spec, wait=False, clients=_submit_clients(spec, yes))
    if output != "json":
        click.echo(f"submitted {record.id} ({record.name}) · target {record.target} · "
                   f"logs: dtrain logs {record.id}")
    if not (wait or follow):
        if output == "json":
            echo_json(record.to_dict())
        return
    try:
        if follow:  # with -o json, stdout holds only the final record
            for line in jobs.logs(record.id, follow=True):
                click.echo(line, err=output == "json")
        elif output != "json":
            _show_progress(record.id)
        final = jobs.wait_for(record.id,
                              on_status=None if output == "json" else _print_transition)
    except KeyboardInterrupt:
        _interrupted(record, stop=stop_on_interrupt)
    _finish(final, output)


def _interrupted(record: Any, *, stop: bool) -> None:
    """Ctrl-C while waiting: say what happens to the job, then exit 130."""
    import contextlib

    from dtrain.jobs import api as jobs

    # the stop before any word: after a hang-up, writing to the terminal fails
    stopped = jobs.stop(record.id) if stop else None
    with contextlib.suppress(OSError):
        click.echo(err=True)
        if stopped is not None:
            how = ("its nodes are terminated" if record.target == "ec2" else
                   "it checkpoints and ends within the grace period")
            click.echo(f"interrupted: stopping job {record.id} ({stopped.status}); {how}; see "
                       f"`dtrain status {record.id}`", err=True)
        else:
            click.echo(f"interrupted: job {record.id} ({record.name}) keeps running; follow it "
                       f"with `dtrain logs {record.id} --follow`, stop it with "
                       f"`dtrain stop {record.id}`", err=True)
    raise SystemExit(130)


@click.command("list")
@click.option("--target", type=click.Choice(TARGETS), default=None,
              help="Only jobs of this target.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True,
              help="Newest N jobs.")
@click.option("--refresh/--no-refresh", default=True, show_default=True,
              help="Ask the targets about jobs that have not ended (at most 10 s in all, "
                   "concurrently); --no-refresh lists what is recorded.")
@OUTPUT_OPTION
def list_command(target: str | None, limit: int, refresh: bool, output: str) -> None:
    """List recorded jobs, newest first."""
    from dtrain.jobs import api as jobs

    records = jobs.list_jobs(target=target, limit=limit,
                             refresh_s=jobs.LIST_REFRESH_S if refresh else None)
    if output == "json":
        echo_json([r.to_dict() for r in records])
        return
    width = max([4, *(len(r.name) for r in records)])
    click.echo(f"{'ID':<12}  {'NAME':<{width}}  {'TARGET':<9}  {'STATUS':<10}  {'CREATED':<19}  TIME")
    for r in records:
        status = "unreadable" if r.problem else r.status
        click.echo(f"{r.id:<12}  {r.name:<{width}}  {r.target:<9}  {status:<10}  "
                   f"{_fmt_time(r.created_at):<19}  {r.duration}")


@click.command()
@click.argument("job")
@OUTPUT_OPTION
def status(job: str, output: str) -> None:
    """Show a job's state (JOB: id, unique id prefix, or name for the latest), as its target
    tells it now; when the target cannot be asked (no credentials, no network), as last
    recorded, with a warning."""
    from dtrain.core.errors import DtrainError
    from dtrain.jobs import api as jobs

    record = jobs.find(job)  # an unknown job, a damaged store: their own errors
    try:
        record = jobs.get(record.id)
    except Exception as exc:
        asked = isinstance(exc, DtrainError) or type(exc).__module__.startswith("botocore")
        if record.problem or not asked:  # an unreadable record, or a bug: not the target's
            raise
        click.echo(f"warning: could not ask {record.target} about job {record.id} ({exc}); "
                   "showing what was last recorded", err=True)
    if output == "json":
        echo_json(record.to_dict())
        return
    rows = [("id", record.id), ("name", record.name), ("target", record.target),
            ("status", _status_with_detail(record)), ("created", _fmt_time(record.created_at)),
            ("started", _fmt_time(record.started_at)), ("ended", _fmt_time(record.ended_at)),
            ("duration", record.duration), ("logs", record.log_location or "-"),
            ("output", record.output_location or "-")]
    for key, value in rows:
        click.echo(f"{key:<9} {value}")
    if record.failure_reason:
        reason = record.failure_reason.strip().replace("\n", "\n" + " " * 10)  # under its column
        click.echo(f"{'reason':<9} {reason}")
    hint = jobs.resume_hint(record)
    if hint:
        click.echo(f"{'resume':<9} {hint}")


@click.command()
@click.argument("job")
@click.option("--follow", "-f", is_flag=True, help="Keep printing until the job ends.")
@click.option("--host", default=None,
              help="Only this host, as the lines name it: algo-2 (local, SageMaker), a node's "
                   "name (Slurm) or private IP (EC2).")
@click.option("--rank", type=int, default=None, help="Only this global rank.")
def logs(job: str, follow: bool, host: str | None, rank: int | None) -> None:
    """Print a job's logs: every host's lines in the order they were written, a worker's
    prefixed `[host rank]:`, a node agent's own `[host]`."""
    from dtrain.jobs import api as jobs

    printed = 0
    for line in jobs.logs(job, follow=follow, host=host, rank=rank):
        click.echo(line)
        printed += 1
    if not printed:
        from dtrain.core.errors import DtrainError

        record = jobs.get(job)
        gone = jobs.deleted_job_folder(record)
        if gone:
            raise DtrainError(gone)
        which = " and ".join(filter(None, [host and f"host {host}",
                                           rank is not None and f"rank {rank}"]))
        when = f"(it ended {record.status})" if record.is_final else "(yet)"
        click.echo(f"no log lines{' for ' + which if which else ''} {when} in job {job}",
                   err=True)


@click.command()
@click.argument("job")
@click.option("--wait/--no-wait", default=False, show_default=True,
              help="Wait until the job has stopped.")
@OUTPUT_OPTION
def stop(job: str, wait: bool, output: str) -> None:
    """Stop a job: its workers get SIGTERM, on which dtrain's Trainer writes a checkpoint, and
    SIGKILL when still running after the grace period (local: environment
    DTRAIN_STOP_GRACE_PERIOD, default 30 s; SageMaker: its own 120 s; Slurm: KillWait). EC2
    terminates the nodes. The job ends Stopped; `dtrain submit --resume JOB` continues it from
    its newest checkpoint."""
    from dtrain.jobs import api as jobs

    # as last recorded, before the stop (its own note on a shared name comes with the stop)
    ended = jobs.find(job, on_note=lambda _line: None).status in (COMPLETED, FAILED, STOPPED)
    record = jobs.stop(job)
    if wait:
        try:
            record = jobs.wait_for(record.id)
        except KeyboardInterrupt:
            click.echo(f"\ninterrupted: the stop was sent; job {record.id} ({record.status}) "
                       f"ends on its own; see `dtrain status {record.id}`", err=True)
            raise SystemExit(130) from None
    if output == "json":
        echo_json(record.to_dict())
    else:
        click.echo(f"{record.id} {record.name}: {record.status}")
        if ended:  # a stop still ends what of it runs (an EC2 peer of a failed node)
            click.echo(f"job {job} had already ended ({record.status}); the stop only ended "
                       "what of it may still have run", err=True)


@click.command()
@click.argument("job")
@click.option("--file", "output_path", type=click.Path(dir_okay=False, writable=True),
              default=None, help="File to write (default: JOB-report.html, or JOB-METRIC.svg).")
@click.option("--format", "fmt", type=click.Choice(["html", "svg"]), default="html",
              show_default=True, help="html: facts and every chart; svg: one chart.")
@click.option("--metric", default=None,
              help="svg: the metric to chart (default loss); html: an extra chart, "
                   "e.g. grad_norm or lr.")
def report(job: str, output_path: str | None, fmt: str, metric: str | None) -> None:
    """Plot a job's loss, tokens/s and MFU against step into an HTML page or an SVG chart."""
    from dtrain.jobs.report import write_report

    click.echo(write_report(job, output=output_path, fmt=fmt, metric=metric))


COMMANDS = [submit, list_command, status, logs, stop, report]
