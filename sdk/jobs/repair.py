"""`dtrain store repair`: a damaged job store becomes a working one with every job that can still
be read, from the store itself or its daily backup; the damaged file is kept aside."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from dataclasses import dataclass, field

from dtrain.core.errors import DtrainError
from dtrain.core.paths import default_db_path
from dtrain.jobs import store as job_store


@dataclass
class Repair:
    path: str
    kept: int = 0
    from_backup: int = 0
    unreadable: list[str] = field(default_factory=list)  # ids of rows whose JSON was damaged
    moved_aside: str | None = None
    healthy: bool = False  # nothing to repair: the store was left as it was


def readable_rows(path: str) -> list[tuple]:
    """The rows of ``path``'s jobs table that sqlite can still read (none of a non-database)."""
    rows: list[tuple] = []
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return rows
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error:
        return rows
    try:
        cursor = conn.execute(f"SELECT {','.join(job_store.COLUMNS)} FROM jobs")
        while True:  # row by row: a damaged page stops the reading, not what came before
            row = cursor.fetchone()
            if row is None:
                break
            rows.append(row)
    except sqlite3.Error:
        pass
    finally:
        conn.close()
    return rows


def _readable_json(row: tuple) -> bool:
    values = dict(zip(job_store.COLUMNS, row))
    try:
        json.loads(values["spec"])
        json.loads(values["target_data"] or "{}")
    except (TypeError, ValueError):
        return False
    return True


def whole_store_jobs(path: str) -> int | None:
    """How many jobs the store at ``path`` holds when it is whole (sqlite's integrity check
    passes and every record reads); None when it is damaged or missing."""
    if not os.path.isfile(path):
        return None
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            if conn.execute("PRAGMA integrity_check").fetchone() != ("ok",):
                return None
            rows = conn.execute(f"SELECT {','.join(job_store.COLUMNS)} FROM jobs").fetchall()
        finally:
            conn.close()
    except sqlite3.Error:
        return None
    return len(rows) if all(_readable_json(row) for row in rows) else None


def repair(path: str | None = None, *, force: bool = False) -> Repair:
    """Rebuild the store at ``path`` (module doc); a whole store is left as it is unless
    ``force``.

    The damaged file (with its ``-wal`` and ``-shm``) is moved aside first and read there; the
    new store is built under a temporary name, takes what another command saved at ``path``
    meanwhile, and replaces ``path`` only when whole, so a repair cut short leaves the damaged
    copy to repair from again, and the backup is refreshed from the result. A record the store
    holds with damaged JSON takes those columns from the backup, where they read."""
    path = os.path.abspath(path or default_db_path())
    if os.path.isdir(path):
        raise DtrainError(f"{path} is a folder, not a job store; point DTRAIN_JOBS_DB (or "
                          "DTRAIN_HOME) at the store's file")
    report = Repair(path=path)
    whole = None if force else whole_store_jobs(path)
    if whole is not None:
        report.kept, report.healthy = whole, True
        return report
    building = path + ".repairing"
    try:
        if os.path.exists(path):
            report.moved_aside = _aside(path)
            _move(path, report.moved_aside)
        rows: dict[str, tuple] = {row[0]: row for row in readable_rows(report.moved_aside or "")}
        for row in readable_rows(path + ".bak"):
            mine = rows.get(row[0])
            if mine is None:
                rows[row[0]] = row
                if _readable_json(row):  # else it is counted unreadable
                    report.from_backup += 1
            elif not _readable_json(mine) and _readable_json(row):
                rows[row[0]] = _mended(mine, row)
                report.from_backup += 1
        _remove(building, ("", "-wal", "-shm", ".bak"))  # of a repair cut short
        fresh = job_store.JobStore(building)
        for job_id, row in rows.items():
            if not _readable_json(row):
                report.unreadable.append(job_id)
                continue
            fresh.insert_row(row)
            report.kept += 1
        for row in readable_rows(path):  # saved by another command since the move: newer
            if _readable_json(row):
                fresh.insert_row(row)
        _settle(building)
        _remove(building, (".bak",))  # the new store's own, of an empty one
        _remove(path)
        os.replace(building, path)
    except BaseException as exc:
        # cut short before the new store replaced it: the damaged one goes back, to repair again
        if report.moved_aside and not os.path.exists(path):
            with contextlib.suppress(OSError):
                _move(report.moved_aside, path)
        with contextlib.suppress(OSError):
            _remove(building, ("", "-wal", "-shm", ".bak"))
        if isinstance(exc, OSError):
            raise DtrainError(f"could not repair the job store at {path}: "
                              f"{exc.strerror or exc} ({exc.filename or path}); check that its "
                              "folder is writable") from None
        raise
    job_store.JobStore(path).back_up()  # what a later repair falls back on: the repaired jobs
    return report


def _mended(row: tuple, backup: tuple) -> tuple:
    """``row`` with its unreadable JSON columns from ``backup``: its status and times stay the
    store's, which may be newer."""
    values, older = dict(zip(job_store.COLUMNS, row)), dict(zip(job_store.COLUMNS, backup))
    for column in ("spec", "target_data"):
        try:
            json.loads(values[column] or "{}")
        except (TypeError, ValueError):
            values[column] = older[column]
    return tuple(values[column] for column in job_store.COLUMNS)


def _move(path: str, to: str) -> None:
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.replace(path + suffix, to + suffix)


def _remove(path: str, suffixes: tuple[str, ...] = ("", "-wal", "-shm")) -> None:
    for suffix in suffixes:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path + suffix)


def _settle(path: str) -> None:
    """Fold the store's write-ahead log into its file, so the file alone is the store."""
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("PRAGMA journal_mode=DELETE")
    finally:
        conn.close()


def _aside(path: str) -> str:
    """A name for the damaged file that no earlier repair took (two can come in one second)."""
    stem = f"{path}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
    name, n = stem, 1
    while os.path.exists(name):
        n += 1
        name = f"{stem}-{n}"
    return name
