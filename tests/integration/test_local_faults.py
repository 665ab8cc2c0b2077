"""Faults of a local job and what the user sees: a killed monitor or node agent, two failures in
the same second, a stranger's process holding a pid dtrain recorded, a full disk. Real monitor,
agents and workers (plain Python scripts but for the full disk, so most tests take seconds).

    pytest tests/integration/test_local_faults.py -q
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from dtrain.jobs import api as jobs
from dtrain.jobs.store import JobStore
from dtrain.launcher import process
from dtrain.launcher.local import layout
from dtrain.runtime.train.checkpoint import latest_checkpoint
from dtrain.spec.model import JobSpec
from test_local import _wait_until, make_spec

pytestmark = pytest.mark.slow

# Each worker says it runs, then waits for the test's go (a file in the source folder).
WAIT_FOR_GO = """
    import os, time
    print("up", flush=True)
    go = os.path.join(os.path.dirname(__file__), "go")  # the source folder: shared
    while not os.path.exists(go):
        time.sleep(0.1)
    """


def submit_and_wait_until_up(spec) -> tuple[str, Path]:
    record = jobs.submit(spec, wait=False)
    job_dir = Path(record.target_data["job_dir"])
    hosts = record.target_data["hosts"]
    _wait_until(lambda: all("up" in _read(job_dir / h / "output/logs") for h in hosts),
                timeout=90, what="every worker runs")
    return record.id, job_dir


def _read(logs: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in logs.glob("rank-*.stdout.log"))


def kill_monitor(job_id: str) -> None:
    monitor = JobStore().get(job_id).target_data["monitor"]
    assert process.process_alive(monitor)
    os.kill(monitor["pid"], signal.SIGKILL)
    _wait_until(lambda: process.process_alive(monitor) is False, timeout=10,
                what="the monitor is gone")


def test_a_job_whose_monitor_was_killed_still_completes(tmp_path, dtrain_home, live_processes):
    job, _ = submit_and_wait_until_up(make_spec(tmp_path, WAIT_FOR_GO, instance_count=2))
    kill_monitor(job)
    record = jobs.get(job)  # the workers train on: it runs, and nothing is stopped
    assert (record.status, record.target_data["secondary_status"]) == ("Running", "MonitorGone")
    (tmp_path / "code" / "go").touch()
    record = jobs.wait_for(job, timeout_s=60)
    assert (record.status, record.failure_reason) == ("Completed", None)
    assert live_processes(str(tmp_path)) == [] and live_processes(str(dtrain_home)) == []


def test_without_a_monitor_a_failed_host_still_stops_the_others_within_the_grace_period(
        tmp_path, monkeypatch, dtrain_home, live_processes):
    monkeypatch.setenv("DTRAIN_STOP_GRACE_PERIOD", "1")
    script = WAIT_FOR_GO + """
    import signal
    if os.environ["SM_CURRENT_HOST"] == "algo-2":
        raise ValueError("bad batch")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # algo-1 will not stop on its own
    time.sleep(300)
    """
    job, _ = submit_and_wait_until_up(make_spec(tmp_path, script, instance_count=2))
    kill_monitor(job)
    (tmp_path / "code" / "go").touch()
    record = jobs.wait_for(job, timeout_s=60)
    assert record.status == "Failed"
    assert record.failure_reason.startswith("rank 1 on algo-2 exited with code 1: ValueError: "
                                            "bad batch"), record.failure_reason
    assert live_processes(str(tmp_path)) == [] and live_processes(str(dtrain_home)) == []


def test_a_stop_without_a_monitor_sends_sigterm_and_waits_the_grace_period(
        tmp_path, dtrain_home, live_processes):
    script = """
        import os, signal, sys, time
        def stop(*_):
            time.sleep(2)  # writing a stop checkpoint takes a while
            open(os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], "stop-checkpoint"), "w").close()
            sys.exit(143)
        signal.signal(signal.SIGTERM, stop)
        print("up", flush=True)
        time.sleep(300)
        """
    job, job_dir = submit_and_wait_until_up(make_spec(tmp_path, script, instance_count=2))
    kill_monitor(job)
    record = jobs.stop(job)
    assert (record.status, record.failure_reason) == ("Stopped", "stopped by user")
    for host in ("algo-1", "algo-2"):
        assert (job_dir / host / "output/data/stop-checkpoint").exists()
        assert "because this host received SIGTERM" in \
            (job_dir / host / "output/failure").read_text()
    assert live_processes(str(tmp_path)) == [] and live_processes(str(dtrain_home)) == []


def test_a_killed_node_agent_is_named_as_the_root_cause(tmp_path, dtrain_home, live_processes):
    job, job_dir = submit_and_wait_until_up(make_spec(tmp_path, WAIT_FOR_GO, instance_count=2))
    agent = layout.read_state(str(job_dir))["agents"][1]
    assert process.process_alive(agent)
    os.kill(agent["pid"], signal.SIGKILL)
    record = jobs.wait_for(job, timeout_s=60)
    assert record.status == "Failed"
    assert record.failure_reason == (f"the node agent on algo-2 (pid {agent['pid']}) was killed "
                                     "by SIGKILL, and its workers with it")
    assert live_processes(str(tmp_path)) == [] and live_processes(str(dtrain_home)) == []


def test_the_earlier_of_two_failures_in_the_same_second_is_the_root_cause(tmp_path):
    # algo-2's worker fails 0.2 s before algo-1's, inside one wall-clock second: the second
    # decides nothing, the sub-second time does.
    script = """
        import math, os, time
        shared = os.path.join(os.path.dirname(__file__), "second")
        if os.environ["SM_CURRENT_HOST"] == "algo-1":
            with open(shared + ".tmp", "w") as f:
                f.write(str(math.floor(time.time()) + 2))
            os.replace(shared + ".tmp", shared)
        while not os.path.exists(shared):
            time.sleep(0.01)
        second = int(open(shared).read())
        first = os.environ["SM_CURRENT_HOST"] == "algo-2"
        time.sleep(second + (0.1 if first else 0.3) - time.time())
        raise ValueError("first" if first else "second")
        """
    record = jobs.submit(make_spec(tmp_path, script, instance_count=2), wait=True)
    assert record.status == "Failed"
    assert record.failure_reason.startswith("rank 1 on algo-2 exited with code 1: ValueError: "
                                            "first"), record.failure_reason


def test_a_process_that_is_not_the_recorded_one_is_never_signalled_and_the_job_is_lost(
        tmp_path, dtrain_home, live_processes):
    job, job_dir = submit_and_wait_until_up(make_spec(tmp_path, WAIT_FOR_GO, instance_count=2))
    record, facts = JobStore().get(job), layout.read_state(str(job_dir))
    # As after a reboot: the monitor, the agents and their workers are gone at once...
    os.kill(record.target_data["monitor"]["pid"], signal.SIGKILL)
    for agent in facts["agents"]:
        os.killpg(agent["pid"], signal.SIGKILL)
    _wait_until(lambda: live_processes(str(tmp_path), settle_s=0) == [], timeout=10,
                what="the job's processes are gone")
    # ...and a stranger now holds the pids dtrain recorded: for the agents, a process started at
    # another time; for the monitor, even one started at the same time, but another program.
    stranger = subprocess.Popen(["sleep", "300"])
    try:
        monitor = [sys.executable, "-m", "dtrain.launcher.local.monitor", str(job_dir)]
        JobStore().update(job, target_data={"monitor": {**process.describe(stranger.pid),
                                                        "cmdline": monitor}})
        layout.write_state(str(job_dir), agents=[{**a, "pid": stranger.pid}
                                                 for a in facts["agents"]])
        stopped = jobs.stop(job)
        assert stranger.poll() is None, "dtrain signalled a process it does not own"
        assert stopped.status == "Failed"
        assert stopped.failure_reason.startswith(
            "lost: no process of this job runs and none left a record of how it ended, so "
            "nothing was signalled (the local job monitor: pid "
            f"{stranger.pid} now belongs to another process (`sleep 300`")
        assert jobs.get(job).status == "Failed" and stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def fill(disk: Path, *, leave: int) -> Path:
    """Fill ``disk`` until ``leave`` bytes are free (the job writes meanwhile: measured as it
    goes, a full disk ends it early)."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        while (free := shutil.disk_usage(disk).free) > leave:
            try:
                f.write(bytes(min(free - leave, 2**20)))
            except OSError:
                break
    return filler


