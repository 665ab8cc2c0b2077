"""What the backends read from the node agents they ran, and how they end a job from it.

Where the hosts share the job's folder (local, Slurm), each has its contract root there
(``host_root``) and its agent's output beside its logs (``agent_log``). An agent leaves its facts
under its host's contract root: ``output/failure`` (SageMaker's free text) and
``output/failure.json`` when its workers did not finish, and its exit code (also written to
``output/agent_exit.json`` as it exits, for a launcher that lost sight of the process). The
local monitor and the Slurm backend turn the agents of a job into its end the same way
(``final_state``: the first failure is the root cause, an agent killed without a report named
as such), and the
nodes of the EC2 and Slurm targets name the interface NCCL binds to the same way
(``default_interface``). Log files grow while a job runs; ``new_lines`` reads what was added since
the last look, ``agent_lines`` merges the hosts' agent logs (stamped by agents started with
``logformat.STAMP_ENV``) in time order, and ``follow`` keeps reading until the job has ended.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from dtrain.core import contract, logformat, states
from dtrain.core.states import COMPLETED, STOPPED

STOP_REASON = "stopped by user"
AGENT_LOG = "agent.log"


def host_root(job_dir: str, host: str) -> str:
    """A host's contract root, in a job folder that holds one per host (local, Slurm)."""
    return os.path.join(job_dir, host)


def agent_log(job_dir: str, host: str) -> str:
    """The node agent's own output, where a backend that starts the agent itself keeps it."""
    return os.path.join(contract.Paths(host_root(job_dir, host)).output_dir, AGENT_LOG)


def default_interface() -> str:
    """The interface of the default route (``ens32`` on p4d, not ``eth0``); NCCL binds to it."""
    try:
        with open("/proc/net/route") as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                if len(fields) > 1 and fields[1] == "00000000":
                    return fields[0]
    except OSError:
        pass
    return "eth0"


UNKNOWN_EXIT_CODE = -1  # an agent gone without an exit record counts as failed


@dataclass(frozen=True)
class AgentEnd:
    """How one host's node agent ended."""

    host: str
    code: int | None  # None: gone without an exit record
    pid: int | None = None
    stopped: bool = False  # dtrain signalled it: a stop, or another host had failed
    why: str = ""  # with code None: why it is judged gone


def read_exit_record(job_dir: str, host: str) -> dict | None:
    """The exit record ``host``'s agent wrote as it exited (None: none, or unreadable)."""
    try:
        with open(contract.Paths(host_root(job_dir, host)).agent_exit_file) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("exit_code"), int) \
        else None


def host_reports(job_dir: str, hosts: Iterable[str]) -> dict[str, tuple[dict, str]]:
    """host -> (failure.json, failure text) of every host whose agent wrote them."""
    found = {}
    for host in hosts:
        paths = contract.Paths(host_root(job_dir, host))
        try:
            with open(paths.failure_details_file) as f:
                details = json.load(f)
            with open(paths.failure_file) as f:
                text = f.read().strip()
        except (OSError, ValueError):
            continue
        if isinstance(details, dict):
            found[host] = (details, text)
    return found


def unreported_end(job_dir: str, end: AgentEnd) -> str | None:
    """What to say of an agent that ended badly without a report, unless dtrain stopped it:
    killed (SIGKILL, the OOM killer) or gone, it could not say what happened. An agent that
    exited as interrupted (a SIGTERM it obeyed) is no cause either."""
    who = f"the node agent on {end.host}" + (f" (pid {end.pid})" if end.pid else "")
    if end.stopped or end.code in (0, contract.PREEMPTED_EXIT_CODE):
        return None
    if end.code is None:
        return f"{who} is gone without an exit record: {end.why}"
    if end.code < 0:
        try:
            name = signal.Signals(-end.code).name
        except ValueError:
            name = f"signal {-end.code}"
        return f"{who} was killed by {name}, and its workers with it"
    return (f"{who} exited with code {end.code} without a report; see its log "
            f"{agent_log(job_dir, end.host)}")


