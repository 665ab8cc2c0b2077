"""Slurm's job states mapped onto dtrain's, and a Slurm job's end from what its nodes reported.

While Slurm runs the job its state says where the job is (queued, starting, running). Once Slurm
says it ended, the end comes from the node agents' exit codes as on every target
(``dtrain.launcher.agents.final_state``); Slurm's own state names the end only for what no agent
could report: a job cancelled or timed out before its agents wrote anything, a node failure.
"""

from __future__ import annotations

from dtrain.core import states
from dtrain.core.states import FAILED, PENDING, RUNNING, STARTING, STOPPED
from dtrain.launcher import agents
from dtrain.launcher.slurm.commands import SlurmJob

# Slurm's states of a job that has not ended, by the dtrain status they read as.
WAITING = frozenset({"PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD",
                     "SPECIAL_EXIT"})
STARTING_UP = frozenset({"CONFIGURING"})
UNDER_WAY = frozenset({"RUNNING", "COMPLETING", "SUSPENDED", "SIGNALING", "STAGE_OUT",
                       "STOPPED", "RESIZING"})
# Slurm's ends that are a stop to resume from when no agent said otherwise; every other end
# (FAILED, NODE_FAIL, BOOT_FAIL, OUT_OF_MEMORY, DEADLINE, COMPLETED without reports...) fails.
STOPPED_BY_SLURM = {
    "CANCELLED": "cancelled in Slurm (scancel), not by `dtrain stop`",
    "TIMEOUT": "Slurm's time limit (compute.max_run + 10 min) was reached",
    "PREEMPTED": "preempted by Slurm",
}


def has_ended(slurm: SlurmJob | None) -> bool:
    """None (Slurm no longer knows the job) has ended too."""
    return slurm is None or slurm.state not in WAITING | STARTING_UP | UNDER_WAY


def progress(slurm: SlurmJob) -> tuple[str, str | None]:
    """(status, secondary status) of a job Slurm still has."""
    detail = f"{slurm.state}: {slurm.reason}" if slurm.reason else slurm.state
    if slurm.state in WAITING:
        return PENDING, detail
    if slurm.state in STARTING_UP:
        return STARTING, detail
    return RUNNING, None if slurm.state == "RUNNING" else detail


def ending(slurm: SlurmJob | None, reports: dict[str, dict], job_dir: str, *,
           stop_requested: bool, job_id: str, output: str,
           checkpoint_dir: str) -> tuple[str, str | None]:
    """(status, failure reason) of a job Slurm says has ended (``slurm`` None: forgotten).

    ``reports``: each node of the job -> its ``status/<node>.json`` ({} if it never wrote one);
    the nodes' contract roots in ``job_dir`` hold their agents' failure reports."""
    codes = [report.get("exit_code") for report in reports.values()]
    if codes and all(isinstance(code, int) for code in codes):
        ends = [agents.AgentEnd(host, report["exit_code"]) for host, report in reports.items()]
        return agents.final_state(job_dir, ends, stopped_by_user=stop_requested)
    reported = agents.host_reports(job_dir, reports)
    cause = agents.root_cause(job_dir, [agents.AgentEnd(host, None, stopped=True)
                                        for host in reported]) or next(
        (r["reason"] for r in reports.values() if r.get("reason")), "")
    if any(isinstance(code, int) and states.outcome([code]) == FAILED for code in codes):
        return FAILED, cause or f"node agent exit codes {codes}; see `dtrain logs`"
    if stop_requested:
        return STOPPED, agents.stop_reason(job_dir, reports)
    state = slurm.state if slurm else None
    if state in STOPPED_BY_SLURM:
        return STOPPED, STOPPED_BY_SLURM[state] + (
            f"; {cause}" if cause else
            f"; resubmit to resume from the newest checkpoint in {checkpoint_dir}")
    what = f"Slurm job {job_id} ended {state} before every node reported" if state else \
        f"Slurm no longer knows job {job_id} and not every node reported"
    return FAILED, what + (f": {cause}" if cause else f"; see {output}")
