"""What the backends read from the node agents they ran, and how they end a job from it.

Where the hosts share the job's folder (local, Slurm), each has its contract root there
(``host_root``) and its agent's output beside its logs (``agent_log``). An agent leaves its facts
under its host's contract root: ``output/failure`` (SageMaker's free text) and
``output/failure.json`` when its workers did not finish, and its exit code. The local monitor and
the Slurm backend turn the agents of a job into its end the same way (``final_state``), and the
nodes of the EC2 and Slurm targets name the interface NCCL binds to the same way
(``default_interface``). Log files grow while a job runs; ``new_lines`` reads what was added since
the last look, ``agent_lines`` merges the hosts' agent logs (stamped by agents started with
``logformat.STAMP_ENV``) in time order, and ``follow`` keeps reading until the job has ended.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator

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


def host_reports(roots: Iterable[str]) -> list[tuple[dict, str]]:
    """(failure.json, failure text) of every host root whose agent wrote them."""
    found = []
    for root in roots:
        paths = contract.Paths(root)
        try:
            with open(paths.failure_details_file) as f:
                details = json.load(f)
            with open(paths.failure_file) as f:
                text = f.read().strip()
        except (OSError, ValueError):
            continue
        if isinstance(details, dict):
            found.append((details, text))
    return found


def root_cause(roots: Iterable[str]) -> str:
    """The earliest failure any host reported (other hosts usually fail as a consequence).

    max_run comes first, then crashes, then interruptions (which a crash elsewhere can cause).
    """
    found = [({"max_run": 0, "interrupted": 2}.get(details.get("reason"), 1),
              details.get("timestamp") or 0, text)
             for details, text in host_reports(roots)]
    return min(found)[2] if found else ""


def final_state(codes: list[int], roots: list[str], *,
                stopped_by_user: bool) -> tuple[str, str | None]:
    """(status, failure reason) from the agents' exit codes and the reports under ``roots``.

    Every agent exiting 0 is Completed even after a stop: the workers finished the job (a stop
    during the final model save lets it finish). A stop that cut the final model save short says
    so, since the model then has to come from the last checkpoint.
    """
    if states.outcome(codes) == COMPLETED:
        return COMPLETED, None
    if stopped_by_user:
        return STOPPED, stop_reason(roots)
    reason = root_cause(roots) or f"node agent exit codes {codes}; see `dtrain logs`"
    return states.outcome(codes), reason


def stop_reason(roots: list[str]) -> str:
    """``stopped by user``, and what an agent said of the model if the stop cut its save short."""
    notes = [d["model_note"] for d, _ in host_reports(roots) if d.get("model_note")]
    return STOP_REASON + (f"; {notes[0]}" if notes else "")


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
                rank: int | None) -> Iterator[str]:
    """The lines the hosts' agent logs gained since the last call, in the order they were
    written (worker lines included: the agent echoes them), as ``logformat`` lines; only
    ``rank``'s if given."""
    new = {host: new_lines(agent_log(job_dir, host), offsets) for host in hosts}
    for host, raw in logformat.merge_by_time(new):
        line = logformat.as_line(host, raw)
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
