"""How a local job ended, decided from what its node agents leave: their exit codes (or the exit
records they write as they exit, ``output/agent_exit.json``) and each host's failure report.

The monitor decides it when it sees the agents exit. Once the monitor is gone, ``status`` and
``stop`` decide it the same way from the exit records (:mod:`dtrain.launcher.local.recovery`),
so the job's state comes from facts the job itself leaves, not from the process that watched it.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass

from dtrain.core import contract, states
from dtrain.core.states import COMPLETED, STOPPED
from dtrain.launcher.local.layout import agent_log, host_root

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


def host_reports(job_dir: str, hosts: list[str]) -> dict[str, tuple[dict, str]]:
    """host -> (failure.json, failure text) of every host that wrote them."""
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
    killed (SIGKILL, the OOM killer) or gone, it could not say what happened."""
    who = f"the node agent on {end.host}" + (f" (pid {end.pid})" if end.pid else "")
    if end.stopped or end.code == 0:
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
        reports = host_reports(job_dir, [end.host for end in ends]).values()
        notes = [d["model_note"] for d, _ in reports if d.get("model_note")]
        return STOPPED, "stopped by user" + (f"; {notes[0]}" if notes else "")
    reason = root_cause(job_dir, ends) or f"node agent exit codes {codes}; see `dtrain logs`"
    return states.outcome(codes), reason
