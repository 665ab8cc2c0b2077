"""Paths a user takes one step past the quickstart: Ctrl-C while waiting, a job found by the name
the user gave it, log filters, --debug anywhere, typos in instance types."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from functools import partial

import _cli
import pytest
from dtrain.core.errors import SpecError
from dtrain.jobs import api as jobs
from dtrain.jobs.store import JobStore
from dtrain.spec.model import JobSpec

# check=False: the exit code is what these tests assert on
dtrain = partial(_cli.dtrain, check=False, timeout=120)
write_job = partial(_cli.write_job, name="patient", absolute_source_dir=True, instance_count=1,
                    processes_per_instance=1)


def _interrupt_waiting_submit(spec: str, *extra: str, sig: int = signal.SIGINT
                              ) -> tuple[subprocess.CompletedProcess, str]:
    # A terminal's Ctrl-C reaches a foreground process whose SIGINT is at its default. A test run
    # started in the background (`cmd &` in a script) has SIGINT ignored, which its children
    # would inherit; a handled signal is reset to the default in a child at exec.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "dtrain.cli.main", "submit", spec, *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    first = proc.stdout.readline()  # "submitted <id> (...)"
    job = first.split()[1]
    deadline = time.monotonic() + 60
    while jobs.get(job).status != "Running":
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, first + out, err), job


@pytest.mark.slow
def test_ctrl_c_while_waiting_leaves_the_job_running_and_says_how_to_follow_or_stop_it(
        tmp_path, monkeypatch):
    monkeypatch.setenv("DTRAIN_STOP_GRACE_PERIOD", "2")
    spec = write_job(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(300)\n")
    result, job = _interrupt_waiting_submit(spec)
    assert result.returncode == 130
    assert f"interrupted: job {job} (patient) keeps running; follow it with `dtrain logs {job} " \
        f"--follow`, stop it with `dtrain stop {job}`" in result.stderr
    assert jobs.get(job).status == "Running"
    assert jobs.stop(job, wait=True, timeout_s=60).status == "Stopped"

    result, job = _interrupt_waiting_submit(spec, "--stop-on-interrupt")
    assert result.returncode == 130 and f"interrupted: stopping job {job}" in result.stderr
    assert jobs.wait_for(job, timeout_s=60).status == "Stopped"

    # a closed terminal (SIGHUP) is a Ctrl-C, not a death that leaves no word
    result, job = _interrupt_waiting_submit(spec, sig=signal.SIGHUP)
    assert result.returncode == 130 and f"interrupted: job {job} (patient) keeps running" \
        in result.stderr
    assert jobs.stop(job, wait=True, timeout_s=60).status == "Stopped"
    # Ctrl-C while `dtrain stop --wait` waits: the stop stands, and it says so ("aborted" only)
    ignoring = write_job(tmp_path, "import signal, time\nsignal.signal(signal.SIGTERM, "
                         "signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(300)\n")
    monkeypatch.setenv("DTRAIN_STOP_GRACE_PERIOD", "8")  # the wait outlasts the Ctrl-C
    job = json.loads(dtrain("submit", ignoring, "--no-wait", "-o", "json").stdout)["id"]
    deadline = time.monotonic() + 60
    while "up" not in dtrain("logs", job).stdout:  # its SIGTERM is ignored from here on
        assert time.monotonic() < deadline, jobs.get(job).status
        time.sleep(0.2)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        waiting = subprocess.Popen([sys.executable, "-m", "dtrain.cli.main", "stop", job,
                                    "--wait"], stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    while jobs.get(job).status != "Stopping":
        assert time.monotonic() < deadline, jobs.get(job).status
        time.sleep(0.2)
    time.sleep(1)  # recorded by the stop call: let it return and the wait begin
    waiting.send_signal(signal.SIGINT)
    _, err = waiting.communicate(timeout=30)
    assert waiting.returncode == 130, err
    assert f"interrupted: the stop was sent; job {job} (Stopping) ends on its own" in err
    assert jobs.wait_for(job, timeout_s=60).status == "Stopped"  # the grace period ends it
    monkeypatch.setenv("DTRAIN_STOP_GRACE_PERIOD", "2")
    # so is a SIGTERM (`timeout`, a cancelled CI job): it stopped nothing, without a word
    result, job = _interrupt_waiting_submit(spec, "--stop-on-interrupt", sig=signal.SIGTERM)
    assert result.returncode == 130 and f"interrupted: stopping job {job}" in result.stderr
    assert jobs.wait_for(job, timeout_s=60).status == "Stopped"


def test_the_name_a_user_gave_finds_the_latest_of_its_jobs_and_names_the_others(tmp_path):
    store = JobStore()
    older = store.create(name="pythia-1b-p4d-20261124-001019", target="sagemaker",
                         spec={"name": "pythia-1b-p4d"}, status="Completed", created_at=100.0)
    newer = store.create(name="pythia-1b-p4d-20261124-101500", target="sagemaker",
                         spec={"name": "pythia-1b-p4d"}, status="Failed", created_at=200.0)
    notes = []
    assert jobs.find("pythia-1b-p4d", store=store, on_note=notes.append).id == newer.id
    assert notes == [(f"2 jobs are named 'pythia-1b-p4d'; this is the latest, {newer.id} "
                     f"(pythia-1b-p4d-20261124-101500); the others: {older.id} (Completed) "
                     "(give an id to pick one)")]
    # a command that looks its job up more than once (logs: to read, then to say it has none)
    # says it once
    for n in (1, 2):
        store.create(name=f"cpu-{n}", target="local", spec={"name": "cpu"}, status="Completed",
                     created_at=100.0 * n)
    listed = dtrain("logs", "cpu")
    assert listed.stderr.count("2 jobs are named 'cpu'") == 1, listed.stderr
    # the target's full name and the id still find exactly one, without a note
    assert jobs.find("pythia-1b-p4d-20261124-001019", store=store).id == older.id
    assert jobs.find(older.id[:6], store=store).id == older.id


def test_dtrain_list_shows_full_names(tmp_path):
    JobStore().create(name="a-rather-long-job-name-for-a-list-20261124-001019", target="local",
                      spec={}, status="Completed")
    out = dtrain("list", "--no-refresh").stdout
    assert "a-rather-long-job-name-for-a-list-20261124-001019" in out


def _finished_local_job(tmp_path) -> str:
    spec = write_job(tmp_path, "print('hello', flush=True)\n", instance_count=2)
    result = dtrain("submit", spec, "-o", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["id"]


@pytest.mark.slow
def test_log_filters_outside_the_job_are_input_errors_and_an_empty_log_says_so(tmp_path):
    job = _finished_local_job(tmp_path)
    for flag, value in (("--rank", "7"), ("--rank", "-1")):
        result = dtrain("logs", job, flag, value)
        assert result.returncode == 2
        assert result.stderr == f"error: --rank {value}: job {job} has ranks 0 to 1\n"
    result = dtrain("logs", job, "--host", "algo-9")
    assert result.returncode == 2
    assert result.stderr == f"error: --host 'algo-9': job {job} runs on algo-1, algo-2\n"
    ok = dtrain("logs", job, "--rank", "1")
    assert ok.returncode == 0 and "[algo-2 1]:hello" in ok.stdout
    for host in ("algo-1", "algo-2"):  # one prefix format: [host] for agent lines
        lines = dtrain("logs", job, "--host", host).stdout.splitlines()
        assert lines and all(line.startswith((f"[{host}] ", f"[{host} ")) for line in lines)
    record = JobStore().get(job)
    for host in ("algo-1", "algo-2"):  # the same job with its logs gone
        os.truncate(os.path.join(record.target_data["job_dir"], host, "output", "agent.log"), 0)
    empty = dtrain("logs", job)
    assert empty.returncode == 0 and empty.stdout == ""
    assert empty.stderr == f"no log lines (it ended Completed) in job {job}\n"
    shutil.rmtree(record.target_data["job_dir"])  # the folder itself gone: said, and exit 1
    gone = dtrain("logs", job)
    assert gone.returncode == 1
    assert gone.stderr == (f"error: job {job} ended Completed, and its folder "
                           f"{record.target_data['job_dir']}, which held its logs and metrics, "
                           "no longer exists\n")
    reported = dtrain("report", job)  # not "logged no metrics"
    assert (reported.returncode, reported.stderr) == (1, gone.stderr)


def test_debug_is_accepted_after_the_subcommand(tmp_path):
    result = dtrain("validate", str(tmp_path / "missing.yaml"), "--debug")
    assert result.returncode != 0 and "Traceback" in result.stderr
    assert "No such option" not in result.stderr


def test_unknown_instance_types_suggest_only_their_own_family(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("entry_point: recipe:causal_lm\n")
    far = dtrain("validate", str(spec), "--set", "compute.instance_type=ml.p9.96xlarge")
    assert far.returncode == 2 and "did you mean" not in far.stderr
    near = dtrain("validate", str(spec), "--set", "compute.instance_type=p4d.12xlarge")
    assert "did you mean 'p4d.24xlarge'?" in near.stderr


def test_dry_run_lists_what_would_be_packed_and_the_secrets_left_out(tmp_path):
    src = tmp_path / "src"
    (src / "lib").mkdir(parents=True)
    for rel in ("train.py", "lib/model.py", ".ENV"):
        (src / rel).write_text("x")
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples",
                           "sagemaker-p4d.yaml")
    result = dtrain("submit", example, "--dry-run", "--set", f"source_dir={src}")
    assert result.returncode == 0, result.stderr
    assert f"packed from {src} (2 files): lib/model.py, train.py" in result.stdout
    assert "not packed, they look like secrets: .ENV" in result.stdout
    packed = json.loads(dtrain("submit", example, "--dry-run", "--set", f"source_dir={src}",
                               "-o", "json").stdout)["packed"]
    assert packed == {str(src): {"files": ["lib/model.py", "train.py"], "secrets": [".ENV"]}}


def test_resume_uses_the_jobs_checkpoint_location_on_the_same_target(tmp_path):
    from dtrain.core.errors import DtrainError, SpecError

    spec = {"name": "big", "entry_point": "recipe:causal_lm", "output_path": "s3://out-bkt/d",
            "compute": {"target": "sagemaker", "instance_type": "ml.p4d.24xlarge"},
            "sagemaker": {"role": "arn:aws:iam::111122223333:role/Train"}}
    store = JobStore()
    job = store.create(name="big-20261124-001019", target="sagemaker", spec=spec,
                       status="Stopped",
                       target_data={"checkpoints": "s3://out-bkt/d/big-20261124-001019/ckpt"})
    resumed = jobs.resume_spec(job.id, store=store, overrides=["hyperparameters.steps=9"])
    assert resumed.checkpoint.uri == "s3://out-bkt/d/big-20261124-001019/ckpt"
    assert resumed.hyperparameters == {"steps": 9}
    with pytest.raises(SpecError, match="the job ran on sagemaker, this spec targets local"):
        jobs.resume_spec(job.id, store=store, spec=jobs.resume_spec(job.id, store=store)
                         .model_copy(update={"compute": resumed.compute.model_copy(
                             update={"target": "local"})}))
    bare = store.create(name="old", target="sagemaker", spec=spec, status="Failed")
    with pytest.raises(DtrainError, match="recorded no checkpoint location"):
        jobs.resume_spec(bare.id, store=store)


def test_a_stopped_or_failed_job_with_a_checkpoint_says_how_to_resume_it(tmp_path):
    store = JobStore()
    spec = {"name": "tiny", "entry_point": "recipe:causal_lm", "compute": {"target": "local"},
            "hyperparameters": {"data": "/data/corpus"}}
    saved, empty = tmp_path / "saved", tmp_path / "empty"
    (saved / "step-000040").mkdir(parents=True)
    (saved / "step-000040" / "COMPLETE").write_text("")
    (empty / "step-000080.tmp").mkdir(parents=True)  # a checkpoint never finished
    stopped = store.create(name="tiny-stopped", target="local", spec=spec, status="Stopped",
                           target_data={"checkpoints": str(saved)})
    failed = store.create(name="tiny-failed", target="local", spec=spec, status="Failed",
                          target_data={"checkpoints": str(saved)})
    shown = dtrain("status", stopped.id)
    assert f"resume    dtrain submit --resume {stopped.id}\n" in shown.stdout
    running = store.create(name="tiny-running", target="local", spec=spec, status="Running",
                           target_data={"secondary_status": "MonitorGone"})
    assert "status    Running (MonitorGone)\n" in dtrain("status", running.id).stdout
    ended = store.create(name="tiny-ended", target="local", spec=spec, status="Completed",
                         target_data={"secondary_status": "MonitorGone"})
    assert "status    Completed\n" in dtrain("status", ended.id).stdout  # it means no more
    # a node lost without notice fails the job; its checkpoints are there to continue from
    assert f"resume    dtrain submit --resume {failed.id}\n" in dtrain("status", failed.id).stdout
    cloud = store.create(name="tiny-cloud", target="sagemaker", spec=spec, status="Failed",
                         target_data={"checkpoints": "s3://bkt/tiny/checkpoints"})
    assert "resume " not in dtrain("status", cloud.id).stdout  # none seen there: not offered
    # stopped before its first checkpoint: no resume is offered, and one asked for is refused
    early = store.create(name="tiny-early", target="local", spec=spec, status="Stopped",
                         target_data={"checkpoints": str(empty)})
    assert "resume " not in dtrain("status", early.id).stdout
    refused = dtrain("submit", "--resume", early.id)
    assert refused.returncode != 0
    assert f"left no complete checkpoint in {empty}" in refused.stderr
    gone = store.create(name="tiny-gone", target="local", spec=spec, status="Completed",
                        target_data={"checkpoints": str(tmp_path / "deleted")})
    refused = dtrain("submit", "--resume", gone.id)
    assert f"checkpoint folder {tmp_path / 'deleted'} no longer exists" in refused.stderr
    # a job still running would share its checkpoint folder with the resumed one
    busy = store.create(name="tiny-busy", target="local", spec=spec, status="Running",
                        target_data={"checkpoints": str(saved), "secondary_status": "MonitorGone"})
    refused = dtrain("submit", "--resume", busy.id)
    assert f"checkpoint.uri: job {busy.id} (tiny-busy) is still Running" in refused.stderr
    # and so would resuming the job it resumed: both keep their checkpoints in one folder
    refused = dtrain("submit", "--resume", stopped.id)
    assert refused.returncode == 1
    assert (f"checkpoint.uri: job {busy.id} (tiny-busy) is still Running with its checkpoints "
            f"in {saved}") in refused.stderr
    same = dtrain("submit", "--resume", stopped.id, "--set", f"checkpoint.uri={saved}/",
                  "--dry-run")  # the job's own folder, written otherwise: no conflict there
    assert "checkpoint.uri says" not in same.stderr and "is still Running" in same.stderr
    moved = dtrain("submit", "--resume", stopped.id, "--set", "checkpoint.uri=/elsewhere")
    assert moved.returncode == 2
    assert (f"--resume {stopped.id} continues from {saved}, where the job kept its checkpoints, "
            "and checkpoint.uri says /elsewhere") in moved.stderr
    with pytest.raises(SpecError, match="checkpoint.uri says /elsewhere"):  # so from Python
        jobs.resume_spec(stopped.id, spec=JobSpec.from_dict(
            {**spec, "checkpoint": {"uri": "/elsewhere"}}))


def test_a_hang_up_or_sigterm_is_a_ctrl_c_unless_ignored():
    import contextlib

    from dtrain.cli import main as cli_main

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGHUP, signal.SIGTERM)}
    try:
        for before, after in ((signal.SIG_IGN, signal.SIG_IGN),  # nohup: left as it is
                              (signal.SIG_DFL, cli_main._hang_up)):
            for sig in previous:
                signal.signal(sig, before)
            with contextlib.suppress(SystemExit):
                cli_main.main(["--version"])
            assert [signal.getsignal(sig) for sig in previous] == [after, after]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
