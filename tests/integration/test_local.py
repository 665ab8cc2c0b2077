"""The local target end to end through ``dtrain.jobs``: real monitor, agents and workers."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import boto3
import pytest
import yaml
from dtrain import jobs
from dtrain.spec import JobSpec
from dtrain.store import JobStore

pytestmark = pytest.mark.slow


def make_spec(tmp_path, script: str, **compute) -> JobSpec:
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / "train.py").write_text(textwrap.dedent(script))
    compute = {"instance_type": "local", "instance_count": 1, "processes_per_instance": 1,
               "max_run": 120, **compute}
    data = {"name": "t", "entry_point": "train.py", "source_dir": str(code), "compute": compute}
    return JobSpec.from_dict(data)


def test_failing_worker_fails_the_job_with_rank_and_error(tmp_path, dtrain_home, live_processes):
    spec = make_spec(tmp_path, """
        import os, time
        if os.environ["RANK"] == "1":
            raise KeyError("no such column: tokens")
        time.sleep(60)
        """, processes_per_instance=2)
    started = time.monotonic()
    record = jobs.submit(spec, wait=True)
    assert record.status == "Failed"
    assert time.monotonic() - started < 45
    assert record.failure_reason.startswith("rank 1 on algo-1 exited with code 1")
    assert "KeyError: 'no such column: tokens'" in record.failure_reason
    assert live_processes(str(tmp_path)) == [] and live_processes(str(dtrain_home)) == []


def test_hanging_worker_is_stopped_at_max_run(tmp_path, dtrain_home, live_processes):
    spec = make_spec(tmp_path, "import time\ntime.sleep(300)\n", max_run=3)
    record = jobs.submit(spec, wait=True)
    assert record.status == "Stopped"
    assert "max_run of 3 s reached" in record.failure_reason
    assert live_processes(str(tmp_path)) == []


def test_workers_stopped_after_a_checkpoint_stop_the_job_not_fail_it(tmp_path):
    # Exit code 143 on every rank is what the Trainer's recipes return after the SIGTERM
    # checkpoint; here no checkpoint exists, so the reason names none.
    spec = make_spec(tmp_path, "raise SystemExit(143)\n", instance_count=2)
    record = jobs.submit(spec, wait=True)
    assert record.status == "Stopped"
    assert record.failure_reason.startswith("interrupted: the workers on algo-")
    assert "resubmit to resume from the newest checkpoint in" in record.failure_reason


def test_one_failure_is_retried_with_max_restarts(tmp_path):
    spec = make_spec(tmp_path, """
        import os
        marker = os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], "failed-once")
        if not os.path.exists(marker):
            open(marker, "w").close()
            raise SystemExit("first attempt fails")
        """, max_restarts=1)
    assert jobs.submit(spec, wait=True).status == "Completed"


def test_logs_are_kept_per_host_and_rank_and_filterable(tmp_path):
    spec = make_spec(tmp_path, "import os\nprint('hello from', os.environ['RANK'])\n",
                     instance_count=2)
    record = jobs.submit(spec, wait=True)
    assert record.status == "Completed", record.failure_reason
    job_dir = record.target_data["job_dir"]
    assert "hello from 1" in Path(f"{job_dir}/algo-2/output/logs/rank-1.stdout.log").read_text()
    assert [line for line in jobs.logs(record.id, rank=1) if "hello" in line] == \
        ["[algo-2 1]:hello from 1"]
    assert all("algo-1" in line for line in jobs.logs(record.id, host="algo-1"))


def test_dry_run_request_is_pure_and_names_every_host(tmp_path):
    spec = make_spec(tmp_path, "", instance_count=3)
    first = jobs.submit(spec, dry_run=True)
    assert first == jobs.submit(spec, dry_run=True)
    assert first["hosts"] == ["algo-1", "algo-2", "algo-3"]
    # the user's backend choice travels; the runtime resolves "auto" to gloo on CPU
    assert first["settings"]["distribution"]["backend"] == spec.distribution.backend
    assert JobStore().list() == []


def test_s3_inputs_are_downloaded_into_every_host_channel(tmp_path, monkeypatch):
    import moto

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with moto.mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="data")
        s3.put_object(Bucket="data", Key="corpus/part-0.txt", Body=b"hello")
        s3.put_object(Bucket="data", Key="corpus/sub/part-1.txt", Body=b"world")
        from dtrain.launcher.local import LocalLauncher

        staged = LocalLauncher(s3_client=s3)._stage_inputs(
            {"train": "s3://data/corpus"}, str(tmp_path / "job"))
    folder = staged["train"]
    assert Path(f"{folder}/part-0.txt").read_text() == "hello"
    assert Path(f"{folder}/sub/part-1.txt").read_text() == "world"


def test_local_input_paths_reach_the_script_as_channels(tmp_path):
    data = tmp_path / "data.txt"
    data.write_text("abc")
    spec_file = tmp_path / "job.yaml"
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(
        "import os\nassert open(os.environ['SM_CHANNEL_TRAIN'] + '/data.txt').read() == 'abc'\n")
    spec_file.write_text(yaml.safe_dump({
        "entry_point": "train.py", "source_dir": "code", "inputs": {"train": str(data)},
        "compute": {"instance_type": "local", "max_run": 60}}))
    record = jobs.submit(JobSpec.from_file(spec_file), wait=True)
    assert record.status == "Completed", record.failure_reason
    assert json.loads(Path(record.target_data["job_dir"], "request.json").read_text())["inputs"]


def _wait_until(predicate, *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)


def test_stop_while_awaiting_the_other_hosts_of_an_interruption_is_prompt(
        tmp_path, dtrain_home, live_processes):
    # algo-2's workers stop after a checkpoint (143); the monitor then gives algo-1 the grace
    # period plus 5 s (35 s) to stop at the same step on its own. `dtrain stop` cuts that short.
    spec = make_spec(tmp_path, """
        import os, time
        if os.environ["SM_CURRENT_HOST"] == "algo-2":
            raise SystemExit(143)
        time.sleep(300)
        """, instance_count=2)
    record = jobs.submit(spec, wait=False)
    report = Path(record.target_data["job_dir"], "algo-2", "output", "failure.json")
    _wait_until(report.exists, timeout=90, what="algo-2 reports its interruption")
    time.sleep(3)  # its agent exits and the monitor starts waiting for algo-1
    assert jobs.get(record.id).status == "Running"
    stopped_at = time.monotonic()
    jobs.stop(record.id)
    final = jobs.wait_for(record.id, timeout_s=60)
    took = time.monotonic() - stopped_at
    assert (final.status, final.failure_reason) == ("Stopped", "stopped by user")
    assert took < 15, f"the stop took {took:.1f} s"  # it took 30+ s while the monitor waited
    assert live_processes(str(tmp_path)) == [] and live_processes(str(dtrain_home)) == []
