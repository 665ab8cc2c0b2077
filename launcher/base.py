"""The interface every backend implements, and lookup of backends by name.

A backend is written against this module alone (docs/how-to/add-a-backend.md):

* ``build_request(spec, plan, job)`` is pure: a function of its arguments only (no clock, no
  I/O, no state). The jobs layer chooses the job's id, name and submission time before it, so
  ``dtrain submit --dry-run`` prints exactly the :class:`Request` that ``submit`` sends.
* ``submit(request, journal)`` sends it and returns a :class:`Handle`. A backend never touches
  the job store: what it learns goes into the :class:`Journal` the jobs layer hands it, as an
  :class:`Update`; the jobs layer writes it.
* ``status``/``stop``/``logs`` take the Handle (built by the jobs layer from the store) and
  return an :class:`Update` (or log lines).
* Each target's own facts are a typed :class:`TargetState` (``state_type``), stored as JSON.

Backends are imported only when used, so ``import dtrain`` stays light.
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import import_module
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from dtrain.core import contract
from dtrain.core.errors import DtrainError
from dtrain.core.states import FAILED, FINAL_STATUSES, STOPPED, STOPPING
from dtrain.launcher import process

if TYPE_CHECKING:
    from dtrain.planning.planner import Plan
    from dtrain.spec.model import JobSpec

BACKENDS = {
    "local": "dtrain.launcher.local.launcher:LocalLauncher",
    "sagemaker": "dtrain.launcher.sagemaker.launcher:SageMakerLauncher",
    "ec2": "dtrain.launcher.ec2.launcher:Ec2Launcher",
    "slurm": "dtrain.launcher.slurm.launcher:SlurmLauncher",
}


@dataclass(frozen=True)
class JobIdentity:
    """Chosen by the jobs layer before ``build_request``: the store's id, the name the target
    knows the job by, and when it was submitted (epoch seconds)."""

    id: str
    name: str
    submitted_at: float


@dataclass(frozen=True)
class Upload:
    """A file ``submit`` puts in place before it creates the job: ``source`` is a local folder to
    pack (the job's ``source_dir``), or a file dtrain makes itself (``packaging.WHEEL``,
    ``packaging.SAGEMAKER_ENTRY_SCRIPT``); ``uri`` is an S3 URI, or for the Slurm target a folder
    of the cluster's shared file system."""

    source: str
    uri: str


@dataclass(frozen=True)
class Request:
    """Everything ``submit`` sends: the target's own request (``payload``) and the uploads."""

    target: str
    job: JobIdentity
    payload: dict[str, Any]
    uploads: tuple[Upload, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class TargetState:
    """A target's facts about one job (subclassed per target). Stored as the record's JSON
    ``target_data``; unknown keys (written by another dtrain version) are ignored on read."""

    secondary_status: str | None = None  # finer than the status: "Training", "Interrupted"...
    # where the job keeps its checkpoints (a folder or an S3 URI): a job submitted with this
    # checkpoint.uri resumes from the newest complete one (`dtrain submit --resume`)
    checkpoints: str | None = None
    # the `dtrain submit` process (process.describe) while it submits; None once the backend has
    # the job. A status call that finds it gone first can tell a job that will never start.
    submitter: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> TargetState:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in names})

    @classmethod
    def changes(cls, **values: Any) -> dict[str, Any]:
        """``values`` checked against the fields: what an :class:`Update` merges into the state."""
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
        return values


@dataclass(frozen=True)
class Handle:
    """What the store knows of a submitted job, as its backend sees it."""

    job: JobIdentity
    status: str
    state: TargetState
    failure_reason: str | None = None
    started_at: float | None = None
    ended_at: float | None = None

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_STATUSES


@dataclass(frozen=True)
class Update:
    """What a backend learnt; the jobs layer writes it. ``None`` leaves a field as it is; a
    final status never changes again; ``state`` holds changed fields only (merged, also into
    an ended job's state)."""

    status: str | None = None
    failure_reason: str | None = None
    started_at: float | None = None
    ended_at: float | None = None
    log_location: str | None = None
    output_location: str | None = None
    state: dict[str, Any] = field(default_factory=dict)


class Journal(Protocol):
    """The jobs layer's write path for a backend that records progress while it works (the
    EC2 launch records each node as it goes, so a stop meanwhile finds them)."""

    def record(self, update: Update) -> Handle:
        """Write ``update``; returns the job as stored afterwards."""

    def current(self) -> Handle:
        """The job as stored now (another process may have changed it, e.g. `dtrain stop`)."""


@dataclass(frozen=True)
class PendingCleanup:
    """What a target still has to remove after its job ended; each ``status`` call retries it."""

    what: str  # "security group sg-0abc and placement group dtrain-job-1a2b"
    once: str  # what the removal waits for: "the 2 nodes have terminated"
    retry_hint: str  # who finishes it when nobody waits: "`dtrain status 3f2a` tries again, ..."


Found = TypeVar("Found")


# How long a submit this machine cannot watch (it ran on another host, or in another pid
# namespace) may take before its job, still not made, counts as abandoned.
OTHER_HOST_SUBMIT_S = 3600.0


