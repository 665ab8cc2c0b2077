"""Job states and the one rule that turns node agents' exit codes into a job state (stdlib only).

Every target reports a job in these names, and every target ends a job by :func:`outcome` of
its node agents' exit codes, so a job stopped at ``max_run`` or by a spot notice reads the same
on this machine, on SageMaker, on EC2 and on Slurm (docs/concepts/container-contract.md, "Exit
codes").
"""

from __future__ import annotations

from collections.abc import Iterable

from dtrain.core.contract import MAX_RUN_EXIT_CODE, PREEMPTED_EXIT_CODE

PENDING, STARTING, RUNNING = "Pending", "Starting", "Running"
COMPLETED, FAILED, STOPPING, STOPPED = "Completed", "Failed", "Stopping", "Stopped"
STATUSES = (PENDING, STARTING, RUNNING, COMPLETED, FAILED, STOPPING, STOPPED)
FINAL_STATUSES = frozenset({COMPLETED, FAILED, STOPPED})


def outcome(exit_codes: Iterable[int]) -> str:
    """Completed when every agent exited 0; Stopped when one stopped at max_run (124) or the
    rest stopped after a checkpoint on SIGTERM (143), a stop to resume from; else Failed."""
    codes = set(exit_codes)
    if codes <= {0}:
        return COMPLETED
    if MAX_RUN_EXIT_CODE in codes or codes <= {0, PREEMPTED_EXIT_CODE}:
        return STOPPED
    return FAILED