@pytest.fixture
def small_disk(tmp_path):
    """A 32 MiB file system of its own (tmpfs; the tests run as root), unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)


def test_a_full_disk_fails_the_job_naming_it_and_keeps_the_last_checkpoint_and_the_logs(
        small_disk, tmp_path, monkeypatch, capsys, live_processes):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(__file__).read_text() * 3)
    args = {"model": "gpt-neox-tiny", "micro_batch_size": 2, "seq_len": 32, "log_interval": 1,
            "data": str(corpus)}
    spec = JobSpec.from_dict({
        "name": "full-disk", "entry_point": "recipe:causal_lm", "output_path": str(small_disk),
        "hyperparameters": {**args, "steps": 1000}, "checkpoint": {"interval_steps": 2},
        "compute": {"instance_type": "local", "processes_per_instance": 1, "max_run": 300}})
    record = jobs.submit(spec, wait=False)
    checkpoints = Path(record.target_data["job_dir"]) / "checkpoints"
    host = Path(record.target_data["job_dir"]) / "algo-1"
    _wait_until(lambda: latest_checkpoint(checkpoints) is not None, timeout=120,
                what="the first checkpoint is complete")
    filler = fill(small_disk, leave=300_000)  # less room than a checkpoint (2.4 MB) needs
    record = jobs.wait_for(record.id, timeout_s=120)
    kept = latest_checkpoint(checkpoints)
    assert record.status == "Failed"
    assert f"error: no space left on device writing checkpoint {checkpoints}/step-" in \
        record.failure_reason
    assert f"the last complete checkpoint, {kept}, is intact" in record.failure_reason
    assert not list(checkpoints.glob("*.tmp"))  # the failed save gave its room back
    # Nothing cut short: the rank's error and the agent's copy of it are whole.
    assert (host / "output/logs/rank-0.stderr.log").read_text().endswith("is intact\n")
    assert "[algo-1 0]:error: no space left on device writing checkpoint" in \
        (host / "output/agent.log").read_text()
    assert live_processes(str(small_disk)) == []
    # The checkpoint that was kept loads: a run on the same data resumes from it.
    filler.unlink()
    step = int(kept.name.split("-")[1])
    for key, value in {"SM_MODEL_DIR": tmp_path / "model", "SM_OUTPUT_DATA_DIR": tmp_path / "out",
                       "DTRAIN_CHECKPOINT_DIR": checkpoints}.items():
        monkeypatch.setenv(key, str(value))
    from dtrain.runtime.recipes import causal_lm

    argv = [f"--{k}={v}" for k, v in {**args, "steps": step + 1}.items()]
    assert causal_lm.main(argv) == 0
    assert f"resumed from {kept} at step {step}" in capsys.readouterr().out
