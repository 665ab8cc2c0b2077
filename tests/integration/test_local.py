"""The local target end to end through ``dtrain.jobs.api``: real monitor, agents and workers."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import boto3
import pytest
import yaml
from dtrain.jobs import api as jobs
from dtrain.jobs.store import JobStore
from dtrain.spec.model import JobSpec

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
    # it points at no checkpoint: this run wrote none
    assert "before this run wrote a checkpoint; resubmitted, the job resumes from the newest " \
        "one in" in record.failure_reason and record.failure_reason.endswith("else starts afresh")


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
    assert first == jobs.submit(spec, dry_run=True, job=first.job)
    assert first.payload["hosts"] == ["algo-1", "algo-2", "algo-3"]
    # the user's backend choice travels; the runtime resolves "auto" to gloo on CPU
    assert first.payload["settings"]["distribution"]["backend"] == spec.distribution.backend
    assert JobStore().list() == []


def test_s3_inputs_are_downloaded_into_every_host_channel(tmp_path, monkeypatch):
    import moto

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with moto.mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="data")
        s3.put_object(Bucket="data", Key="corpus/part-0.txt", Body=b"hello")
        s3.put_object(Bucket="data", Key="corpus/sub/part-1.txt", Body=b"world")
        from dtrain.launcher.staging import stage_inputs

        staged = stage_inputs({"train": "s3://data/corpus"}, str(tmp_path / "job"),
                              s3_client=s3)
    folder = staged["train"]
    assert Path(f"{folder}/part-0.txt").read_text() == "hello"
    assert Path(f"{folder}/sub/part-1.txt").read_text() == "world"


def test_an_s3_input_in_a_bucket_that_does_not_exist_is_a_one_line_error(tmp_path, monkeypatch):
    import moto
    from dtrain.core.errors import DtrainError
    from dtrain.launcher.staging import stage_inputs

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with moto.mock_aws(), pytest.raises(DtrainError) as caught:
        stage_inputs({"train": "s3://no-such-bucket/corpus"}, str(tmp_path / "job"),
                     s3_client=boto3.client("s3", region_name="us-east-1"))
    assert "downloading input s3://no-such-bucket/corpus" in str(caught.value)
    assert "NoSuchBucket" in str(caught.value) and "\n" not in str(caught.value)


def test_local_inputs_reach_the_script_as_channels_and_its_environment_sets_the_grace(tmp_path):
    data = tmp_path / "data.txt"
    data.write_text("abc")
    spec_file = tmp_path / "job.yaml"
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(
        "import os\nassert open(os.environ['SM_CHANNEL_TRAIN'] + '/data.txt').read() == 'abc'\n")
    spec_file.write_text(yaml.safe_dump({
        "entry_point": "train.py", "source_dir": "code", "inputs": {"train": str(data)},
        "environment": {"DTRAIN_STOP_GRACE_PERIOD": "7"},
        "compute": {"instance_type": "local", "max_run": 60}}))
    record = jobs.submit(JobSpec.from_file(spec_file), wait=True)
    assert record.status == "Completed", record.failure_reason
    request = json.loads(Path(record.target_data["job_dir"], "request.json").read_text())
    assert request["payload"]["inputs"]
    assert request["grace_period_s"] == 7  # the job's environment, as in a container


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
    # The monitor says so once it has seen algo-2's agent exit 143, right before it waits.
    _wait_until(lambda: jobs.get(record.id).target_data.get("secondary_status") == "Interrupted",
                timeout=90, what="the monitor awaits algo-1 after algo-2's interruption")
    assert jobs.get(record.id).status == "Running"
    stopped_at = time.monotonic()
    jobs.stop(record.id)
    final = jobs.wait_for(record.id, timeout_s=60)
    took = time.monotonic() - stopped_at
    assert (final.status, final.failure_reason) == ("Stopped", "stopped by user")
    assert took < 15, f"the stop took {took:.1f} s"  # it took 30+ s while the monitor waited
    assert live_processes(str(tmp_path)) == [] and live_processes(str(dtrain_home)) == []


SLOW_SAVE_TRAINER = """
    # The Trainer on 2 hosts whose final model save takes --save_seconds (as a big model's would).
    import os, sys, time
    import dtrain.runtime as rt
    import torch
    from dtrain.runtime.train import trainer as t
    from dtrain.runtime.train.data import DistributedTokenLoader
    from dtrain.runtime.models import from_preset, hf_io
    from dtrain.runtime.recipes.causal_lm import next_token_loss
    from dtrain.runtime.train.tokenize import encode_bytes

    seconds = float(sys.argv[sys.argv.index("--save_seconds") + 1])
    write_weights = hf_io.save_file

    def slow_save_file(tensors, path, **kwargs):
        write_weights(tensors, path, **kwargs)
        open(os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], "saving"), "w").close()
        time.sleep(seconds)

    hf_io.save_file = slow_save_file
    ctx = rt.init(distribution={"sharding_degree": 1})
    torch.manual_seed(0)
    model = rt.shard(from_preset("gpt-neox-tiny"), ctx)
    loader = DistributedTokenLoader(encode_bytes([open(__file__).read() * 20]), window=33,
                                    micro_batch_size=2, dp_rank=ctx.rank,
                                    dp_world_size=ctx.world_size)
    result = t.Trainer(model, ctx, next_token_loss, config=t.TrainerConfig(steps=3)).fit(loader)
    torch.distributed.destroy_process_group()
    sys.exit(t.PREEMPTED_EXIT_CODE if result.preempted else 0)
    """


def _stop_during_the_final_save(tmp_path, save_seconds: int):
    """Submit SLOW_SAVE_TRAINER, `dtrain stop` it while rank 0 writes the model; final record."""
    spec = make_spec(tmp_path, SLOW_SAVE_TRAINER, instance_count=2, max_run=600)
    spec = JobSpec.from_dict({**spec.to_dict(), "hyperparameters": {"save_seconds": save_seconds}})
    record = jobs.submit(spec, wait=False)
    job_dir = Path(record.target_data["job_dir"])
    _wait_until(lambda: any(job_dir.glob("algo-*/output/data/saving")), timeout=180,
                what="rank 0 is writing the final model")
    jobs.stop(record.id)
    return jobs.wait_for(record.id, timeout_s=120), job_dir


def test_a_stop_during_the_final_model_save_lets_it_finish_and_the_job_completes(tmp_path):
    record, job_dir = _stop_during_the_final_save(tmp_path, save_seconds=4)
    assert (record.status, record.failure_reason) == ("Completed", None)
    (model,) = [m for m in job_dir.glob("algo-*/model") if (m / "config.json").exists()]
    assert (model / "model.safetensors").is_file()


def test_a_final_model_save_cut_off_by_the_grace_period_says_the_model_is_incomplete(
        tmp_path, monkeypatch, live_processes):
    # The monitor SIGKILLs each agent 5 s after the 2 s grace; the report takes well under 1 s of
    # that once the workers are killed (measured ~0.5 s on 2 loaded cores).
    monkeypatch.setenv("DTRAIN_STOP_GRACE_PERIOD", "2")
    record, job_dir = _stop_during_the_final_save(tmp_path, save_seconds=300)
    checkpoint = job_dir / "checkpoints" / "step-000003"
    assert record.status == "Stopped"
    assert record.failure_reason == (
        "stopped by user; training finished all 3 steps but the final model was not saved, so "
        f"model/ is incomplete; the checkpoint {checkpoint} has everything: resubmit to resume "
        "from it, which only writes the model")
    assert (checkpoint / "COMPLETE").is_file()
    # Nothing of the cut-off save is left where model/ is uploaded from, or next to it.
    for host in ("algo-1", "algo-2"):
        assert [p.name for p in (job_dir / host / "model").iterdir()] == []
        assert not list((job_dir / host).glob(".*partial*"))
    assert live_processes(str(tmp_path)) == []


def test_a_stop_while_the_job_starts_is_delivered_once_its_monitor_runs(
        tmp_path, dtrain_home, live_processes, monkeypatch):
    from dtrain.launcher.local.launcher import LocalLauncher

    spec = make_spec(tmp_path, """
        import time
        time.sleep(120)
        """)
    start = LocalLauncher._start_monitor

    def start_then_stopped(job_dir):  # `dtrain stop` lands before the monitor is recorded
        monitor = start(job_dir)
        [pending] = JobStore().list()
        jobs.stop(pending.id)
        return monitor

    monkeypatch.setattr(LocalLauncher, "_start_monitor", staticmethod(start_then_stopped))
    record = jobs.submit(spec, wait=False)
    _wait_until(lambda: jobs.get(record.id).status == "Stopped", timeout=60,
                what="the stop reached the job")
    assert live_processes(str(tmp_path)) == [] and live_processes(str(dtrain_home)) == []


KILLED_SUBMIT = """
import os, sys
from dtrain.jobs import api as jobs
from dtrain.launcher.local import launcher, layout
from dtrain.spec.model import JobSpec

