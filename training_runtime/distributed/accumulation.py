"""MiCS 2-hop gradient sync for gradient accumulation.

Hop 1 runs on every micro-step: FSDP2 reduce-scatters gradients inside the partition group
(fast, intra-node when the group fits a node) and keeps the sum of the shards. Hop 2, the
all-reduce across replica groups, runs only on the accumulation boundary's backward
(``set_requires_all_reduce(False)`` until then; with ``gradient_sync: overlapped`` the
background communicator of :mod:`~dtrain.runtime.distributed.gradient_sync` fills its buffers only
then), so the slow cross-group traffic is paid once per optimizer step instead of once per
micro-batch.

Loss scaling: FSDP2 averages gradients over the ``world_size`` data-parallel ranks, and sums the
micro-steps of one optimizer step. Divide each micro-batch's loss by the number of micro-steps
(``micro.scale(loss)`` does it) so the step's gradient is the mean over the whole global batch,
as a single process on that batch would compute it.

Hand-written loop::

    for micro in ctx.accumulate(model, loader):          # gradient_accumulation_steps of the job
        loss = micro.scale(loss_fn(model(micro.batch)))  # loss / steps
        loss.backward()                                  # must run inside the loop body
        if micro.is_boundary:
            optimizer.step()
            optimizer.zero_grad()

or, when the caller owns the batching (a Trainer)::

    with ctx.micro_step(model, boundary=(i + 1) % steps == 0):
        (loss_fn(model(x)) / steps).backward()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from dtrain.runtime.distributed import gradient_sync
from torch.distributed.fsdp import FSDPModule


@dataclass(frozen=True)
class MicroStep:
    """One micro-batch of an accumulation window."""

    batch: Any
    index: int  # position inside the window, 0-based
    num_steps: int  # micro-steps per optimizer step
    is_boundary: bool  # the last micro-step: gradients are fully synced after its backward

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss / num_steps``: the mean over the window once the micro-steps are summed."""
        return loss / self.num_steps


def set_sync_mode(model: torch.nn.Module, *, boundary: bool) -> None:
    """Hop 2 (replica all-reduce) only when ``boundary``; hop 1 (reduce-scatter) always."""
    if not isinstance(model, FSDPModule):
        return  # not sharded (one process): nothing to sync
    model.set_requires_all_reduce(boundary)
    gradient_sync.set_boundary(model, boundary)  # the overlapped sync's all-reduce (hop 2)
    # FSDP2 finishes a backward's bookkeeping only on the last one; keep partial sums before.
    model.set_is_last_backward(boundary)


@contextmanager
def micro_step(model: torch.nn.Module, *, boundary: bool,
               within: Callable[[], AbstractContextManager] = nullcontext) -> Iterator[None]:
    """Run one micro-step's forward and backward inside; restores full sync on exit.

    ``within`` is entered around them too (the runtime passes the tensor-parallel loss's
    context, which the loss and its backward need)."""
    set_sync_mode(model, boundary=boundary)
    try:
        with within():
            yield
    finally:
        set_sync_mode(model, boundary=True)


_UNREAD = object()


def accumulate(
    model: torch.nn.Module, batches: Iterable[Any], *, micro_batches_per_step: int,
    within: Callable[[], AbstractContextManager] = nullcontext,
) -> Iterator[MicroStep]:
    """Yield micro-steps with the sync mode set for each, ``micro_batches_per_step`` per window.

    A trailing partial window is still closed by a boundary on its last batch, so no gradient
    is left unsynchronised; its ``scale`` divides by the full count all the same.
    """
    steps = micro_batches_per_step
    if steps < 1:
        raise ValueError(f"micro_batches_per_step must be >= 1, got {steps}")
    iterator = iter(batches)
    try:
        current = next(iterator)
    except StopIteration:
        return
    index = 0
    while True:
        # Look ahead (is this the data's last batch?) only inside a window: at its boundary the
        # loader's state_dict then counts exactly the batches trained on, as a checkpoint
        # taken there must.
        boundary, last, upcoming = index == steps - 1, False, _UNREAD
        if not boundary:
            try:
                upcoming = next(iterator)
            except StopIteration:
                boundary = last = True
        with micro_step(model, boundary=boundary, within=within):
            yield MicroStep(current, index, steps, boundary)
        if last:
            return
        if upcoming is _UNREAD:
            try:
                upcoming = next(iterator)
            except StopIteration:
                return
        current, index = upcoming, 0 if boundary else index + 1
