"""Checkpoint/resume on 4 real gloo workers (2 hosts x 2, MiCS sharding degree 2).

A run SIGKILLed after a checkpoint and restarted ends with the same parameters as an
uninterrupted run, and so does a local job with ``max_restarts: 1`` one of whose workers is
SIGKILLed (every host's workers restart into a new rendezvous round); leftovers of an unfinished
checkpoint are never loaded; and the 4-rank run trains the same model as one process on the
same global batch. Workers are started as torchrun
would start them (RANK, LOCAL_WORLD_SIZE=2, ...); the reference and the killed run go at once.

    pytest tests/integration/test_resume.py -q
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import _workers as w
import pytest
import torch
from dtrain.jobs import api as jobs
from dtrain.runtime.train.checkpoint import COMPLETE, latest_checkpoint
from dtrain.spec.model import JobSpec

pytestmark = pytest.mark.slow

STEPS, INTERVAL = 8, 3
ARGS = ["--model", "gpt-neox-tiny", "--steps", str(STEPS), "--micro_batch_size", "2",
        "--seq_len", "32", "--lr", "3e-3", "--warmup_steps", "2", "--log_interval", "1",
        "--checkpoint_interval", str(INTERVAL), "--seed", "7"]
MICS = {"sharding_degree": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    corpus = root / "corpus.txt"
    corpus.write_text(Path(__file__).read_text() * 3)
    args = [*ARGS, "--data", str(corpus)]
    reference = w.launch("causal_lm", args, root / "reference",
                         checkpoints=root / "reference" / "ckpt", distribution=MICS)
    killed_ckpt = root / "killed" / "ckpt"
    killed = w.launch("causal_lm", args, root / "killed", checkpoints=killed_ckpt,
                      distribution=MICS)
    try:
        w.wait_for(lambda: latest_checkpoint(killed_ckpt) is not None, procs=killed)
    finally:
        w.kill(killed)  # SIGKILL: no handler runs, no final model
    interrupted = not (root / "killed" / "model" / "model.safetensors").exists()
    _plant_unfinished_checkpoints(killed_ckpt)
    resumed = w.launch("causal_lm", args, root / "killed", checkpoints=killed_ckpt,
                       distribution=MICS)
    codes = w.wait(reference) + w.wait(resumed)
    return {"root": root, "corpus": corpus, "codes": codes, "interrupted": interrupted}


def _plant_unfinished_checkpoints(folder: Path) -> None:
    """A newer checkpoint still being written, and one whose COMPLETE marker never came."""
    newest = latest_checkpoint(folder)
    for name, marker in (("step-000007.tmp", True), ("step-000005", False)):
        shutil.copytree(newest, folder / name)
        for shard in (folder / name).glob("*.distcp"):
            shard.write_bytes(b"garbage: loading this must fail")
        if not marker:
            (folder / name / COMPLETE).unlink()


def test_killed_run_resumes_to_the_same_parameters(runs):
    assert runs["codes"] == [0] * 8, [w.read_log(runs["root"] / "killed", r) for r in range(4)]
    assert runs["interrupted"], "the run finished before it was killed; the test proved nothing"
    log = w.read_log(runs["root"] / "killed")
    resumed_at = int(re.search(r"resumed from .*step-(\d+) at step", log).group(1))
    assert resumed_at in range(INTERVAL, STEPS, INTERVAL)
    expected = w.final_weights(runs["root"] / "reference")
    actual = w.final_weights(runs["root"] / "killed")
    assert expected.keys() == actual.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=1e-6, msg=key)


def test_unfinished_checkpoints_are_never_loaded(runs):
    log = w.read_log(runs["root"] / "killed")
    assert "step-000005 " not in log and "step-000007" not in log
    assert "resumed from" in log


def test_losses_match_one_process_on_the_same_global_batch(runs, tmp_path, monkeypatch):
    from dtrain.runtime.recipes import causal_lm

    job = tmp_path / "single"
    for key, value in w.job_env(job, checkpoints=job / "ckpt",
                                distribution={"sharding_degree": 1}).items():
        monkeypatch.setenv(key, value)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    args = [*ARGS, "--data", str(runs["corpus"]), "--checkpoint_interval", "0"]
    args[args.index("--micro_batch_size") + 1] = "8"  # 4 ranks x 2
    assert causal_lm.main(args) == 0
    sharded = w.records(runs["root"] / "reference")
    single = w.records(job)
    assert sharded["loss"][-1] < sharded["loss"][0]
    assert single["loss"] == pytest.approx(sharded["loss"], rel=1e-4)
    # The clipped norm is the whole model's, not a shard's (DTensor-aware clipping).
    assert single["grad_norm"] == pytest.approx(sharded["grad_norm"], rel=1e-3)


def test_a_worker_killed_after_a_checkpoint_is_restarted_on_every_host_to_the_same_parameters(
        runs, tmp_path, live_processes):
    hyperparameters = {ARGS[i][2:]: ARGS[i + 1] for i in range(0, len(ARGS), 2)}
    del hyperparameters["checkpoint_interval"]  # the spec's checkpoint.interval_steps instead
    spec = JobSpec.from_dict({
        "name": "restart", "entry_point": "recipe:causal_lm", "output_path": str(tmp_path),
        "hyperparameters": {**hyperparameters, "data": str(runs["corpus"])},
        "checkpoint": {"interval_steps": INTERVAL},
        "compute": {"instance_type": "local", "instance_count": 2, "processes_per_instance": 2,
                    "max_run": 300, "max_restarts": 1},
        "distribution": {**MICS, "backend": "gloo"},
        "environment": {"OMP_NUM_THREADS": "1"}})  # as the reference's: the same float sums
    record = jobs.submit(spec, wait=False)
    job_dir = Path(record.target_data["job_dir"])
    try:
        w.wait_for(lambda: latest_checkpoint(job_dir / "checkpoints") is not None)
        w.worker_process(job_dir, rank=3).kill()
        final = jobs.wait_for(record.id, timeout_s=240)
    finally:
        jobs.stop(record.id, wait=True, timeout_s=60)  # a no-op once the job has ended
    assert (final.status, final.failure_reason) == ("Completed", None)
    logs = job_dir / "algo-1" / "output" / "logs"
    first, second = (logs / "rank-0.stdout.log").read_text(), \
        (logs / "rank-0.attempt-1.stdout.log").read_text()
    assert "resumed from" not in first and "step=1 " in first  # the first attempt's log is kept
    assert re.search(r"resumed from .*step-\d+ at step", second)
    assert (job_dir / "algo-2" / "output" / "logs" / "rank-3.attempt-1.stderr.log").exists()
    expected = w.final_weights(runs["root"] / "reference")
    actual = w.final_weights(job_dir / "algo-1")
    assert expected.keys() == actual.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=1e-6, msg=key)
    assert live_processes(str(job_dir)) == []
