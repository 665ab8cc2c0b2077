"""Target-agnostic job operations used by the CLI, ``Estimator`` and the SageMaker shim.

``submit`` goes spec -> plan -> backend request -> backend; everything after submission works
from the job store, so ``get``/``logs``/``stop``/``wait`` treat every target alike. This layer
alone writes the store: a backend returns what it learnt (``Update``) or records it through the
``Journal`` handed to it. Waiting ends when the job has ended and its target has removed what it
made for it (``pending_cleanup``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from dtrain.core import names
from dtrain.core.errors import DtrainError
from dtrain.core.states import COMPLETED, FAILED, PENDING, STOPPED
from dtrain.jobs.store import JobRecord, JobStore, new_job_id

if TYPE_CHECKING:
    from dtrain.launcher.base import Handle, JobIdentity, Launcher, Request, Update
    from dtrain.spec.model import JobSpec

# How long a wait goes on after the job ended for its target to remove what it created (EC2: the
# groups, once the nodes that powered off have terminated, which normally takes about a minute).
CLEANUP_SETTLE_S = 300.0
# How long `dtrain list` spends asking the targets about jobs that have not ended.
LIST_REFRESH_S = 10.0


def launcher_for(target: str, clients: dict[str, Any] | None = None) -> Launcher:
    from dtrain.launcher.base import get_launcher

    return get_launcher(target, **(clients or {}))


# ---------------------------------------------------------------- the store <-> a backend

def handle_of(record: JobRecord, launcher: Launcher) -> Handle:
    """The backend's view of a stored job."""
    from dtrain.launcher.base import Handle, JobIdentity

    return Handle(job=JobIdentity(record.id, record.name, record.created_at),
                  status=record.status, state=launcher.state_type.from_dict(record.target_data),
                  failure_reason=record.failure_reason, started_at=record.started_at,
                  ended_at=record.ended_at)


def apply(store: JobStore, job_id: str, update: Update) -> JobRecord:
    """Write a backend's ``Update`` (a final status stays final; state merges in any case)."""
    fields = {k: getattr(update, k) for k in ("failure_reason", "started_at", "ended_at",
                                              "log_location", "output_location")
              if getattr(update, k) is not None}
    return store.update(job_id, status=update.status, target_data=update.state, **fields)


class StoreJournal:
    """The ``Journal`` a backend records its progress in: this job's row of the store."""

    def __init__(self, store: JobStore, launcher: Launcher, job_id: str) -> None:
        self.store, self.launcher, self.job_id = store, launcher, job_id

    def record(self, update: Update) -> Handle:
        return handle_of(apply(self.store, self.job_id, update), self.launcher)

    def current(self) -> Handle:
        return handle_of(self.store.get(self.job_id), self.launcher)


def refresh(record: JobRecord, launcher: Launcher, store: JobStore) -> JobRecord:
    """Ask the target about the job and write what changed."""
    if record.problem:
        raise DtrainError(f"job {record.id}: {record.problem}")
    return apply(store, record.id, launcher.status(handle_of(record, launcher)))


# ---------------------------------------------------------------- submit

# A dry run's job identity: the id and the time in cloud job names are chosen at submit, so a
# dry run shows these, and the same spec always prints the same request (diffable in review).
DRY_RUN_ID = "dry-run"
DRY_RUN_TIME = 0.0


def identity(spec: JobSpec, launcher: Launcher, *, now: float | None = None,
             job_id: str | None = None) -> JobIdentity:
    """The job's id, target name and submission time, chosen before the request is built."""
    from datetime import datetime, timezone

    from dtrain.launcher.base import JobIdentity

    now = time.time() if now is None else now
    name = spec.name
    if launcher.stamps_job_names:
        name = names.timestamped(spec.name, now=datetime.fromtimestamp(now, timezone.utc))
    return JobIdentity(id=job_id or new_job_id(), name=name, submitted_at=now)


def build_request(spec: JobSpec, *, clients: dict[str, Any] | None = None,
                  job: JobIdentity | None = None) -> Request:
    """What ``submit`` would send (``--dry-run``); without ``job``, the dry run's identity."""
    from dtrain.planning.planner import plan

    launcher = launcher_for(spec.compute.target, clients)
    job = job or identity(spec, launcher, now=DRY_RUN_TIME, job_id=DRY_RUN_ID)
    return launcher.build_request(spec, plan(spec), job)


