"""Pipeline parallelism in the spec and the parallelism plan (no torch): the settings' rules and
their one-line errors, where stages live, the predicted bubble, and the partitioner's choices."""

from __future__ import annotations

import json

import pytest
from dtrain.core import pipeline as ppl
from dtrain.core.errors import SpecError
from dtrain.core.parallelism import ParallelismError, ParallelismPlan, build_parallelism_plan
from dtrain.spec.model import JobSpec


def local_spec(distribution: dict, *, hosts: int = 2, per_host: int = 2) -> JobSpec:
    return JobSpec(entry_point="recipe:causal_lm", distribution=distribution,
                   compute={"instance_count": hosts, "processes_per_instance": per_host})


def problem(distribution: dict, **kw) -> str:
    with pytest.raises(SpecError) as info:
        local_spec(distribution, **kw)
    message = str(info.value)
    assert "\n" not in message, "one line"
    return message


def plan(distribution: dict, *, world: int = 4, per_node: int = 2, **kw) -> ParallelismPlan:
    return build_parallelism_plan({"sharding_degree": 1, **distribution}, world_size=world,
                                  devices_per_node=per_node, **kw)


class TestSettings:
    def test_microbatches_must_cover_the_pipeline_for_1f1b(self):
        msg = problem({"pipeline_parallel_degree": 2, "microbatches": 1,
                       "pipeline_schedule": "1f1b"})
        assert msg.startswith("distribution.microbatches: 1: 1f1b needs at least as many")
        assert "use microbatches >= 2, or pipeline_schedule gpipe" in msg

    def test_interleaved_schedules_need_whole_rounds_of_microbatches(self):
        msg = problem({"pipeline_parallel_degree": 2, "microbatches": 5,
                       "pipeline_schedule": "interleaved-1f1b"})
        assert msg.startswith("distribution.microbatches: 5: interleaved-1f1b")
        assert "use one of 1, 2, 3, 4, 6, 8" in msg

    @pytest.mark.parametrize(("schedule", "per_rank", "expected"), [
        ("gpipe", 2, "gpipe runs one stage per rank"),
        ("zbv", 3, "zbv runs exactly 2 stages per rank"),
        ("interleaved-zero-bubble", 1, "interleaves several stages per rank"),
    ])
    def test_stages_per_rank_must_fit_the_schedule(self, schedule, per_rank, expected):
        msg = problem({"pipeline_parallel_degree": 2, "pipeline_schedule": schedule,
                       "stages_per_rank": per_rank})
        assert msg.startswith("distribution.stages_per_rank:") and expected in msg

    def test_a_stage_may_not_straddle_nodes_so_only_transfers_cross_them(self):
        msg = problem({"pipeline_parallel_degree": 3}, hosts=2, per_host=3)
        assert msg.startswith("distribution.pipeline_parallel_degree: 3 stages of 2 ranks "
                              "straddle nodes of 3")
        assert "use one of 1, 2, 6" in msg
        local_spec({"pipeline_parallel_degree": 2}, hosts=2, per_host=3)  # a node per stage

    def test_a_degree_that_does_not_divide_the_world_is_said_so(self):
        # it was "3 stages of 5 ranks straddle nodes of 8" for 16 ranks: 5 from 16 // 3
        msg = problem({"pipeline_parallel_degree": 3}, hosts=2, per_host=2)
        assert msg == ("distribution.pipeline_parallel_degree: 3 does not divide the world size "
                       "4 into stages of equal ranks: use one of 1, 2, 4")

    def test_pipeline_settings_without_a_pipeline_are_refused(self):
        msg = problem({"microbatches": 4})
        assert msg == ("distribution.microbatches: 4 applies to pipeline parallelism; set "
                       "pipeline_parallel_degree above 1 or remove it")

    def test_an_explicit_partition_lists_one_start_per_later_stage(self):
        msg = problem({"pipeline_parallel_degree": 2, "partition": [1, 2]})
        assert msg.endswith("gives 3 stages but the pipeline has 2; list 1 block index")
        with pytest.raises(ParallelismError, match=r"must rise strictly, from 1 to 3"):
            plan({"pipeline_parallel_degree": 2, "partition": [4]}, num_blocks=4)

    def test_more_stages_than_blocks_are_refused_once_the_blocks_are_known(self):
        with pytest.raises(ParallelismError, match=r"^distribution.pipeline_parallel_degree: 2 "
                           r"ranks × 2 stages per rank = 4 stages, but the model has 2 blocks"):
            plan({"pipeline_parallel_degree": 2, "pipeline_schedule": "interleaved-1f1b"},
                 num_blocks=2)


