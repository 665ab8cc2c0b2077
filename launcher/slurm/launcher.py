"""The Slurm backend: ``sbatch`` from the login node, one node agent per node with ``srun``.

``build_request`` is pure (``script``): the batch script, the ``sbatch`` command line, and what
each node writes its contract from. ``submit`` makes the job's folder under ``slurm.shared_dir``
(the code copied in, the runtime wheel for a container image, S3 inputs downloaded, the script
written exactly as dry-run printed it) and runs ``sbatch --parsable``. ``status`` asks
``squeue`` (``sacct`` once squeue has forgotten the job) and reads the nodes' reports in the job's
folder (``layout``); a submit that died before it recorded sbatch's id leaves a job ``status``
finds by its name and folder, or ends lost; ``stop`` is ``scancel``: Slurm's SIGTERM, then
SIGKILL after its KillWait, so the workers checkpoint first. Nothing here writes the job store.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from dtrain.core import contract
from dtrain.core.errors import DtrainError
from dtrain.core.states import STOPPED, STOPPING
from dtrain.launcher import agents, packaging, process, staging
from dtrain.launcher.agents import STOP_REASON
from dtrain.launcher.base import (
    Launcher,
    Request,
    TargetState,
    Update,
    Upload,
    follow_submitter,
    runtime_settings,
)
from dtrain.launcher.slurm import commands, layout, script, states

if TYPE_CHECKING:
    from dtrain.launcher.base import Handle, JobIdentity, Journal
    from dtrain.planning.planner import Plan
    from dtrain.spec.model import JobSpec


@dataclass(frozen=True)
class SlurmState(TargetState):
    job_dir: str | None = None
    slurm_job_id: str | None = None
    hosts: list[str] = field(default_factory=list)  # the job's nodes, once it has them
    model_data: str | None = None  # the first node's model/, where rank 0 writes the model
    stop_requested_at: float | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SlurmState:
        # records of dtrain before 2026-11-25 kept the checkpoint folder as checkpoint_dir
        data = dict(data or {})
        if not data.get("checkpoints") and data.get("checkpoint_dir"):
            data["checkpoints"] = data["checkpoint_dir"]
        return super().from_dict(data)


class SlurmLauncher(Launcher):
    name = "slurm"
    state_type = SlurmState
    follows_submitter = True
    poll_s = 2.0  # each status is one squeue call to slurmctld, shared by the whole cluster

    def __init__(self, *, s3_client: Any = None, stream: IO[str] | None = None):
        self._s3 = s3_client
        self.stream = stream

    # ---------------------------------------------------------------- request and submit

    def build_request(self, spec: JobSpec, plan: Plan, job: JobIdentity) -> Request:
        job_dir = os.path.join(spec.slurm.shared_dir, job.id)
        code_dir = os.path.join(job_dir, layout.CODE_DIR)
        has_code = spec.source_dir is not None and not spec.is_recipe
        settings = runtime_settings(spec, plan, job_name=job.name,
                                    instance_type=spec.compute.instance_type,
                                    processes_per_host=plan.processes_per_node,
                                    source_dir=code_dir if has_code else None)
        uploads = [Upload(spec.source_dir, code_dir)] if has_code else []
        if spec.slurm.container_image:
            uploads.append(Upload(packaging.WHEEL, os.path.join(job_dir, layout.WHEEL_DIR)))
        return Request(target=self.name, job=job, uploads=tuple(uploads), payload={
            "job_dir": job_dir,
            "sbatch": script.sbatch_command(job_dir),
            "script": script.build_script(spec, plan, job_id=job.id, job_name=job.name,
                                          job_dir=job_dir),
            "node": {"settings": settings.__dict__,
                     "hyperparameters": dict(spec.hyperparameters),
                     "checkpoint_dir": spec.checkpoint.uri or
                     os.path.join(job_dir, "checkpoints")},
            "inputs": dict(spec.inputs),
        })

    def known_before_submit(self, request: Request) -> dict[str, Any]:
        return SlurmState.changes(job_dir=request.payload["job_dir"],
                                  checkpoints=request.payload["node"]["checkpoint_dir"])

    def submit(self, request: Request, journal: Journal) -> Handle:
        """Make the job's folder and ``sbatch`` the script; on failure remove the folder."""
        payload = request.payload
        job_dir = payload["job_dir"]
        shared = os.path.dirname(job_dir)
        if not os.path.isdir(shared):
            raise DtrainError(f"slurm.shared_dir: {shared!r} is not a folder on this machine; "
                              "run dtrain on the login node and create it on the shared file "
                              f"system (mkdir -p {shared})")
        journal.record(Update(log_location=job_dir, output_location=job_dir,
                              state=self.known_before_submit(request)))
        try:
            os.makedirs(job_dir, exist_ok=False)
            self._prepare(request, job_dir)
            slurm_job_id = commands.submit(payload["sbatch"])
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt) and os.path.isfile(
                    os.path.join(job_dir, layout.SCRIPT_FILE)):
                # sbatch may have queued it before the interrupt: status finds it, or ends the
                # job lost and removes the folder (follows_submitter)
                raise
            shutil.rmtree(job_dir, ignore_errors=True)
            if isinstance(exc, OSError):
                raise DtrainError(f"slurm job {request.job.id}: could not prepare {job_dir}: "
                                  f"{exc}") from exc
            raise
        # the id first, the status left as it is (Pending since the record was made, or a
        # stop's): a stop from now on finds the id and cancels the job itself
        handle = journal.record(Update(state=SlurmState.changes(
            slurm_job_id=slurm_job_id, secondary_status=f"submitted as Slurm job {slurm_job_id}")))
        if handle.status in (STOPPING, STOPPED):
            # a `dtrain stop` came while sbatch ran and found no Slurm job to cancel: cancel it
            commands.cancel(slurm_job_id)
            handle = journal.record(Update(status=STOPPED, failure_reason=STOP_REASON))
        return handle

    def _prepare(self, request: Request, job_dir: str) -> None:
        """Everything the nodes read, in the job's folder, before sbatch sees the script."""
        payload = request.payload
        packaging.place_all(request.uploads, stream=self.stream or sys.stderr)
        staged = staging.stage_inputs(payload["inputs"], job_dir, s3_client=self._s3)
        layout.write_json(os.path.join(job_dir, layout.NODE_CONFIG_FILE),
                          {**payload["node"], "channels": staged})
        os.makedirs(payload["node"]["checkpoint_dir"], exist_ok=True)
        with open(os.path.join(job_dir, layout.SCRIPT_FILE), "w") as fh:
            fh.write(payload["script"])

    # ---------------------------------------------------------------- lifecycle

    def status(self, handle: Handle) -> Update:
        state: SlurmState = handle.state
        if handle.is_final:
            return Update()
        adopted: dict[str, Any] = {}
        if not state.slurm_job_id:
            if state.submitter is None or process.judge(state.submitter)[0]:
                return Update()  # still submitting: nothing to ask Slurm yet
            if state.job_dir and process.find_running(script.sbatch_command(state.job_dir)[1:]):
                return Update()  # a killed submit's sbatch may still be talking to Slurm
            waiting, found = follow_submitter(handle, lambda: self._queued(handle),
                                              made="sbatch queued the job")
            if waiting is not None:
                if waiting.status and state.job_dir:  # ended: what its submit would have removed
                    shutil.rmtree(state.job_dir, ignore_errors=True)
                return waiting
            if handle.status == STOPPING:  # the stop its submit would have delivered
                commands.cancel(found)
            adopted = SlurmState.changes(slurm_job_id=found, submitter=None)
            state = dataclasses.replace(state, slurm_job_id=found)
        update = self._status(handle, state)
        return dataclasses.replace(update, state={**(update.state or {}), **adopted})

    def _queued(self, handle: Handle) -> str | None:
        """The Slurm job a submit that died before recording it queued: Slurm's word, else the
        batch output it started writing."""
        job_dir = handle.state.job_dir
        if not job_dir:
            return None  # the submit died before it made the job's folder
        started = layout.batch_output_ids(job_dir)
        return started[-1] if started else commands.find_job(
            handle.job.name, job_dir, since=handle.job.submitted_at)

    def _status(self, handle: Handle, state: SlurmState) -> Update:
        slurm = commands.job_state(state.slurm_job_id)
        hosts = layout.read_hosts(state.job_dir) or list(state.hosts)
        reports = layout.read_statuses(state.job_dir, hosts)
        facts = SlurmState.changes(hosts=hosts, **(
            {"model_data": contract.Paths(layout.host_root(state.job_dir, min(hosts))).model_dir}
            if hosts else {}))
        started = [r["started_at"] for r in reports.values() if r.get("started_at")]
        started_at = min(started) if started else None
        if not states.has_ended(slurm):
            status, secondary = states.progress(slurm)
            return Update(status=status, started_at=started_at,
                          state={**facts, **SlurmState.changes(secondary_status=secondary)})
        status, reason = states.ending(
            slurm, reports, state.job_dir,
            stop_requested=handle.status == STOPPING or bool(state.stop_requested_at),
            job_id=state.slurm_job_id, checkpoint_dir=state.checkpoints,
            output=layout.batch_output(state.job_dir, state.slurm_job_id))
        ended = [r["ended_at"] for r in reports.values() if r.get("ended_at")]
        return Update(status=status, failure_reason=reason, started_at=started_at,
                      ended_at=max(ended) if ended else time.time(),
                      state={**facts, **SlurmState.changes(
                          secondary_status=slurm.state if slurm else None)})

    def hosts(self, handle: Handle) -> list[str] | None:
        state: SlurmState = handle.state
        return list(state.hosts) or (layout.read_hosts(state.job_dir) if state.job_dir
                                     else None) or None

    def logs(self, handle: Handle, *, follow: bool, host: str | None, rank: int | None,
             ended: Callable[[], bool]) -> Iterator[str]:
        state: SlurmState = handle.state
        offsets: dict[str, int] = {}

        def read(_final: bool) -> Iterator[str]:
            hosts = layout.read_hosts(state.job_dir) if state.job_dir else []
            also = {}
            if hosts and host in (None, hosts[0]) and rank is None and state.slurm_job_id:
                # the batch script runs on the job's first node: its output is that node's,
                # its lines stamped as the agents' are (script.py), so they merge in order
                also[layout.batch_output(state.job_dir, state.slurm_job_id)] = hosts[0]
            yield from agents.agent_lines(state.job_dir, [h for h in hosts if host in (None, h)],
                                          offsets, rank, also=also)

        return agents.follow(read, follow=follow, ended=ended, poll_s=0.5)

    def stop(self, handle: Handle, journal: Journal) -> Handle:
        if handle.is_final:
            return handle
        handle = journal.record(Update(status=STOPPING, failure_reason=STOP_REASON,
                                       state=SlurmState.changes(stop_requested_at=time.time())))
        state: SlurmState = handle.state  # as stored now: sbatch's id may have just come
        if not state.slurm_job_id:  # sbatch has not answered: nothing to cancel yet
            if state.submitter is not None:
                return handle  # the submit cancels what sbatch answers; if it dies, status does
            return journal.record(Update(status=STOPPED, failure_reason=STOP_REASON))
        commands.cancel(state.slurm_job_id)
        return journal.current()
