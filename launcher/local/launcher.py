"""The local target: N simulated hosts as real processes on this machine, no Docker.

``submit`` creates the job folder (one contract root per host ``algo-1``, ``algo-2``, ...), stages
the input channels, and starts a detached monitor (``python -m dtrain.launcher.local.monitor``)
that runs one node agent per host and writes what happens to the job folder's facts file. The
monitor, not the CLI, owns the job, so it keeps running after ``dtrain submit --no-wait``
returns; ``status`` reads the facts, or, once the monitor is gone, what the agents left
(:mod:`.recovery`). Every process is recorded with its start time and command line, so nothing
signals a process that merely got a recorded pid later.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dtrain.core import contract
from dtrain.core.errors import DtrainError
from dtrain.core.states import FINAL_STATUSES, STOPPING
from dtrain.launcher import agents, process, staging
from dtrain.launcher.base import (
    Handle,
    JobIdentity,
    Journal,
    Launcher,
    Request,
    TargetState,
    Update,
    follow_submitter,
    runtime_settings,
)
from dtrain.launcher.local import layout, recovery

if TYPE_CHECKING:
    from dtrain.planning.planner import Plan
    from dtrain.spec.model import JobSpec


@dataclass(frozen=True)
class LocalState(TargetState):
    job_dir: str | None = None
    hosts: list[str] = field(default_factory=list)
    monitor: dict[str, Any] | None = None  # process.describe() of the monitor
    agents: list[dict[str, Any]] = field(default_factory=list)  # of each node agent
    model_data: str | None = None  # the first host's model/, where rank 0 writes the model


def checkpoint_folder(payload: dict[str, Any], job_dir: str) -> str:
    """``checkpoint.uri`` (a folder: where the job keeps its checkpoints, as SageMaker syncs
    ``checkpoint_s3_uri``), else the job folder's own."""
    return payload.get("checkpoint_uri") or os.path.join(job_dir, "checkpoints")


def jobs_folder() -> str:
    """``$DTRAIN_HOME/jobs``: where local jobs without an ``output_path`` live."""
    from dtrain.core.paths import dtrain_home

    return os.path.join(dtrain_home(), "jobs")


