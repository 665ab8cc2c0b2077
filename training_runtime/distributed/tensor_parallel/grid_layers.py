"""The layers of a 2-D (Optimus) model, and the cross-entropy on its grid-split logits.

Each replaces a module of the same name and class family (``GridLinear`` is an ``nn.Linear``,
...), so parameter names, ``init_weights`` and checkpoints stay the model's; parameters become
DTensors on the grid mesh, which FSDP2 then shards over the data-parallel axes and DCP saves with
their global shapes. See :mod:`.optimus` for the grid and the SUMMA products.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dtrain.core import tensor_parallel as tpl
from dtrain.core.parallelism import GRID_AXES
from dtrain.runtime.distributed.tensor_parallel.layouts import children as children_of
from dtrain.runtime.distributed.tensor_parallel.layouts import present, share_heads
from dtrain.runtime.distributed.tensor_parallel.optimus import (
    Grid,
    abt_source,
    grid_layer_norm,
    mark_abt_output,
    recompute_abt,
    shared_parameter,
    slices,
    summa_ab,
    summa_abt,
)
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.overrides import TorchFunctionMode

AB = (Shard(1), Shard(0))  # W[out_j, in_i]
ABT = (Shard(0), Shard(1))  # W[out_i, in_j]; an embedding table E[vocab_i, hidden_j]
FEATURES = (Replicate(), Shard(0))  # a vector over features, every grid row holds its slice


def _grid_parameter(param: torch.Tensor, grid: Grid, placements) -> nn.Parameter:
    return nn.Parameter(distribute_tensor(param.detach(), grid.mesh, list(placements)),
                        param.requires_grad)


def _grid_module(cls, old: nn.Module, grid: Grid, *, copy: tuple[str, ...],
                 params: dict[str, tuple]) -> nn.Module:
    """A ``cls`` (a subclass of ``old``'s class) with ``old``'s settings and its parameters as
    grid DTensors, without allocating the class's own parameters."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.training, new.grid = old.training, grid
    for name in copy:
        setattr(new, name, getattr(old, name))
    for name, placements in params.items():
        param = getattr(old, name)
        setattr(new, name, None if param is None else _grid_parameter(param, grid, placements))
    return new


_EMBEDDING = ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
              "scale_grad_by_freq", "sparse")


class GridLinear(nn.Linear):
    """A block's linear layer: AB layout, activations (rows: batch slice, features: column)."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, grid: Grid) -> GridLinear:
        return _grid_module(cls, linear, grid, copy=("in_features", "out_features"),
                            params={"weight": AB, "bias": FEATURES})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to_local()
        return summa_ab(x, self.weight.to_local(), bias, self.grid)

    def activation_then_forward(self, h: torch.Tensor, act) -> torch.Tensor:
        """``self(act(h))`` keeping only ``h`` for backward (``activation_then_linear``)."""
        bias = None if self.bias is None else self.bias.to_local()
        return summa_ab(h, self.weight.to_local(), bias, self.grid, act=act)


class GridLayerNorm(nn.LayerNorm):
    """LayerNorm over features split along the grid row: the statistics are summed over it."""

    @classmethod
    def from_layer_norm(cls, norm: nn.LayerNorm, grid: Grid) -> GridLayerNorm:
        return _grid_module(cls, norm, grid, copy=("normalized_shape", "eps",
                                                   "elementwise_affine"),
                            params={"weight": FEATURES, "bias": FEATURES})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return grid_layer_norm(x, self.weight.to_local(), self.bias.to_local(), eps=self.eps,
                               size=self.normalized_shape[-1], grid=self.grid)


class _GridLookup(torch.autograd.Function):
    """Rows of ``table`` (this rank's vocab_i × hidden_j block) for the whole batch, summed down
    the grid column and scattered by batch slice: rank (i, j) gets batch slice i, features j."""

    @staticmethod
    def forward(ctx, ids, table, first_row, grid: Grid):
        local = ids - first_row
        mine = (local >= 0) & (local < table.shape[0])
        local = torch.where(mine, local, 0)
        partial = F.embedding(local, table) * mine.unsqueeze(-1).to(table.dtype)
        out = partial.new_empty(partial.shape[0] // grid.q, *partial.shape[1:])
        dist.reduce_scatter_single(out, partial.contiguous(), group=grid.col_group)
        ctx.save_for_backward(local, mine)
        ctx.grid, ctx.rows = grid, table.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad_out):
        local, mine = ctx.saved_tensors
        grid = ctx.grid
        full = grad_out.new_empty(grad_out.shape[0] * grid.q, *grad_out.shape[1:])
        dist.all_gather_single(full, grad_out.contiguous(), group=grid.col_group)
        full = full * mine.unsqueeze(-1).to(full.dtype)
        grad_table = full.new_zeros(ctx.rows, full.shape[-1])
        grad_table.index_add_(0, local.reshape(-1), full.reshape(-1, full.shape[-1]))
        return None, grad_table, None, None


class GridEmbedding(nn.Embedding):
    """Vocabulary-parallel down grid columns, features across them (ABT layout of the table)."""

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, grid: Grid) -> GridEmbedding:
        return _grid_module(cls, embedding, grid, copy=_EMBEDDING, params={"weight": ABT})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        problem = tpl.grid_batch_problem(ids.shape[0], self.grid.q)
        if problem:
            raise ValueError(problem)
        table = self.weight.to_local()
        return _GridLookup.apply(ids, table, self.grid.row * table.shape[0], self.grid)


class GridPositionEmbedding(nn.Embedding):
    """Position embeddings: every grid row holds the table's feature slice of its column."""

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, grid: Grid) -> GridPositionEmbedding:
        return _grid_module(cls, embedding, grid, copy=_EMBEDDING,
                            params={"weight": (Replicate(), Shard(1))})

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions, shared_parameter(self.weight.to_local(),
                                                       self.grid.col_group))


