"""The ``dtrain`` command line. It parses arguments, calls the SDK and prints; no logic here.

Keep imports light: ``dtrain --help`` must not import pydantic-heavy modules, boto3 or torch,
so every command imports what it needs inside its body.
"""

from __future__ import annotations

import signal
import sys

import click
from dtrain import __version__
from dtrain.cli.common import OUTPUT_OPTION, echo_json, load_spec, spec_options


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dtrain")
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Declarative distributed training jobs: on this machine, SageMaker, EC2 or Slurm.

    Write a job spec (YAML), check it with `dtrain validate`, see what it will cost and how it
    is sharded with `dtrain plan`, then run it with `dtrain submit`.
    """
    ctx.obj = {"debug": debug}


@cli.command()
@spec_options
@OUTPUT_OPTION
def validate(spec_path: str, overrides: tuple[str, ...], target: str | None, output: str) -> None:
    """Check a job spec without running anything; print it as validated (defaults filled in;
    `auto` settings are resolved by `dtrain plan`) with -o json.

    Runs the same rules as `dtrain plan` and `dtrain submit` (the target's rule set and the
    parallelism plan): what passes here is accepted there, and the plan's notes (e.g. a
    model that would not fit the device) are printed to stderr. What needs the cloud (a bucket
    exists, a role can be assumed) is checked at submit.
    """
    from dtrain.planning.planner import plan as make_plan

    spec = load_spec(spec_path, overrides, target)
    for note in make_plan(spec).notes:
        click.echo(f"note: {note}", err=True)
    if output == "json":
        echo_json(spec.to_dict())
    else:
        click.echo(f"ok: {spec.name} · target {spec.compute.target} · "
                   f"{spec.compute.instance_count} × {spec.compute.instance_type} · "
                   f"world size {spec.world_size}")


@cli.command()
@spec_options
@OUTPUT_OPTION
def plan(spec_path: str, overrides: tuple[str, ...], target: str | None, output: str) -> None:
    """Resolve `auto` settings and estimate memory, communication, step time and cost.

    The model's size comes from hyperparameters: `model` (a preset such as pythia-70m or
    gpt-neox-20b, or a folder with a Hugging Face config.json) or `num_parameters`, with
    `seq_len` and `micro_batch_size`.
    """
    from dtrain.planning.planner import plan as make_plan

    result = make_plan(load_spec(spec_path, overrides, target))
    if output == "json":
        echo_json(result.to_dict())
    else:
        from dtrain.planning.report import render_plan

        click.echo(render_plan(result))


@cli.command()
@click.option("--file", "path", type=click.Path(dir_okay=False, writable=True),
              help="Write the schema to this file instead of standard output.")
def schema(path: str | None) -> None:
    """Print the JSON schema of a job spec (for editors and CI checks)."""
    import json

    from dtrain.core.errors import DtrainError
    from dtrain.spec.model import JobSpec

    text = json.dumps(JobSpec.model_json_schema(), indent=2) + "\n"
    if path:
        try:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError as exc:
            raise DtrainError(f"cannot write {path}: {exc.strerror}") from None
    else:
        click.echo(text, nl=False)


@cli.command("instances")
@OUTPUT_OPTION
def list_instances(output: str) -> None:
    """List the instance types dtrain knows, with GPUs, bandwidths and prices."""
    from dtrain.core import instances

    if output == "json":
        echo_json([t.to_dict() for t in instances.CATALOG.values()])
        return
    from dtrain.planning.report import table

    rows = [[t.name, f"{t.gpus} × {t.gpu_model}" if t.gpus and t.gpu_model != "local" else
             ("CPU" if not t.gpus else "local GPUs"), f"{t.gpu_memory_gib:g}",
             f"{t.peak_tflops:g}", f"{t.network_gbits_per_s:g}", str(t.efa_interfaces),
             _price(t.ec2_price_per_hour), _price(t.sagemaker_price_per_hour)]
            for t in instances.CATALOG.values()]
    click.echo(table(rows, ["type", "GPUs", "GiB/GPU", "TFLOP/s", "Gb/s", "EFA", "EC2 $/h",
                            "SageMaker $/h"]))
    click.echo(f"\nprices: {instances.PRICE_SOURCE}, as of {instances.PRICE_DATE}; "
               "override with compute.price_per_hour")


def _price(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def _register_commands() -> None:
    """Job, EC2 and store commands live in their own modules (one module per concern)."""
    from dtrain.cli import ec2 as cli_ec2
    from dtrain.cli import jobs as cli_jobs
    from dtrain.cli import store as cli_store

    for command in (*cli_jobs.COMMANDS, *cli_ec2.COMMANDS, *cli_store.COMMANDS):
        cli.add_command(command)


_register_commands()


def _hang_up(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors print one line and exit 2 (invalid input) or 1 (failure)."""
    from dtrain.core.errors import DtrainError

    args = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in args
    if debug:  # accepted anywhere on the line, not only before the subcommand
        args = ["--debug", *(a for a in args if a != "--debug")]
    # A closed terminal (SIGHUP) or a polite kill (SIGTERM: `timeout`, a cancelled CI job) is a
    # Ctrl-C: a submit under way leaves a record the next status settles, a wait leaves the job
    # running, or stops it with --stop-on-interrupt. Not a signal ignored on purpose (nohup).
    for sig in (signal.SIGHUP, signal.SIGTERM):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _hang_up)
    try:
        cli.main(args=args, prog_name="dtrain", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(2 if isinstance(exc, click.UsageError) else exc.exit_code)
    except DtrainError as exc:
        if debug:
            raise
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except Exception as exc:
        # an AWS error a command did not word itself (no credentials, a region without the
        # service): still one line, with the fix where one is known
        if debug or not type(exc).__module__.startswith("botocore"):
            raise
        from dtrain.launcher.aws import as_dtrain_error

        click.echo(f"error: {as_dtrain_error(exc, 'an AWS call')}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
