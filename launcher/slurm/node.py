"""``python -m dtrain.launcher.slurm.node JOB_DIR``: one Slurm node's share of a dtrain job.

The batch script starts it on every node with ``srun`` (inside the job's container image when
there is one). It writes this node's container contract under ``JOB_DIR/<node>/``: the hosts are
the job's nodes as ``scontrol show hostnames`` expanded them (``DTRAIN_SLURM_HOSTS``), this one
is ``SLURMD_NODENAME``, the master is the first of the contract's sorted hosts. Then it runs the
node agent (``python -m dtrain.runtime``) and reports in ``JOB_DIR/status/<node>.json`` when it
started and how it ended, which the client's ``status`` reads.

``scancel`` signals every process of the step (SIGTERM, then SIGKILL after Slurm's KillWait):
the agent stops its workers after a checkpoint, and this process outlives the SIGTERM so it can
report the agent's exit code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from dtrain.core import contract, logformat, states
from dtrain.core.states import FAILED, RUNNING
from dtrain.launcher import staging
from dtrain.launcher.agents import default_interface
from dtrain.launcher.slurm import layout


def write_contract(job_dir: str, host: str, hosts: list[str]) -> contract.Paths:
    """This node's contract from the job's ``node.json``; channels link to the staged folders."""
    config = layout.read_json(os.path.join(job_dir, layout.NODE_CONFIG_FILE))
    if not config:
        raise FileNotFoundError(f"{job_dir}/{layout.NODE_CONFIG_FILE} is missing or unreadable; "
                                "is the job's folder on a file system this node mounts?")
    channels = config.get("channels", {})
    paths = contract.write_host_contract(
        layout.host_root(job_dir, host), current_host=host, hosts=hosts,
        settings=contract.Settings(**config["settings"]),
        hyperparameters=config["hyperparameters"], channels=sorted(channels),
        # one folder on the shared file system: DCP writes each shard once, from its rank
        checkpoint_local_path=config["checkpoint_dir"],
        network_interface_name=default_interface())
    staging.link_channels(paths, channels)
    return paths


def run_agent(job_dir: str, host: str, stop_requested: list[bool]) -> int:
    """The node agent, its output in the host's ``output/agent.log``; returns its exit code."""
    if stop_requested:  # stopped before the agent ran: nothing to checkpoint
        return contract.PREEMPTED_EXIT_CODE
    root = layout.host_root(job_dir, host)
    with open(layout.agent_log(job_dir, host), "ab") as log:
        agent = subprocess.Popen([sys.executable, "-m", "dtrain.runtime", "--root", root],
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, **{logformat.STAMP_ENV: "1"}))
    return agent.wait()


def main(argv: list[str] | None = None) -> int:
    # Slurm's SIGTERM reaches the agent itself; this process only has to outlive it to report.
    # A handler, not SIG_IGN: an ignored signal would stay ignored in the agent it starts.
    stop_requested: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.append(True))
    job_dir = (argv if argv is not None else sys.argv[1:])[0]
    host = os.environ["SLURMD_NODENAME"]
    hosts = os.environ[layout.HOSTS_ENV].split()
    report = layout.status_file(job_dir, host)
    layout.write_json(report, {"host": host, "state": RUNNING.lower(), "started_at": time.time()})
    reason = None
    try:
        write_contract(job_dir, host, hosts)
        code = run_agent(job_dir, host, stop_requested)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = f"node {host} could not start its agent: {type(exc).__name__}: {exc}"
        print(f"dtrain: {reason}", file=sys.stderr)
        code = 2
    outcome = states.outcome([code])
    layout.write_json(report, {**layout.read_json(report), "state": outcome.lower(),
                               "exit_code": code, "reason": reason, "ended_at": time.time()})
    # Only a crash ends the other nodes at once (srun --kill-on-bad-exit). A stop to resume from
    # (143, 124) lets them finish their checkpoint: its code is in the report, not this exit code.
    return code if outcome == FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
