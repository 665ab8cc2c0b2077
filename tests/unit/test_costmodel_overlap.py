"""What the cost model lets overlap, per strategy: exposed communication and memory that fits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from dtrain.planning import costmodel
from dtrain.planning.planner import plan
from dtrain.planning.report import render_plan
from dtrain.spec.model import JobSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def p4d_50b(degree: int = 128) -> JobSpec:
    return JobSpec.from_dict({
        "entry_point": "recipe:causal_lm", "output_path": "s3://dtrain-test-bucket/out",
        "hyperparameters": {"model": "gpt-neox-50b", "seq_len": 2048, "micro_batch_size": 1},
        "compute": {"target": "ec2", "instance_type": "p4d.24xlarge", "instance_count": 32},
        "distribution": {"sharding_degree": degree, "activation_checkpointing": True},
        "ec2": {"instance_profile": "dtrain-node", "subnet_id": "subnet-0123"},
    })


def named(result, label: str) -> costmodel.StepEstimate:
    return next(s for s in result.strategies if s.label == label)


class TestFiftyBillionOn32P4d:
    """SMP v1.13's published setting: GPT-NeoX 50B, 32 × p4d.24xlarge, sharding degree 128."""

    @pytest.fixture(scope="class")
    def result(self):
        return plan(p4d_50b())

    def test_ddp_is_marked_as_not_fitting_instead_of_given_a_step_time(self, result):
        ddp = named(result, "DDP")
        assert not ddp.fits and ddp.step_s is None and ddp.tokens_per_s is None
        assert ddp.memory_gib > ddp.device_gib == 40  # 50e9 × 16 B of states alone is ~745 GiB
        assert result.strategies[-1].fits is False  # ranked after every strategy that runs
        assert all(s.fits for s in result.strategies if s.strategy != "DDP")

    def test_mics_and_zero3_differ_by_what_prefetch_cannot_hide(self, result):
        mics, zero3 = named(result, "MiCS"), named(result, "ZeRO-3")
        assert mics.compute_s == zero3.compute_s  # same model, same tokens per GPU
        assert zero3.exposed.total_s > mics.exposed.total_s > 0
        assert zero3.step_s > mics.step_s
        for est in (mics, zero3):
            assert est.step_s == pytest.approx(est.compute_s + est.exposed.total_s)

    def test_the_all_gather_is_not_hidden_at_this_scale(self, result):
        # SMP measured 102 -> 143 TFLOP/s per GPU from a faster all-gather alone: the plan must
        # show an exposed all-gather, a sizeable part of the step
        chosen = result.chosen
        assert chosen.exposed.all_gather_s > 0.1 * chosen.step_s

    def test_strategies_are_ranked_fastest_first(self, result):
        running = [s.tokens_per_s for s in result.strategies if s.fits]
        assert running == sorted(running, reverse=True)

    def test_the_plan_shows_exposed_communication_and_the_misfit(self, result):
        text = render_plan(result)
        assert "exposed comm" in text and "(all-gather)" in text
        assert "does not fit: 7" in text  # DDP's ~7xx GiB against the 40 GiB device


def test_the_sagemaker_example_no_longer_gives_every_strategy_the_same_step():
    result = plan(JobSpec.from_file(EXAMPLES / "sagemaker-p4d.yaml"))
    steps = {s.label: s.step_s for s in result.strategies}
    assert len(set(steps.values())) > 2, steps
    assert steps["ZeRO-3"] > steps["MiCS"]


def cpu_cluster(**kw) -> costmodel.Cluster:
    return costmodel.Cluster(num_nodes=2, gpus_per_node=2, tflops_per_gpu=1.0,
                             intra_gbytes_per_s=0.25, inter_gbits_per_s=0.16, latency_s=0.0,
                             efficiency=1.0, backend="gloo", **kw)


WORK = costmodel.Workload(num_parameters=int(33.6e6), num_layers=8, hidden_size=512,
                          seq_len=64, micro_batch_size=1, compute_bytes=4)


def test_on_gloo_fsdp2_s_collectives_are_all_exposed():
    est = costmodel.estimate_step(WORK, cpu_cluster(), sharding_degree=2)
    micro, boundary = est.micro_comm.seconds, est.boundary_comm.seconds
    assert est.exposed.total_s == pytest.approx(micro + boundary)
    assert est.exposed.all_reduce_s == pytest.approx(boundary)


def test_the_overlapped_sync_hides_the_replica_all_reduce_behind_backward():
    fsdp = costmodel.estimate_step(WORK, cpu_cluster(), sharding_degree=2)
    over = costmodel.estimate_step(WORK, cpu_cluster(), sharding_degree=2,
                                   gradient_sync="overlapped")
    assert over.gradient_sync == "overlapped" and over.label == "MiCS overlapped"
    assert over.inter_bytes == fsdp.inter_bytes  # same bytes, other timing
    assert over.exposed.all_gather_s == fsdp.exposed.all_gather_s
    assert over.exposed.all_reduce_s < fsdp.exposed.all_reduce_s
    # the link is busy from the first unit's hand-over to the last buffer: what is left after
    # backward ends is exposed, at least one unit's share
    units = WORK.num_layers + 1
    unit_ar = fsdp.boundary_comm.seconds / units
    gather = fsdp.exposed.all_gather_s / (2 * units)  # forward and backward, all exposed
    reduce = fsdp.exposed.reduce_scatter_s / units
    slot = 2 * costmodel.compute_seconds(WORK, cpu_cluster()) / 3 / units + gather + reduce
    expected = max(unit_ar, slot + units * unit_ar - units * slot)
    assert over.exposed.all_reduce_s == pytest.approx(expected)


