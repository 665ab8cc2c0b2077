"""The parallelism plan (dtrain.core.parallelism): one function owns every degree and decision."""

from __future__ import annotations

import pytest
from dtrain.core.parallelism import ParallelismError, ParallelismPlan, build_parallelism_plan
from dtrain.core.tensor_parallel import ModelDims


def _plan(world=24, per_node=8, **distribution):
    return build_parallelism_plan(distribution, world_size=world, devices_per_node=per_node)


def test_three_p4d_nodes_at_degree_12_plan_a_flat_all_gather_under_auto():
    # 12 ranks span 1.5 nodes: the two-stage all-gather needs whole nodes, so auto is off
    plan = _plan(sharding_degree=12)
    assert (plan.dp_replicate, plan.dp_shard, plan.shard_group_spans_nodes) == (2, 12, True)
    assert plan.hierarchical_allgather is False


def test_hierarchical_true_on_a_group_of_one_and_a_half_nodes_is_refused_naming_the_field():
    with pytest.raises(ParallelismError, match=r"^distribution\.hierarchical_allgather: true "
                       r"needs partition groups of whole nodes.*use sharding_degree 8, 24"):
        _plan(sharding_degree=12, hierarchical_allgather=True)


def test_auto_turns_the_hierarchical_all_gather_on_for_whole_node_groups_with_backend_auto():
    assert _plan(32, sharding_degree=16).hierarchical_allgather is True
    assert _plan(32, sharding_degree=16, backend="nccl").hierarchical_allgather is False
    assert _plan(32, sharding_degree=16, backend="gloo").hierarchical_allgather is False
    assert _plan(32, sharding_degree=8).hierarchical_allgather is False  # inside a node


def test_auto_degree_is_deferred_without_a_model_and_resolved_the_same_way_with_one():
    assert _plan(sharding_degree="auto") is None
    # 7B parameters * 16 bytes = 112 GB: two 40 GiB devices are not enough (32 GiB usable
    # each), four are; the smallest node-aligned group that fits, and on the same rule the
    # all-gather decision
    plan = build_parallelism_plan({"sharding_degree": "auto"}, world_size=24,
                                  devices_per_node=8, num_parameters=int(7e9),
                                  device_memory_bytes=40 * 2**30)
    assert plan.dp_shard == 4 and plan.hierarchical_allgather is False
    plan = build_parallelism_plan({"sharding_degree": "auto"}, world_size=16,
                                  devices_per_node=8, num_parameters=int(20e9),
                                  device_memory_bytes=40 * 2**30)
    assert plan.dp_shard == 16 and plan.hierarchical_allgather is True


@pytest.mark.parametrize("degree, message", [
    (0, "got 0; use 1 for plain data parallel"),
    (5, "5 does not divide the world size 24; use one of 1, 2, 3, 4, 6, 8, 12, 24"),
    (48, "48 exceeds the world size 24"),
])
def test_degrees_that_make_no_plan_name_the_field_and_the_fix(degree, message):
    with pytest.raises(ParallelismError, match=r"^distribution\.sharding_degree: ") as info:
        _plan(sharding_degree=degree)
    assert message in str(info.value)


def test_full_is_zero3_and_one_is_ddp():
    assert _plan(sharding_degree="full").strategy == "ZeRO-3"
    assert _plan(sharding_degree=1).strategy == "DDP"
    assert _plan(sharding_degree=4).strategy == "MiCS"


def test_mesh_axes_outermost_first_and_a_rank_s_coordinates():
    plan = build_parallelism_plan({"sharding_degree": 2, "tensor_parallel_degree": 2,
                                   "pipeline_parallel_degree": 2},
                                  world_size=16, devices_per_node=4)
    assert plan.mesh_axis_names == ("pp", "dp_replicate", "dp_shard", "tp")
    assert plan.mesh_shape == (2, 2, 2, 2)
    assert plan.coordinates(13) == {"pp": 1, "dp_replicate": 1, "dp_shard": 0, "tp": 1}
    assert plan.dp_rank(13) == 2
    assert plan.shard_group(13) == [13, 15]


def test_tensor_parallel_groups_stay_inside_a_node():
    with pytest.raises(ParallelismError, match=r"^distribution\.tensor_parallel_degree: 3"):
        build_parallelism_plan({"tensor_parallel_degree": 3}, world_size=8, devices_per_node=4)


def test_a_plan_travels_as_a_dict_and_comes_back_equal():
    plan = _plan(32, sharding_degree=16)
    assert ParallelismPlan.from_dict(plan.to_dict()) == plan


# ------------------------------------------------------------------------ tensor parallelism

NEOX_TINY = ModelDims(num_heads=4, hidden_size=64, intermediate_size=256, vocab_size=512)


