"""Target-agnostic job operations used by the CLI and ``Estimator``.

``submit`` goes spec -> plan -> backend request -> backend; everything after submission works
from the job store, so ``get``/``logs``/``stop``/``wait`` treat every target alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from dtrain.errors import DtrainError
from dtrain.store import JobRecord, JobStore

if TYPE_CHECKING:
    from dtrain.launcher.base import Launcher
    from dtrain.spec import JobSpec

POLL_S = 0.5


def _launcher(target: str, clients: dict[str, Any] | None = None) -> Launcher:
    from dtrain.launcher.base import get_launcher

    return get_launcher(target, **(clients or {}))


def build_request(spec: JobSpec, *, clients: dict[str, Any] | None = None) -> dict[str, Any]:
    """What ``submit`` would send (``--dry-run``)."""
    from dtrain.planner import plan

    return _launcher(spec.compute.target, clients).build_request(plan(spec))


def submit(spec: JobSpec, *, wait: bool = True, follow: bool = False, dry_run: bool = False,
           store: JobStore | None = None, clients: dict[str, Any] | None = None,
           on_line: Callable[[str], None] | None = None) -> JobRecord | dict[str, Any]:
    """Run ``spec``. Returns the request (dry run) or the job record (final one when waiting).

    ``on_line`` receives each log line while waiting with ``follow``.
    """
    if dry_run:
        return build_request(spec, clients=clients)
    from dtrain.planner import plan

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


def wait_for(job: str, *, store: JobStore | None = None, clients: dict[str, Any] | None = None,
             timeout_s: float | None = None, poll_s: float = POLL_S,
             on_status: Callable[[JobRecord], None] | None = None) -> JobRecord:
    """Poll until the job reaches Completed, Failed or Stopped; returns the final record.

    ``on_status`` is called whenever the status or the target's secondary status changes.
    """
    store = store or JobStore()
    record = store.find(job)
    launcher = _launcher(record.target, clients)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    last = None
    while True:
        record = launcher.status(store.get(record.id), store=store)
        seen = (record.status, (record.target_data or {}).get("secondary_status"))
        if on_status and seen != last:
            on_status(record)
        last = seen
        if record.is_final:
            return record
        if deadline is not None and time.monotonic() > deadline:
            raise DtrainError(f"job {record.id} still {record.status} after {timeout_s:g} s; "
                              f"check `dtrain status {record.id}` or `dtrain stop {record.id}`")
        time.sleep(poll_s)


wait = wait_for
