"""The Launcher interface every backend implements, and lookup of backends by name.

A backend turns a Plan into a request with the pure ``build_request`` (what ``--dry-run``
prints), sends it with ``submit``, and then answers ``status``/``logs``/``stop`` for the job
record the store holds. A backend that removes what it created only once the job's machines are
gone says so through ``pending_cleanup``, so a caller that waits for the job can wait for that
too. Backends are imported only when used, so ``import dtrain`` stays light.

``this_process``/``process_alive`` let a backend whose client process owns a step (the EC2
launch, until every node runs) tell later whether that process died without finishing it.
"""

from __future__ import annotations

import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING, Any

from dtrain.core.errors import DtrainError
from dtrain.jobs.store import JobRecord, JobStore

if TYPE_CHECKING:
    from dtrain.planning.planner import Plan

BACKENDS = {
    "local": "dtrain.launcher.local.launcher:LocalLauncher",
    "sagemaker": "dtrain.launcher.sagemaker.launcher:SageMakerLauncher",
    "ec2": "dtrain.launcher.ec2.launcher:Ec2Launcher",
}


@dataclass(frozen=True)
class PendingCleanup:
    """What a target still has to remove after its job ended; each ``status`` call retries it."""

    what: str  # "security group sg-0abc and placement group dtrain-job-1a2b"
    once: str  # what the removal waits for: "the 2 nodes have terminated"
    retry_hint: str  # who finishes it when nobody waits: "`dtrain status 3f2a` tries again, ..."


class Launcher(ABC):
    """One target (local processes, SageMaker training jobs, EC2 instances)."""

    name: str
    # How often a waiting client asks ``status``: the cloud targets' describe calls are
    # rate-limited per account, so they override this with seconds, not half-seconds.
    poll_s: float = 0.5

    @abstractmethod
    def build_request(self, plan: Plan) -> dict[str, Any]:
        """The exact request ``submit`` would send. Pure: no I/O, no clock-dependent ids."""

    @abstractmethod
    def submit(self, request: dict[str, Any], *, store: JobStore) -> JobRecord:
        """Start the job, record it in ``store`` and return the record."""

    @abstractmethod
    def status(self, record: JobRecord, *, store: JobStore) -> JobRecord:
        """Refresh the record from the target (and write the change to ``store``)."""

    @abstractmethod
    def logs(self, record: JobRecord, *, follow: bool = False, host: str | None = None,
             rank: int | None = None) -> Iterator[str]:
        """The job's log lines, optionally only one host or rank; ``follow`` until it ends."""

    @abstractmethod
    def stop(self, record: JobRecord, *, store: JobStore) -> JobRecord:
        """Ask the job to stop; returns the record (Stopping or already final)."""

    def pending_cleanup(self, record: JobRecord) -> PendingCleanup | None:
        """For an ended job: what ``status`` has yet to remove (it retries on each call), or None.

        Reads the record only, no call to the target. By default nothing is left once a job ended.
        """
        return None


def runtime_settings(plan: Plan, *, job_name: str, instance_type: str,
                     processes_per_host: int | None, source_dir: str | None = None):
    """The reserved ``dtrain_*`` settings every backend writes into the container contract."""
    from dtrain.core import contract

    spec = plan.spec
    return contract.Settings(
        entry_point=spec.entry_point, job_name=job_name, instance_type=instance_type,
        source_dir=source_dir, distribution=plan.runtime_distribution(),
        processes_per_host=processes_per_host, max_restarts=spec.compute.max_restarts,
        max_run=int(spec.compute.max_run),
        checkpoint_interval_steps=spec.checkpoint.interval_steps,
        checkpoint_keep_last=spec.checkpoint.keep_last,
    )


def get_launcher(name: str, **clients: Any) -> Launcher:
    """The backend for target ``name``; ``clients`` go to its constructor (boto3 clients...)."""
    try:
        module_name, class_name = BACKENDS[name].split(":")
    except KeyError:
        raise DtrainError(f"unknown target {name!r}; use one of {sorted(BACKENDS)}") from None
    try:
        backend_class = getattr(import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise DtrainError(f"target {name!r} is not available in this install: {exc}") from None
    return backend_class(**clients)


# ---------------------------------------------------------------- the process that owns a step

def this_process() -> dict[str, Any]:
    """This process, described well enough to tell later whether it still runs."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "boot_id": _boot_id(),
            "pid_namespace": _pid_namespace(), "start": _start_ticks(pid)}


def process_alive(owner: dict[str, Any] | None) -> bool | None:
    """Whether the process ``this_process()`` described still runs; None when this machine
    cannot tell (it ran on another host, or the record predates the description)."""
    if not owner or owner.get("host") != socket.gethostname():
        return None
    if owner.get("boot_id") != _boot_id():
        return False  # rebooted since: every process of then is gone
    if owner.get("pid_namespace", _pid_namespace()) != _pid_namespace():
        # another container on this kernel with the same host name (--net=host, a shared
        # ~/.dtrain): its pids mean nothing here
        return None
    pid = int(owner["pid"])
    start = _start_ticks(pid)
    if start is not None or os.path.isdir("/proc"):
        # a zombie or a later process that got the same pid is not the owner
        return start is not None and owner.get("start") in (None, start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (start time since boot); None if gone, a zombie, or no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])