def judge_submitter(handle: Handle, *, now: float) -> tuple[bool | None, str]:
    """``process.judge`` of the record's submitter, where one this machine cannot watch (None:
    it ran on another host) counts as gone ``OTHER_HOST_SUBMIT_S`` after the submit began."""
    alive, why = process.judge(handle.state.submitter)
    if alive is None and now - handle.job.submitted_at >= OTHER_HOST_SUBMIT_S:
        return False, f"{why}, more than {OTHER_HOST_SUBMIT_S / 3600:g} h ago"
    return alive, why


def follow_submitter(handle: Handle, find: Callable[[], Found | None], *,
                     made: str) -> tuple[Update | None, Found | None]:
    """What became of a job its target has not recorded yet, while ``submitter`` (the `dtrain
    submit` that makes it) may have died half-way: a target whose status reads this sets
    ``Launcher.follows_submitter``.

    ``find()`` asks the target for the job the submit made, None if there is none. Returns
    ``(None, found)`` when the target has it: the caller adopts it (and clears ``submitter``;
    a ``Stopping`` record's stop, which that submit would have delivered, is the caller's to
    deliver now); else ``(update, None)``: no change while the submit runs, or, where it cannot
    be judged (it ran on another host), for ``OTHER_HOST_SUBMIT_S`` after it began; once it is
    gone the job has ended: ``Failed`` ("lost"), or ``Stopped`` if a stop was asked. ``made``
    ends "`dtrain submit` ended before ...": what the target would have had."""
    alive, why = judge_submitter(handle, now=time.time())
    if alive:
        return Update(), None  # still submitting: nothing to ask the target yet
    found = find()
    if found is not None:
        return None, found
    if alive is None:
        return Update(), None
    if handle.status == STOPPING:
        return Update(status=STOPPED, ended_at=time.time()), None  # "stopped by user" stays
    return Update(status=FAILED, ended_at=time.time(), failure_reason=(
        f"lost: `dtrain submit` ended before {made} ({why}); nothing of it ran; "
        "submit again")), None


class Launcher(ABC):
    """One target (local processes, SageMaker training jobs, EC2 instances, a Slurm cluster)."""

    name: ClassVar[str]
    state_type: ClassVar[type[TargetState]] = TargetState
    # How often a waiting client asks ``status``: the cloud targets' describe calls are
    # rate-limited per account, so they override this with seconds, not half-seconds.
    poll_s: ClassVar[float] = 0.5
    # Cloud targets keep every job name forever: each submission gets a timestamped one.
    stamps_job_names: ClassVar[bool] = False
    # status() follows ``TargetState.submitter`` (``follow_submitter``): an interrupted submit
    # leaves the record as it is, and the next status adopts what the target made or ends it lost
    follows_submitter: ClassVar[bool] = False

    @abstractmethod
    def build_request(self, spec: JobSpec, plan: Plan, job: JobIdentity) -> Request:
        """The exact request ``submit`` sends. Pure: no I/O, no clock, no state."""

    def known_before_submit(self, request: Request) -> dict[str, Any]:
        """State fields ``request`` fixes before ``submit`` runs (where the job's files will
        be), stored with the job's first record: a record restored from the store's backup,
        which is taken then, still leads ``status`` to them."""
        return {}

    @abstractmethod
    def submit(self, request: Request, journal: Journal) -> Handle:
        """Start the job; record what is learnt in ``journal`` and return the job's handle.

        On failure, leave nothing behind and raise DtrainError (one line); what the backend
        recorded stays (the jobs layer marks the job Failed unless it ended otherwise)."""

    @abstractmethod
    def status(self, handle: Handle) -> Update:
        """What changed since ``handle`` (asked of the target)."""

    @abstractmethod
    def logs(self, handle: Handle, *, follow: bool, host: str | None, rank: int | None,
             ended: Callable[[], bool]) -> Iterator[str]:
        """The job's log lines (``log_line`` format), optionally only one host or rank;
        ``follow`` until ``ended()`` says the job is over."""

    @abstractmethod
    def stop(self, handle: Handle, journal: Journal) -> Handle:
        """Ask the job to stop; returns the job as recorded afterwards (Stopping, or final)."""

    def hosts(self, handle: Handle) -> list[str] | None:
        """The job's host names as ``logs`` takes them (None: not known yet)."""
        return None

    def pending_cleanup(self, handle: Handle) -> PendingCleanup | None:
        """For an ended job: what ``status`` has yet to remove (it retries on each call), or None.

        Reads the handle only, no call to the target. By default nothing is left once a job ended.
        """
        return None


def runtime_settings(spec: JobSpec, plan: Plan, *, job_name: str, instance_type: str,
                     processes_per_host: int | None,
                     source_dir: str | None = None) -> contract.Settings:
    """The reserved ``dtrain_*`` settings every backend writes into the container contract."""
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
    return backend_class(name)(**clients)


def backend_class(name: str) -> type[Launcher]:
    try:
        module_name, class_name = BACKENDS[name].split(":")
    except KeyError:
        raise DtrainError(f"unknown target {name!r}; use one of {sorted(BACKENDS)}") from None
    try:
        return getattr(import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise DtrainError(f"target {name!r} is not available in this install: {exc}") from None
