"""Optimus-style 2-D tensor parallelism: SUMMA matrix products on a ``q × q`` grid.

Rank ``(i, j)`` of the grid (``i`` its row: the ``tp_row`` mesh coordinate, ``j`` its column)
holds block ``(i, j)`` of every activation, ``X[i][j]``: the ``i``-th slice of the micro-batch and
the ``j``-th slice of the features. So every rank keeps ``1/q²`` of the activations (1-D tensor
parallelism keeps whole copies of the layer inputs). A weight ``A`` (``in × out``) is split into
``q × q`` blocks too; ``Y = X A`` is computed as SUMMA does (van de Geijn & Watts 1997, the
products of Optimus, Xu et al. 2021): for ``k = 0 … q-1``, rank ``(i, k)`` broadcasts ``X[i][k]``
along grid row ``i``, rank ``(k, j)`` broadcasts ``A[k][j]`` down grid column ``j``, and rank
``(i, j)`` adds ``X[i][k] A[k][j]`` to ``Y[i][j]``. The backward does the same with the
products ``dX = dY Aᵀ`` and ``dA = Xᵀ dY``, reducing partial sums to the rank that owns the block.
A rank holds one broadcast block at a time, never a whole row of the grid.

Two layouts of an ``nn.Linear`` weight ``W`` (``out × in``, ``A = Wᵀ``) as a DTensor on the grid
mesh (placements for ``(tp_row, tp_col)``):

* ``AB``  ``(Shard(1), Shard(0))``: rank ``(i, j)`` holds ``W[out_j, in_i]`` (= ``A[i][j]ᵀ``); the
  block layers;
* ``ABT`` ``(Shard(0), Shard(1))``: rank ``(i, j)`` holds ``W[out_i, in_j]``, the layout of the
  grid embedding's table, so the LM head tied to it computes ``X Wᵀ`` with ``W`` as stored.

Both leave the output split like the input: rows of the batch by grid row, features by column.
DTensor's own propagation is not used for these products: for a weight sharded on both dims it
all-gathers the weight and returns full-size gradients (measured on torch 2.13).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from dtrain.runtime import torch_private
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Grid:
    """This rank's place on the ``q × q`` grid and the groups of its row and column."""

    mesh: DeviceMesh  # ("tp_row", "tp_col")
    q: int
    row: int  # i
    col: int  # j
    row_group: dist.ProcessGroup  # grid row i: ranks (i, 0..q-1)
    col_group: dist.ProcessGroup  # grid column j: ranks (0..q-1, j)

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> Grid:
        q = mesh.size(0)
        assert mesh.ndim == 2 and mesh.size(1) == q, mesh
        return cls(mesh, q, mesh.get_local_rank(0), mesh.get_local_rank(1),
                   row_group=mesh.get_group(1), col_group=mesh.get_group(0))

    def in_row(self, k: int) -> int:
        """Global rank of ``(i, k)``."""
        return dist.get_global_rank(self.row_group, k)

    def in_col(self, k: int) -> int:
        """Global rank of ``(k, j)``."""
        return dist.get_global_rank(self.col_group, k)


def _broadcast(mine: torch.Tensor, *, owner: bool, src: int, group, shape) -> torch.Tensor:
    block = mine.contiguous() if owner else mine.new_empty(shape)
    dist.broadcast(block, src=src, group=group)
    return block


def _reduce(partial: torch.Tensor, *, dst: int, group) -> torch.Tensor:
    dist.reduce(partial, dst=dst, op=dist.ReduceOp.SUM, group=group)
    return partial


def _save_input(ctx, x: torch.Tensor, weight: torch.Tensor, norm) -> None:
    """Keep ``x`` for backward, or, when ``x`` is a grid layer norm's output (``norm``, see
    :func:`_norm_recipe`), what recomputes it: the norm's input, which the norm keeps anyway, and
    its per-token statistics. The normed output, ``1/q²`` of the layer's input, is then not kept."""
    ctx.shape = x.shape
    if norm is None:
        ctx.norm = False
        ctx.save_for_backward(x, weight)
    else:
        ctx.norm = True
        ctx.save_for_backward(weight, *norm)


