"""What a Slurm submit puts in the shared folder before ``sbatch``, and what it leaves when sbatch
refuses the job (nothing). ``sbatch`` is a stand-in on PATH answering as Slurm's does; the real
one runs in tests/integration/test_slurm.py."""

from __future__ import annotations

import json
import os
import stat
import textwrap

import boto3
import moto
import pytest
from dtrain.core.errors import DtrainError
from dtrain.jobs import api as jobs
from dtrain.jobs.store import JobStore
from dtrain.spec.model import JobSpec


@pytest.fixture
def sbatch(tmp_path, monkeypatch):
    """``sbatch(answer, code)``: the stand-in prints ``answer``, exits ``code``, and keeps its
    arguments in ``calls``."""
    folder = tmp_path / "bin"
    folder.mkdir()
    calls = tmp_path / "calls"
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")

    def answer(text: str, code: int = 0) -> None:
        path = folder / "sbatch"
        path.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nprintf "%s\\n" "{text}" '
                        f'>&{2 if code else 1}\nexit {code}\n')
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    answer.calls = calls
    answer.folder = folder
    return answer


def spec_with_code(tmp_path, **inputs) -> JobSpec:
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("print('hi')\n")
    (code / ".env").write_text("AWS_SECRET_ACCESS_KEY=x\n")
    (code / ".gitignore").write_text("scratch/\n")
    (code / "scratch").mkdir()
    (code / "scratch" / "big.bin").write_text("x")
    (tmp_path / "shared").mkdir()
    return JobSpec.from_dict({
        "name": "t", "entry_point": "train.py", "source_dir": str(code), "inputs": inputs,
        "compute": {"target": "slurm", "instance_type": "local", "instance_count": 2},
        "slurm": {"shared_dir": str(tmp_path / "shared")}})


def test_submit_fills_the_job_folder_then_runs_exactly_the_dry_run_s_sbatch(tmp_path, sbatch,
                                                                            monkeypatch):
    sbatch("4242")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with moto.mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="data")
        s3.put_object(Bucket="data", Key="corpus/part-0.txt", Body=b"hello")
        spec = spec_with_code(tmp_path, train="s3://data/corpus", local=str(tmp_path / "code"))
        dry = jobs.submit(spec, dry_run=True)
        record = jobs.submit(spec, wait=False, job=dry.job)
    job_dir = tmp_path / "shared" / record.id
    assert record.status == "Pending" and record.target_data["slurm_job_id"] == "4242"
    assert sbatch.calls.read_text().split() == dry.payload["sbatch"][1:]
    assert (job_dir / "job.sbatch").read_text() == dry.payload["script"]
    assert sorted(p.name for p in (job_dir / "code").iterdir()) == [".gitignore", "train.py"]
    node = json.loads((job_dir / "node.json").read_text())
    assert node["channels"] == {"train": str(job_dir / "inputs" / "train"),
                                "local": str(tmp_path / "code")}
    assert (job_dir / "inputs" / "train" / "part-0.txt").read_text() == "hello"
    assert node["settings"] == dry.payload["node"]["settings"]


def test_a_refused_job_leaves_no_folder_and_fails_with_sbatch_s_line(tmp_path, sbatch):
    sbatch("sbatch: error: Batch job submission failed: Invalid partition name specified", 1)
    spec = spec_with_code(tmp_path)
    with pytest.raises(DtrainError) as failed:
        jobs.submit(spec, wait=False)
    assert str(failed.value) == ("sbatch failed (exit code 1): sbatch: error: Batch job "
                                 "submission failed: Invalid partition name specified")
    assert list((tmp_path / "shared").iterdir()) == []
    (record,) = JobStore().list()
    assert record.status == "Failed" and record.failure_reason == str(failed.value)


def test_a_shared_folder_missing_on_the_login_node_is_named_with_the_fix(tmp_path, sbatch):
    spec = spec_with_code(tmp_path)
    (tmp_path / "shared").rmdir()
    with pytest.raises(DtrainError, match=textwrap.dedent(r"""
            ^slurm.shared_dir: '.*/shared' is not a folder on this machine; run dtrain on the
            login node and create it on the shared file system \(mkdir -p .*/shared\)$
            """).strip().replace("\n", " ")):
        jobs.submit(spec, wait=False)


def test_a_stop_while_sbatch_runs_cancels_the_slurm_job_it_made(tmp_path, monkeypatch):
    from dtrain.launcher.slurm import commands

    cancelled = []

    def sbatch_while_stopped(*_args, **_kwargs) -> str:
        [pending] = JobStore().list()  # the job being submitted, no Slurm id yet
        jobs.stop(pending.id)  # nothing to cancel yet: recorded Stopped
        return "4242"

    monkeypatch.setattr(commands, "submit", sbatch_while_stopped)
    monkeypatch.setattr(commands, "cancel", cancelled.append)
    record = jobs.submit(spec_with_code(tmp_path), wait=False)
    assert cancelled == ["4242"]  # not left to run untracked
    assert (record.status, record.target_data["slurm_job_id"]) == ("Stopped", "4242")


@pytest.mark.parametrize("during", ["sbatch", "staging"])
def test_a_ctrl_c_leaves_the_record_to_status_and_keeps_the_folder_only_if_sbatch_ran(
        tmp_path, monkeypatch, during):
    from dtrain.launcher import process, staging
    from dtrain.launcher.slurm import commands

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands if during == "sbatch" else staging,
                        "submit" if during == "sbatch" else "stage_inputs", interrupted)
    with pytest.raises(KeyboardInterrupt):
        jobs.submit(spec_with_code(tmp_path), wait=False)
    (record,) = JobStore().list()
    # sbatch may have queued the job before the interrupt: `dtrain status` finds out (it
    # adopts the job or ends the record lost, tests/integration/test_slurm.py)
    assert record.status == "Pending"
    assert record.target_data["submitter"] == process.this_process()
    folders = [p.name for p in (tmp_path / "shared").iterdir()]
    assert folders == ([record.id] if during == "sbatch" else [])


def test_a_stop_then_a_ctrl_c_during_sbatch_ends_stopped_once_the_submit_is_gone(
        tmp_path, monkeypatch, sbatch):
    import subprocess

    from dtrain.launcher import process
    from dtrain.launcher.slurm import commands

    for name in ("squeue", "sacct"):  # Slurm has no such job: sbatch never queued it
        sbatch.folder.joinpath(name).write_text("#!/bin/sh\nexit 0\n")
        sbatch.folder.joinpath(name).chmod(0o755)

    def stopped_then_interrupted(*_args, **_kwargs):
        [pending] = JobStore().list()
        assert jobs.stop(pending.id).status == "Stopping"  # the submit under way delivers it
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "submit", stopped_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        jobs.submit(spec_with_code(tmp_path), wait=False)
    (record,) = JobStore().list()
    assert record.status == "Stopping" and (tmp_path / "shared" / record.id).is_dir()
    gone = subprocess.Popen(["sleep", "30"])  # the submit, as if it had exited
    dead = process.describe(gone.pid)
    gone.kill()
    gone.wait()
    JobStore().update(record.id, target_data={"submitter": dead})
    ended = jobs.get(record.id)
    assert (ended.status, ended.failure_reason) == ("Stopped", "stopped by user")
    assert not (tmp_path / "shared" / record.id).exists()  # nothing left on the shared disk
