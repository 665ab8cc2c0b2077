"""The 1-D row-parallel linear layer: each rank multiplies its slice of the input features by
its slice of the weight's columns, then one collective sums the partial outputs.

Without sequence parallelism the sum is an all-reduce (backward: the gradient as is, every rank
holds all of it); with it, a reduce-scatter along the sequence (backward: an all-gather), whose
output is the residual stream's ``Shard(1)`` DTensor. The module computes its product on local
blocks rather than through DTensor's ``RowwiseParallel``, so that the MLP's second projection
can keep ``activation_then_linear``'s saving (only the pre-activation is kept for backward),
which a DTensor product of ``act(h)`` would lose.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dtrain.core import tensor_parallel as tpl
from dtrain.runtime.models.common import Activation, activation_then_matmul
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


class _SumPartials(torch.autograd.Function):
    """Forward: all-reduce; backward: the output's gradient, which every rank already holds."""

    @staticmethod
    def forward(ctx, partial, group):
        out = partial.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumPartialsOverSequence(torch.autograd.Function):
    """Forward: reduce-scatter along the sequence (dim 1); backward: all-gather it back."""

    @staticmethod
    def forward(ctx, partial, group):
        ctx.group = group
        ways = group.size()
        problem = tpl.sequence_split_problem(partial.shape[1], ways)
        if problem:
            raise ValueError(problem)
        moved = partial.transpose(0, 1).contiguous()  # collectives split dim 0
        out = moved.new_empty(moved.shape[0] // ways, *moved.shape[1:])
        dist.reduce_scatter_single(out, moved, group=group)
        return out.transpose(0, 1).contiguous()

    @staticmethod
    def backward(ctx, grad):
        moved = grad.transpose(0, 1).contiguous()
        full = moved.new_empty(moved.shape[0] * ctx.group.size(), *moved.shape[1:])
        dist.all_gather_single(full, moved, group=ctx.group)
        return full.transpose(0, 1).contiguous(), None


class RowParallelLinear(nn.Linear):
    """Weight split by columns (``Shard(1)``), bias whole; input: this rank's features."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, mesh: DeviceMesh, *,
                    sequence_parallel: bool) -> RowParallelLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.training = linear.training
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.mesh, new.sequence_parallel = mesh, sequence_parallel
        new.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(1)]),
                                  linear.weight.requires_grad)
        new.bias = None if linear.bias is None else nn.Parameter(
            distribute_tensor(linear.bias.detach(), mesh, [Replicate()]),
            linear.bias.requires_grad)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._sum(F.linear(x, self.weight.to_local()))

    def activation_then_forward(self, h: torch.Tensor, act: Activation) -> torch.Tensor:
        return self._sum(activation_then_matmul(h, act, self.weight.to_local(), None))

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        group = self.mesh.get_group()
        if self.sequence_parallel:
            out = DTensor.from_local(_SumPartialsOverSequence.apply(partial, group), self.mesh,
                                     [Shard(1)], run_check=False)
            return out if self.bias is None else out + self.bias
        out = _SumPartials.apply(partial, group)
        # every rank adds the whole bias to the whole output: its gradient is the same on all
        return out if self.bias is None else out + self.bias.to_local()