class GridHead(nn.Linear):
    """The LM head (ABT layout, tied or not): logits split like activations, batch slice by grid
    row and vocabulary slice by column, returned as a DTensor for :func:`grid_cross_entropy`."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, grid: Grid) -> GridHead:
        if linear.bias is not None:
            raise ValueError("2-D tensor parallelism has no plan for an LM head with a bias; "
                             "use tensor_parallel_mode 1d")
        return _grid_module(cls, linear, grid, copy=("in_features", "out_features", "bias"),
                            params={"weight": ABT})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = summa_abt(x, self.weight.to_local(), self.grid)
        shape = (x.shape[0] * self.grid.q, *x.shape[1:-1], self.out_features)
        out = DTensor.from_local(logits, self.grid.mesh, [Shard(0), Shard(logits.ndim - 1)],
                                 run_check=False, shape=torch.Size(shape),
                                 stride=torch.empty(shape, device="meta").stride())
        mark_abt_output(out)  # the cross-entropy recomputes these logits while unchanged
        return out


class _GridCrossEntropy(torch.autograd.Function):
    """Mean (or sum) cross-entropy of logits split by batch (grid rows) and vocabulary (grid
    columns); every rank returns the same loss, and its backward is local to each rank.

    Given ``head``, the LM head's product that made the logits (:func:`.optimus.abt_source`), it
    keeps no logits-sized tensor for backward: its backward makes the logits again from what the
    head keeps for its own backward, with one more SUMMA product, and turns them into the
    gradient in place. Without it, it keeps the probabilities."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, mean, grid: Grid, head):
        ctx.dtype, ctx.grid = logits.dtype, grid
        vocab_first = grid.col * logits.shape[-1]
        logits = logits.float()
        peak = logits.max(-1, keepdim=True).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=grid.row_group)
        local = target - vocab_first
        mine = (local >= 0) & (local < logits.shape[-1])
        picked = logits.gather(-1, torch.where(mine, local, 0).unsqueeze(-1)).squeeze(-1)
        picked = torch.where(mine, picked, 0.0)
        dist.all_reduce(picked, group=grid.row_group)
        # every rank of the grid takes the same path: the recomputation's products are collective
        agree = torch.tensor([head is not None], dtype=torch.int32)
        for group in (grid.row_group, grid.col_group):
            dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=group)
        head = head if agree.item() else None
        if head is None:
            # one logits-sized fp32 tensor beside the logits, not three: the shifted logits are
            # exponentiated and then normalised in place
            probs = torch.sub(logits, peak).exp_()
            total = probs.sum(-1, keepdim=True)
        else:  # the sums only, a slice of rows at a time
            total = torch.cat([torch.sub(logits[rows], peak[rows]).exp_().sum(-1, keepdim=True)
                               for rows in slices(*logits.shape, logits.element_size())])
        dist.all_reduce(total, group=grid.row_group)
        kept = target != ignore_index
        losses = torch.where(kept, torch.log(total.squeeze(-1)) + peak.squeeze(-1) - picked, 0.0)
        sums = torch.stack([losses.sum(), kept.sum().to(losses.dtype)])
        dist.all_reduce(sums, group=grid.col_group)
        count = sums[1].clamp(min=1.0) if mean else torch.ones(())
        if head is None:
            probs /= total
            ctx.save_for_backward(torch.where(mine, local, -1), kept, count, probs)
        else:
            ctx.save_for_backward(torch.where(mine, local, -1), kept, count, peak, total)
        ctx.head = head  # an ancestor of this node in the graph: no reference cycle
        return sums[0] / count

    @staticmethod
    def backward(ctx, grad):
        local, kept, count, *kept_for_grad = ctx.saved_tensors
        if ctx.head is not None:
            peak, total = kept_for_grad
            # the forward's probabilities, by its operations in its order
            grad_logits = recompute_abt(ctx.head).float().sub_(peak).exp_().div_(total)
        else:
            grad_logits = kept_for_grad[0].clone()
        rows = torch.nonzero(local >= 0).squeeze(-1)
        grad_logits[rows, local[rows]] -= 1.0
        grad_logits *= (kept.unsqueeze(-1) * (grad / count)).to(grad_logits.dtype)
        return grad_logits.to(ctx.dtype), None, None, None, None, None


