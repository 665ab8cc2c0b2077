"""`dtrain plan` for pipeline parallelism: the partition (the one the runtime builds), each
stage's share, the predicted bubble and transfers, and `pipeline_parallel_degree: auto` choosing
``(pp, tp, shard)`` by memory fit first, then predicted throughput, saying why."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from dtrain.core.errors import SpecError
from dtrain.core.parallelism import ParallelismPlan, build_parallelism_plan
from dtrain.planning.planner import plan as make_plan
from dtrain.planning.report import render_plan
from dtrain.spec.model import JobSpec

ROOT = Path(__file__).resolve().parents[2]
# GPT-NeoX, 8 blocks, a 5376-token head worth about six blocks (tests/unit/test_pipeline_partition)
UNBALANCED = {"model": "gpt-neox-tiny", "num_layers": 8, "vocab_size": 5376, "seq_len": 64,
              "micro_batch_size": 4}


def planned(distribution: dict, *, hyperparameters: dict | None = None, script: bool = False,
            **compute):
    """A recipe's plan, or with ``script`` a training script's (whose model the plan knows
    only from ``hyperparameters``)."""
    entry = {"entry_point": "train.py", "source_dir": str(ROOT / "examples" / "sagemaker_src")} \
        if script else {"entry_point": "recipe:causal_lm"}
    spec = {**entry, "distribution": distribution,
            "hyperparameters": UNBALANCED if hyperparameters is None else hyperparameters,
            "compute": {"instance_count": 2, "processes_per_instance": 2, **compute}}
    if compute.get("target", "local") != "local":
        spec.update(output_path="s3://dtrain-bucket/out",
                    sagemaker={"role": "arn:aws:iam::111122223333:role/Training",
                               "region": "us-east-1"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_plan(JobSpec.from_dict(spec))


def test_plan_prints_the_partition_shares_bubble_and_transfers():
    result = planned({"pipeline_parallel_degree": 2, "sharding_degree": 2,
                      "pipeline_schedule": "1f1b"})
    assert result.pipeline.stages == ["embeddings + blocks 0-6", "block 7 + head"]
    assert result.pipeline.shares == pytest.approx([0.5, 0.5], abs=0.01)
    text = render_plan(result)
    assert "2 stages (1 per rank), 1f1b, 4 micro-batches per step; predicted bubble 20.0%" in text
    assert "auto: 0: embeddings + blocks 0-6 (50.0%); 1: block 7 + head (50.0%)" in text
    # 4 × 64 tokens × 64 wide in fp32 cross each cut, per micro-batch, between the two hosts
    assert "(0.07 MB per micro-batch and cut, across nodes)" in text
    assert result.chosen in result.strategies and result.chosen.pipeline == 2
    data = result.to_dict()["pipeline"]
    assert data["stage_units"] == result.pipeline.stages and data["across_nodes"] is True
    assert data["bytes_sent_per_step_per_rank"] == 4 * 4 * 64 * 64 * 4  # 4 micro-batches, 1 cut


def test_a_uniform_partition_is_predicted_as_it_runs():
    settings = {"pipeline_parallel_degree": 2, "sharding_degree": 1, "pipeline_schedule": "1f1b"}
    result = planned({**settings, "partition": "uniform"})
    assert result.pipeline.stages == ["embeddings + blocks 0-3", "blocks 4-7 + head"]
    assert max(result.pipeline.shares) > 0.7  # the head's stage is the slow one
    assert planned(settings).chosen.step_s < result.chosen.step_s


def test_without_a_model_shape_the_partition_is_measured_at_run_time():
    text = render_plan(planned({"pipeline_parallel_degree": 2, "sharding_degree": 1},
                               hyperparameters={}, script=True))
    assert "partition                    auto: measured at run time" in text


BIG = {"model": "gpt-neox-20b", "seq_len": 2048, "micro_batch_size": 1}


def test_auto_picks_a_layout_that_fits_and_says_why():
    result = planned({"pipeline_parallel_degree": "auto", "tensor_parallel_degree": "auto"},
                     hyperparameters=BIG, target="sagemaker", instance_type="ml.p4d.24xlarge",
                     instance_count=4, processes_per_instance=None)
    chosen = result.parallelism
    usable = 40 * 0.8
    assert result.memory.total_gib <= usable
    weighed = result.layout_choice.candidates
    assert weighed[0].plan == chosen and weighed[0].fits
    fitting = [c for c in weighed if c.fits]
    assert all(c.step.tokens_per_s <= weighed[0].step.tokens_per_s for c in fitting)
    assert any(not c.fits for c in weighed)  # ZeRO-3 alone on 32 GPUs does not hold 20B
    text = render_plan(result)
    assert f"fastest predicted is pp {chosen.pp} × tp {chosen.tp} × shard {chosen.dp_shard}" in text
    assert "layouts weighed by pipeline_parallel_degree auto" in text
    # what the runtime receives: the chosen degrees, which rebuild the same plan
    runtime = result.runtime_distribution()
    assert (runtime["pipeline_parallel_degree"], runtime["tensor_parallel_degree"],
            runtime["sharding_degree"]) == (chosen.pp, chosen.tp, chosen.dp_shard)
    rebuilt = build_parallelism_plan(runtime, world_size=32, devices_per_node=8,
                                     num_blocks=44)
    assert rebuilt == chosen and ParallelismPlan.from_dict(runtime["parallelism"]) == chosen


def test_auto_without_sizes_plans_no_pipeline_and_says_so():
    result = planned({"pipeline_parallel_degree": "auto", "microbatches": 8,
                      "sharding_degree": 1}, hyperparameters={})
    assert result.parallelism.pp == 1
    assert any("pipeline_parallel_degree auto: needs the model's size" in n for n in result.notes)
    runtime = result.runtime_distribution()
    assert runtime["pipeline_parallel_degree"] == 1 and runtime["microbatches"] == "auto"


def test_auto_refuses_with_the_fix_when_nothing_fits():
    with pytest.raises(SpecError, match=r"distribution.pipeline_parallel_degree: auto: no "
                                        r"pipeline × tensor × sharding layout fits"):
        planned({"pipeline_parallel_degree": "auto"},
                hyperparameters={"model": "gpt-neox-100b", "seq_len": 2048},
                target="sagemaker", instance_type="ml.g5.12xlarge", instance_count=1,
                processes_per_instance=None)


def test_more_stages_than_the_model_s_blocks_are_refused_by_the_plan():
    with pytest.raises(SpecError, match=r"= 4 stages, but the model has 2 blocks"):
        planned({"pipeline_parallel_degree": 2, "pipeline_schedule": "interleaved-1f1b",
                 "sharding_degree": 1}, hyperparameters={"model": "gpt-neox-tiny"})


def test_a_pipeline_rows_intra_node_bytes_include_tensor_parallel_traffic():
    # as without a pipeline: tp_bytes is the tensor-parallel share of intra_bytes (the column
    # showed 0.00 GB beside a plan line of GBs of tensor-parallel traffic)
    result = planned({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2,
                      "sharding_degree": 1, "pipeline_schedule": "1f1b"})
    [row] = [s for s in result.strategies if s.pipeline == 2]
    assert row.tp_bytes > 0 and row.intra_bytes >= row.tp_bytes


def test_auto_weighs_each_layout_with_the_collectives_its_plan_runs():
    # 13B on 2 × p4d: the chosen pp 1 plan shards over both nodes with the hierarchical
    # all-gather; its candidate was weighed with the flat one (2.03 s against the 1.73 s of the
    # row marked chosen), so a pipeline could win on a misprediction
    result = planned({"pipeline_parallel_degree": "auto"},
                     hyperparameters={"model": "gpt-neox-13b", "seq_len": 2048,
                                      "micro_batch_size": 1},
                     target="sagemaker", instance_type="ml.p4d.24xlarge", instance_count=2,
                     processes_per_instance=None)
    chosen = result.parallelism
    assert (chosen.pp, chosen.hierarchical_allgather) == (1, True)
    best = result.layout_choice.candidates[0]
    assert best.plan == chosen
    assert best.step.step_s == pytest.approx(result.chosen.step_s)
    assert (best.step.hierarchical, best.step.gradient_sync) == (True, chosen.gradient_sync)


def test_a_pipeline_with_the_hierarchical_all_gather_has_its_row():
    # partition groups of two whole nodes: each stage's FSDP2 units gather hierarchically
    result = planned({"pipeline_parallel_degree": 2, "sharding_degree": 16,
                      "pipeline_schedule": "1f1b"},
                     hyperparameters={"model": "gpt-neox-1.3b", "seq_len": 2048,
                                      "micro_batch_size": 1},
                     target="sagemaker", instance_type="ml.p4d.24xlarge", instance_count=4,
                     processes_per_instance=None)
    assert result.parallelism.hierarchical_allgather
    row = result.chosen
    assert row is not None and row.pipeline == 2 and row.hierarchical
    flat = planned({"pipeline_parallel_degree": 2, "sharding_degree": 16,
                    "pipeline_schedule": "1f1b", "hierarchical_allgather": False},
                   hyperparameters={"model": "gpt-neox-1.3b", "seq_len": 2048,
                                    "micro_batch_size": 1},
                   target="sagemaker", instance_type="ml.p4d.24xlarge", instance_count=4,
                   processes_per_instance=None).chosen
    # the hierarchical gather sends each parameter across the nodes once, not per rank
    assert row.inter_bytes < flat.inter_bytes
    assert "PP 2 × ZeRO-3 hier. *" in render_plan(result)  # the row marked as this job


def test_a_plan_that_overflows_the_device_names_only_the_fixes_it_allows():
    # pipeline stages of 20B sharded over every rank of their stage: "raise sharding_degree"
    # cannot help (it was the advice), more stages, tensor parallelism or checkpointing can
    result = planned({"pipeline_parallel_degree": 2}, hyperparameters=BIG, target="sagemaker",
                     instance_type="ml.p4d.24xlarge", instance_count=4,
                     processes_per_instance=None)
    assert result.parallelism.dp_shard == result.parallelism.dp_degree
    [note] = [n for n in result.notes if "exceeds its 40 GiB" in n]
    assert note.endswith("; set tensor_parallel_degree (or auto), raise pipeline_parallel_degree, "
                         "enable activation_checkpointing or use more or larger instances")
    result = planned({"sharding_degree": 2, "tensor_parallel_degree": 2}, hyperparameters=BIG,
                     target="sagemaker", instance_type="ml.p4d.24xlarge", instance_count=4,
                     processes_per_instance=None)
    [note] = [n for n in result.notes if "exceeds its 40 GiB" in n]
    assert note.endswith("; raise sharding_degree, raise tensor_parallel_degree, set "
                         "pipeline_parallel_degree (or auto), enable activation_checkpointing or "
                         "use more or larger instances")


@pytest.mark.parametrize("setting", ["sharding_degree", "pipeline_parallel_degree"])
def test_a_model_that_fits_no_layout_is_not_told_to_enable_what_is_on(setting):
    # "enable distribution.activation_checkpointing" was advised with it on, and tensor
    # parallelism (off) was never named
    with pytest.raises(SpecError) as info:
        planned({setting: "auto", "activation_checkpointing": True}, hyperparameters=BIG,
                target="sagemaker", instance_type="ml.p4d.24xlarge", instance_count=1,
                processes_per_instance=None)
    message = str(info.value)
    assert "activation_checkpointing" not in message, message
    assert message.endswith("set tensor_parallel_degree (or auto) or use more or larger instances"
                            if setting == "pipeline_parallel_degree" else
                            "set tensor_parallel_degree (or auto), set pipeline_parallel_degree "
                            "(or auto) or use more or larger instances"), message
