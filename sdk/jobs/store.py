"""The job store: one SQLite file that records every job of every target.

``dtrain list/status/logs/stop`` read it the same way for local, SageMaker, EC2 and Slurm jobs.
Many CLI processes and local monitors write it at once, so every call opens its own connection,
uses WAL (a rollback journal on a file system machines share), a busy timeout, short
``BEGIN IMMEDIATE`` transactions and retries on ``database is locked``.
Final states are sticky: an update never moves a job out of Completed/Failed/Stopped.
"""

from __future__ import annotations

import json
import os
import random
import re
import sqlite3
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from dtrain.core.errors import DtrainError
from dtrain.core.paths import default_db_path, dtrain_home  # noqa: F401 - re-exported
from dtrain.core.states import (  # noqa: F401 - the store's vocabulary, re-exported
    COMPLETED,
    FAILED,
    FINAL_STATUSES,
    PENDING,
    RUNNING,
    STARTING,
    STATUSES,
    STOPPED,
    STOPPING,
)

COLUMNS = ("id", "name", "target", "spec", "status", "created_at", "started_at", "ended_at",
            "failure_reason", "log_location", "output_location", "target_data")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    target TEXT NOT NULL,
    spec TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL,
    failure_reason TEXT,
    log_location TEXT,
    output_location TEXT,
    target_data TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS jobs_name_created ON jobs (name, created_at);
