"""A damaged or unreachable job store: one line naming the file and what to do, a way back, and
a bad row listed as unreadable instead of crashing the listing."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from functools import partial

import _cli
import pytest
from dtrain.jobs.store import JobStore

# check=False: the exit code is what these tests assert on
dtrain = partial(_cli.dtrain, check=False, timeout=60)


def stored_jobs(count: int) -> JobStore:
    store = JobStore()
    for i in range(count):
        store.create(name=f"job-{i}", target="local", spec={"name": f"job-{i}"},
                     status="Completed")
    return store


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    return result.stderr


def test_a_garbage_store_is_one_line_and_repair_brings_back_the_backups_jobs(dtrain_home):
    store = stored_jobs(3)  # the first open of the day leaves a backup with these
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(store.path + suffix):
            os.remove(store.path + suffix)
    with open(store.path, "wb") as fh:
        fh.write(b"this is not a database, it was overwritten\n" * 100)
    error = one_line_error(dtrain("list", "--no-refresh"))
    assert error.startswith(f"error: job store {store.path} is damaged: file is not a database;")
    assert "`dtrain store repair`" in error
    repaired = dtrain("store", "repair")
    assert repaired.returncode == 0, repaired.stderr
    assert "kept 3 job(s) (3 from the backup)" in repaired.stdout
    assert "the damaged file is at" in repaired.stdout
    listing = dtrain("list", "--no-refresh").stdout
    assert all(f"job-{i}" in listing for i in range(3))


def test_a_truncated_store_is_noticed_not_shown_as_empty(dtrain_home):
    store = stored_jobs(2)
    os.truncate(store.path, 0)
    for suffix in ("-wal", "-shm"):
        if os.path.exists(store.path + suffix):
            os.remove(store.path + suffix)
    error = one_line_error(dtrain("list", "--no-refresh"))
    assert "is empty (0 bytes) though it had jobs" in error
    assert dtrain("store", "repair").returncode == 0
    assert "job-1" in dtrain("list", "--no-refresh").stdout


def test_a_row_with_damaged_json_is_listed_as_unreadable_and_the_rest_still_work(dtrain_home):
    store = stored_jobs(2)
    bad = store.create(name="bad", target="local", spec={}, status="Running")
    conn = sqlite3.connect(store.path)
    conn.execute("UPDATE jobs SET spec = '{not json' WHERE id = ?", (bad.id,))
    conn.commit()
    conn.close()
    listing = dtrain("list")
    assert listing.returncode == 0, listing.stderr
    [line] = [row for row in listing.stdout.splitlines() if row.startswith(bad.id)]
    assert "unreadable" in line and "job-0" in listing.stdout
    error = one_line_error(dtrain("status", bad.id))
    assert "its stored record is unreadable" in error and "dtrain store repair" in error
    if os.path.exists(store.backup_path):  # unreadable in the backup too: nowhere to read it
        conn = sqlite3.connect(store.backup_path)
        conn.execute("UPDATE jobs SET spec = '{not json' WHERE id = ?", (bad.id,))
        conn.commit()
        conn.close()
    repaired = dtrain("store", "repair")
    assert f"removed 1 unreadable record(s): {bad.id}" in repaired.stdout
    records = json.loads(dtrain("list", "--no-refresh", "-o", "json").stdout)
    assert sorted(r["name"] for r in records) == ["job-0", "job-1"]


def test_an_unwritable_home_is_one_line_naming_the_folder(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    error = one_line_error(dtrain("list", env={"DTRAIN_HOME": str(blocker / "home")}))
    assert f"cannot create the job store's folder '{blocker / 'home'}'" in error
    assert "set DTRAIN_HOME" in error


def test_repair_from_a_backup_taken_at_submit_finds_the_jobs_folder_and_its_end(dtrain_home,
                                                                                 tmp_path):
    # the backup is taken when the job is created, before the submit got further: the record
    # it keeps must still lead status to the job's folder (it once read as lost, for good)
    from _cli import write_job

    spec = write_job(tmp_path, "print('done')")
    done = dtrain("submit", spec)
    assert done.returncode == 0, done.stdout + done.stderr
    store = JobStore()
    [job] = store.list()
    assert job.status == "Completed"
    # taken again once the submit returned: it holds what the target recorded (the monitor)
    backup = sqlite3.connect(store.backup_path)
    [(kept,)] = backup.execute("SELECT target_data FROM jobs").fetchall()
    backup.close()
    assert json.loads(kept)["monitor"] and json.loads(kept)["job_dir"]
    with open(store.path, "wb") as fh:
        fh.write(b"this is not a database, it was overwritten\n" * 100)
    for suffix in ("-wal", "-shm"):
        if os.path.exists(store.path + suffix):
            os.remove(store.path + suffix)
    assert dtrain("store", "repair").returncode == 0
    assert JobStore().get(job.id).status == "Pending"  # as the backup had it
    shown = dtrain("status", job.id)
    assert shown.returncode == 0, shown.stderr
    assert JobStore().get(job.id).status == "Completed", shown.stdout


def test_repair_leaves_a_whole_store_as_it_is(dtrain_home):
    # it moved a healthy store aside "as damaged" and rebuilt it
    stored_jobs(2)
    result = dtrain("store", "repair")
    assert result.returncode == 0
    assert "reads whole (2 job(s)): nothing to repair" in result.stdout
    assert len(JobStore().list()) == 2
    assert not [name for name in os.listdir(dtrain_home) if ".damaged-" in name]
    forced = dtrain("store", "repair", "--force")
    assert "kept 2 job(s)" in forced.stdout and "the damaged file is at" in forced.stdout


def test_repair_takes_a_damaged_record_from_the_backup_and_refuses_what_is_no_store(dtrain_home,
                                                                                   tmp_path):
    from dtrain.core.errors import DtrainError
    from dtrain.jobs.repair import readable_rows, repair

    store = stored_jobs(2)
    store._backup(force=True)  # the daily backup, with both records whole
    conn = sqlite3.connect(store.path)
    conn.execute("UPDATE jobs SET target_data = '{broken' WHERE name = 'job-0'")
    conn.commit()
    conn.close()
    # the store's damaged row hid the backup's readable one, and the job was dropped
    report = repair()
    assert (report.kept, report.from_backup, report.unreadable) == (2, 1, [])
    assert sorted(r.name for r in JobStore().list()) == ["job-0", "job-1"]
    # the backup holds the repaired jobs (it was replaced by the new, empty store's copy)
    assert len(readable_rows(store.backup_path)) == 2
    again = repair(force=True)  # in the same second: the first damaged file stays
    assert again.moved_aside != report.moved_aside and os.path.isfile(report.moved_aside)
    folder = tmp_path / "a-folder"
    folder.mkdir()
    with pytest.raises(DtrainError, match="is a folder, not a job store"):
        repair(str(folder))
    assert folder.is_dir()  # not moved aside as "damaged"
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(DtrainError, match=r"could not repair the job store at .*a-file/jobs.db: "
                                          r"Not a directory"):
        repair(str(blocker / "jobs.db"))  # a traceback before


def test_a_repair_cut_short_leaves_the_damaged_store_to_repair_again(dtrain_home, monkeypatch):
    from dtrain.jobs import repair as repairing

    store = stored_jobs(3)
    os.remove(store.backup_path)  # no backup: the store's rows are all there is
    conn = sqlite3.connect(store.path)
    conn.execute("UPDATE jobs SET spec = '{no' WHERE name = 'job-0'")
    conn.commit()
    conn.close()
    inserted = []

    def insert_then_fail(self, row):
        if inserted:
            raise KeyboardInterrupt
        inserted.append(row)
    real = JobStore.insert_row
    monkeypatch.setattr(JobStore, "insert_row", insert_then_fail)
    with pytest.raises(KeyboardInterrupt):
        repairing.repair()
    # the half-built store is not taken for a whole one: the damaged one is back in place
    monkeypatch.setattr(JobStore, "insert_row", real)
    report = repairing.repair()
    assert (report.healthy, report.kept) == (False, 2)
    assert sorted(r.name for r in JobStore().list()) == ["job-1", "job-2"]
