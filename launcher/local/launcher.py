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

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dtrain.core import contract, logformat, s3
from dtrain.core.errors import DtrainError
from dtrain.core.states import FINAL_STATUSES, STOPPING
from dtrain.launcher import process
from dtrain.launcher.base import (
    Handle,
    JobIdentity,
    Journal,
    Launcher,
    Request,
    TargetState,
    Update,
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


def jobs_folder() -> str:
    """``$DTRAIN_HOME/jobs``: where local jobs without an ``output_path`` live."""
    from dtrain.core.paths import dtrain_home

    return os.path.join(dtrain_home(), "jobs")


class LocalLauncher(Launcher):
    name = "local"
    state_type = LocalState

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

    def submit(self, request: Request, journal: Journal) -> Handle:
        payload = request.payload
        job_dir = os.path.abspath(os.path.join(payload["output_path"] or jobs_folder(),
                                               request.job.id))
        journal.record(Update(log_location=job_dir, output_location=job_dir,
                              state=LocalState.changes(job_dir=job_dir, hosts=payload["hosts"])))
        try:
            os.makedirs(job_dir, exist_ok=False)
            self._write_contracts(request, job_dir)
            monitor = self._start_monitor(job_dir)
        except DtrainError:
            raise
        except OSError as exc:
            raise DtrainError(f"local job {request.job.id}: could not start: {exc}") from exc
        return journal.record(Update(state=LocalState.changes(monitor=monitor)))

    def _write_contracts(self, request: Request, job_dir: str) -> None:
        payload = request.payload
        settings = contract.Settings(**payload["settings"])
        staged = self._stage_inputs(payload["inputs"], job_dir)
        for host in payload["hosts"]:
            paths = contract.write_host_contract(
                layout.host_root(job_dir, host), current_host=host, hosts=payload["hosts"],
                settings=settings, hyperparameters=payload["hyperparameters"],
                channels=sorted(staged), checkpoint_s3_uri=payload.get("checkpoint_uri"),
                # one folder for all simulated hosts: DCP writes each shard once, from one host
                checkpoint_local_path=os.path.join(job_dir, "checkpoints"),
                network_interface_name="lo")
            for channel, source in staged.items():
                target = paths.channel_dir(channel)
                os.rmdir(target)
                os.symlink(source, target)
        grace = self.grace_period_s
        if grace is None:
            grace = int(os.environ.get(contract.GRACE_PERIOD_ENV, contract.DEFAULT_GRACE_PERIOD_S))
        with open(os.path.join(job_dir, layout.REQUEST_FILE), "w") as f:
            json.dump({**request.to_dict(), "grace_period_s": grace}, f, indent=2, default=str)

    def _stage_inputs(self, inputs: dict[str, str], job_dir: str) -> dict[str, str]:
        """channel -> a local folder holding its data (S3 downloaded once, shared by hosts)."""
        staged = {}
        for channel, uri in inputs.items():
            if s3.is_s3_uri(uri):
                staged[channel] = self._download(uri, os.path.join(job_dir, "inputs", channel))
                continue
            source = os.path.abspath(os.path.expanduser(uri))
            if not os.path.exists(source):
                raise DtrainError(f"inputs.{channel}: {uri!r} does not exist; fix the path")
            if os.path.isfile(source):
                folder = os.path.join(job_dir, "inputs", channel)
                os.makedirs(folder, exist_ok=True)
                os.symlink(source, os.path.join(folder, os.path.basename(source)))
                source = folder
            staged[channel] = source
        return staged

    def _download(self, uri: str, folder: str) -> str:
        bucket, prefix = s3.split(uri)
        client = self._s3
        if client is None:
            import boto3

            client = self._s3 = boto3.client("s3")
        count = 0
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                     Prefix=prefix):
            for obj in page.get("Contents", []):
                key = obj["Key"]
                rel = os.path.relpath(key, prefix) if prefix and key != prefix \
                    else os.path.basename(key)
                if key.endswith("/") or rel.startswith(".."):
                    continue
                target = os.path.join(folder, rel)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                client.download_file(bucket, key, target)
                count += 1
        if count == 0:
            raise DtrainError(f"input {uri}: no objects under this prefix; check the URI")
        return folder

    @staticmethod
    def _start_monitor(job_dir: str) -> dict[str, Any]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(os.path.join(job_dir, layout.MONITOR_LOG), "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dtrain.launcher.local.monitor", job_dir],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True)
        return process.describe(proc.pid)

    # ---------------------------------------------------------------- lifecycle

    def status(self, handle: Handle) -> Update:
        """The monitor's facts; when the monitor is gone without writing an end, the facts
        the job itself left (:mod:`dtrain.launcher.local.recovery`)."""
        state: LocalState = handle.state
        if handle.is_final or not state.job_dir:
            return Update()
        facts = layout.read_state(state.job_dir)
        if facts.get("status") not in FINAL_STATUSES:
            alive, why = process.judge(state.monitor)
            facts = layout.read_state(state.job_dir)  # it may have ended while we looked
            if alive is False and facts.get("status") not in FINAL_STATUSES:
                facts = {**facts, **recovery.settle(
                    state.job_dir, state.hosts, facts, monitor_why=why,
                    stopping=handle.status == STOPPING, grace_s=_grace_period(state.job_dir))}
        return _update_from(facts)

    def hosts(self, handle: Handle) -> list[str] | None:
        return list(handle.state.hosts) or None

    def logs(self, handle: Handle, *, follow: bool, host: str | None, rank: int | None,
             ended: Callable[[], bool]) -> Iterator[str]:
        state: LocalState = handle.state
        hosts = [h for h in state.hosts if host in (None, h)]
        offsets = {h: 0 for h in hosts}
        while True:
            done = not follow or ended()
            for h in hosts:
                yield from _read_new_lines(layout.agent_log(state.job_dir, h), offsets, h, rank)
            if done:
                return
            time.sleep(0.25)

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


def _read_new_lines(path: str, offsets: dict[str, int], host: str,
                    rank: int | None) -> Iterator[str]:
    try:
        with open(path, "rb") as f:
            f.seek(offsets[host])
            data = f.read()
    except FileNotFoundError:
        return
    end = data.rfind(b"\n") + 1  # hold back a partial last line until it is complete
    offsets[host] += end
    for raw in data[:end].decode(errors="replace").splitlines():
        line = logformat.as_line(host, raw)
        if rank is None or logformat.rank_of(line) == rank:
            yield line