def test_with_one_replica_there_is_nothing_to_overlap():
    est = costmodel.estimate_step(WORK, cpu_cluster(), sharding_degree=4,
                                  gradient_sync="overlapped")
    assert est.gradient_sync == "fsdp" and est.exposed.all_reduce_s == 0


def test_with_streams_a_unit_hides_what_fits_in_its_compute():
    # 4 units; per unit: forward 1 s, backward 2 s; gather 0.5 s, reduce 0.5 s, all-reduce 2 s
    out = costmodel.step_timeline(3.0, 0.5, 0.5, 2.0, units=4, overlapped=True,
                                  background=False)
    assert out.all_gather_s == pytest.approx(0.5 + 3 * 1 * 0.5 / 3)  # first gather + share
    assert out.reduce_scatter_s == pytest.approx(3 * 1 * 0.5 / 3 + 0.5)
    assert out.all_reduce_s == pytest.approx(3 * 1 * 2 / 3 + 2)
    # the same all-reduce in the background: the link drains 4 × 2 s from the end of the first
    # unit's backward (2 s), backward ends at 8 s: 2 s exposed
    back = costmodel.step_timeline(3.0, 0.5, 0.5, 2.0, units=4, overlapped=True,
                                   background=True)
    assert back.all_reduce_s == pytest.approx(2.0)
    assert back.all_gather_s == pytest.approx(0.5) and back.reduce_scatter_s == 0.5


def test_accumulation_pays_the_replica_all_reduce_once():
    one = costmodel.estimate_step(WORK, cpu_cluster(), sharding_degree=2)
    four = costmodel.estimate_step(WORK, cpu_cluster(), sharding_degree=2, accumulation=4)
    assert four.exposed.all_reduce_s == pytest.approx(one.exposed.all_reduce_s)
    assert four.exposed.all_gather_s == pytest.approx(4 * one.exposed.all_gather_s)


@pytest.mark.parametrize(("ranks", "nodes", "factor", "all_to_all"), [
    (2, 1, 1.0, True),  # inside a node: a ring's bytes, where gloo's moves an all-reduce's
    (4, 2, 4 / 3, True),  # 2 hosts × 2 (ZeRO-3 in the benchmark): a node sends 1 × S, not 1.5
    (16, 2, 2.0, False),  # 2 nodes × 8: the all-to-all would move 64/15 of a ring: keep gloo's
    (8, 8, 1.0, True),  # one rank per node: every chunk crosses once, as in a ring
    (1, 1, 1.0, False),  # nothing to reduce
])
def test_on_gloo_a_partition_group_reduce_scatters_with_the_cheaper_of_two(ranks, nodes, factor,
                                                                           all_to_all):
    from dtrain.core.collective_choices import (
        gloo_reduce_scatter_by_all_to_all,
        gloo_reduce_scatter_factor,
    )

    assert gloo_reduce_scatter_factor(ranks, nodes) == pytest.approx(factor)
    assert gloo_reduce_scatter_by_all_to_all(ranks, nodes) is all_to_all
    gloo = cpu_cluster()
    assert costmodel.reduce_scatter_factor_of(gloo, ranks=ranks, nodes=nodes) == \
        pytest.approx(factor)
    nccl = dataclasses.replace(gloo, backend="nccl")
    assert costmodel.reduce_scatter_factor_of(nccl, ranks=ranks, nodes=nodes) == 1.0


@pytest.mark.parametrize(("nodes", "per_node", "degree"), [
    (2, 2, 2), (2, 2, 4), (2, 8, 16), (3, 8, 12), (3, 4, 6), (4, 2, 8), (2, 4, 4),
])
def test_the_runtime_reduce_scatters_as_the_cost_model_counts(nodes, per_node, degree):
    """The runtime's choice for a plan's partition groups, and the bytes the cost model gives
    the same group on gloo, come from one layout and one rule (uneven groups included)."""
    from dtrain.core.collective_choices import group_layout
    from dtrain.core.parallelism import build_parallelism_plan
    from dtrain.runtime.distributed.collectives import gloo_reduce_scatter

    plan = build_parallelism_plan({"sharding_degree": degree}, world_size=nodes * per_node,
                                  devices_per_node=per_node)
    cluster = dataclasses.replace(cpu_cluster(), num_nodes=nodes, gpus_per_node=per_node)
    spanned, _ = group_layout(degree, stride=1, gpus_per_node=per_node)
    factor = costmodel.reduce_scatter_factor_of(cluster, ranks=degree, nodes=spanned)
    assert (gloo_reduce_scatter(plan) is not None) == (factor < 2)
    est = costmodel.estimate_step(WORK, cluster, sharding_degree=degree)
    units = WORK.num_layers + 1
    shape = {"ranks": degree, "nodes": spanned, "per_node": degree // spanned, "cluster": cluster}
    ring = costmodel.ring(WORK.num_parameters * costmodel.GRAD_REDUCE_BYTES / units, **shape)
    gather = costmodel.ring(WORK.num_parameters * WORK.compute_bytes / units, **shape)
    # a step's partition-group bytes: 2 all-gathers and the reduce-scatter, per unit
    assert est.micro_comm.intra_bytes + est.micro_comm.inter_bytes == pytest.approx(
        units * (2 * (gather.intra_bytes + gather.inter_bytes)
                 + factor * (ring.intra_bytes + ring.inter_bytes)))
