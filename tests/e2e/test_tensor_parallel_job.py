"""The causal-LM recipe as a local 2 x 2 job with tensor parallelism, end to end through the CLI:
`tp 2` inside each simulated host, MiCS over the two hosts' data-parallel ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cli import dtrain

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_recipe_trains_at_tp_2_by_shard_2_with_falling_loss_and_exports_the_model():
    spec = str(REPO / "examples/local-cpu.yaml")
    settings = ["--set", "distribution.tensor_parallel_degree=2",
                "--set", "hyperparameters.steps=20", "--set", "hyperparameters.log_interval=5"]
    plan = json.loads(dtrain("plan", spec, *settings, "-o", "json").stdout)
    assert plan["parallelism"]["mesh_shape"] == [1, 1, 2, 2]
    assert plan["tensor_parallel"]["layout"] == "1-D (Megatron) over 2 with sequence parallelism"
    dtrain("submit", spec, *settings)
    record = json.loads(dtrain("status", "local-cpu-lm", "-o", "json").stdout)
    assert record["status"] == "Completed"
    job_dir = Path(record["target_data"]["job_dir"])
    rows = [json.loads(line) for line in
            (job_dir / "algo-1/output/data/metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows]
    assert len(losses) == 4 and losses[-1] < losses[0] - 1.0
    # a tensor-parallel group trains on one batch: each token counted once, by replica too
    assert all(row["tokens_per_s_per_replica"] == pytest.approx(row["tokens_per_s"] / 2)
               for row in rows)
    assert all(row["comm_tp_bytes_per_step"] > 0 for row in rows)

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(job_dir / "algo-1/model")
    assert model.config.model_type == "gpt_neox"