def _grid_logits(value) -> bool:
    return (isinstance(value, DTensor) and value.device_mesh.mesh_dim_names == GRID_AXES
            and value.placements[0] == Shard(0) and value.placements[1] == Shard(value.ndim - 1))


class _CrossEntropyOnTheGrid(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy and args and _grid_logits(args[0]):
            return _cross_entropy(*args, **kwargs)
        return func(*args, **kwargs)


def _cross_entropy(logits: DTensor, target: torch.Tensor, weight=None, size_average=None,
                   ignore_index: int = -100, reduce=None, reduction: str = "mean",
                   label_smoothing: float = 0.0) -> torch.Tensor:
    if weight is not None or label_smoothing or reduction not in ("mean", "sum") or (
            size_average is not None or reduce is not None):
        raise ValueError("2-D tensor parallelism's cross-entropy takes class-index targets with "
                         "reduction 'mean' or 'sum' only; compute other losses with mode 1d")
    grid = Grid.from_mesh(logits.device_mesh)
    local = logits.to_local()
    rows = target.reshape(grid.q, -1)[grid.row]
    loss = _GridCrossEntropy.apply(local.reshape(-1, local.shape[-1]), rows.reshape(-1),
                                   ignore_index, reduction == "mean", grid, abt_source(logits))
    return loss


@contextlib.contextmanager
def grid_cross_entropy() -> Iterator[None]:
    """Inside: ``F.cross_entropy`` on a :class:`GridHead`'s logits runs on the grid."""
    with _CrossEntropyOnTheGrid():
        yield


def replace_module(model: nn.Module, fqn: str, build, grid: Grid) -> None:
    """Put ``build(old, grid)`` where ``fqn`` is, under the same name (skipped when absent)."""
    parent_name, _, name = fqn.rpartition(".")
    try:
        parent = model.get_submodule(parent_name)
        old = getattr(parent, name)
    except AttributeError:
        return
    if old is not None:
        setattr(parent, name, build(old, grid))


def slice_attention_mask(module: nn.Module, grid: Grid) -> None:
    """``module(input_ids, attention_mask)``: blocks see the mask of their batch slice."""
    def keep_rows(_module, args, kwargs):
        if len(args) > 1 and isinstance(args[1], torch.Tensor):
            args = (args[0], args[1].chunk(grid.q)[grid.row], *args[2:])
        if isinstance(kwargs.get("attention_mask"), torch.Tensor):
            kwargs = {**kwargs, "attention_mask": kwargs["attention_mask"].chunk(grid.q)[grid.row]}
        return args, kwargs

    module.register_forward_pre_hook(keep_rows, with_kwargs=True)


def apply_blocks(model: nn.Module, blocks: str, block, grid: Grid) -> list[str]:
    """Every block's norms and projections as grid layers; returns the heads' modules."""
    heads = []
    for fqn in children_of(model, blocks):
        for name in block.norms:
            replace_module(model, f"{fqn}.{name}", GridLayerNorm.from_layer_norm, grid)
        for name in (*block.columns, *block.rows):
            replace_module(model, f"{fqn}.{name}", GridLinear.from_linear, grid)
        heads.append(f"{fqn}.{block.heads}")
    return heads


def apply_causal_lm(model: nn.Module, mesh, family) -> None:
    """A decoder (``layouts.CausalLM``) on the grid: embeddings, blocks, final norm, head; the
    blocks see the attention mask of their grid row's batch slice."""
    grid = Grid.from_mesh(mesh)
    replace_module(model, family.embedding, GridEmbedding.from_embedding, grid)
    if family.position_embedding:
        replace_module(model, family.position_embedding, GridPositionEmbedding.from_embedding,
                       grid)
    heads = apply_blocks(model, family.blocks, family.block, grid)
    replace_module(model, family.final_norm, GridLayerNorm.from_layer_norm, grid)
    replace_module(model, family.head, GridHead.from_linear, grid)
    inner = family.blocks.split(".")[0]  # the model that takes (input_ids, attention_mask)
    if present(model, inner):
        slice_attention_mask(model.get_submodule(inner), grid)
    share_heads(model, heads, grid.q)
