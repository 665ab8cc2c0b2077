"""distribution.gradient_sync: the parallelism plan decides fsdp or overlapped, once."""

from __future__ import annotations

import pytest
from dtrain.core.parallelism import ParallelismError, ParallelismPlan, build_parallelism_plan


def _plan(world=16, per_node=8, **distribution):
    return build_parallelism_plan(distribution, world_size=world, devices_per_node=per_node)


def test_auto_overlaps_where_the_replica_all_reduce_crosses_nodes():
    # MiCS 8 on 2 nodes: the two replicas of every shard sit on different nodes
    plan = _plan(sharding_degree=8)
    assert plan.replica_group(3) == [3, 11] and plan.replica_group_spans_nodes
    assert plan.gradient_sync == "overlapped"
    # DDP on 2 nodes: one all-reduce over every rank, across the nodes
    assert _plan(sharding_degree=1).gradient_sync == "overlapped"


def test_auto_keeps_fsdp_where_replicas_share_a_node_or_the_backend_is_stock_nccl():
    plan = _plan(world=8, sharding_degree=4)  # two replicas inside one node
    assert plan.replica_group(1) == [1, 5] and not plan.replica_group_spans_nodes
    assert plan.gradient_sync == "fsdp"
    assert _plan(sharding_degree=8, backend="nccl").gradient_sync == "fsdp"
    assert _plan(sharding_degree=8, gradient_sync="fsdp").gradient_sync == "fsdp"


def test_one_replica_has_no_all_reduce_to_overlap_whatever_is_asked():
    assert _plan(sharding_degree=16, gradient_sync="overlapped").gradient_sync == "fsdp"
    assert _plan(sharding_degree="full").gradient_sync == "fsdp"


def test_overlapped_is_honoured_inside_a_node_too():
    assert _plan(world=8, sharding_degree=4, gradient_sync="overlapped").gradient_sync == \
        "overlapped"


@pytest.mark.parametrize("distribution, message", [
    ({"gradient_sync": "overlapped", "backend": "nccl"},
     "overlapped needs dtrain's background communicator, but backend 'nccl'"),
    ({"gradient_sync": "async"}, "'async': use auto, fsdp or overlapped"),
])
def test_settings_that_cannot_apply_name_the_field_and_the_fix(distribution, message):
    with pytest.raises(ParallelismError, match=r"^distribution\.gradient_sync: ") as info:
        _plan(sharding_degree=8, **distribution)
    assert message in str(info.value)


def test_replica_groups_follow_the_mesh_with_tensor_parallelism():
    plan = _plan(sharding_degree=4, tensor_parallel_degree=2)  # 2 replicas × 4 shards × tp 2
    assert plan.replica_group(5) == [5, 13]
    assert {tuple(plan.replica_group(r)) for r in range(16)} == {
        (r, r + 8) for r in range(8)}


def test_the_decision_travels_with_the_plan_and_older_plans_read_as_fsdp():
    plan = _plan(sharding_degree=8)
    assert ParallelismPlan.from_dict(plan.to_dict()) == plan
    older = {k: v for k, v in plan.to_dict().items() if k != "gradient_sync"}
    assert ParallelismPlan.from_dict(older).gradient_sync == "fsdp"


def test_pipeline_stages_keep_fsdp_s_sync_and_refuse_the_overlapped_one():
    # 2 stages × 4 replicas × shard 4 on 4 nodes of 8: replicas exist, yet auto stays fsdp
    plan = _plan(world=32, pipeline_parallel_degree=2, sharding_degree=4)
    assert plan.pp == 2 and plan.dp_replicate == 4 and plan.replica_group_spans_nodes
    assert plan.gradient_sync == "fsdp"
    with pytest.raises(ParallelismError, match=r"^distribution\.gradient_sync: overlapped is "
                                               r"not combined with pipeline parallelism"):
        _plan(world=32, pipeline_parallel_degree=2, sharding_degree=4,
              gradient_sync="overlapped")
