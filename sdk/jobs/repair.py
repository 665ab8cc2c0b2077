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
    ``force``. The damaged file (with its ``-wal`` and ``-shm``) is moved aside first and read
    there, so a job another command saves meanwhile lands in the new store, not in the old one.
    A record the store holds but cannot read is taken from the backup where that reads."""
    path = os.path.abspath(path or default_db_path())
    if os.path.isdir(path):
        raise DtrainError(f"{path} is a folder, not a job store; point DTRAIN_JOBS_DB (or "
                          "DTRAIN_HOME) at the store's file")
    report = Repair(path=path)
    whole = None if force else whole_store_jobs(path)
    if whole is not None:
        report.kept, report.healthy = whole, True
        return report
    source = path
    try:
        if os.path.exists(path):
            report.moved_aside = source = _aside(path)
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.replace(path + suffix, source + suffix)
        rows: dict[str, tuple] = {row[0]: row for row in readable_rows(source)}
        for row in readable_rows(path + ".bak"):
            mine = rows.get(row[0])
            if mine is None or (not _readable_json(mine) and _readable_json(row)):
                rows[row[0]] = row
                report.from_backup += 1
        fresh = job_store.JobStore(path)
    except OSError as exc:
        raise DtrainError(f"could not repair the job store at {path}: {exc.strerror or exc}"
                          f" ({exc.filename or path}); check that its folder is writable"
                          ) from None
    for job_id, row in rows.items():
        if not _readable_json(row):
            report.unreadable.append(job_id)
            continue
        fresh.insert_row(row)
        report.kept += 1
    report.from_backup = min(report.from_backup, report.kept)
    return report


def _aside(path: str) -> str:
    """A name for the damaged file that no earlier repair took (two can come in one second)."""
    stem = f"{path}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
    name, n = stem, 1
    while os.path.exists(name):
        n += 1
        name = f"{stem}-{n}"
    return name