def packed_sources(request: Request) -> dict[str, dict[str, list[str]]]:
    """For each source folder the request uploads: the files it packs and the secrets it
    leaves out (what ``submit`` would put in S3, listed without packing anything)."""
    from dtrain.launcher import packaging

    out = {}
    for upload in request.uploads:
        if upload.source not in (packaging.WHEEL, packaging.SAGEMAKER_ENTRY_SCRIPT):
            files, secrets = packaging.list_source_files(upload.source)
            out[upload.source] = {"files": files, "secrets": secrets}
    return out


def submit(spec: JobSpec, *, wait: bool = True, follow: bool = False, dry_run: bool = False,
           store: JobStore | None = None, clients: dict[str, Any] | None = None,
           on_line: Callable[[str], None] | None = None,
           job: JobIdentity | None = None) -> JobRecord | Request:
    """Run ``spec``. Returns the request (dry run) or the job record (final one when waiting,
    which also waits for the target to remove what it created for the job; see ``wait_for``).

    ``on_line`` receives each log line while waiting with ``follow``.
    """
    from dtrain.planning.planner import plan

    if dry_run:
        return build_request(spec, clients=clients, job=job)
    launcher = launcher_for(spec.compute.target, clients)
    request = launcher.build_request(spec, plan(spec), job or identity(spec, launcher))
    store = store or JobStore()
    if spec.checkpoint.uri:
        refuse_a_checkpoint_location_in_use(spec.checkpoint.uri, store=store, clients=clients)
    from dtrain.launcher import process

    record = store.create(job_id=request.job.id, name=request.job.name, target=launcher.name,
                          spec=spec.to_dict(), status=PENDING,
                          created_at=request.job.submitted_at,
                          target_data={"submitter": process.this_process(),
                                       **launcher.known_before_submit(request)})
    journal = StoreJournal(store, launcher, record.id)
    try:
        launcher.submit(request, journal)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt) and launcher.follows_submitter:
            raise  # the target may have the job already: the next status finds out
        reason = str(exc) if isinstance(exc, DtrainError) else \
            f"submit interrupted ({type(exc).__name__}: {exc})"
        store.update(record.id, status=FAILED, failure_reason=reason)  # unless it ended otherwise
        raise
    store.update(record.id, target_data={"submitter": None})  # the backend has the job
    # what the target recorded meanwhile (an EC2 launch's nodes, a SageMaker job's name) is in
    # the backup `dtrain store repair` restores from, not only the job's first record; the job
    # runs whatever becomes of that copy
    try:
        store.back_up()
    except (DtrainError, OSError):
        pass
    if follow:
        for line in logs(record.id, follow=True, store=store, clients=clients):
            if on_line:
                on_line(line)
    if wait or follow:
        return wait_for(record.id, store=store, clients=clients)
    return store.get(record.id)


