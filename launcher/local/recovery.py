"""What ``status`` and ``stop`` do for a local job whose monitor is gone (killed, a closed
terminal, a reboot): finish its work from the facts the job leaves.

Each node agent writes its exit code to ``output/agent_exit.json`` as it exits, and the monitor
recorded every agent's identity (:mod:`dtrain.launcher.process`). So without the monitor,
``status`` still tells a job that completed from one that failed and stops the other hosts when
one has failed, as the monitor would; ``stop`` sends SIGTERM and waits the grace period. A
process is signalled only when it is proven to be the one dtrain started. A job none of whose
processes runs, with no record of how any ended, is lost: it fails, saying why, and nothing is
signalled.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any

from dtrain.core.contract import PREEMPTED_EXIT_CODE
from dtrain.core.states import FAILED, STOPPED
from dtrain.launcher import process
from dtrain.launcher.agents import STOP_REASON, AgentEnd, final_state, read_exit_record
from dtrain.launcher.local.layout import write_state

MONITOR_GONE = "MonitorGone"  # the secondary status while the agents run on without it


@dataclass
class Survey:
    """Each host's agent: ended (with its exit record, or judged gone) or still running."""

    ends: list[AgentEnd] = field(default_factory=list)
    running: dict[str, dict[str, Any]] = field(default_factory=dict)  # host -> its description
    ended_at: float | None = None  # the latest exit record's time

    @property
    def failed(self) -> bool:
        return any(end.code not in (0, PREEMPTED_EXIT_CODE) for end in self.ends)


def survey(job_dir: str, hosts: list[str], facts: dict[str, Any]) -> Survey:
    found = Survey()
    stopped = set(facts.get("stopped_hosts") or ())
    for host, agent in zip(hosts, facts.get("agents") or []):
        alive, why = process.judge(agent)
        if alive is not False:  # running (perhaps past its exit record), or cannot tell
            found.running[host] = agent
            continue
        record = read_exit_record(job_dir, host)
        code = None if record is None else record["exit_code"]
        found.ends.append(AgentEnd(host, code, agent.get("pid"),
                                           stopped=host in stopped, why=why))
        if record is not None:
            found.ended_at = max(found.ended_at or 0, float(record.get("ended_at") or 0))
    return found


def settle(job_dir: str, hosts: list[str], facts: dict[str, Any], *, monitor_why: str,
           stopping: bool, grace_s: float) -> dict[str, Any]:
    """The facts ``status`` reports for a job whose monitor is gone (``monitor_why``)."""
    if not facts.get("agents"):
        if stopping:  # a stop that reached the monitor as it started: it ended before any agent
            return {"status": STOPPED, "failure_reason": STOP_REASON, "ended_at": time.time()}
        return _lost(f"the local job monitor is gone ({monitor_why}) before it recorded any "
                     "node agent")
    found = survey(job_dir, hosts, facts)
    if found.running:
        if found.failed:  # a failed host ends the job: SIGTERM, and SIGKILL after the grace
            sent = facts.get("stop_sent_at")
            if sent is None:
                _stop(job_dir, found.running, signal.SIGTERM)
            elif time.time() > float(sent) + grace_s + 5:
                for agent in found.running.values():
                    process.signal_group(agent, signal.SIGKILL)
        return {"secondary_status": MONITOR_GONE}
    if all(end.code is None for end in found.ends):
        gone = "; ".join(f"the node agent on {end.host} (pid {end.pid}): {end.why}"
                         for end in found.ends)
        return _lost(f"the local job monitor: {monitor_why}; {gone}")
    status, reason = final_state(job_dir, found.ends, stopped_by_user=stopping)
    return {"status": status, "failure_reason": reason,
            "ended_at": found.ended_at or time.time()}


def stop(job_dir: str, hosts: list[str], facts: dict[str, Any], *, grace_s: float,
         monitor_why: str) -> dict[str, Any]:
    """What the monitor does on ``dtrain stop``: SIGTERM every running agent, SIGKILL those
    still running after the grace period (plus their shutdown); then the job's final facts."""
    running = survey(job_dir, hosts, facts).running
    stopped = _stop(job_dir, running, signal.SIGTERM)
    deadline = time.monotonic() + grace_s + 5
    while survey(job_dir, hosts, facts).running.keys() & stopped and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    left = {h: a for h, a in survey(job_dir, hosts, facts).running.items() if h in stopped}
    for agent in left.values():
        process.signal_group(agent, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while survey(job_dir, hosts, facts).running.keys() & left.keys() and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    facts = {**facts, "stopped_hosts": sorted(stopped)}
    return settle(job_dir, hosts, facts, monitor_why=monitor_why, stopping=True, grace_s=grace_s)


def _stop(job_dir: str, running: dict[str, dict[str, Any]], sig: int) -> set[str]:
    """Signal the process groups of the running agents proven ours; returns their hosts."""
    stopped = {host for host, agent in running.items() if process.signal_group(agent, sig)}
    write_state(job_dir, stopped_hosts=sorted(stopped), stop_sent_at=time.time())
    return stopped


def _lost(why: str) -> dict[str, Any]:
    return {"status": FAILED, "ended_at": time.time(),
            "failure_reason": f"lost: no process of this job runs and none left a record of how "
                              f"it ended, so nothing was signalled ({why})"}
