"""The planner with tensor parallelism: memory per layout, tensor-parallel bytes, auto, refusals."""

from __future__ import annotations

import pytest
from dtrain.core.errors import SpecError
from dtrain.planning import costmodel
from dtrain.planning.memory import Layout, activation_tensors_per_layer
from dtrain.planning.planner import plan
from dtrain.planning.report import render_plan
from dtrain.spec.model import JobSpec

GIB = 2**30


def job(distribution: dict, *, nodes: int = 2, **hps) -> JobSpec:
    return JobSpec.from_dict({
        "entry_point": "recipe:causal_lm", "output_path": "s3://dtrain-test-bucket/out",
        "hyperparameters": {"model": "gpt-neox-20b", "seq_len": 2048, "micro_batch_size": 1,
                            **hps},
        "compute": {"target": "ec2", "instance_type": "p4d.24xlarge", "instance_count": nodes},
        "distribution": distribution,
        "ec2": {"instance_profile": "dtrain-node", "subnet_id": "subnet-0123"},
    })


def test_model_states_and_the_unsharded_layer_divide_by_tp_times_shard():
    mics = plan(job({"sharding_degree": 8})).memory
    tp = plan(job({"sharding_degree": 4, "tensor_parallel_degree": 2})).memory
    # 20.55e9 parameters x 16 bytes over 8 ranks either way (8 shards, or 2 x 4)
    assert tp.model_state_gib == pytest.approx(mics.model_state_gib, rel=1e-6)
    assert tp.model_state_gib == pytest.approx(20_554_567_680 * 16 / 8 / GIB, rel=1e-3)
    assert tp.unsharded_layers_gib == pytest.approx(mics.unsharded_layers_gib / 2)


@pytest.mark.parametrize("layout, tensors", [
    (Layout(1), 12), (Layout(4, "1d"), 4 + 8 / 4), (Layout(4, "1d", True), 2 + 10 / 4),
    (Layout(4, "2d"), 12 / 4),
])
def test_activations_per_layer_shrink_per_layout(layout, tensors):
    assert activation_tensors_per_layer(layout) == pytest.approx(tensors)


def test_two_d_keeps_half_the_layer_activations_of_one_d_without_sequence_parallelism_at_4():
    assert activation_tensors_per_layer(Layout(4, "2d")) == \
        activation_tensors_per_layer(Layout(4, "1d")) / 2


def test_plan_memory_follows_the_layout():
    def activations(micro_batch_size=1, **dist):
        return plan(job({"sharding_degree": 4, **dist},
                        micro_batch_size=micro_batch_size)).memory.activation_gib

    # h 6144, 2048 tokens, bf16, 44 layers; logits 2048 x 50432 x (2 + 4) bytes split over tp
    layer = 6144 * 2048 * 2 * 44 / GIB
    logits = 2048 * 50432 * 6 / GIB
    assert activations(tensor_parallel_degree=4, sequence_parallel=False) == \
        pytest.approx(6 * layer + logits / 4)
    assert activations(tensor_parallel_degree=4) == pytest.approx(4.5 * layer + logits / 4)
    # a 2 x 2 grid splits each micro-batch over its rows: 2 sequences, twice the tokens
    assert activations(tensor_parallel_degree=4, tensor_parallel_mode="2d",
                       micro_batch_size=2) == pytest.approx(2 * (3 * layer + logits / 4))


def test_one_d_tensor_parallel_bytes_are_four_all_reduces_per_layer_plus_two():
    work = costmodel.Workload(num_parameters=int(1e9), num_layers=24, hidden_size=2048,
                              seq_len=2048, micro_batch_size=1, vocab_size=50304)
    cluster = costmodel.Cluster(num_nodes=1, gpus_per_node=8, tflops_per_gpu=312,
                                intra_gbytes_per_s=300, inter_gbits_per_s=400, latency_s=0)
    traffic = costmodel.tensor_parallel_traffic(work, cluster, tp=4)
    one_all_reduce = 2 * 3 / 4 * 2048 * 2048 * 2  # ring: 2(t-1)/t of b*s*h*bytes
    assert traffic.intra_bytes == pytest.approx((4 * 24 + 2) * one_all_reduce)
    assert traffic.inter_bytes == 0


def test_two_d_tensor_parallel_bytes_are_summa_broadcasts_and_reduces():
    work = costmodel.Workload(num_parameters=int(1e9), num_layers=1, hidden_size=1024,
                              seq_len=1024, micro_batch_size=1, vocab_size=4096)
    cluster = costmodel.Cluster(num_nodes=1, gpus_per_node=8, tflops_per_gpu=312,
                                intra_gbytes_per_s=300, inter_gbits_per_s=400, latency_s=0)
    h, t = 1024, 1024
    linears = [(h, 3 * h), (h, h), (h, 4 * h), (4 * h, h), (h, 4096)]
    expected = sum(3 * 1 * (t * i + i * o) / 4 * 2 for i, o in linears)  # q = 2
    assert costmodel.tensor_parallel_traffic(work, cluster, tp=4, mode="2d").intra_bytes == \
        pytest.approx(expected)


def test_auto_picks_tensor_parallelism_when_mics_alone_does_not_fit_and_says_why():
    result = plan(job({"sharding_degree": "auto", "tensor_parallel_degree": "auto"},
                      nodes=4, micro_batch_size=2))
    assert (result.parallelism.tp, result.parallelism.sequence_parallel) == (2, True)
    assert result.memory.total_gib <= 40 * 0.8
    text = render_plan(result)
    assert "tensor parallel              1-D (Megatron) over 2 with sequence parallelism " \
           "(auto: MiCS alone needs 37.2 GiB per device even fully sharded" in text
    assert "tensor-parallel traffic" in text
    summary = result.to_dict()["tensor_parallel"]
    assert summary["degree"] == 2 and summary["bytes_per_step_per_device"] > 0


def test_auto_keeps_tensor_parallelism_off_when_mics_alone_fits():
    result = plan(job({"sharding_degree": "auto", "tensor_parallel_degree": "auto"},
                      model="pythia-1b"))
    assert result.parallelism.tp == 1
    assert result.tensor_parallel_reason.startswith("auto: MiCS alone fits")


def test_a_degree_that_does_not_split_the_heads_is_refused_by_validation():
    with pytest.raises(SpecError, match=r"^distribution\.tensor_parallel_degree: 8 does not "
                       r"divide the model's 4 attention heads .*use one of 1, 2, 4$"):
        plan(job({"sharding_degree": 1, "tensor_parallel_degree": 8}, model="gpt-neox-tiny",
                 seq_len=256))


def test_tensor_parallel_compute_is_split_and_step_estimates_include_its_traffic():
    one = plan(job({"sharding_degree": 8})).chosen
    two = plan(job({"sharding_degree": 4, "tensor_parallel_degree": 2})).chosen
    assert two.tensor_parallel == 2 and two.tp_bytes > 0 and one.tp_bytes == 0
    assert two.compute_s < one.compute_s  # half the FLOPs per device, plus its collectives