"""
_RETRIES = 20
BACKUP_EVERY_S = 86400.0


@dataclass(frozen=True)
class JobRecord:
    id: str
    name: str
    target: str
    spec: dict[str, Any]
    status: str
    created_at: float
    started_at: float | None = None
    ended_at: float | None = None
    failure_reason: str | None = None
    log_location: str | None = None
    output_location: str | None = None
    target_data: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None  # set when the stored row cannot be read (its JSON is damaged)

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_STATUSES

    @property
    def duration(self) -> str:
        """How long it has run, as status, list and report show it: ``2m05s``, ``48h01m``."""
        if not self.started_at:
            return "-"
        seconds = int((self.ended_at or time.time()) - self.started_at)
        hours, rest = divmod(seconds, 3600)
        return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def _from_row(cls, row: sqlite3.Row) -> JobRecord:
        values = dict(zip(COLUMNS, row))
        try:
            values["spec"] = json.loads(values["spec"])
            values["target_data"] = json.loads(values["target_data"] or "{}")
        except (TypeError, ValueError) as exc:  # listed as unreadable, never a crash
            values.update(spec={}, target_data={},
                          problem=f"its stored record is unreadable ({exc}); `dtrain store "
                                  "repair` removes it")
        return cls(**values)


def new_job_id() -> str:
    return uuid.uuid4().hex[:12]


# File systems that machines share, where SQLite's WAL is unsafe (its docs: "WAL does not work
# over a network filesystem").
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "fuse.ceph-fuse",
    "glusterfs", "fuse.glusterfs", "wekafs", "gfs2", "ocfs2", "virtiofs", "9p", "afs", "panfs",
    "fuse.sshfs", "fuse.s3fs", "fuse.mountpoint-s3", "fuse.gcsfuse", "fuse.juicefs",
})
MOUNTS = "/proc/mounts"


def filesystem_type(path: str) -> str | None:
    """The type of the file system ``path`` is on: its longest mount point in ``/proc/mounts``
    (None where there is none to read, as on macOS)."""
    try:
        with open(MOUNTS, encoding="utf-8", errors="replace") as mounts:
            table = [line.split()[1:3] for line in mounts if len(line.split()) >= 3]
    except OSError:
        return None
    path = os.path.realpath(path)
    best, kind = "", None
    for point, fs_type in table:
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), point)  # \040: a space
        # ">=": of two mounts on one point (autofs, then the NFS it mounted) the later is seen
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fs_type
    return kind


class JobStore:
    """All reads and writes of job records. Safe to use from many processes at once."""

    def __init__(self, path: str | None = None, *, timeout_s: float = 30.0):
        self.path = os.path.abspath(path or default_db_path())
        self._timeout_s = timeout_s
        folder = os.path.dirname(self.path)
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise DtrainError(f"cannot create the job store's folder {folder!r}: "
                              f"{exc.strerror}; set DTRAIN_HOME (or DTRAIN_JOBS_DB) to a place "
                              "you can write") from None
        # a store that had jobs (it has a backup) and is now empty was truncated, not new
        if os.path.isfile(self.backup_path) and os.path.isfile(self.path) and \
                os.path.getsize(self.path) == 0:
            raise self.damaged("it is empty (0 bytes) though it had jobs")
        self._retry(self._create_schema)
        self._retry(self._backup)

    @property
    def backup_path(self) -> str:
        return self.path + ".bak"

    def damaged(self, what: str) -> DtrainError:
        return DtrainError(f"job store {self.path} is damaged: {what}; `dtrain store repair` "
                           "keeps every readable job (and those of its daily backup) and moves "
                           "the damaged file aside")

    # -------------------------------------------------------------- plumbing

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=self._timeout_s, isolation_level=None)
        conn.execute(f"PRAGMA busy_timeout = {int(self._timeout_s * 1000)}")
        return conn

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE")
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        finally:
            conn.close()

    def _retry(self, fn, *args):
        for attempt in range(_RETRIES):
            try:
                return fn(*args)
            except sqlite3.OperationalError as exc:
                busy = "locked" in str(exc) or "busy" in str(exc)
                if "unable to open" in str(exc) or "readonly" in str(exc):
                    raise DtrainError(f"job store {self.path}: {exc}; make it writable, or set "
                                      "DTRAIN_HOME (or DTRAIN_JOBS_DB) elsewhere") from None
                if not busy or attempt == _RETRIES - 1:
                    raise DtrainError(
                        f"job store {self.path}: {exc}; retry, or set DTRAIN_JOBS_DB to another file"
                    ) from None
                time.sleep(min(0.05 * 2 ** attempt, 1.0) * random.uniform(0.5, 1.5))
            except sqlite3.DatabaseError as exc:  # not a database, or a malformed one
                raise self.damaged(str(exc)) from None

    def back_up(self) -> None:
        """Take the backup now (``submit`` does, once the target has recorded a new job)."""
        self._retry(lambda: self._backup(force=True))

    def _backup(self, *, force: bool = False) -> None:
        """A copy of the store next to it, taken after each new job (when it is created and
        again when its submit has returned) and at least daily: what `dtrain store repair`
        falls back on when the store itself cannot be read."""
        try:
            if not force and time.time() - os.path.getmtime(self.backup_path) < BACKUP_EVERY_S:
                return
        except OSError:
            pass
        partial = f"{self.backup_path}.{os.getpid()}.tmp"
        source, target = self._connect(), sqlite3.connect(partial)
        try:
            source.backup(target)
        finally:
            target.close()
            source.close()
        os.replace(partial, self.backup_path)

    def _create_schema(self) -> None:
        conn = self._connect()
        try:
            # WAL lets readers run while a writer commits; the mode is stored in the file. Its
            # index is shared memory, so every process must be on one machine: on a file system
            # machines share (two login nodes, one home) the store keeps a rollback journal.
            # Another connection open on the file blocks the change: it is tried again next time.
            mode = "delete" if filesystem_type(self.path) in NETWORK_FILESYSTEMS else "wal"
            if conn.execute("PRAGMA journal_mode").fetchone()[0] != mode:
                conn.execute("PRAGMA busy_timeout = 100")  # not worth waiting for
                try:
                    conn.execute(f"PRAGMA journal_mode={mode}")
                except sqlite3.OperationalError:  # "database is locked": another one has it
                    pass
            conn.executescript(_SCHEMA)
        finally:
            conn.close()

    def _query(self, sql: str, params: tuple = ()) -> list[JobRecord]:
        def run() -> list[JobRecord]:
            conn = self._connect()
            try:
                return [JobRecord._from_row(r) for r in conn.execute(sql, params).fetchall()]
            finally:
                conn.close()
        return self._retry(run)

    # -------------------------------------------------------------- writes

    def insert_row(self, row: tuple) -> None:
        """A row as another store holds it (``COLUMNS`` order): how a repair copies jobs."""
        def insert() -> None:
            with self._write() as conn:
                conn.execute(f"INSERT OR REPLACE INTO jobs ({','.join(COLUMNS)}) VALUES "
                             f"({','.join('?' * len(COLUMNS))})", row)
        self._retry(insert)

    def create(self, *, name: str, target: str, spec: dict[str, Any], job_id: str | None = None,
               status: str = PENDING, log_location: str | None = None,
               output_location: str | None = None, created_at: float | None = None,
               target_data: dict[str, Any] | None = None) -> JobRecord:
        record = JobRecord(id=job_id or new_job_id(), name=name, target=target, spec=spec,
                           status=status, created_at=created_at or time.time(),
                           log_location=log_location,
                           output_location=output_location, target_data=target_data or {})

        def insert() -> None:
            row = record.to_dict()
            row["spec"] = json.dumps(row["spec"], default=str)
            row["target_data"] = json.dumps(row["target_data"], default=str)
            with self._write() as conn:
                conn.execute(f"INSERT INTO jobs ({','.join(COLUMNS)}) VALUES "
                             f"({','.join('?' * len(COLUMNS))})", [row[c] for c in COLUMNS])
        self._retry(insert)
        self.back_up()
        return record

    def update(self, job_id: str, *, status: str | None = None,
               target_data: dict[str, Any] | None = None, **fields: Any) -> JobRecord:
        """Change fields of a job; ``target_data`` is merged. A final status never changes, nor
        does any other field of an ended job, except ``target_data``: a target learns facts
        after the end too (the EC2 backend removing its groups). A Stopping job changes only to
        a final status: a target's Running, or a submit's Starting, written after `dtrain stop`
        asked does not undo the stop.

        Returns the record as stored afterwards (check ``status`` to see whether you won a race).
        """
        unknown = set(fields) - set(COLUMNS[5:11])
        if unknown:
            raise ValueError(f"cannot update {sorted(unknown)}; allowed: {list(COLUMNS[5:11])}")
        if status is not None and status not in STATUSES:
            raise ValueError(f"status {status!r} is not one of {STATUSES}")

        def apply() -> None:
            with self._write() as conn:
                row = conn.execute("SELECT status, target_data FROM jobs WHERE id = ?",
                                   (job_id,)).fetchone()
                if row is None:
                    raise DtrainError(f"no job with id {job_id!r}; see `dtrain list`")
                values = {} if row[0] in FINAL_STATUSES else dict(fields)
                if status is not None and row[0] not in FINAL_STATUSES and (
                        row[0] != STOPPING or status in FINAL_STATUSES):
                    values["status"] = status
                    if status in FINAL_STATUSES and "ended_at" not in values:
                        values["ended_at"] = time.time()
                if target_data:
                    merged = {**json.loads(row[1] or "{}"), **target_data}
                    values["target_data"] = json.dumps(merged, default=str)
                if values:
                    sets = ", ".join(f"{k} = ?" for k in values)
                    conn.execute(f"UPDATE jobs SET {sets} WHERE id = ?", [*values.values(), job_id])
        self._retry(apply)
        return self.get(job_id)

    # -------------------------------------------------------------- reads

    def get(self, job_id: str) -> JobRecord:
        rows = self._query(f"SELECT {','.join(COLUMNS)} FROM jobs WHERE id = ?", (job_id,))
        if not rows:
            raise DtrainError(f"no job with id {job_id!r}; see `dtrain list`")
        return rows[0]

    def find(self, ref: str) -> JobRecord:
        """A job by exact id, by name (the latest; see :meth:`find_all`), or by a unique id
        prefix. A name is the one the spec gave (``pythia-1b-p4d``) or the one the target
        gave the job (``pythia-1b-p4d-20261124-001019``)."""
        return self.find_all(ref)[0]

    def find_all(self, ref: str) -> list[JobRecord]:
        """Every job ``ref`` names, newest first: one for an id or a unique id prefix, all the
        jobs of a name. Raises DtrainError when none matches."""
        cols = ",".join(COLUMNS)
        rows = self._query(f"SELECT {cols} FROM jobs WHERE id = ?", (ref,))
        if not rows:
            rows = self._query(
                f"SELECT {cols} FROM jobs WHERE name = ? OR (json_valid(spec) AND "
                "json_extract(spec, '$.name') = ?) "
                "ORDER BY created_at DESC, rowid DESC", (ref, ref))
        if not rows and ref:
            pattern = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            rows = self._query(f"SELECT {cols} FROM jobs WHERE id LIKE ? ESCAPE '\\'",
                               (pattern,))
            if len(rows) > 1:
                ids = ", ".join(r.id for r in rows[:5])
                raise DtrainError(f"job reference {ref!r} matches {len(rows)} jobs ({ids}); "
                                  f"give more characters of the id")
        if not rows:
            raise DtrainError(f"no job with id, id prefix or name {ref!r}; see `dtrain list`")
        return rows

    def list(self, *, target: str | None = None, status: str | None = None,
             limit: int | None = None) -> list[JobRecord]:
        """Newest first."""
        where, params = [], []
        if target:
            where.append("target = ?")
            params.append(target)
        if status:
            where.append("status = ?")
            params.append(status)
        sql = f"SELECT {','.join(COLUMNS)} FROM jobs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC, rowid DESC"
        if limit:
            sql += f" LIMIT {int(limit)}"
        return self._query(sql, tuple(params))
