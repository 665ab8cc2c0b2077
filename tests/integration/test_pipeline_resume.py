"""Checkpoint and resume of a pipelined job on 4 real gloo workers (2 hosts × 2: a pipeline stage
per host, each MiCS-sharded over its 2 ranks), through the causal_lm recipe and the Trainer.

A run SIGKILLed after a checkpoint and restarted ends with the same parameters as an
uninterrupted run (within 1e-6): each stage's ranks write their shards of one DCP checkpoint
under the whole model's parameter names, and the final Hugging Face export gathers every stage.

    pytest tests/integration/test_pipeline_resume.py -q
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import _workers as w
import pytest
import torch
from dtrain.core.checkpoint_layout import COMPLETE
from dtrain.runtime.train.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow

STEPS, INTERVAL = 6, 2
ARGS = ["--model", "gpt-neox-tiny", "--steps", str(STEPS), "--micro_batch_size", "2",
        "--seq_len", "32", "--lr", "3e-3", "--warmup_steps", "2", "--log_interval", "1",
        "--checkpoint_interval", str(INTERVAL), "--seed", "7"]
PIPELINE = {"pipeline_parallel_degree": 2, "sharding_degree": 2, "microbatches": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline-resume")
    corpus = root / "corpus.txt"
    corpus.write_text(Path(__file__).read_text() * 6)
    args = [*ARGS, "--data", str(corpus)]
    reference = w.launch("causal_lm", args, root / "reference",
                         checkpoints=root / "reference" / "ckpt", distribution=PIPELINE)
    killed_ckpt = root / "killed" / "ckpt"
    killed = w.launch("causal_lm", args, root / "killed", checkpoints=killed_ckpt,
                      distribution=PIPELINE)
    try:
        w.wait_for(lambda: latest_checkpoint(killed_ckpt) is not None, procs=killed,
                   timeout=400)
    finally:
        w.kill(killed)  # SIGKILL: no handler runs, no final model
    interrupted = not (root / "killed" / "model" / "model.safetensors").exists()
    resumed = w.launch("causal_lm", args, root / "killed", checkpoints=killed_ckpt,
                       distribution=PIPELINE)
    codes = w.wait(reference, timeout=400) + w.wait(resumed, timeout=400)
    return {"root": root, "codes": codes, "interrupted": interrupted}


def test_a_killed_pipelined_run_resumes_to_the_same_parameters(runs):
    assert runs["codes"] == [0] * 8, [w.read_log(runs["root"] / "killed", r) for r in range(4)]
    assert runs["interrupted"], "the run finished before it was killed; the test proved nothing"
    log = w.read_log(runs["root"] / "killed")
    resumed_at = int(re.search(r"resumed from .*step-(\d+) at step", log).group(1))
    assert resumed_at in range(INTERVAL, STEPS, INTERVAL)
    expected = w.final_weights(runs["root"] / "reference")
    actual = w.final_weights(runs["root"] / "killed")
    assert expected.keys() == actual.keys()
    assert "gpt_neox.embed_in.weight" in actual and "lm_head.weight" in actual  # both stages
    # the checkpoint names the family's parameter layout, not the pipeline's class
    record = json.loads((latest_checkpoint(runs["root"] / "killed" / "ckpt") / COMPLETE)
                        .read_text())
    assert record["state_layout"] == {"model": "gpt_neox", "version": 1}
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=1e-6, msg=key)


def test_the_pipelined_run_reports_the_loss_the_bubble_and_each_stage_s_time(runs):
    records = w.records(runs["root"] / "reference")
    assert records["loss"][-1] < records["loss"][0]
    assert all(0 < b < 1 for b in records["pipeline_bubble"])
    assert all(t > 0 for t in records["pp_rank0_compute_s"] + records["pp_rank1_compute_s"])
    # stage 0 on host 0 sends activations to stage 1 on host 1
    assert all(b > 0 for b in records["comm_pp_bytes_per_step"])