class TestPlan:
    def test_pp_is_the_outermost_axis_of_the_mesh(self):
        p = plan({"pipeline_parallel_degree": 2, "sharding_degree": 2})
        assert p.mesh_shape == (2, 1, 2, 1) and p.num_stages == 2
        assert [p.coordinates(r)["pp"] for r in range(4)] == [0, 0, 1, 1]
        assert (p.pipeline_schedule, p.microbatches, p.stages_per_rank) == ("1f1b", 4, 1)

    def test_the_plan_travels_as_json_and_comes_back_equal(self):
        p = plan({"pipeline_parallel_degree": 2, "partition": [2, 4, 6]}, num_blocks=8)
        data = json.loads(json.dumps(p.to_dict()))
        assert data["partition"] == [2, 4, 6]
        # a partition listing four stages is two per rank: interleaved, zero-bubble unsharded
        assert (data["pipeline_schedule"], data["stages_per_rank"]) == (
            "interleaved-zero-bubble", 2)
        assert ParallelismPlan.from_dict(data) == p

    def test_auto_interleaves_when_the_blocks_allow_and_zero_bubble_only_without_resharding(
            self):
        assert plan({"pipeline_parallel_degree": 2}).pipeline_schedule == "1f1b"  # blocks unknown
        assert plan({"pipeline_parallel_degree": 2}, num_blocks=8).pipeline_schedule == \
            "interleaved-zero-bubble"
        sharded = plan({"pipeline_parallel_degree": 2, "sharding_degree": 2}, num_blocks=8)
        assert (sharded.pipeline_schedule, sharded.stages_per_rank) == ("interleaved-1f1b", 2)
        assert plan({"pipeline_parallel_degree": 2, "microbatches": 1}).pipeline_schedule == \
            "gpipe"

    def test_stages_sit_in_a_loop_or_in_a_v(self):
        loop = plan({"pipeline_parallel_degree": 2, "pipeline_schedule": "interleaved-1f1b"})
        assert [loop.stage_indices(r) for r in (0, 2)] == [(0, 2), (1, 3)]
        v = plan({"pipeline_parallel_degree": 2, "pipeline_schedule": "zbv"})
        assert [v.stage_indices(r) for r in (0, 2)] == [(0, 3), (1, 2)]
        assert [ppl.stage_rank(s, pp=2, schedule="zbv") for s in range(4)] == [0, 1, 1, 0]

    def test_without_a_pipeline_the_plan_is_as_before(self):
        p = plan({})
        assert (p.pp, p.pipeline_schedule, p.bubble_fraction, p.stage_indices(3)) == (
            1, "none", 0.0, (0,))


def test_the_bubble_shrinks_with_microbatches_interleaving_and_zero_bubble():
    def bubble(schedule, m, v=1):
        return ppl.bubble_fraction(schedule, pp=4, microbatches=m, stages_per_rank=v)

    assert bubble("gpipe", 4) == bubble("1f1b", 4) == pytest.approx(3 / 7)
    assert bubble("1f1b", 16) == pytest.approx(3 / 19)
    assert bubble("interleaved-1f1b", 16, 2) == pytest.approx(3 / 35)
    assert bubble("interleaved-zero-bubble", 16, 2) == pytest.approx(3 / 99)