def root_cause(job_dir: str, ends: list[AgentEnd]) -> str:
    """The failure that came first; the others usually follow from it.

    max_run comes first; then an agent that died without a report (its death makes the other
    hosts' workers fail); then crashes, earliest first (sub-second times); then interruptions,
    which a failure elsewhere can cause.
    """
    reports = host_reports(job_dir, [end.host for end in ends])
    found = []
    for index, end in enumerate(ends):
        if end.host not in reports:
            cause = unreported_end(job_dir, end)
            if cause:
                found.append((1, float(index), cause))
            continue
        details, text = reports[end.host]
        priority = {"max_run": 0, "interrupted": 3}.get(details.get("reason"), 2)
        try:
            when = float(details.get("timestamp") or 0)
        except (TypeError, ValueError):
            when = 0.0
        found.append((priority, when, text))
    return min(found)[2] if found else ""


def stop_reason(job_dir: str, hosts: Iterable[str]) -> str:
    """``stopped by user``, and what an agent said of the model if the stop cut its save short."""
    notes = [d["model_note"] for d, _ in host_reports(job_dir, hosts).values()
             if d.get("model_note")]
    return STOP_REASON + (f"; {notes[0]}" if notes else "")


def final_state(job_dir: str, ends: list[AgentEnd], *,
                stopped_by_user: bool) -> tuple[str, str | None]:
    """(status, failure reason) from the agents' exit codes and reports.

    Every agent exiting 0 is Completed even after a stop: the workers finished the job (a stop
    during the final model save lets it finish). A stop that cut the final model save short says
    so, since the model then has to come from the last checkpoint.
    """
    codes = [UNKNOWN_EXIT_CODE if end.code is None else end.code for end in ends]
    if states.outcome(codes) == COMPLETED:
        return COMPLETED, None
    if stopped_by_user:
        return STOPPED, stop_reason(job_dir, [end.host for end in ends])
    reason = root_cause(job_dir, ends) or f"node agent exit codes {codes}; see `dtrain logs`"
    return states.outcome(codes), reason


def new_lines(path: str, offsets: dict[str, int]) -> list[str]:
    """The complete lines added to ``path`` since the last call (``offsets``: bytes read of each
    path); a line still being written waits for the next call."""
    try:
        with open(path, "rb") as f:
            f.seek(offsets.get(path, 0))
            data = f.read()
    except FileNotFoundError:
        return []
    end = data.rfind(b"\n") + 1
    offsets[path] = offsets.get(path, 0) + end
    return data[:end].decode(errors="replace").splitlines()


def agent_lines(job_dir: str, hosts: Iterable[str], offsets: dict[str, int],
                rank: int | None, *, also: Mapping[str, str] | None = None) -> Iterator[str]:
    """The lines the hosts' agent logs gained since the last call, in the order they were
    written (worker lines included: the agent echoes them), as ``logformat`` lines; only
    ``rank``'s if given. ``also`` maps more files of stamped lines to the host they are of
    (a target's own output), merged in with the agents'."""
    sources = {agent_log(job_dir, host): host for host in hosts}
    sources.update(also or {})
    new = {path: new_lines(path, offsets) for path in sources}
    for path, raw in logformat.merge_by_time(new):
        line = logformat.as_line(sources[path], raw)
        if rank is None or logformat.rank_of(line) == rank:
            yield line


def follow(read: Callable[[bool], Iterable[str]], *, follow: bool, ended: Callable[[], bool],
           poll_s: float, sleep: Callable[[float], None] = time.sleep) -> Iterator[str]:
    """``read(final)``'s lines; with ``follow``, again every ``poll_s`` until ``ended()``.

    ``ended`` is asked before each read, so the read after the job ended (``final``) still
    brings its last lines."""
    while True:
        done = not follow or ended()
        yield from read(done)
        if done:
            return
        sleep(poll_s)
