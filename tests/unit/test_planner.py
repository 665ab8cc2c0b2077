"""Planner arithmetic against hand-computed figures (see dtrain/costmodel.py for the model)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dtrain.core import parallelism as partitioning
from dtrain.core.errors import SpecError
from dtrain.planning import costmodel
from dtrain.planning.planner import plan
from dtrain.spec.model import JobSpec

GB = 1e9
ROOT = Path(__file__).resolve().parents[2]


def p4d_job(nodes: int, degree, **hps) -> JobSpec:
    return JobSpec.from_dict({
        "entry_point": "recipe:causal_lm", "output_path": "s3://dtrain-test-bucket/out",
        "hyperparameters": {"seq_len": 2048, "micro_batch_size": 1, **hps},
        "compute": {"target": "ec2", "instance_type": "p4d.24xlarge", "instance_count": nodes},
        "distribution": {"sharding_degree": degree},
        "ec2": {"instance_profile": "dtrain-node", "subnet_id": "subnet-0123"},
    })


def by_name(result, strategy: str, hierarchical: bool = False):
    return next(s for s in result.strategies
                if s.strategy == strategy and s.hierarchical == hierarchical)


class TestSageMakerPublished13B:
    """GPT-NeoX 13B on 16 × p4d.24xlarge at sharding degree 64 (SageMaker's MiCS post)."""

    @pytest.fixture(scope="class")
    def result(self):
        return plan(p4d_job(16, 64, num_parameters=13e9, hidden_size=5120, num_layers=40,
                            vocab_size=50304))

    def test_mesh_and_layout(self, result):
        assert (result.world_size, result.replicate_degree, result.sharding_degree) == (128, 2, 64)
        assert result.group_within_node is False
        assert result.hierarchical_allgather is True  # backend auto, group spans 8 nodes
        assert result.backend == "nccl" and result.mixed_precision == "bf16"

    def test_model_state_memory_is_16_bytes_per_parameter_over_the_degree(self, result):
        # 13e9 × 16 B / 64 = 3.25e9 B
        assert result.memory.model_state_gib * 2**30 == pytest.approx(3.25e9)

    def test_flat_mics_traffic(self, result):
        # per micro-batch: 2 all-gathers of 2 B/param + reduce-scatter of 4 B/param, ring of 64
        # → 8Ψ·63/64 per GPU; a node's NIC carries it once, so a GPU's share is 1/8 of it.
        # boundary: all-reduce of the 4Ψ/64 shard between 2 replicas on 2 nodes → 4Ψ/64.
        mics = by_name(result, "MiCS")
        volume = 8 * 13e9 * 63 / 64
        assert mics.inter_bytes == pytest.approx(volume / 8 + 4 * 13e9 / 64)
        assert mics.intra_bytes == pytest.approx(volume * 7 / 8)

    def test_hierarchical_mics_traffic(self, result):
        # all-gather: inter stage moves 2Ψ·(8-1)/64, intra stage 2Ψ·(8-1)/8, twice per step;
        # reduce-scatter stays a flat ring.
        hier = by_name(result, "MiCS", hierarchical=True)
        psi = 13e9
        inter = 2 * (2 * psi * 7 / 64) + 4 * psi * 63 / 64 / 8 + 4 * psi / 64
        intra = 2 * (2 * psi * 7 / 8) + 4 * psi * 63 / 64 * 7 / 8
        assert hier.inter_bytes == pytest.approx(inter)
        assert hier.intra_bytes == pytest.approx(intra)
        assert hier.inter_bytes < by_name(result, "MiCS").inter_bytes

    def test_zero3_and_ddp_traffic(self, result):
        psi = 13e9
        zero3 = by_name(result, "ZeRO-3")
        assert zero3.inter_bytes == pytest.approx(8 * psi * 127 / 128 / 8)
        ddp = by_name(result, "DDP")
        assert ddp.inter_bytes == pytest.approx(2 * 4 * psi * 127 / 128 / 8)
        assert ddp.micro_comm.calls == 0  # DDP only syncs at the accumulation boundary

    def test_cost(self, result):
        assert result.cost_per_hour == pytest.approx(16 * 32.7726)
        assert result.max_run_cost == pytest.approx(16 * 32.7726 * 24)


def test_sagemaker_published_100b_on_32_p4d_at_degree_256():
    result = plan(p4d_job(32, 256, num_parameters=100e9, hidden_size=10240, num_layers=80,
                          vocab_size=50304))
    assert (result.world_size, result.replicate_degree) == (256, 1)
    assert result.memory.model_state_gib * 2**30 == pytest.approx(100e9 * 16 / 256)
    assert result.chosen.strategy == "ZeRO-3"
    assert result.chosen.boundary_comm.calls == 0  # one replica: nothing to all-reduce


def test_accumulation_multiplies_micro_traffic_but_not_the_replica_all_reduce():
    one = plan(p4d_job(2, 8, num_parameters=1e9, hidden_size=2048, num_layers=24,
                       vocab_size=50304)).chosen
    spec = p4d_job(2, 8, num_parameters=1e9, hidden_size=2048, num_layers=24, vocab_size=50304)
    spec.distribution.gradient_accumulation_steps = 4
    four = plan(spec).chosen
    assert four.micro_comm.inter_bytes == one.micro_comm.inter_bytes == 0  # group inside a node
    assert four.boundary_comm.inter_bytes == pytest.approx(one.boundary_comm.inter_bytes)
    assert four.intra_bytes == pytest.approx(4 * one.micro_comm.intra_bytes
                                             + one.boundary_comm.intra_bytes)


def test_compute_time_follows_6n_plus_attention_flops():
    work = costmodel.Workload(num_parameters=int(1e9), num_layers=24, hidden_size=2048,
                              seq_len=2048, micro_batch_size=1)
    cluster = costmodel.Cluster(num_nodes=1, gpus_per_node=8, tflops_per_gpu=312,
                                intra_gbytes_per_s=300, inter_gbits_per_s=400)
    flops = 2048 * (6e9 + 12 * 24 * 2048 * 2048)
    assert costmodel.compute_seconds(work, cluster) == pytest.approx(flops / (312e12 * 0.5))


def test_ring_collective_on_one_node_has_no_inter_node_bytes():
    cluster = costmodel.Cluster(num_nodes=1, gpus_per_node=8, tflops_per_gpu=1,
                                intra_gbytes_per_s=100, inter_gbits_per_s=100, latency_s=0)
    t = costmodel.ring(8 * GB, ranks=8, nodes=1, per_node=8, cluster=cluster)
    assert (t.intra_bytes, t.inter_bytes) == (7 * GB, 0)
    assert t.seconds == pytest.approx(7 / 100)


class TestAutoShardingDegree:
    def test_smallest_node_aligned_group_that_fits_with_headroom(self):
        # 40 GiB GPUs, 20 % headroom → 32 GiB budget; 10e9 params × 16 B = 160e9 B.
        choose = partitioning.choose_sharding_degree
        kw = {"world_size": 16, "gpus_per_node": 8, "device_memory_bytes": 40 * 2**30}
        assert choose(num_parameters=int(10e9), **kw) == 8  # 20e9 B at 8; 40e9 B at 4
        assert choose(num_parameters=int(3e9), **kw) == 2  # 24e9 B at 2 < 34.4e9 B
        assert choose(num_parameters=int(1e9), **kw) == 1
        # 20e9 params: 40e9 B at 8 > 34.4e9 B budget → two whole nodes, never 12 or 10
        assert choose(num_parameters=int(20e9), **kw) == 16

    def test_groups_never_split_a_node(self):
        assert partitioning.candidate_degrees(32, 8) == [1, 2, 4, 8, 16, 32]
        assert partitioning.candidate_degrees(24, 8) == [1, 2, 4, 8, 24]

    def test_model_that_never_fits_is_a_clear_error(self):
        with pytest.raises(ValueError, match="even fully sharded over 8 devices"):
            partitioning.choose_sharding_degree(num_parameters=int(100e9), world_size=8,
                                                gpus_per_node=8, device_memory_bytes=40 * 2**30)

    def test_planner_resolves_auto_with_activation_memory(self):
        result = plan(p4d_job(2, "auto", model="gpt-neox-13b"))
        # states alone would fit at 8 (24.4 GiB) but activations (9.95 GiB) push it to 16
        assert result.sharding_degree == 16
        assert result.memory.total_gib <= 40 * 0.8

    def test_auto_without_model_size_is_left_to_the_runtime(self):
        result = plan(JobSpec.from_dict({"entry_point": "recipe:causal_lm"}))
        assert result.sharding_degree is None
        assert result.runtime_distribution()["sharding_degree"] == "auto"
        assert any("resolved at run time" in n for n in result.notes)


def test_preset_sizes_match_published_parameter_counts():
    result = plan(p4d_job(1, 8, model="pythia-70m"))
    assert result.model.num_parameters == pytest.approx(70.4e6, rel=0.01)
    result = plan(p4d_job(1, 8, model="gpt-neox-20b"))
    assert result.model.num_parameters == pytest.approx(20.6e9, rel=0.01)


def test_price_override_is_used():
    spec = p4d_job(2, 8, model="pythia-70m")
    spec.compute.price_per_hour = 10.0
    assert plan(spec).cost_per_hour == 20.0


@pytest.mark.parametrize("overrides,said", [
    ({"pipeline_parallel_degree": 2},
     "distribution.pipeline_parallel_degree: gpt2 here ties its output layer"),
    ({"tensor_parallel_degree": 2, "hps": {"seq_len": 63}},
     "hyperparameters.seq_len: sequence parallelism splits each sequence over 2 ranks"),
    ({"tensor_parallel_degree": 4, "tensor_parallel_mode": "2d",
      "hps": {"micro_batch_size": 3}},
     "hyperparameters.micro_batch_size: 2-D tensor parallelism splits each micro-batch over 2"),
    ({"tensor_parallel_degree": 4, "tensor_parallel_mode": "2d",
      "hps": {"model": "gpt-j-tiny"}},
     "distribution.tensor_parallel_mode: 2d has plans for gpt_neox, gpt2, not gptj"),
], ids=["tied-head-pipelined", "sequence-split", "grid-batch", "2d-family"])
def test_the_plan_refuses_what_the_runtime_would_at_its_first_step(overrides, said):
    # before, `dtrain plan` printed a plan and the job failed on its paid instances
    hps = {"model": "gpt2-tiny", "seq_len": 64, "micro_batch_size": 2,
           **overrides.pop("hps", {})}
    spec = JobSpec.from_dict({
        "entry_point": "recipe:causal_lm", "hyperparameters": hps,
        "compute": {"instance_type": "local", "instance_count": 1, "processes_per_instance": 4},
        "distribution": {"sharding_degree": 1, **overrides}})
    with pytest.raises(SpecError) as caught:
        plan(spec)
    assert str(caught.value).startswith(said)


def test_a_recipe_is_planned_with_the_model_batch_and_length_the_recipe_uses():
    # what the recipe leaves out, it fills in (recipe_inputs.DEFAULTS): the plan sizes that job
    spec = JobSpec.from_dict({
        "entry_point": "recipe:causal_lm", "hyperparameters": {"steps": 10},
        "compute": {"target": "local", "instance_type": "local", "instance_count": 1}})
    shape = plan(spec).model
    assert (shape.source, shape.micro_batch_size, shape.seq_len) == ("gpt-neox-tiny", 8, 128)
    script = JobSpec.from_dict({**spec.to_dict(), "entry_point": "train.py",
                                "source_dir": str(ROOT / "examples" / "sagemaker_src")})
    assert plan(script).model is None  # a script's model is its own: nothing to size


def test_fp32_computes_at_the_gpus_fp32_peak_not_its_half_precision_one():
    # PyTorch runs fp32 matrix products without TF32 by default: an A100's 19.5, not 312
    half = plan(p4d_job(2, 8, model="pythia-1b"))
    spec = p4d_job(2, 8, model="pythia-1b").to_dict()
    spec["distribution"]["mixed_precision"] = "fp32"
    full = plan(JobSpec.from_dict(spec))
    assert (half.mixed_precision, full.mixed_precision) == ("bf16", "fp32")
    ratio = by_name(full, "MiCS").compute_s / by_name(half, "MiCS").compute_s
    assert ratio == pytest.approx(312 / 19.5)


def script_job(tmp_path, **hps) -> JobSpec:
    return JobSpec.from_dict({
        "entry_point": "train.py", "source_dir": str(ROOT / "examples" / "sagemaker_src"),
        "hyperparameters": hps,
        "compute": {"target": "local", "instance_type": "local", "instance_count": 1}})


def test_a_script_s_size_below_one_is_left_out_of_the_estimates_with_a_note(tmp_path):
    # seq_len -1 was planned as is: "seq -1", negative compute and tokens/s; a script's sentinel
    # is its own business (a recipe refuses it before the plan), the plan does not use it
    result = plan(script_job(tmp_path, model="gpt-neox-tiny", seq_len=-1, micro_batch_size=0))
    assert (result.model.seq_len, result.model.micro_batch_size) == (256, 1)
    assert all(s.step_s > 0 and s.tokens_per_s > 0 for s in result.strategies)
    assert "hyperparameters seq_len -1, micro_batch_size 0: not a size (below 1)" in \
        " ".join(result.notes)


def test_a_model_folder_without_a_readable_config_is_named_not_a_traceback(tmp_path,
                                                                             monkeypatch):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{")
    with pytest.raises(SpecError, match=r"hyperparameters.model: .*bad/config.json is not a "
                                        r"readable JSON model config \(Expecting"):
        plan(script_job(tmp_path, model=str(tmp_path / "bad")))
    with pytest.raises(SpecError, match=r"the folder .*empty has no config.json"):
        plan(script_job(tmp_path, model=str(tmp_path / "empty")))
    with pytest.raises(SpecError, match=r"unknown model preset 'nope'.*; or give a Hugging Face "
                                        r"model folder \(a relative folder is read from "):
        plan(script_job(tmp_path, model="nope"))
    # a folder that happens to bear a preset's name does not hide the preset
    (tmp_path / "gpt-neox-tiny").mkdir()
    monkeypatch.chdir(tmp_path)
    assert plan(script_job(tmp_path, model="gpt-neox-tiny")).model.source == "gpt-neox-tiny"


def test_local_cpu_workers_share_this_machine_s_cores(monkeypatch):
    # each local worker was estimated at a whole CPU's nominal rate: 4 workers on 2 cores were
    # predicted twice as fast as they could be
    spec = JobSpec.from_dict({"entry_point": "recipe:causal_lm",
                              "hyperparameters": {"data": "/data/corpus"},
                              "compute": {"instance_count": 2, "processes_per_instance": 2}})
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    alone = plan(spec).strategies[0].compute_s
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert plan(spec).strategies[0].compute_s == pytest.approx(2 * alone)


def test_a_model_sized_only_by_its_parameter_count_gets_a_preset_like_shape():
    # 6.9B parameters alone: about Pythia-6.9B's 4096 x 32, not 2 layers of 17856 (whose
    # unsharded layer was 10x too big and activations 3x too small)
    from dtrain.planning.model_shape import model_shape

    preset = model_shape({"model": "pythia-6.9b"})
    guessed = model_shape({"num_parameters": preset.num_parameters})
    assert 0.8 < guessed.hidden_size / preset.hidden_size < 1.2
    assert 0.8 < guessed.num_layers / preset.num_layers < 1.3