def units(flops: list[int], *, params: list[int] | None = None,
          out: list[int] | None = None) -> list[ppl.UnitCost]:
    params = params or [1] * len(flops)
    out = out or [1] * len(flops)
    return [ppl.UnitCost(f"u{i}", f, p, o) for i, (f, p, o) in enumerate(zip(flops, params, out))]


class TestPartition:
    def test_uniform_splits_the_blocks_evenly_with_embeddings_first_and_head_last(self):
        part = ppl.uniform_partition(8, 2)
        assert part.starts == (0, 5)
        assert [part.describe(k) for k in (0, 1)] == ["embeddings + blocks 0-3",
                                                      "blocks 4-7 + head"]
        assert ppl.uniform_partition(5, 3).starts == (0, 3, 5)
        assert ppl.explicit_partition([6], 8).describe(1) == "blocks 6-7 + head"

    def test_auto_balances_a_heavy_head_by_moving_blocks_forward(self):
        costs = units([0] + [1] * 8 + [6])  # embeddings, 8 blocks, a head worth 6 blocks
        part = ppl.balanced_partition(costs, 2)
        assert part.stage_flops(costs) == [7, 7]
        assert part.describe(1) == "block 7 + head"
        assert max(ppl.uniform_partition(8, 2).stage_flops(costs)) == 10

    def test_ties_go_to_the_cut_with_the_smaller_tensor(self):
        # cutting before or after the FLOP-free unit 1 balances alike; the smaller tensor wins
        assert ppl.balanced_partition(units([2, 0, 2], out=[8, 1, 8]), 2).starts == (0, 2)
        assert ppl.balanced_partition(units([2, 0, 2], out=[1, 8, 8]), 2).starts == (0, 1)

    def test_stages_must_fit_in_memory_even_if_slower(self):
        costs = units([1, 1, 1, 1], params=[10, 1, 1, 1])
        assert ppl.balanced_partition(costs, 2).starts == (0, 2)
        fitted = ppl.balanced_partition(costs, 2, bytes_per_parameter=1.0, budget_bytes=10)
        assert fitted.starts == (0, 1)
        with pytest.raises(ValueError, match=r"no cut into 2 stages fits .* raise "
                                             r"pipeline_parallel_degree"):
            ppl.balanced_partition(costs, 2, bytes_per_parameter=1.0, budget_bytes=5)

    def test_predicted_costs_count_what_the_flop_counter_counts(self):
        config = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 512,
                  "intermediate_size": 256, "tie_word_embeddings": False}
        costs = ppl.transformer_unit_costs(config, seq_len=16, micro_batch_size=2)
        tokens = 32
        block = 3 * (2 * tokens * (4 * 64 * 64 + 2 * 64 * 256) + 4 * 2 * 16 * 16 * 64)
        assert [c.flops for c in costs] == [0, block, block, 3 * 2 * tokens * 64 * 512]
        assert costs[0].output_bytes == tokens * 64 * 2


def test_stages_per_rank_given_with_the_schedule_left_automatic_interleave_without_the_model():
    # a hand-run script's init() plans before it has the model; two stages a rank asked for by
    # number is an interleaved schedule, not 1f1b refusing them
    chosen = plan({"pipeline_parallel_degree": 2, "stages_per_rank": 2})
    assert (chosen.pipeline_schedule, chosen.stages_per_rank) == ("interleaved-zero-bubble", 2)
    # stages_per_rank auto without the model: no block count to interleave on
    assert plan({"pipeline_parallel_degree": 2}).pipeline_schedule == "1f1b"
    # with a model too small for them, the error says so (it blamed a 1f1b never asked for)
    with pytest.raises(ParallelismError, match=r"2 ranks × 2 stages per rank = 4 stages, but "
                                                r"the model has 2 blocks"):
        plan({"pipeline_parallel_degree": 2, "stages_per_rank": 2}, num_blocks=2)
