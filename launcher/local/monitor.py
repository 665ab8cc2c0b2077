"""``python -m dtrain.launcher.local.monitor JOB_DIR``: owns one local job until it ends.

Started detached by ``LocalLauncher.submit``. Runs one node agent per simulated host, each in
its own session so the whole tree can be signalled; stops the others when one host fails (as
SageMaker does); on SIGTERM (``dtrain stop``) stops every agent within the grace period; and
writes what happens (the agents it started, then the final status, decided by
:mod:`.outcome`) to the job folder's facts file, which ``status`` reads. Should the monitor
die, ``status`` and ``stop`` finish its work from the agents' exit records (:mod:`.recovery`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

from dtrain.core import contract, logformat
from dtrain.core.states import COMPLETED, FAILED, RUNNING, STARTING
from dtrain.launcher import process
from dtrain.launcher.agents import AgentEnd, final_state
from dtrain.launcher.local.layout import (
    REQUEST_FILE,
    agent_log,
    host_root,
    write_state,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_agents(request: dict, job_dir: str, agents: list[subprocess.Popen]) -> None:
    """Start one node agent per host, appending each to ``agents`` as it starts (so a failure
    half-way leaves the started ones where the caller stops them)."""
    hosts = request["payload"]["hosts"]
    env = dict(os.environ, **request["payload"].get("environment", {}),
               **{logformat.STAMP_ENV: "1"},
               DTRAIN_MASTER_ADDR="127.0.0.1", PYTHONUNBUFFERED="1")
    if len(hosts) > 1:
        env[contract.MASTER_PORT_ENV] = str(free_port())
    for host in hosts:
        with open(agent_log(job_dir, host), "ab") as log:
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "dtrain.runtime", "--root", host_root(job_dir, host),
                 "--grace-period", str(request["grace_period_s"])],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))


def wait_for_agents(agents: list[subprocess.Popen], timeout_s: float, *,
                    stop_requested: list | tuple = ()) -> None:
    """Until every agent has exited, ``timeout_s`` has passed or a stop is requested."""
    deadline = time.monotonic() + timeout_s
    while any(a.poll() is None for a in agents) and time.monotonic() < deadline \
            and not stop_requested:
        time.sleep(0.1)


def stop_agents(agents: list[subprocess.Popen], grace_s: float) -> set[int]:
    """SIGTERM every agent (they forward it to workers), SIGKILL what is left after the grace;
    returns the pids of the agents it stopped (those still running)."""
    running = [a for a in agents if a.poll() is None]
    _signal_groups(running, signal.SIGTERM)
    wait_for_agents(running, grace_s + 5)  # the agents' own grace plus their shutdown
    _signal_groups(agents, signal.SIGKILL)  # their workers too, should any outlive them
    for agent in agents:
        agent.wait()
    return {a.pid for a in running}


def _signal_groups(agents: list[subprocess.Popen], sig: int) -> None:
    for agent in agents:  # each agent leads its own session: the group is its whole tree
        try:
            os.killpg(agent.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def supervise(request: dict, job_dir: str, stop_requested: list) -> None:
    """Start the agents and watch them to the end; should the watching itself fail (a full
    disk under the state file, a bug), the agents are stopped before the error goes on: the
    job then shows Failed, and nothing of it runs unwatched."""
    agents: list[subprocess.Popen] = []
    try:
        _watch(request, job_dir, stop_requested, agents)
    except BaseException:
        stop_agents(agents, float(request["grace_period_s"]))
        raise


def _watch(request: dict, job_dir: str, stop_requested: list,
           agents: list[subprocess.Popen]) -> None:
    write_state(job_dir, status=STARTING, monitor=process.this_process())
    start_agents(request, job_dir, agents)
    write_state(job_dir, status=RUNNING, started_at=time.time(),
                agents=[process.describe(a.pid) for a in agents])
    grace = float(request["grace_period_s"])
    while not stop_requested:
        codes = [a.poll() for a in agents]
        if all(code == 0 for code in codes):
            write_state(job_dir, status=COMPLETED, ended_at=time.time())
            return
        if any(code not in (None, 0) for code in codes):
            if set(codes) <= {None, 0, contract.PREEMPTED_EXIT_CODE}:
                # Interrupted: the other hosts stop at the same step on their own, and say where
                # (unless `dtrain stop` comes first); the secondary status says why it still
                # runs, as on EC2.
                write_state(job_dir, secondary_status="Interrupted")
                wait_for_agents(agents, grace + 5, stop_requested=stop_requested)
            break
        time.sleep(0.2)
    stopped = stop_agents(agents, grace)  # a stop, or one host failed (or still runs): it is over
    ends = [AgentEnd(host, a.returncode, a.pid, stopped=a.pid in stopped)
            for host, a in zip(request["payload"]["hosts"], agents)]
    status, reason = final_state(job_dir, ends, stopped_by_user=bool(stop_requested))
    write_state(job_dir, status=status, failure_reason=reason, ended_at=time.time())


def main(argv: list[str] | None = None) -> int:
    job_dir = (argv or sys.argv[1:])[0]
    with open(os.path.join(job_dir, REQUEST_FILE)) as f:
        request = json.load(f)
    stop_requested: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.append(True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the submitting shell is not a stop
    try:
        supervise(request, job_dir, stop_requested)
    except BaseException as exc:
        write_state(job_dir, status=FAILED, ended_at=time.time(),
                    failure_reason=f"local job monitor failed: {type(exc).__name__}: {exc}")
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
