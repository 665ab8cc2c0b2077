"""Target-agnostic job operations used by the CLI and ``Estimator``.

``submit`` goes spec -> plan -> backend request -> backend; everything after submission works
from the job store, so ``get``/``logs``/``stop``/``wait`` treat every target alike. Waiting ends
when the job has ended and its target has removed what it made for it (``pending_cleanup``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from dtrain.core.errors import DtrainError
from dtrain.jobs.store import JobRecord, JobStore

if TYPE_CHECKING:
    from dtrain.launcher.base import Launcher
    from dtrain.spec.model import JobSpec

# How long a wait goes on after the job ended for its target to remove what it created (EC2: the
# groups, once the nodes that powered off have terminated, which normally takes about a minute).
CLEANUP_SETTLE_S = 300.0


def _launcher(target: str, clients: dict[str, Any] | None = None) -> Launcher:
    from dtrain.launcher.base import get_launcher

    return get_launcher(target, **(clients or {}))


def build_request(spec: JobSpec, *, clients: dict[str, Any] | None = None) -> dict[str, Any]:
    """What ``submit`` would send (``--dry-run``)."""
    from dtrain.planning.planner import plan

    return _launcher(spec.compute.target, clients).build_request(plan(spec))


def submit(spec: JobSpec, *, wait: bool = True, follow: bool = False, dry_run: bool = False,
           store: JobStore | None = None, clients: dict[str, Any] | None = None,
           on_line: Callable[[str], None] | None = None) -> JobRecord | dict[str, Any]:
    """Run ``spec``. Returns the request (dry run) or the job record (final one when waiting,
    which also waits for the target to remove what it created for the job; see ``wait_for``).

    ``on_line`` receives each log line while waiting with ``follow``.
    """
    if dry_run:
        return build_request(spec, clients=clients)
    from dtrain.planning.planner import plan

    store = store or JobStore()
    launcher = _launcher(spec.compute.target, clients)
    record = launcher.submit(launcher.build_request(plan(spec)), store=store)
    if follow:
        for line in launcher.logs(record, follow=True):
            if on_line:
                on_line(line)
    if wait or follow:
        record = wait_for(record.id, store=store, clients=clients)
    return record


def get(job: str, *, store: JobStore | None = None,
        clients: dict[str, Any] | None = None) -> JobRecord:
    """A job by id, id prefix or name, refreshed from its target."""
    store = store or JobStore()
    record = store.find(job)
    return _launcher(record.target, clients).status(record, store=store)


def list_jobs(*, target: str | None = None, limit: int | None = None,
              store: JobStore | None = None) -> list[JobRecord]:
    """Newest first, as recorded (no calls to the targets)."""
    return (store or JobStore()).list(target=target, limit=limit)


def logs(job: str, *, follow: bool = False, host: str | None = None, rank: int | None = None,
         store: JobStore | None = None, clients: dict[str, Any] | None = None) -> Iterator[str]:
    record = (store or JobStore()).find(job)
    return _launcher(record.target, clients).logs(record, follow=follow, host=host, rank=rank)


def stop(job: str, *, wait: bool = False, store: JobStore | None = None,
         clients: dict[str, Any] | None = None, timeout_s: float | None = None) -> JobRecord:
    store = store or JobStore()
    record = store.find(job)
    record = _launcher(record.target, clients).stop(record, store=store)
    if wait:
        record = wait_for(record.id, store=store, clients=clients, timeout_s=timeout_s)
    return record


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
    launcher = _launcher(record.target, clients)
    poll_s = launcher.poll_s if poll_s is None else poll_s
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    last = None
    while True:
        record = launcher.status(store.get(record.id), store=store)
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
    pending = launcher.pending_cleanup(record)
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
            record = launcher.status(store.get(record.id), store=store)
            pending = launcher.pending_cleanup(record)
    except KeyboardInterrupt:  # the job is over: Ctrl-C only gives up waiting for the removal
        if pending is not None:
            on_note(f"stopped waiting: {pending.what} not removed yet; {pending.retry_hint}")
        return store.get(record.id)
    return record


wait = wait_for
