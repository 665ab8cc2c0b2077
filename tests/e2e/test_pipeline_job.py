"""A pipelined job as a user runs it: ``dtrain submit`` of ``recipe:causal_lm`` with
``pipeline_parallel_degree: 2`` on 2 local hosts × 2 processes (a stage per host, each stage
MiCS-sharded over its host's 2 processes), end to end through the node agents."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from _cli import dtrain
from dtrain.core.metrics_format import parse_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_causal_lm_with_two_pipeline_stages_trains_on_two_hosts_by_two(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((REPO / "docs" / "architecture.md").read_text() * 4)
    spec = {
        "name": "pipeline-lm", "entry_point": "recipe:causal_lm",
        "hyperparameters": {"model": "gpt-neox-tiny", "data": "train", "steps": 12,
                            "micro_batch_size": 4, "seq_len": 64, "lr": 0.003,
                            "warmup_steps": 2, "log_interval": 4, "checkpoint_interval": 6},
        "inputs": {"train": str(corpus)},
        "compute": {"instance_count": 2, "processes_per_instance": 2, "max_run": 600},
        "distribution": {"pipeline_parallel_degree": 2, "sharding_degree": 2, "backend": "gloo"},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    plan = dtrain("plan", str(path)).stdout
    assert "pp 2 × dp_replicate 1 × dp_shard 2" in plan
    out = dtrain("submit", str(path)).stdout
    losses = [float(line.split("loss ")[1].split()[0]) for line in out.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0] - 1.0, out
    record = json.loads(dtrain("status", "pipeline-lm", "-o", "json").stdout)
    assert record["status"] == "Completed"
    job_dir = Path(record["target_data"]["job_dir"])
    model_dir = job_dir / "algo-1" / "model"  # gathered from both stages by rank 0
    assert (model_dir / "config.json").exists() and (model_dir / "model.safetensors").exists()
    assert any((job_dir / "checkpoints").glob("step-*/COMPLETE"))
    log = (job_dir / "algo-1" / "output" / "logs" / "rank-0.stdout.log").read_text()
    metrics = [m for m in map(parse_metrics, log.splitlines()) if m]
    assert metrics and all("pipeline_bubble" in m and "pp_rank1_compute_s" in m for m in metrics)