class LocalLauncher(Launcher):
    name = "local"
    state_type = LocalState
    follows_submitter = True

    def __init__(self, *, s3_client: Any = None, grace_period_s: int | None = None):
        self._s3 = s3_client
        self.grace_period_s = grace_period_s

    # ---------------------------------------------------------------- request

    def build_request(self, spec: JobSpec, plan: Plan, job: JobIdentity) -> Request:
        compute = spec.compute
        # local_gpu without an explicit count uses every GPU the agent finds.
        per_host = compute.processes_per_instance
        if per_host is None and compute.instance_type == "local":
            per_host = plan.processes_per_node
        settings = runtime_settings(spec, plan, job_name=job.name,
                                    instance_type=compute.instance_type,
                                    processes_per_host=per_host, source_dir=spec.source_dir)
        return Request(target=self.name, job=job, payload={
            "hosts": [f"algo-{i + 1}" for i in range(plan.num_nodes)],
            "settings": settings.__dict__,
            "hyperparameters": dict(spec.hyperparameters),
            "inputs": dict(spec.inputs),
            "output_path": spec.output_path,
            "checkpoint_uri": spec.checkpoint.uri,
            "environment": dict(spec.environment),
        })

    # ---------------------------------------------------------------- submit

    def known_before_submit(self, request: Request) -> dict[str, Any]:
        payload = request.payload
        job_dir = os.path.abspath(os.path.join(payload["output_path"] or jobs_folder(),
                                               request.job.id))
        model_dir = contract.Paths(layout.host_root(job_dir, payload["hosts"][0])).model_dir
        return LocalState.changes(job_dir=job_dir, hosts=payload["hosts"],
                                  checkpoints=checkpoint_folder(payload, job_dir),
                                  model_data=model_dir)

    def submit(self, request: Request, journal: Journal) -> Handle:
        payload = request.payload
        known = self.known_before_submit(request)
        job_dir = known["job_dir"]
        journal.record(Update(log_location=job_dir, output_location=job_dir, state=known))
        try:
            os.makedirs(job_dir, exist_ok=False)
            os.makedirs(checkpoint_folder(payload, job_dir), exist_ok=True)
            self._write_contracts(request, job_dir)
            monitor = self._start_monitor(job_dir)
            layout.write_state(job_dir, monitor=monitor)  # for status, should this process die
        except DtrainError:
            raise
        except OSError as exc:
            raise DtrainError(f"local job {request.job.id}: could not start: {exc}") from exc
        handle = journal.record(Update(state=LocalState.changes(monitor=monitor, submitter=None)))
        if handle.status == STOPPING:  # a `dtrain stop` came while it started: deliver it now
            handle = self.stop(handle, journal)
        return handle

    def _write_contracts(self, request: Request, job_dir: str) -> None:
        payload = request.payload
        settings = contract.Settings(**payload["settings"])
        staged = staging.stage_inputs(payload["inputs"], job_dir, s3_client=self._s3)
        for host in payload["hosts"]:
            paths = contract.write_host_contract(
                layout.host_root(job_dir, host), current_host=host, hosts=payload["hosts"],
                settings=settings, hyperparameters=payload["hyperparameters"],
                channels=sorted(staged),
                # one folder for all simulated hosts: DCP writes each shard once, from one host
                checkpoint_local_path=checkpoint_folder(payload, job_dir),
                network_interface_name="lo")
            staging.link_channels(paths, staged)
        grace = self.grace_period_s
        if grace is None:  # the job's environment, as a container's agent reads it, else ours
            grace = int(request.payload["environment"].get(contract.GRACE_PERIOD_ENV)
                        or os.environ.get(contract.GRACE_PERIOD_ENV,
                                          contract.DEFAULT_GRACE_PERIOD_S))
        with open(os.path.join(job_dir, layout.REQUEST_FILE), "w") as f:
            json.dump({**request.to_dict(), "grace_period_s": grace}, f, indent=2, default=str)

    @staticmethod
    def _start_monitor(job_dir: str) -> dict[str, Any]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(os.path.join(job_dir, layout.MONITOR_LOG), "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, *_monitor_arguments(job_dir)],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True)
        return process.describe(proc.pid)

    # ---------------------------------------------------------------- lifecycle

    def status(self, handle: Handle) -> Update:
        """The monitor's facts; when the monitor is gone without writing an end, the facts
        the job itself left (:mod:`dtrain.launcher.local.recovery`)."""
        state: LocalState = handle.state
        if handle.is_final:
            return Update()
        adopted: dict[str, Any] = {}
        if state.monitor is None and state.submitter is not None:
            def noted_monitor() -> dict[str, Any] | None:
                # the submitter notes the monitor in the facts file before the store: died
                # between, or even between starting the monitor and noting it?
                if not state.job_dir:
                    return None
                return layout.read_state(state.job_dir).get("monitor") or \
                    process.find_running(_monitor_arguments(state.job_dir))

            waiting, monitor = follow_submitter(handle, noted_monitor, made="it started the job")
            if waiting is not None:
                return waiting
            adopted = {"monitor": monitor, "submitter": None}
            state = dataclasses.replace(state, monitor=monitor)
            if handle.status == STOPPING:  # the stop its submit would have delivered
                process.signal_process(monitor, signal.SIGTERM)
        if not state.job_dir:
            return Update()
        facts = layout.read_state(state.job_dir)
        if facts.get("status") not in FINAL_STATUSES:
            alive, why = process.judge(state.monitor)
            facts = layout.read_state(state.job_dir)  # it may have ended while we looked
            if alive is False and facts.get("status") not in FINAL_STATUSES:
                facts = {**facts, **recovery.settle(
                    state.job_dir, state.hosts, facts, monitor_why=why,
                    stopping=handle.status == STOPPING, grace_s=_grace_period(state.job_dir))}
        update = _update_from(facts)
        return dataclasses.replace(update, state={**(update.state or {}), **adopted}) \
            if adopted else update

    def hosts(self, handle: Handle) -> list[str] | None:
        return list(handle.state.hosts) or None

    def logs(self, handle: Handle, *, follow: bool, host: str | None, rank: int | None,
             ended: Callable[[], bool]) -> Iterator[str]:
        state: LocalState = handle.state
        hosts = [h for h in state.hosts if host in (None, h)]
        offsets: dict[str, int] = {}

        def read(_final: bool) -> Iterator[str]:
            return agents.agent_lines(state.job_dir, hosts, offsets, rank)

        return agents.follow(read, follow=follow, ended=ended, poll_s=0.25)

    def stop(self, handle: Handle, journal: Journal) -> Handle:
        if handle.is_final:
            return handle
        handle = journal.record(Update(status=STOPPING))
        state: LocalState = handle.state
        if process.signal_process(state.monitor, signal.SIGTERM):
            return handle  # the monitor stops the agents and writes Stopped
        alive, why = process.judge(state.monitor)
        if not state.job_dir or alive is not False:
            return handle
        # The monitor is gone: do its part, grace period included.
        facts = layout.read_state(state.job_dir)
        facts = {**facts, **recovery.stop(state.job_dir, state.hosts, facts, monitor_why=why,
                                          grace_s=_grace_period(state.job_dir))}
        return journal.record(_update_from(facts))


def _grace_period(job_dir: str) -> float:
    """The grace period the job's agents were started with (the default if unreadable)."""
    try:
        with open(os.path.join(job_dir, layout.REQUEST_FILE)) as f:
            return float(json.load(f)["grace_period_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return float(contract.DEFAULT_GRACE_PERIOD_S)


def _update_from(facts: dict[str, Any]) -> Update:
    return Update(status=facts.get("status"), failure_reason=facts.get("failure_reason"),
                  started_at=facts.get("started_at"), ended_at=facts.get("ended_at"),
                  state=LocalState.changes(**{k: facts[k] for k in ("agents", "secondary_status")
                                              if k in facts}))


def _monitor_arguments(job_dir: str) -> list[str]:
    """The monitor's command line after the interpreter: how status recognises one whose
    submit died before noting it."""
    return ["-m", "dtrain.launcher.local.monitor", job_dir]