def same_location(a: str, b: str) -> bool:
    """Whether two checkpoint locations are one: S3 prefixes with or without the trailing
    slash, folders as paths ('~', relative, '..')."""
    from dtrain.core import s3

    if s3.is_s3_uri(a) or s3.is_s3_uri(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.abspath(os.path.expanduser(a)) == os.path.abspath(os.path.expanduser(b))


def refuse_a_checkpoint_location_in_use(location: str, *, store: JobStore,
                                        clients: dict[str, Any] | None = None) -> None:
    """Two jobs on one checkpoint location write, and prune, each other's checkpoints: refuse
    ``location`` when a job that has not ended (of any target: SageMaker and EC2 jobs can
    share an S3 prefix) keeps its checkpoints there. A job its target cannot be asked about is
    passed over, as a stale record would otherwise block every submit."""
    for record in store.list():
        if record.is_final or record.problem:
            continue
        launcher = launcher_for(record.target, clients)
        theirs = handle_of(record, launcher).state.checkpoints
        if not theirs or not same_location(theirs, location):
            continue
        try:
            record = refresh(record, launcher, store)
        except Exception:  # noqa: BLE001, S112 -- cannot be asked: passed over, as documented
            continue
        if not record.is_final:
            raise DtrainError(
                f"checkpoint.uri: job {record.id} ({record.name}) is still {record.status} with "
                f"its checkpoints in {location}, and two jobs would write and prune the same "
                f"ones; stop it first (dtrain stop {record.id} --wait), or give this job "
                "another checkpoint.uri")


def resume_from(record: JobRecord, *,
                clients: dict[str, Any] | None = None) -> tuple[str | None, str | None]:
    """``(location, problem)``: where ``record``'s job kept its checkpoints, and why it cannot
    be resumed from there (None: it can). It recorded no location, or the location is a folder
    here without a complete checkpoint. A location in S3 is taken as it is (the Trainer starts
    afresh if it holds none)."""
    from dtrain.core import checkpoint_layout, s3

    location = handle_of(record, launcher_for(record.target, clients)).state.checkpoints
    if not location:
        return None, (f"job {record.id} recorded no checkpoint location (it never started, or "
                      "an older dtrain submitted it); resubmit with --set checkpoint.uri=<where "
                      "its checkpoints are>")
    if not s3.is_s3_uri(location) and not os.path.isdir(location):
        return location, (f"job {record.id}'s checkpoint folder {location} no longer exists; "
                          "submit its spec again to start afresh")
    if not s3.is_s3_uri(location) and not checkpoint_layout.complete_checkpoints(location):
        return location, (f"job {record.id} left no complete checkpoint in {location} (it "
                          "ended before its first); submit its spec again to start afresh")
    return location, None


def resume_hint(record: JobRecord, *, clients: dict[str, Any] | None = None) -> str | None:
    """The command that resumes a job that stopped, or failed (a node lost, a bug fixed since),
    from its newest checkpoint, if it left one (a failed job's: one seen here, not in S3)."""
    from dtrain.core import s3

    if record.status not in (STOPPED, FAILED):
        return None
    location, problem = resume_from(record, clients=clients)
    if problem or (record.status == FAILED and s3.is_s3_uri(location)):
        return None
    return f"dtrain submit --resume {record.id}"


def not_completed(record: JobRecord, *, clients: dict[str, Any] | None = None) -> str | None:
    """What a waiting caller is told of a job that ended without completing (None: it
    completed): the first line of its reason, or where its logs are, and how to resume it."""
    if record.status == COMPLETED:
        return None
    reason = (record.failure_reason or "").strip()
    why = reason.splitlines()[0] if reason else f"see `dtrain logs {record.id}`"
    hint = resume_hint(record, clients=clients)
    return f"job {record.id} {record.status}: {why}" + (
        f"; resume it with `{hint}`" if hint else "")


def resume_spec(job: str, *, spec: JobSpec | None = None, overrides: list[str] | None = None,
                store: JobStore | None = None,
                clients: dict[str, Any] | None = None) -> JobSpec:
    """The spec to resubmit ``job`` with so it resumes from its newest complete checkpoint:
    ``spec`` (default: the job's own) with ``checkpoint.uri`` set to where ``job`` kept its
    checkpoints."""
    from dtrain.core.errors import SpecError
    from dtrain.spec.model import JobSpec

    store = store or JobStore()
    record = find(job, store=store)
    location, problem = resume_from(record, clients=clients)
    if problem:
        raise DtrainError(problem)
    from dtrain.spec.base import takes_text
    from dtrain.spec.io import apply_overrides

    data = spec.to_dict() if spec is not None else apply_overrides(
        record.spec, overrides or [], text_at=lambda parts: takes_text(JobSpec, parts))
    given = (data.get("checkpoint") or {}).get("uri")
    if given and not same_location(given, location):
        raise SpecError(f"--resume {job} continues from {location}, where the job kept its "
                        f"checkpoints, and checkpoint.uri says {given}; leave checkpoint.uri "
                        "out, or submit without --resume to train from that location")
    # the job itself still running, or another that resumed it (a second --resume)
    refuse_a_checkpoint_location_in_use(location, store=store, clients=clients)
    if data.get("compute", {}).get("target") != record.target:
        raise SpecError(f"--resume {job}: the job ran on {record.target}, this spec targets "
                        f"{data.get('compute', {}).get('target')}; resume on the same target")
    data["checkpoint"] = {**data.get("checkpoint", {}), "uri": location}
    return JobSpec.from_dict(data)


# ---------------------------------------------------------------- after submission

def find(job: str, *, store: JobStore | None = None,
         on_note: Callable[[str], None] | None = None) -> JobRecord:
    """A job by id, id prefix or name — the spec's name or the target's. A name several jobs
    share finds the latest, and ``on_note`` (default: stderr, once per process: a command
    finds its job more than once) hears which and the others."""
    matches = (store or JobStore()).find_all(job)
    if len(matches) > 1:
        others = ", ".join(f"{r.id} ({r.status})" for r in matches[1:6])
        more = f" and {len(matches) - 6} more" if len(matches) > 6 else ""
        note = (f"{len(matches)} jobs are named {job!r}; this is the latest, {matches[0].id} "
                f"({matches[0].name}); the others: {others}{more} (give an id to pick one)")
        if on_note is not None:
            on_note(note)
        elif note not in _NOTED:
            _NOTED.add(note)
            note_to_stderr(note)
    return matches[0]


_NOTED: set[str] = set()  # the shared-name notes this process printed


def get(job: str, *, store: JobStore | None = None,
        clients: dict[str, Any] | None = None) -> JobRecord:
    """A job by id, id prefix or name (see ``find``), refreshed from its target."""
    store = store or JobStore()
    record = find(job, store=store)
    return refresh(record, launcher_for(record.target, clients), store)


def list_jobs(*, target: str | None = None, limit: int | None = None,
              store: JobStore | None = None, refresh_s: float | None = LIST_REFRESH_S,
              clients: dict[str, Any] | None = None) -> list[JobRecord]:
    """Newest first. Jobs that have not ended are asked about first, concurrently, for at
    most ``refresh_s`` seconds in all (None: as recorded, no call to any target); a job whose
    target does not answer in time, or fails to, is listed as recorded."""
    store = store or JobStore()
    records = store.list(target=target, limit=limit)
    live = [r for r in records if not r.is_final and not r.problem]
    if refresh_s is None or not live:
        return records
    import queue
    import threading

    todo: queue.SimpleQueue[JobRecord] = queue.SimpleQueue()
    for record in live:
        todo.put(record)
    fresh: dict[str, JobRecord] = {}
    lock = threading.Lock()

    def work() -> None:
        while True:
            try:
                record = todo.get_nowait()
            except queue.Empty:
                return
            try:
                answer = refresh(record, launcher_for(record.target, clients), store)
            except Exception:  # noqa: BLE001, S112 -- listed as recorded, as documented
                continue
            with lock:
                fresh[record.id] = answer

    # daemon threads: a target that does not answer in time holds neither the list nor the
    # process's exit (a thread pool's workers are joined at exit)
    threads = [threading.Thread(target=work, daemon=True, name="dtrain-list-refresh")
               for _ in range(min(8, len(live)))]
    deadline = time.monotonic() + refresh_s
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with lock:
        answered = dict(fresh)
    return [answered.get(r.id, r) for r in records]


def logs(job: str, *, follow: bool = False, host: str | None = None, rank: int | None = None,
         store: JobStore | None = None, clients: dict[str, Any] | None = None) -> Iterator[str]:
    store = store or JobStore()
    record = find(job, store=store)
    launcher = launcher_for(record.target, clients)
    handle = handle_of(record, launcher)
    _check_log_filter(record, launcher.hosts(handle) if host is not None else None,
                      host=host, rank=rank)

    def ended() -> bool:
        return refresh(store.get(record.id), launcher, store).is_final

    return launcher.logs(handle, follow=follow, host=host, rank=rank, ended=ended)


def deleted_job_folder(record: JobRecord) -> str | None:
    """The problem of an ended job whose folder here (local, Slurm: an absolute path, not a
    cloud location) was deleted, and its logs and metrics with it; None otherwise."""
    folder = record.log_location
    if record.is_final and folder and os.path.isabs(folder) and not os.path.exists(folder):
        return (f"job {record.id} ended {record.status}, and its folder {folder}, which held "
                "its logs and metrics, no longer exists")
    return None


def world_size(record: JobRecord) -> int | None:
    """The job's number of ranks from its stored spec (None when it cannot tell)."""
    from dtrain.core import instances

    compute = (record.spec or {}).get("compute") or {}
    if compute.get("instance_type") == "local_gpu" and not compute.get("processes_per_instance"):
        return None  # every GPU the agent finds
    try:
        per_node = compute.get("processes_per_instance") or \
            max(1, instances.get(compute.get("instance_type", "local")).gpus)
        return int(compute.get("instance_count", 1)) * int(per_node)
    except (ValueError, TypeError):
        return None


def _check_log_filter(record: JobRecord, hosts: list[str] | None, *, host: str | None,
                      rank: int | None) -> None:
    from dtrain.core.errors import SpecError

    world = world_size(record)
    if rank is not None and (rank < 0 or (world is not None and rank >= world)):
        valid = f"0 to {world - 1}" if world else "0 or more"
        raise SpecError(f"--rank {rank}: job {record.id} has ranks {valid}")
    if host is not None and hosts is not None and host not in hosts:
        raise SpecError(f"--host {host!r}: job {record.id} runs on {', '.join(hosts)}")


def stop(job: str, *, wait: bool = False, store: JobStore | None = None,
         clients: dict[str, Any] | None = None, timeout_s: float | None = None) -> JobRecord:
    store = store or JobStore()
    record = find(job, store=store)
    launcher = launcher_for(record.target, clients)
    record = refresh(record, launcher, store)
    launcher.stop(handle_of(record, launcher), StoreJournal(store, launcher, record.id))
    if wait:
        return wait_for(record.id, store=store, clients=clients, timeout_s=timeout_s)
    return store.get(record.id)


def note_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def wait_for(job: str, *, store: JobStore | None = None, clients: dict[str, Any] | None = None,
             timeout_s: float | None = None, poll_s: float | None = None,
             settle_s: float = CLEANUP_SETTLE_S,
             on_status: Callable[[JobRecord], None] | None = None,
             on_note: Callable[[str], None] = note_to_stderr) -> JobRecord:
    """Poll until the job reaches Completed, Failed or Stopped; returns the final record.

    ``poll_s`` defaults to the target's own interval (half a second locally, ten on AWS).
    ``on_status`` is called whenever the status or the target's secondary status changes.
    When the job has ended but its target still has to remove what it created for it (EC2: the
    security and placement groups, once the nodes have terminated), polling goes on until that is
    done or given up on, for up to ``settle_s`` (and never past ``timeout_s``), so nothing is
    left behind when this returns.
    ``on_note`` gets a line saying what it waits for, and one if that took longer or was
    interrupted (Ctrl-C); either way the job's own final record is returned.
    """
    store = store or JobStore()
    record = store.find(job)
    launcher = launcher_for(record.target, clients)
    poll_s = launcher.poll_s if poll_s is None else poll_s
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    last = None
    while True:
        record = refresh(store.get(record.id), launcher, store)
        seen = (record.status, (record.target_data or {}).get("secondary_status"))
        if on_status and seen != last:
            on_status(record)
        last = seen
        if record.is_final:
            if deadline is not None:
                settle_s = max(0.0, min(settle_s, deadline - time.monotonic()))
            return _settle(launcher, record, store=store, poll_s=poll_s, settle_s=settle_s,
                           on_note=on_note)
        if deadline is not None and time.monotonic() > deadline:
            raise DtrainError(f"job {record.id} still {record.status} after {timeout_s:g} s; "
                              f"check `dtrain status {record.id}` or `dtrain stop {record.id}`")
        time.sleep(poll_s)


def _settle(launcher: Launcher, record: JobRecord, *, store: JobStore, poll_s: float,
            settle_s: float, on_note: Callable[[str], None]) -> JobRecord:
    """Poll an ended job's target while it is removing what it created (status retries it)."""
    pending = launcher.pending_cleanup(handle_of(record, launcher))
    if pending is None:
        return record
    on_note(f"{record.status}; removing {pending.what} once {pending.once}…")
    deadline = time.monotonic() + settle_s
    try:
        while pending is not None:
            if time.monotonic() + poll_s > deadline:  # the next look would come too late
                on_note(f"warning: {pending.what} still not removed after {settle_s:.3g} s "
                        f"(waiting until {pending.once}); {pending.retry_hint}")
                return record
            time.sleep(poll_s)
            record = refresh(store.get(record.id), launcher, store)
            pending = launcher.pending_cleanup(handle_of(record, launcher))
    except KeyboardInterrupt:  # the job is over: Ctrl-C only gives up waiting for the removal
        if pending is not None:
            on_note(f"stopped waiting: {pending.what} not removed yet; {pending.retry_hint}")
        return store.get(record.id)
    return record


wait = wait_for
