"""dtrain's own collectives for FSDP2: MiCS's hierarchical all-gather (``set_custom_all_gather``)
and, on gloo, an all-to-all reduce-scatter (``set_custom_reduce_scatter``, last section).

When a partition group spans ``k`` nodes with ``L`` ranks on each (group rank ``r = n*L + l``
for node ``n`` and local position ``l``), a flat ring all-gather pushes ``k·(N-1)/N`` of the data
across nodes on every crossing link. MiCS gathers in two hops instead:

1. inter-node: the ``k`` ranks of the group that share local position ``l`` all-gather their
   shards (only ``(k-1)/k`` of a ``k``-rank gather crosses nodes, and it runs on ``L`` parallel
   links);
2. intra-node: the ``L`` ranks of my node all-gather those stage-1 buffers over fast links.

Stage 2's buffer is ordered ``[l][n]``; FSDP2 expects ``[n*L + l]``, so a transposing copy
writes the output. It only moves bytes, so the result is bit-identical to the flat all-gather.

Why the FSDP2 hook works on gloo/CPU in torch 2.13: ``foreach_all_gather`` calls the custom
``AllGather`` with the flat output buffer (whose own-rank slice is the input) and the shard
group; ``wait_for_unshard`` treats a ``None`` work as already complete. Two dependent
collectives cannot be returned as one ``Work``, so this implementation runs both stages
synchronously and returns ``None`` (on CPU nothing overlaps anyway; with NCCL, ``backend: auto``
still uses it, and the stages run on FSDP2's all-gather stream it is called under).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from dtrain.core.collective_choices import gloo_reduce_scatter_by_all_to_all, group_layout
from dtrain.runtime import torch_private
from dtrain.runtime.distributed import comm_stats

if TYPE_CHECKING:
    from dtrain.core.parallelism import ParallelismPlan


@dataclass(frozen=True)
class HierarchyGroups:
    """The two stage groups of this rank's partition group (ranks sorted, node-contiguous)."""

    inter: dist.ProcessGroup  # same local position, one rank per node of the partition group
    intra: dist.ProcessGroup  # this node's ranks of the partition group
    nodes_per_group: int  # k
    ranks_per_node: int  # L


def build_hierarchy_groups(plan: ParallelismPlan, *, rank: int) -> HierarchyGroups:
    """Create the stage groups of every partition group (collective: all ranks must call).

    Needs partition groups made of whole nodes (``plan.hierarchical_allgather`` is only set
    then). A group's members are node-contiguous: ``members[n*L:(n+1)*L]`` are on its n-th node.
    """
    assert plan.shard_group_whole_nodes, plan
    per_node = plan.devices_per_node // plan.tp
    k = plan.dp_shard // per_node
    groups = sorted({tuple(plan.shard_group(r)) for r in range(plan.world_size)})
    mine_inter = mine_intra = None
    # new_group is collective over the world, so every rank creates every group in one order.
    for members in groups:
        for local in range(per_node):
            ranks = [members[n * per_node + local] for n in range(k)]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine_inter = group
        for n in range(k):
            ranks = list(members[n * per_node:(n + 1) * per_node])
            group = dist.new_group(ranks)
            if rank in ranks:
                mine_intra = group
    assert mine_inter is not None and mine_intra is not None
    return HierarchyGroups(mine_inter, mine_intra, k, per_node)


class HierarchicalAllGather(torch_private.fsdp_all_gather_base()):
    """FSDP2 ``AllGather``: inter-node stage, then intra-node stage; same bytes as flat."""

    def __init__(self, groups: HierarchyGroups) -> None:
        self.groups = groups

    def allocate(
        self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        k, per_node = self.groups.nodes_per_group, self.groups.ranks_per_node
        if group.size() != k * per_node:
            raise ValueError(
                f"hierarchical all-gather built for partition groups of {k * per_node} ranks "
                f"was called on a group of {group.size()}; build it for this mesh"
            )
        hierarchical_all_gather(output_tensor, input_tensor, self.groups)


def hierarchical_all_gather(
    output: torch.Tensor, shard: torch.Tensor, groups: HierarchyGroups
) -> torch.Tensor:
    """All-gather ``shard`` into ``output`` (flat layout, group-rank order) in two hops."""
    k, per_node = groups.nodes_per_group, groups.ranks_per_node
    numel = shard.numel()
    assert output.numel() == numel * k * per_node
    shard = shard.contiguous()
    across_nodes = torch.empty(k * numel, dtype=shard.dtype, device=shard.device)
    dist.all_gather_single(across_nodes, shard.view(-1), group=groups.inter)
    on_node = torch.empty(per_node * k * numel, dtype=shard.dtype, device=shard.device)
    dist.all_gather_single(on_node, across_nodes, group=groups.intra)
    # on_node is [l][n][chunk]; the flat all-gather's layout is [n][l][chunk].
    output.view(k, per_node, numel).copy_(on_node.view(per_node, k, numel).transpose(0, 1))
    return output


# ---------------------------------------------------------------- reduce-scatter on gloo


class AllToAllReduceScatter(torch_private.fsdp_reduce_scatter_base()):
    """FSDP2 ``ReduceScatter`` for gloo: every rank sends each peer that peer's chunk of the
    gradients (one ``all_to_all_single``) and sums the chunks it receives, in group-rank order.

    gloo's own ``reduce_scatter_tensor`` runs as an all-reduce and moves twice a ring's bytes;
    this one moves a ring's inside a node (:func:`~dtrain.core.collective_choices.
    gloo_reduce_scatter_factor` says where it is used). Sums of two ranks are bit-identical to
    gloo's; with more ranks the order of the additions differs (about 1e-7, relative, in fp32).
    FSDP2 asks gloo for ``SUM`` and divides itself (``set_force_sum_reduction_for_comms``).
    It holds one more input-sized buffer while it runs (what it receives). ``comm_stats``
    counts it as a reduce-scatter under its ring byte model, as every other collective; across
    nodes the all-to-all puts more on the network than that (4/3 of it on 2 nodes × 2).
    """

    def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: object, async_op: bool = False) -> None:
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"the all-to-all reduce-scatter sums; FSDP2 asked for {op}")
        if async_op:
            raise ValueError("the all-to-all reduce-scatter runs synchronously")
        ranks = group.size()
        if input_tensor.numel() != ranks * output_tensor.numel():
            raise ValueError(f"reduce-scatter of {input_tensor.numel()} elements over {ranks} "
                             f"ranks into {output_tensor.numel()}")
        comm_stats.record_collective("reduce_scatter", group, input_tensor.nbytes)
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        torch.sum(received.view(ranks, -1), dim=0, out=output_tensor.view(-1))


def gloo_reduce_scatter(plan: ParallelismPlan) -> AllToAllReduceScatter | None:
    """The reduce-scatter for ``plan``'s partition groups on gloo: dtrain's where it moves fewer
    bytes than gloo's own, else None (keep gloo's)."""
    nodes, _ = group_layout(plan.dp_shard, stride=plan.tp, gpus_per_node=plan.devices_per_node)
    if gloo_reduce_scatter_by_all_to_all(plan.dp_shard, nodes):
        return AllToAllReduceScatter()
    return None