when = sys.argv[2]
start = launcher.LocalLauncher._start_monitor
if when == "before-the-monitor":
    launcher.LocalLauncher._start_monitor = staticmethod(lambda job_dir: os._exit(9))
elif when == "before-noting-it":  # the monitor starts; nothing has noted it yet
    launcher.LocalLauncher._start_monitor = staticmethod(lambda job_dir: (start(job_dir),
                                                                          os._exit(9)))
else:  # after the monitor started and was noted in the facts file, before the store heard
    write = layout.write_state
    def write_then_die(job_dir, **facts):
        write(job_dir, **facts)
        if "monitor" in facts:
            os._exit(9)
    layout.write_state = write_then_die
jobs.submit(JobSpec.from_file(sys.argv[1]), wait=False)
"""


@pytest.mark.parametrize("when, status", [("before-the-monitor", "Failed"),
                                          ("before-noting-it", "Completed"),
                                          ("after-the-monitor", "Completed")])
def test_a_submit_killed_half_way_leaves_a_record_that_ends(tmp_path, dtrain_home, when, status):
    import subprocess
    import sys

    spec = make_spec(tmp_path, "print('trained', flush=True)\n")
    spec_file = tmp_path / "job.json"  # JSON is YAML
    spec_file.write_text(json.dumps(spec.to_dict()))
    script = tmp_path / "killed_submit.py"
    script.write_text(KILLED_SUBMIT)
    done = subprocess.run([sys.executable, str(script), str(spec_file), when], timeout=120,
                          check=False)
    assert done.returncode == 9  # as a kill -9 of `dtrain submit` would leave it
    [record] = JobStore().list()
    _wait_until(lambda: jobs.get(record.id).status == status, timeout=60,
                what=f"the job ended {status}")
    if status == "Failed":
        assert jobs.get(record.id).failure_reason.startswith(
            "lost: `dtrain submit` ended before it started the job")


def test_a_recipe_runs_the_attention_kernel_the_distribution_names(tmp_path):
    # distribution.attention reached the contract but the recipe built its model with the
    # default kernel (flash: SDPA's flash kernel on CPU)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(__file__).read_text())
    spec = JobSpec.from_dict({
        "name": "eager", "entry_point": "recipe:causal_lm", "inputs": {"train": str(corpus)},
        "hyperparameters": {"steps": 2, "seq_len": 32, "micro_batch_size": 2},
        "output_path": str(tmp_path / "jobs"), "distribution": {"attention": "eager"},
        "compute": {"instance_type": "local", "instance_count": 1, "max_run": 120}})
    record = jobs.submit(spec, wait=True)
    assert record.status == "Completed", record.failure_reason
    log = (Path(record.target_data["job_dir"]) / "algo-1" / "output" / "logs" /
           "rank-0.stderr.log").read_text()
    assert "dtrain rank 0 attention kernel: eager" in log, log[-2000:]