def _saved_input(ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, weight)`` as :func:`_save_input` kept them, ``x`` recomputed bit for bit."""
    if not ctx.norm:
        return ctx.saved_tensors
    weight, norm_x, norm_weight, norm_bias, mean, rstd = ctx.saved_tensors
    x = _normed(norm_x, norm_weight, norm_bias, mean, rstd)
    return x.reshape(ctx.shape), weight


class _SummaAB(torch.autograd.Function):
    """``Y = act(X) Wᵀ + b`` with ``W`` in the AB layout (module docstring); 2-D ``x`` of local
    rows. With an activation only ``x`` is kept: ``act(x)`` is recomputed in backward (the
    saving of :func:`dtrain.runtime.models.common.activation_then_linear`); a layer norm's
    output is recomputed from the norm's input (:func:`_save_input`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, grid: Grid, act, norm):
        ctx.grid, ctx.act = grid, act
        ctx.has_bias = bias is not None
        _save_input(ctx, x, weight, norm)
        xa = x if act is None else act(x)
        out = x.new_zeros(x.shape[0], weight.shape[0])
        for k in range(grid.q):
            xk = _broadcast(xa, owner=grid.col == k, src=grid.in_row(k), group=grid.row_group,
                            shape=(x.shape[0], weight.shape[1]))
            wk = _broadcast(weight, owner=grid.row == k, src=grid.in_col(k),
                            group=grid.col_group, shape=weight.shape)
            out.addmm_(xk, wk.t())
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = _saved_input(ctx)
        grid = ctx.grid
        xa = x if ctx.act is None else ctx.act(x)
        grad_out = grad_out.contiguous()
        grad_x = grad_w = None
        for k in range(grid.q):
            # dX[i][k] = sum_j dY[i][j] W[out_j, in_k], reduced along row i to (i, k)
            wk = _broadcast(weight, owner=grid.row == k, src=grid.in_col(k),
                            group=grid.col_group, shape=weight.shape)
            got = _reduce(grad_out @ wk, dst=grid.in_row(k), group=grid.row_group)
            grad_x = got if grid.col == k else grad_x
            # dW[out_j, in_k] = sum_i dY[i][j]ᵀ X[i][k], reduced down column j to (k, j)
            xk = _broadcast(xa, owner=grid.col == k, src=grid.in_row(k), group=grid.row_group,
                            shape=(x.shape[0], weight.shape[1]))
            got = _reduce(grad_out.t() @ xk, dst=grid.in_col(k), group=grid.col_group)
            grad_w = got if grid.row == k else grad_w
        del xa
        if ctx.act is not None:
            grad_x = ctx.act.backward(grad_x, x)  # written over grad_x, which is ours
        grad_b = None
        if ctx.has_bias:  # the bias of out_j is every row's: sum the rows' tokens
            grad_b = grad_out.sum(0)
            dist.all_reduce(grad_b, group=grid.col_group)
        return grad_x, grad_w, grad_b, None, None, None


# The LM head's products and the grid's cross-entropy work on slices of this many bytes of
# logits at a time: their temporaries are a slice, not another logits-sized tensor, beside the
# logits while every block's activations are kept.
SLICE_BYTES = 8 * 2**20


