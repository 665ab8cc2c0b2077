"""The local target: N simulated hosts as real processes on this machine, no Docker.

``submit`` creates the job folder (one contract root per host ``algo-1``, ``algo-2``, ...), stages
the input channels, and starts a detached monitor (``python -m dtrain.launcher.local.monitor``)
that runs one node agent per host and writes the final status. The monitor, not the CLI, owns
the job, so it keeps running after ``dtrain submit --no-wait`` returns.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dtrain.core import contract
from dtrain.core.errors import DtrainError
from dtrain.jobs.store import FAILED, PENDING, STOPPED, STOPPING, JobRecord, JobStore, dtrain_home
from dtrain.launcher.base import Launcher, runtime_settings

if TYPE_CHECKING:
    from dtrain.planning.planner import Plan

REQUEST_FILE = "request.json"
AGENT_LOG = "agent.log"
_RANK_PREFIX = re.compile(r"^\[(\S+) (\d+)\]:")


def job_name_for(spec: Any) -> str:
    if spec.name:
        return spec.name
    stem = os.path.splitext(os.path.basename(spec.entry_point.split(":")[-1]))[0]
    return re.sub(r"[^A-Za-z0-9-]+", "-", stem).strip("-")[:40] or "job"


def host_root(job_dir: str, host: str) -> str:
    return os.path.join(job_dir, host)


def agent_log(job_dir: str, host: str) -> str:
    return os.path.join(host_root(job_dir, host), "output", AGENT_LOG)


class LocalLauncher(Launcher):
    name = "local"

    def __init__(self, *, s3_client: Any = None, grace_period_s: int | None = None):
        self._s3 = s3_client
        if grace_period_s is None:
            grace_period_s = int(os.environ.get(contract.GRACE_PERIOD_ENV,
                                                contract.DEFAULT_GRACE_PERIOD_S))
        self.grace_period_s = grace_period_s

    # ---------------------------------------------------------------- request

    def build_request(self, plan: Plan) -> dict[str, Any]:
        spec = plan.spec
        compute = spec.compute
        # local_gpu without an explicit count uses every GPU the agent finds.
        per_host = compute.processes_per_instance
        if per_host is None and compute.instance_type == "local":
            per_host = plan.processes_per_node
        settings = runtime_settings(plan, job_name=job_name_for(spec),
                                    instance_type=compute.instance_type,
                                    processes_per_host=per_host, source_dir=spec.source_dir)
        return {
            "target": "local",
            "job_name": settings.job_name,
            "hosts": [f"algo-{i + 1}" for i in range(plan.num_nodes)],
            "settings": settings.__dict__,
            "hyperparameters": dict(spec.hyperparameters),
            "inputs": dict(spec.inputs),
            "output_path": spec.output_path,
            "checkpoint_uri": spec.checkpoint.uri,
            "environment": dict(spec.environment),
            "grace_period_s": self.grace_period_s,
            "spec": spec.to_dict(),
        }

    # ---------------------------------------------------------------- submit

    def submit(self, request: dict[str, Any], *, store: JobStore) -> JobRecord:
        record = store.create(name=request["job_name"], target="local", spec=request["spec"],
                              status=PENDING)
        job_dir = self._job_dir(request, record.id)
        record = store.update(record.id, log_location=job_dir, output_location=job_dir,
                              target_data={"job_dir": job_dir, "hosts": request["hosts"]})
        try:
            os.makedirs(job_dir, exist_ok=False)
            self._write_contracts(request, job_dir, record.id)
            pid = self._start_monitor(job_dir, record.id, store)
        except BaseException as exc:
            store.update(record.id, status=FAILED, failure_reason=f"submit failed: {exc}")
            if isinstance(exc, (DtrainError, KeyboardInterrupt)):
                raise
            raise DtrainError(f"local job {record.id}: could not start: {exc}") from exc
        return store.update(record.id, target_data={"monitor_pid": pid})

    @staticmethod
    def _job_dir(request: dict[str, Any], job_id: str) -> str:
        base = request.get("output_path")
        if not base or base.startswith("s3://"):
            base = os.path.join(dtrain_home(), "jobs")
        return os.path.abspath(os.path.join(base, job_id))

    def _write_contracts(self, request: dict[str, Any], job_dir: str, job_id: str) -> None:
        settings = contract.Settings(**request["settings"])
        staged = self._stage_inputs(request["inputs"], job_dir)
        for host in request["hosts"]:
            paths = contract.write_host_contract(
                host_root(job_dir, host), current_host=host, hosts=request["hosts"],
                settings=settings, hyperparameters=request["hyperparameters"],
                channels=sorted(staged), checkpoint_s3_uri=request.get("checkpoint_uri"),
                # one folder for all simulated hosts: DCP writes each shard once, from one host
                checkpoint_local_path=os.path.join(job_dir, "checkpoints"),
                network_interface_name="lo")
            for channel, source in staged.items():
                target = paths.channel_dir(channel)
                os.rmdir(target)
                os.symlink(source, target)
        with open(os.path.join(job_dir, REQUEST_FILE), "w") as f:
            json.dump({**request, "job_id": job_id}, f, indent=2, default=str)

    def _stage_inputs(self, inputs: dict[str, str], job_dir: str) -> dict[str, str]:
        """channel -> a local folder holding its data (S3 downloaded once, shared by hosts)."""
        staged = {}
        for channel, uri in inputs.items():
            if uri.startswith("s3://"):
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
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        s3 = self._s3
        if s3 is None:
            import boto3

            s3 = self._s3 = boto3.client("s3")
        count = 0
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                key = obj["Key"]
                rel = os.path.relpath(key, prefix) if prefix and key != prefix \
                    else os.path.basename(key)
                if key.endswith("/") or rel.startswith(".."):
                    continue
                target = os.path.join(folder, rel)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                s3.download_file(bucket, key, target)
                count += 1
        if count == 0:
            raise DtrainError(f"input {uri}: no objects under this prefix; check the URI")
        return folder

    def _start_monitor(self, job_dir: str, job_id: str, store: JobStore) -> int:
        env = dict(os.environ, DTRAIN_JOBS_DB=store.path, PYTHONUNBUFFERED="1")
        with open(os.path.join(job_dir, "monitor.log"), "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dtrain.launcher.local.monitor", job_dir],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True)
        return proc.pid

    # ---------------------------------------------------------------- lifecycle

    def status(self, record: JobRecord, *, store: JobStore) -> JobRecord:
        """The store's view, corrected when the monitor died without writing a final state."""
        if record.is_final:
            return record
        pid = record.target_data.get("monitor_pid")
        if pid and not pid_alive(pid):
            record = store.get(record.id)  # it may have finished while we looked
            if not record.is_final:
                kill_process_groups(record.target_data.get("agent_pids", []), signal.SIGKILL)
                status = STOPPED if record.status == STOPPING else FAILED
                record = store.update(record.id, status=status,
                                      failure_reason=record.failure_reason or
                                      "the local job monitor exited unexpectedly")
        return record

    def logs(self, record: JobRecord, *, follow: bool = False, host: str | None = None,
             rank: int | None = None) -> Iterator[str]:
        job_dir = record.target_data.get("job_dir") or record.log_location
        hosts = [h for h in record.target_data.get("hosts", []) if host in (None, h)]
        if host and not hosts:
            raise DtrainError(f"host {host!r} is not part of job {record.id}; "
                              f"hosts: {record.target_data.get('hosts')}")
        offsets = {h: 0 for h in hosts}
        store = JobStore()
        while True:
            done = not follow or self.status(store.get(record.id), store=store).is_final
            for h in hosts:
                yield from _read_new_lines(agent_log(job_dir, h), offsets, h, rank)
            if done:
                return
            time.sleep(0.25)

    def stop(self, record: JobRecord, *, store: JobStore) -> JobRecord:
        record = self.status(record, store=store)
        if record.is_final:
            return record
        record = store.update(record.id, status=STOPPING)
        pid = record.target_data.get("monitor_pid")
        if pid and pid_alive(pid):
            os.kill(pid, signal.SIGTERM)  # the monitor stops the agents and marks Stopped
        else:
            kill_process_groups(record.target_data.get("agent_pids", []), signal.SIGKILL)
            record = store.update(record.id, status=STOPPED, failure_reason="stopped by user")
        return record


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
        match = _RANK_PREFIX.match(raw)
        if rank is not None and (match is None or int(match.group(2)) != rank):
            continue
        yield raw if match else f"[{host}] {raw}"


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def kill_process_groups(pids: list[int], sig: int) -> None:
    """Signal each process group led by ``pids`` (agents run as session leaders)."""
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
