"""The job store: records, look-ups, sticky final states, and many writers at once."""

from __future__ import annotations

import multiprocessing
import os

import pytest
from dtrain.core.errors import DtrainError
from dtrain.jobs.store import COMPLETED, FAILED, RUNNING, JobStore, default_db_path


def test_database_lives_under_dtrain_home_unless_overridden(dtrain_home, monkeypatch, tmp_path):
    assert default_db_path() == os.path.join(str(dtrain_home), "jobs.db")
    monkeypatch.setenv("DTRAIN_JOBS_DB", str(tmp_path / "other.db"))
    assert JobStore().path == str(tmp_path / "other.db")
    # '~' and a relative path mean one place, whatever the current folder
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "me"))
    monkeypatch.setenv("DTRAIN_JOBS_DB", "rel.db")
    assert default_db_path() == str(tmp_path / "rel.db")
    monkeypatch.delenv("DTRAIN_JOBS_DB")
    monkeypatch.setenv("DTRAIN_HOME", "~/dt")
    assert default_db_path() == str(tmp_path / "me" / "dt" / "jobs.db")


def test_a_job_round_trips_with_spec_and_target_data():
    store = JobStore()
    rec = store.create(name="demo", target="local", spec={"a": [1, 2]},
                       target_data={"pids": [1]}, log_location="/logs")
    got = store.get(rec.id)
    assert got.spec == {"a": [1, 2]} and got.target_data == {"pids": [1]}
    assert got.status == "Pending" and got.log_location == "/logs"
    updated = store.update(rec.id, status=RUNNING, started_at=5.0, target_data={"monitor": 9})
    assert updated.status == RUNNING and updated.started_at == 5.0
    assert updated.target_data == {"pids": [1], "monitor": 9}


def test_final_states_are_sticky():
    store = JobStore()
    rec = store.create(name="demo", target="local", spec={})
    store.update(rec.id, status=FAILED, failure_reason="rank 1 failed")
    after = store.update(rec.id, status=COMPLETED)
    assert after.status == FAILED and after.failure_reason == "rank 1 failed"
    assert after.ended_at is not None


def test_a_stopping_job_changes_only_to_an_end():
    store = JobStore()
    rec = store.create(name="demo", target="local", spec={})
    store.update(rec.id, status="Stopping", failure_reason="stopped by user")
    # a target still saying Running, a submit recording its Starting after the stop came
    for status in (RUNNING, "Starting", "Pending"):
        assert store.update(rec.id, status=status, target_data={"seen": status}).status == \
            "Stopping"
    assert store.get(rec.id).target_data == {"seen": "Pending"}  # the facts still merge
    assert store.update(rec.id, status="Stopped").status == "Stopped"


def test_find_by_id_prefix_or_latest_name():
    store = JobStore()
    first = store.create(name="same", target="local", spec={}, job_id="abc111")
    second = store.create(name="same", target="local", spec={}, job_id="abd222")
    assert store.find("abc111") == first
    assert store.find("abd").id == second.id
    assert store.find("same").id == second.id
    with pytest.raises(DtrainError, match="matches 2 jobs"):
        store.find("ab")
    with pytest.raises(DtrainError, match="no job"):
        store.find("zzz")


def test_a_damaged_row_does_not_break_lookups_by_name():
    import sqlite3

    store = JobStore()
    store.create(name="broken", target="local", spec={"name": "broken"}, job_id="bad000")
    wanted = store.create(name="fine", target="local", spec={"name": "fine"}, job_id="good00")
    with sqlite3.connect(store.path) as db:  # a record torn by hand or by a disk fault
        db.execute("UPDATE jobs SET spec = '{not json' WHERE id = 'bad000'")
    assert store.find("fine").id == wanted.id
    assert store.find("bad").id == "bad000"  # by id prefix it is still there


def test_list_is_newest_first_and_filters():
    store = JobStore()
    ids = [store.create(name=f"j{i}", target="local" if i % 2 else "ec2", spec={}).id
           for i in range(4)]
    assert [r.id for r in store.list()] == ids[::-1]
    assert {r.target for r in store.list(target="ec2")} == {"ec2"}


def _hammer(args):
    path, n = args
    store = JobStore(path)
    for i in range(n):
        rec = store.create(name=f"w{os.getpid()}", target="local", spec={"i": i})
        store.update(rec.id, status=RUNNING, target_data={"i": i})
        store.update(rec.id, status=COMPLETED)
        store.list(limit=5)
    return n


def test_many_processes_write_at_once_without_database_errors(tmp_path):
    path = str(tmp_path / "jobs.db")
    with multiprocessing.get_context("spawn").Pool(6) as pool:
        done = sum(pool.map(_hammer, [(path, 15)] * 6))
    records = JobStore(path).list()
    assert done == len(records) == 90
    assert {r.status for r in records} == {COMPLETED}


def test_target_data_learnt_after_the_end_is_merged_without_touching_the_status():
    store = JobStore()
    rec = store.create(name="demo", target="ec2", spec={}, target_data={"prefix": "s3://b/p"})
    store.update(rec.id, status=COMPLETED, target_data={"cleanup": {"state": "pending"}})
    after = store.update(rec.id, status=FAILED, failure_reason="late",
                         target_data={"cleanup": {"state": "done"}})
    assert after.status == COMPLETED and after.ended_at is not None
    assert after.failure_reason is None
    assert after.target_data == {"prefix": "s3://b/p", "cleanup": {"state": "done"}}
    with pytest.raises(DtrainError, match="no job"):
        store.update("nope", target_data={})


def test_on_a_file_system_machines_share_the_store_keeps_a_rollback_journal(tmp_path,
                                                                            monkeypatch):
    import sqlite3

    from dtrain.jobs import store as store_module

    def journal_mode(path) -> str:
        conn = sqlite3.connect(path)
        try:
            return conn.execute("PRAGMA journal_mode").fetchone()[0]
        finally:
            conn.close()

    home = tmp_path / "home dir"  # /proc/mounts writes the space as \040
    home.mkdir()
    local = JobStore(str(tmp_path / "local" / "jobs.db"))
    before = JobStore(str(home / "jobs.db"))  # made while the home was a local disk: WAL
    before.create(name="demo", target="local", spec={})
    assert journal_mode(local.path) == journal_mode(before.path) == "wal"
    mounts = tmp_path / "mounts"
    point = str(home).replace(" ", chr(92) + "040")
    # an automounter's direct map: autofs on the point, then the NFS it mounted over it
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\n/etc/auto.direct {point} autofs rw 0 0\n"
                      f"server:/export/home {point} nfs4 rw 0 0\n")
    monkeypatch.setattr(store_module, "MOUNTS", str(mounts))
    held = sqlite3.connect(before.path)  # another dtrain process has it open: no switch yet,
    held.execute("SELECT count(*) FROM jobs").fetchone()  # and no error either
    assert journal_mode(JobStore(str(home / "jobs.db")).path) == "wal"
    held.close()
    shared = JobStore(str(home / "jobs.db"))  # WAL's shared-memory index is unsafe there
    assert journal_mode(shared.path) == "delete"
    assert [r.name for r in shared.list()] == ["demo"]
    assert journal_mode(JobStore(str(tmp_path / "local" / "jobs.db")).path) == "wal"