def slices(rows: int, cols: int, element_size: int) -> list[slice]:
    """Consecutive slices of ``rows`` whose ``rows × cols`` blocks hold at most SLICE_BYTES."""
    step = max(1, SLICE_BYTES // max(1, cols * element_size))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _abt_product(x: torch.Tensor, weight: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``X Wᵀ`` with ``W`` in the ABT layout, 2-D ``x`` of local rows; a new tensor. The partial
    products for the other ranks of the row are reduced a slice of rows at a time."""
    out = x.new_empty(x.shape[0], weight.shape[0])
    for k in range(grid.q):
        # Y[i][k] = sum_j X[i][j] W[out_k, in_j]ᵀ, reduced along row i to (i, k)
        wk = _broadcast(weight, owner=grid.row == k, src=grid.in_col(k),
                        group=grid.col_group, shape=weight.shape)
        for rows in slices(x.shape[0], weight.shape[0], x.element_size()):
            partial = torch.mm(x[rows], wk.t(), out=out[rows] if grid.col == k else None)
            _reduce(partial, dst=grid.in_row(k), group=grid.row_group)
    return out


class _SummaABT(torch.autograd.Function):
    """``Y = X Wᵀ`` with ``W`` in the ABT layout (module docstring); no bias. Keeps ``x`` itself,
    even a layer norm's output: the LM head's logits are recomputed from it (:func:`abt_source`)
    while the final norm's weight may be resharded, and ``x`` is small beside the logits."""

    @staticmethod
    def forward(ctx, x, weight, grid: Grid):
        ctx.grid = grid
        ctx.save_for_backward(x, weight)
        # for abt_source and recompute_abt: what the output is made from (tensors kept for this
        # backward anyway; mark_abt_output adds the output's version as its caller hands it on)
        ctx.made_from = (x.detach(), weight.detach())
        return _abt_product(x, weight, grid)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grid = ctx.grid
        grad_out = grad_out.contiguous()
        grad_x = torch.zeros_like(x)
        grad_w = None
        for k in range(grid.q):
            wk = _broadcast(weight, owner=grid.row == k, src=grid.in_col(k),
                            group=grid.col_group, shape=weight.shape)
            partial = torch.zeros_like(weight)
            # dY[i][k] a slice of rows at a time: a rank holds one slice of another's logits
            for rows in slices(x.shape[0], weight.shape[0], grad_out.element_size()):
                dyk = _broadcast(grad_out[rows], owner=grid.col == k, src=grid.in_row(k),
                                 group=grid.row_group, shape=(rows.stop - rows.start,
                                                              weight.shape[0]))
                grad_x[rows].addmm_(dyk, wk)  # dX[i][j] = sum_k dY[i][k] W[out_k, in_j]
                partial.addmm_(dyk.t(), x[rows])  # dY[i][k]ᵀ X[i][j]
            # dW[out_k, in_j] = sum_i dY[i][k]ᵀ X[i][j], reduced down column j to (k, j)
            got = _reduce(partial, dst=grid.in_col(k), group=grid.col_group)
            grad_w = got if grid.row == k else grad_w
        return grad_x, grad_w, None


def summa_ab(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid: Grid,
             act=None) -> torch.Tensor:
    """``act(x)`` (..., in/q) times a local AB block, plus the local bias; (..., out/q)."""
    flat = x.reshape(-1, x.shape[-1])
    norm = _norm_recipe(x) if act is None else None
    return _SummaAB.apply(flat, weight, bias, grid, act, norm).view(*x.shape[:-1],
                                                                    weight.shape[0])


def summa_abt(x: torch.Tensor, weight: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``x`` (..., in/q) times a local ABT block; (..., out/q)."""
    flat = x.reshape(-1, x.shape[-1])
    return _SummaABT.apply(flat, weight, grid).view(*x.shape[:-1], weight.shape[0])


def mark_abt_output(out: torch.Tensor) -> None:
    """Note on the :func:`summa_abt` product behind ``out`` (through views and DTensor's
    conversions) ``out`` and its version now. Call it on the tensor the caller hands on, a
    DTensor where it is one: DTensor's views share the DTensor's version counter, not their local
    tensors'."""
    node, _ = torch_private.value_source(out)
    if getattr(node, "made_from", None) is not None:
        node.output, node.output_version = weakref.ref(out), out._version


def abt_source(out: torch.Tensor):
    """The backward node of the :func:`summa_abt` product that ``out`` came from through views,
    DTensor's conversions and at most one cast to fp32 (exact from bf16, fp16), unchanged since
    (an in-place change through autograd would stand between; one without it changes the
    version :func:`mark_abt_output` noted); else None.
    ``recompute_abt(node)`` cast to ``out``'s dtype is ``out`` again. After a cast, the marked
    output must still be referenced: its version is what says it did not change before the cast.

    None too when the product's weight is no longer gathered: an LM head tied to the embedding
    is in the root's FSDP unit, which reshards after forward (an untied head's unit does not)."""
    node, cast = torch_private.value_source(out, through_a_cast=out.dtype == torch.float32)
    if getattr(node, "made_from", None) is None or getattr(node, "output", None) is None:
        return None
    _, weight = node.made_from
    if cast:  # the product's output, still alive to read its version, and a fresh cast of it
        marked = node.output()
        unchanged = (marked is not None and marked._version == node.output_version
                     and out._version == 0 and out.device == weight.device
                     and weight.dtype in (torch.float32, torch.bfloat16, torch.float16))
    else:
        unchanged = out._version == node.output_version
    return node if unchanged and weight.untyped_storage().size() else None


def recompute_abt(node) -> torch.Tensor:
    """The output of the :func:`summa_abt` product that ``node`` (:func:`abt_source`) is the
    backward of, bit for bit (the same products and reductions in the same order), from the
    tensors the product keeps for its own backward; a new tensor."""
    x, weight = node.made_from
    if weight.untyped_storage().size() == 0:
        raise RuntimeError("the LM head's gathered weight was freed before backward; the grid's "
                           "cross-entropy needs it to recompute the logits (the head's FSDP "
                           "unit must not reshard after forward)")
    return _abt_product(x, weight, node.grid)


def _normed(x, weight, bias, mean, rstd) -> torch.Tensor:
    """The grid layer norm's output from its input and statistics: the forward's operations in
    its order (``x - mean`` is its ``centred``), so a recomputation is bit for bit its output."""
    return (x - mean) * rstd * weight + bias


def _norm_recipe(out: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """What recomputes ``out`` if it is a grid layer norm's output, unchanged since (its version
    counter as the norm left it), or an alias of all of it (FSDP2 passes a module's outputs on
    as ``view_as``); else None."""
    recipe = getattr(out, "_grid_norm_recipe", None)
    base = out._base
    if recipe is None and base is not None and (
            out.shape == base.shape and out.stride() == base.stride()
            and out.storage_offset() == base.storage_offset() and out.dtype == base.dtype):
        recipe = getattr(base, "_grid_norm_recipe", None)
    if recipe is None or out._version != recipe[0]:
        return None
    return recipe[1:]


class _GridLayerNorm(torch.autograd.Function):
    """LayerNorm of features split along grid row ``i``: the sums behind the mean and variance
    (forward) and behind the input gradient (backward) are all-reduced over the row. Keeps the
    input and two statistics per token, as torch's own LayerNorm does; the weight and bias are
    every grid row's, so their gradients are summed down the column."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, size: int, grid: Grid):
        # two passes, as torch's LayerNorm is accurate: E[x²] - E[x]² would cancel digits
        mean = x.sum(-1, keepdim=True)
        dist.all_reduce(mean, group=grid.row_group)
        mean /= size
        centred = x - mean
        var = (centred * centred).sum(-1, keepdim=True)
        dist.all_reduce(var, group=grid.row_group)
        rstd = torch.rsqrt(var / size + eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.size, ctx.grid = size, grid
        out = centred * rstd * weight + bias  # = _normed(x, weight, bias, mean, rstd)
        # what recomputes out (_norm_recipe): values only, the gradient reaches the norm
        # through out as usual
        out._grid_norm_recipe = (out._version, x.detach(), weight.detach(), bias.detach(),
                                 mean, rstd)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, rstd = ctx.saved_tensors
        grid = ctx.grid
        normed = (x - mean) * rstd
        flat_dims = tuple(range(grad_out.ndim - 1))
        grad_wb = torch.stack([(grad_out * normed).sum(flat_dims), grad_out.sum(flat_dims)])
        dist.all_reduce(grad_wb, group=grid.col_group)
        grad_normed = grad_out * weight
        sums = torch.stack([grad_normed.sum(-1), (grad_normed * normed).sum(-1)])
        dist.all_reduce(sums, group=grid.row_group)
        grad_x = rstd * (grad_normed - (sums[0].unsqueeze(-1)
                                        + normed * sums[1].unsqueeze(-1)) / ctx.size)
        return grad_x, grad_wb[0], grad_wb[1], None, None, None


def grid_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, eps: float,
                    size: int, grid: Grid) -> torch.Tensor:
    """The output carries what recomputes it (:func:`_norm_recipe`): a SUMMA product that takes
    it keeps that, not the output."""
    return _GridLayerNorm.apply(x, weight, bias, eps, size, grid)


class _SharedParameter(torch.autograd.Function):
    """Identity on a parameter block that several ranks hold, each using it on its own slice of
    the batch: the backward sums their gradients, so every holder gets the whole gradient."""

    @staticmethod
    def forward(ctx, weight, group):
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def shared_parameter(weight: torch.Tensor, group) -> torch.Tensor:
    return _SharedParameter.apply(weight, group)
