"""``dtrain submit/list/status/logs/stop`` as a user runs them: real CLI processes."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import _cli
import pytest
from _cli import write_job

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

dtrain = partial(_cli.dtrain, timeout=180)


def status_of(job: str) -> dict:
    return json.loads(dtrain("status", job, "-o", "json").stdout)


def test_twenty_parallel_submits_get_twenty_records_that_all_finish(tmp_path):
    spec = write_job(tmp_path, "print('done')\n")
    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(
            lambda _: dtrain("submit", spec, "--no-wait", "-o", "json", check=False),
            range(20)))
    assert [r.returncode for r in results] == [0] * 20, [r.stderr for r in results if r.stderr]
    ids = {json.loads(r.stdout)["id"] for r in results}
    assert len(ids) == 20
    deadline = time.monotonic() + 150
    while True:
        records = json.loads(dtrain("list", "-o", "json").stdout)
        if all(r["status"] in ("Completed", "Failed", "Stopped") for r in records):
            break
        assert time.monotonic() < deadline, [r["status"] for r in records]
        time.sleep(1)
    assert {r["id"] for r in records} == ids
    assert {r["status"] for r in records} == {"Completed"}, [r["failure_reason"] for r in records]


def test_stop_during_a_run_ends_every_process_within_the_grace_period(
        tmp_path, monkeypatch, dtrain_home, live_processes):
    monkeypatch.setenv("DTRAIN_STOP_GRACE_PERIOD", "2")
    spec = write_job(tmp_path, """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("running", flush=True)
        time.sleep(300)
        """, processes_per_instance=2)
    job = json.loads(dtrain("submit", spec, "--no-wait", "-o", "json").stdout)["id"]
    deadline = time.monotonic() + 60
    while "running" not in dtrain("logs", job).stdout:
        assert time.monotonic() < deadline, status_of(job)
        time.sleep(0.5)
    dtrain("stop", job)
    stopped_at, seen = time.monotonic(), []
    while (status := status_of(job)["status"]) != "Stopped":
        seen.append(status)
        assert time.monotonic() - stopped_at < 20, status_of(job)
        time.sleep(0.3)
    # the workers ignore SIGTERM: the grace period runs, and the job reads Stopping throughout
    assert seen and set(seen) == {"Stopping"}, seen
    assert live_processes(str(dtrain_home)) == [] and live_processes(str(tmp_path)) == []


def test_failed_job_exits_non_zero_with_one_line_reason(tmp_path):
    spec = write_job(tmp_path, "raise ValueError('bad batch')\n")
    result = dtrain("submit", spec, check=False)
    assert result.returncode == 1
    assert "Failed: rank 0 on algo-1 exited with code 1: ValueError: bad batch" in result.stderr


def test_followed_logs_keep_out_of_the_json_record(tmp_path):
    # -o json --follow: stdout is the final record, which a script parses; the lines go to stderr
    spec = write_job(tmp_path, "print('hello from rank 0')\nraise ValueError('bad batch')\n")
    result = dtrain("submit", spec, "--follow", "-o", "json", check=False)
    assert result.returncode == 1
    assert json.loads(result.stdout)["status"] == "Failed"
    assert "[algo-1 0]:hello from rank 0" in result.stderr
    usage = dtrain("submit", spec, "--no-wait", "--follow", check=False)
    assert usage.returncode == 2 and "--follow waits for the job to end" in usage.stderr


def test_invalid_input_exits_2_and_unknown_job_exits_1(tmp_path):
    spec = write_job(tmp_path, "", instance_count=0)
    assert dtrain("submit", spec, check=False).returncode == 2
    result = dtrain("status", "no-such-job", check=False)
    assert result.returncode == 1 and result.stderr.startswith("error: no job")


def test_example_local_cpu_job_trains_two_hosts_by_two_processes():
    result = dtrain("submit", str(REPO / "examples/local-cpu.yaml"),
                    "--set", "hyperparameters.steps=20",
                    "--set", "checkpoint.interval_steps=10", timeout=240)
    progress = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert progress and "tokens/s" in progress[-1]
    losses = [float(line.split("loss ")[1].split()[0]) for line in progress]
    assert losses[-1] < losses[0] - 1.0
    record = status_of("local-cpu-lm")
    assert record["status"] == "Completed"
    job_dir = Path(record["target_data"]["job_dir"])
    model_dir = job_dir / "algo-1/model"  # Hugging Face format, written by the recipe
    assert (model_dir / "config.json").exists() and (model_dir / "model.safetensors").exists()
    assert any((job_dir / "checkpoints").glob("step-*/COMPLETE"))  # one folder for both hosts
    # sharding degree 2 on 2 hosts: the replicas' all-reduce crosses hosts, so `auto` overlaps it
    metrics = [json.loads(line) for line in
               (job_dir / "algo-1/output/data/metrics.jsonl").read_text().splitlines()]
    # the last buffer goes out only when backward ends: every step waits for some of the sync
    assert metrics and all(m["sync_busy_s"] > 0 and m["sync_exposed_s"] > 0 for m in metrics)
    for host, ranks in (("algo-1", (0, 1)), ("algo-2", (2, 3))):
        for rank in ranks:
            assert (job_dir / host / f"output/logs/rank-{rank}.stdout.log").exists()
    assert "Completed" in dtrain("status", record["id"]).stdout
    stopped = dtrain("stop", record["id"])  # too late: it says so and the record stays
    assert stopped.stdout.strip().endswith(": Completed")
    assert "had already ended (Completed)" in stopped.stderr
