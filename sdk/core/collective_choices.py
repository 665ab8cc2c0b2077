"""The collectives a parallelism plan chooses (stdlib only): the hierarchical all-gather and the
gradient sync. :func:`dtrain.core.parallelism.build_parallelism_plan` calls these once per plan;
nothing else decides them. And, on gloo, how a partition group reduce-scatters
(:func:`gloo_reduce_scatter_factor`), which the runtime and the cost model both read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dtrain.core.errors import ParallelismError
from dtrain.core.sizing import divisors, short_list

if TYPE_CHECKING:
    from dtrain.core.parallelism import ParallelismPlan

# What ``distribution.gradient_sync`` resolves to in a plan (``auto`` is decided here).
GRADIENT_SYNCS = ("fsdp", "overlapped")


def hierarchical_setting(distribution: Mapping[str, Any]) -> tuple[Any, str]:
    setting = distribution.get("hierarchical_allgather", "auto")
    backend = distribution.get("backend", "auto")
    field = "distribution.hierarchical_allgather"
    if setting not in ("auto", True, False):
        raise ParallelismError(field, f"{setting!r}: use auto, true or false")
    if setting is True and backend == "nccl":
        raise ParallelismError(
            field, "true needs dtrain's collectives, but backend 'nccl' means stock NCCL "
            "collectives only; set distribution.backend to 'auto' or drop the flag")
    return setting, backend


def hierarchical(plan: ParallelismPlan, setting: Any, backend: str) -> bool:
    """MiCS's two-stage all-gather: only where a partition group spans whole nodes.

    ``auto`` turns it on there with backend ``auto`` (``nccl``/``gloo`` ask for stock
    collectives); ``true`` asks for it wherever a group spans nodes, so a group that spans
    nodes without being made of whole nodes is refused here, before any machine starts.
    """
    field = "distribution.hierarchical_allgather"
    if setting is False or not plan.shard_group_spans_nodes:
        return False
    if not plan.shard_group_whole_nodes:
        if setting is True:
            per_node = plan.devices_per_node // plan.tp
            whole = [d for d in divisors(plan.dp_degree) if d % per_node == 0]
            raise ParallelismError(
                field, f"true needs partition groups of whole nodes, but sharding_degree "
                f"{plan.dp_shard} is not a multiple of the {per_node} data-parallel ranks per "
                f"node; use sharding_degree {short_list(whole)}, or hierarchical_allgather "
                "auto")
        return False
    return setting is True or backend == "auto"


def gradient_sync(plan: ParallelismPlan, setting: Any, backend: str) -> str:
    """How the replicas all-reduce gradients: ``overlapped`` (SDP-style background
    communicator) or ``fsdp`` (FSDP2's all-reduce per block inside backward).

    ``auto`` overlaps where the all-reduce crosses nodes, the traffic it hides, with backend
    ``auto`` or ``gloo`` (``nccl`` asks for stock collectives). With one replica there is no
    all-reduce, so any setting resolves to ``fsdp``. Pipeline stages keep FSDP2's own sync:
    their schedule runs backward micro-batch by micro-batch, outside the accumulation steps the
    background communicator follows.
    """
    field = "distribution.gradient_sync"
    if setting not in ("auto", *GRADIENT_SYNCS):
        raise ParallelismError(field, f"{setting!r}: use auto, fsdp or overlapped")
    if setting == "overlapped" and backend == "nccl":
        raise ParallelismError(
            field, "overlapped needs dtrain's background communicator, but backend 'nccl' "
            "means stock NCCL collectives only; set distribution.backend to 'auto' or use "
            "gradient_sync fsdp")
    if setting == "overlapped" and plan.pp > 1 and plan.dp_replicate > 1:
        raise ParallelismError(
            field, "overlapped is not combined with pipeline parallelism (its schedule runs "
            "backward outside the accumulation steps the background communicator follows); use "
            "gradient_sync fsdp or auto")
    if plan.dp_replicate == 1 or plan.pp > 1:
        return "fsdp"
    if setting == "auto":
        return "overlapped" if plan.replica_group_spans_nodes and backend != "nccl" else "fsdp"
    return setting


def group_layout(size: int, *, stride: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes spanned, members per node) of a group of ``size`` ranks ``stride`` apart, as the
    cost model and the runtime's choice of reduce-scatter both count them."""
    span = size * stride
    if span <= gpus_per_node:
        return 1, size
    per_node = max(1, gpus_per_node // stride)
    return max(1, size // per_node), per_node


def gloo_reduce_scatter_factor(ranks: int, nodes: int) -> float:
    """On gloo, the bytes a partition group's reduce-scatter puts on its busiest link, over a
    ring's; dtrain takes the cheaper of gloo's and its own all-to-all reduce-scatter.

    gloo's ``reduce_scatter_tensor`` runs as an all-reduce (measured): twice a ring's bytes. The
    all-to-all reduce-scatter sends every rank its chunk and sums what it receives: a ring's
    bytes inside a node; across ``k`` nodes of ``L = ranks / k`` ranks a node sends
    ``L·(ranks-L)/ranks`` of the data where a ring sends ``(ranks-1)/ranks``. 1 = a ring's
    bytes; 2 = gloo's own (kept where the all-to-all would move more). ``nodes`` comes from
    :func:`group_layout`.
    """
    if ranks <= 1 or nodes <= 1:
        return 1.0
    per_node = ranks / nodes
    return min(2.0, per_node * (ranks - per_node) / (ranks - 1))


def gloo_reduce_scatter_by_all_to_all(ranks: int, nodes: int) -> bool:
    """Whether dtrain's all-to-all reduce-scatter replaces gloo's for such a group."""
    return ranks > 1 and gloo_reduce_scatter_factor(ranks, nodes) < 2.0
