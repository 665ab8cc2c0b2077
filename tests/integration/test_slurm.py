"""The Slurm target against a real Slurm: two nodes started here, real sbatch, srun and scancel.

Run with ``python -m pytest -q -m slurm`` (as root, with ``apt-get install -y slurm-wlm munge``);
without Slurm every test here fails with one line naming that command. One cluster serves the
module (``_slurm_cluster``); it is stopped and its namespaces removed even when a test fails.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import _slurm_cluster
import pytest
from dtrain import Estimator
from dtrain.core import logformat
from dtrain.core.errors import DtrainError
from dtrain.jobs import api as jobs

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "local-cpu.yaml"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    _slurm_cluster.require_slurm()
    running = _slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm"))
    # a SIGTERM (a CI timeout) ends the session through the teardown, not around it
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield running.start()
    finally:
        running.stop()
        signal.signal(signal.SIGTERM, previous)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt("SIGTERM")


@pytest.fixture
def shared(cluster, tmp_path, monkeypatch):
    """The login node's environment for this cluster, and a shared folder for the jobs."""
    for key, value in cluster.env.items():
        monkeypatch.setenv(key, value)
    folder = tmp_path / "shared"
    folder.mkdir()
    return folder


def dtrain(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtrain.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ), check=False)


def example_on_slurm(shared: Path, *overrides: str) -> list[str]:
    return [str(EXAMPLE), "--target", "slurm", "--set", f"slurm.shared_dir={shared}",
            *(item for override in overrides for item in ("--set", override))]


def test_main_example_runs_on_two_nodes_with_falling_loss(shared, cluster):
    done = dtrain("submit", *example_on_slurm(shared))
    assert done.returncode == 0, done.stdout + done.stderr
    losses = [float(x) for x in
              re.findall(r"^step \d+ · loss ([\d.]+)", done.stdout, re.MULTILINE)]
    assert len(losses) == 4 and losses[-1] < losses[0] * 0.7, done.stdout
    record = jobs.get(re.search(r"submitted (\w+)", done.stdout)[1])
    assert record.status == "Completed" and record.target_data["hosts"] == ["n1", "n2"]
    listed = dtrain("list", "--target", "slurm", "-o", "json")
    assert [(r["id"], r["status"]) for r in json.loads(listed.stdout)] == \
        [(record.id, "Completed")]
    model = Path(record.target_data["model_data"])
    assert (model / "model.safetensors").stat().st_size > 100_000
    assert (model / "config.json").exists()
    # every rank ran on the node Slurm gave it, and dtrain logs reads their files
    on = {host: list(jobs.logs(record.id, host=host)) for host in ("n1", "n2")}
    metrics = {(host, logformat.rank_of(line)) for host, lines in on.items() for line in lines
               if "dtrain-metrics " in line}
    assert metrics == {("n1", 0)}, "rank 0 logs the metrics"
    assert {logformat.rank_of(line) for line in on["n2"]} - {None} == {2, 3}
    # the batch script's first line first: its output merges with the agents' in time order
    assert on["n1"][0] == f"[n1] dtrain: job {record.id} on n1 n2 ", on["n1"][:3]
    # n2's agent shut the rendezvous down while n1's agent still held its store
    assert not [line for lines in on.values() for line in lines if "TCPStore" in line]
    assert cluster.node_processes() == []


def test_stop_checkpoints_on_sigterm_and_submit_resume_continues(shared, cluster):
    overrides = example_on_slurm(shared, "hyperparameters.steps=2000",
                                 "hyperparameters.checkpoint_interval=100000")
    done = dtrain("submit", *overrides, "--no-wait")
    assert done.returncode == 0, done.stderr
    job = re.search(r"submitted (\w+)", done.stdout)[1]
    checkpoints = shared / job / "checkpoints"  # the default: in the job's folder
    wait_for_line(job, r"dtrain-metrics step=20 ")
    stopped = dtrain("stop", job, "--wait")
    assert stopped.returncode == 0 and stopped.stdout.strip().endswith("Stopped"), stopped.stdout
    record = jobs.get(job)
    assert record.failure_reason == "stopped by user"
    saved = sorted(checkpoints.glob("step-*"))
    assert len(saved) == 1 and (saved[0] / "COMPLETE").exists(), saved  # written on SIGTERM
    step = int(saved[0].name.split("-")[1])
    assert 20 <= step < 2000
    assert cluster.node_processes() == [], "a process outlived the stop on a node"

    # what `dtrain status` of a stopped job says to run
    assert f"dtrain submit --resume {job}" in dtrain("status", job).stdout
    again = dtrain("submit", "--resume", job, "--set", f"hyperparameters.steps={step + 20}")
    assert again.returncode == 0, again.stdout + again.stderr
    resumed = re.search(r"submitted (\w+)", again.stdout)[1]
    assert any(f"resumed from {saved[0]} at step {step}" in line for line in jobs.logs(resumed))