def test_two_d_tensor_parallelism_splits_the_tp_axis_into_a_grid_keeping_rank_order():
    plan = build_parallelism_plan({"sharding_degree": 2, "tensor_parallel_degree": 4,
                                   "tensor_parallel_mode": "2d"}, world_size=16,
                                  devices_per_node=8)
    assert plan.mesh_shape == (1, 2, 2, 2, 2)
    assert plan.mesh_axis_names == ("pp", "dp_replicate", "dp_shard", "tp_row", "tp_col")
    assert plan.tp_grid == 2 and plan.sequence_parallel is False
    assert plan.coordinates(13) == {"pp": 0, "dp_replicate": 1, "dp_shard": 1, "tp": 1}
    assert plan.tp_group(13) == [12, 13, 14, 15] and plan.dp_rank(13) == 3
    assert ParallelismPlan.from_dict(plan.to_dict()) == plan


def test_sequence_parallelism_is_on_by_default_with_one_d_tensor_parallelism_only():
    def sp(**dist):
        return _plan(8, 8, sharding_degree=1, **dist).sequence_parallel

    assert sp(tensor_parallel_degree=2) is True
    assert sp(tensor_parallel_degree=2, sequence_parallel=False) is False
    assert sp() is False
    assert sp(tensor_parallel_degree=4, tensor_parallel_mode="2d") is False


@pytest.mark.parametrize("distribution, message", [
    ({"tensor_parallel_degree": 4, "tensor_parallel_mode": "2d", "sequence_parallel": True},
     r"^distribution\.sequence_parallel: true applies to tensor_parallel_mode 1d"),
    ({"sequence_parallel": True},
     r"^distribution\.sequence_parallel: true needs tensor_parallel_degree above 1"),
    ({"tensor_parallel_degree": 8, "tensor_parallel_mode": "2d"},
     (r"^distribution\.tensor_parallel_mode: 2d needs a square tensor_parallel_degree .* use 4, "
      r"or tensor_parallel_mode 1d")),  # the one square that fits a node of 8
    ({"tensor_parallel_mode": "3d"}, r"^distribution\.tensor_parallel_mode: '3d': use 1d"),
])
def test_tensor_parallel_settings_that_cannot_apply_name_the_field_and_the_fix(distribution,
                                                                               message):
    with pytest.raises(ParallelismError, match=message):
        _plan(16, 8, sharding_degree=1, **distribution)


def test_degrees_that_do_not_split_the_model_are_refused_with_the_ones_that_do():
    dims = ModelDims(num_heads=6, hidden_size=96, intermediate_size=384, vocab_size=512)
    with pytest.raises(ParallelismError, match=r"^distribution\.tensor_parallel_degree: 4 does "
                       r"not divide the model's 6 attention heads .*; use one of 1, 2$"):
        build_parallelism_plan({"tensor_parallel_degree": 4}, world_size=8, devices_per_node=8,
                               model_dims=dims)
    odd_vocab = ModelDims(num_heads=4, hidden_size=64, intermediate_size=256, vocab_size=50257)
    with pytest.raises(ParallelismError, match=r"vocabulary of 50257 .* pad vocab_size to 50432 "
                       r"in the model config"):
        build_parallelism_plan({"tensor_parallel_degree": 2}, world_size=8, devices_per_node=8,
                               model_dims=odd_vocab)
    # 2-D splits each dimension q = 2 ways: 6 heads are fine on a 2 x 2 grid
    plan = build_parallelism_plan({"sharding_degree": 2, "tensor_parallel_degree": 4,
                                   "tensor_parallel_mode": "2d"},
                                  world_size=8, devices_per_node=8, model_dims=dims)
    assert plan.tp_grid == 2


def test_auto_tensor_parallelism_is_one_when_mics_alone_fits_and_grows_when_it_does_not():
    common = {"world_size": 8, "devices_per_node": 8, "num_parameters": int(1e9),
              "device_memory_bytes": 40 * 2**30, "model_dims": NEOX_TINY}
    auto = {"sharding_degree": "auto", "tensor_parallel_degree": "auto"}
    assert build_parallelism_plan(auto, **common).tp == 1
    # activations of 62 GiB at tp 1 shrink as 1/tp: 31 GiB at 2 leaves 1 GiB of the 32 GiB
    # usable, less than the states need even fully sharded (1.9 GiB); 15.5 GiB at 4 fits
    plan = build_parallelism_plan(auto, **common,
                                  other_bytes_per_device=lambda tp: 62 * 2**30 / tp)
    assert (plan.tp, plan.sequence_parallel) == (4, True)
    assert build_parallelism_plan(auto, world_size=8, devices_per_node=8) is None
    with pytest.raises(ParallelismError, match=r"^distribution\.tensor_parallel_degree: auto: "
                       r"not even tensor parallel 4 fits the model: .* more or larger instances"):
        build_parallelism_plan(auto, **common, other_bytes_per_device=1e15)


def test_a_plan_written_before_tensor_parallel_modes_reads_as_one_d():
    old = {k: v for k, v in _plan(sharding_degree=8).to_dict().items()
           if k not in ("tp_mode", "sequence_parallel")}
    assert ParallelismPlan.from_dict(old) == _plan(sharding_degree=8)
