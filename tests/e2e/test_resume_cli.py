"""A stopped job resubmitted with `dtrain submit --resume` continues where it stopped and ends
with the parameters an uninterrupted run has (the local target, 2 hosts × 2 processes)."""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import _cli
import pytest
from dtrain.jobs import api as jobs
from safetensors.torch import load_file

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "local-cpu.yaml")
SETTINGS = ["--set", "hyperparameters.steps=40", "--set", "hyperparameters.log_interval=2",
            "--set", "hyperparameters.checkpoint_interval=1000"]  # checkpoints: on SIGTERM only

# check=False: the test asserts on what the commands print and return
dtrain = partial(_cli.dtrain, check=False, timeout=300)


def weights(job: str) -> dict:
    record = jobs.get(job)
    return load_file(Path(record.target_data["job_dir"]) / "algo-1" / "model" /
                     "model.safetensors")


def logged_steps(job: str) -> list[int]:
    lines = dtrain("logs", job, "--rank", "0").stdout.splitlines()
    return [int(line.split("step=")[1].split()[0]) for line in lines if "dtrain-metrics" in line]


@pytest.mark.slow
def test_a_stopped_job_resumes_from_its_checkpoint_and_ends_as_an_uninterrupted_run(monkeypatch):
    monkeypatch.setenv("DTRAIN_STOP_GRACE_PERIOD", "20")
    whole = json.loads(dtrain("submit", EXAMPLE, *SETTINGS, "-o", "json").stdout)
    assert whole["status"] == "Completed", whole["failure_reason"]

    stopped = json.loads(dtrain("submit", EXAMPLE, *SETTINGS, "--no-wait", "-o", "json").stdout)
    deadline = time.monotonic() + 180
    while not [s for s in logged_steps(stopped["id"]) if s >= 10]:
        assert time.monotonic() < deadline, "the job never reached step 10"
        time.sleep(0.5)
    record = json.loads(dtrain("stop", stopped["id"], "--wait", "-o", "json").stdout)
    assert record["status"] == "Stopped", record["failure_reason"]
    stopped_at = max(logged_steps(stopped["id"]))
    assert 10 <= stopped_at < 40

    result = dtrain("submit", "--resume", stopped["id"], "-o", "json")
    assert result.returncode == 0, result.stderr
    resumed = json.loads(result.stdout)
    assert resumed["status"] == "Completed" and resumed["id"] != stopped["id"]
    assert f"resuming {stopped['id']} from " in result.stderr
    steps = logged_steps(resumed["id"])
    assert steps and min(steps) > stopped_at and max(steps) == 40
    final, reference = weights(resumed["id"]), weights(whole["id"])
    assert final.keys() == reference.keys()
    for name, tensor in final.items():
        assert (tensor - reference[name]).abs().max().item() <= 1e-6, name