def test_a_worker_that_raises_fails_the_job_naming_rank_and_error(shared, cluster, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(textwrap.dedent("""
        import os, time
        if os.environ["RANK"] == "3":
            raise KeyError("no such column: tokens")
        time.sleep(120)
        """))
    estimator = Estimator(entry_point="train.py", source_dir=str(code), target="slurm",
                          instance_type="local", instance_count=2, processes_per_instance=2,
                          max_run=300, slurm={"shared_dir": str(shared)})
    started = time.monotonic()
    with pytest.raises(DtrainError, match=r"job \w+ Failed: rank 3 on n2 exited with code 1"):
        estimator.fit()  # as `dtrain submit` exits 1
    record = estimator.latest_job
    assert record.status == "Failed"
    assert record.failure_reason.startswith("rank 3 on n2 exited with code 1"), \
        record.failure_reason
    assert "KeyError: 'no such column: tokens'" in record.failure_reason
    assert time.monotonic() - started < 90, "the other node was not stopped at once"
    assert cluster.node_processes() == []


KILLED_SUBMIT = """
import os, sys
from dtrain.jobs import api as jobs
from dtrain.launcher.slurm import commands
from dtrain.spec.model import JobSpec
sbatch = commands.submit
def submit_then_die(argv):
    if sys.argv[2] == "after-sbatch":
        sbatch(argv)  # Slurm has the job; its id is never recorded
    os._exit(9)  # as a kill -9 of `dtrain submit` would leave it: no except clause runs
commands.submit = submit_then_die
jobs.submit(JobSpec.from_file(sys.argv[1]), wait=False)
"""


def test_a_submit_killed_around_sbatch_is_adopted_or_lost_and_its_folder_removed(
        shared, cluster, tmp_path):
    from dtrain.jobs.store import JobStore
    from dtrain.spec.model import JobSpec

    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("print('trained', flush=True)\n")
    script = tmp_path / "killed_submit.py"
    script.write_text(KILLED_SUBMIT)
    for when in ("before-sbatch", "after-sbatch"):
        spec = JobSpec.from_dict({
            "name": when, "entry_point": "train.py", "source_dir": str(code),
            "compute": {"target": "slurm", "instance_type": "local", "instance_count": 2,
                        "max_run": 300},
            "slurm": {"shared_dir": str(shared)}})
        spec_file = tmp_path / f"{when}.json"  # JSON is YAML
        spec_file.write_text(json.dumps(spec.to_dict()))
        done = subprocess.run([sys.executable, str(script), str(spec_file), when], timeout=120,
                              env=dict(os.environ), capture_output=True, text=True, check=False)
        assert done.returncode == 9, done.stderr
    records = {record.name: record for record in JobStore().list()}
    lost = jobs.get(records["before-sbatch"].id)  # status sees the submit gone
    assert lost.status == "Failed" and lost.failure_reason.startswith(
        "lost: `dtrain submit` ended before sbatch queued the job (pid "), lost.failure_reason
    assert not (shared / lost.id).exists(), "the lost job's folder was left on the shared disk"
    adopted = jobs.get(records["after-sbatch"].id)
    assert adopted.target_data["slurm_job_id"] and adopted.target_data["submitter"] is None
    ended = jobs.wait_for(adopted.id, timeout_s=120)
    assert ended.status == "Completed", ended.failure_reason
    assert any("trained" in line for line in jobs.logs(adopted.id))
    assert cluster.node_processes() == []


def test_without_slurm_the_tests_fail_with_the_install_command(tmp_path):
    with pytest.raises(pytest.fail.Exception) as failed:
        _slurm_cluster.require_slurm(path=str(tmp_path))  # a PATH without Slurm's commands
    message = str(failed.value)
    assert "\n" not in message and message.startswith("Slurm is not installed (munged,")
    assert message.endswith(": apt-get install -y slurm-wlm munge; "
                            "apt-get install -y iproute2 util-linux")


def wait_for_line(job: str, pattern: str, *, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(re.search(pattern, line) for line in jobs.logs(job, rank=0)):
        record = jobs.get(job)
        assert not record.is_final, f"job ended before {pattern!r}: {record.failure_reason}"
        assert time.monotonic() < deadline, f"no {pattern!r} in {timeout_s} s"
        time.sleep(1)
