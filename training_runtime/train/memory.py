"""What a step keeps for backward: the activation memory one rank holds, measured.

Counts the distinct storages autograd saves while the block runs, leaving out parameters (a
weight a layer saves for its backward is the model's memory, not the batch's): whatever the
layout (plain, FSDP2, DTensor tensor parallelism, the 2-D grid), the number is what this rank
keeps alive until backward. Deterministic, unlike a process's resident memory; the benchmark
(``benchmarks/tensor_parallel_memory.py``) reports both.

    with saved_activations(model) as saved:
        loss = loss_fn(model(batch))
    print(saved.bytes)
    loss.backward()
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class SavedActivations:
    storages: dict[int, int] = field(default_factory=dict)  # data pointer -> bytes

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # a DTensor: this rank's part
    return to_local() if callable(to_local) else tensor


def _parameter_storages(model: nn.Module) -> set[int]:
    """Storages of the parameters registered now (FSDP2 registers whole ones while a block runs)."""
    out = set()
    for module in model.modules():
        for _, param in module.named_parameters(recurse=False):
            try:
                out.add(_local(param).untyped_storage().data_ptr())
            except RuntimeError:  # a resharded FSDP2 parameter has no storage
                continue
    return out


@contextmanager
def saved_activations(model: nn.Module) -> Iterator[SavedActivations]:
    """Count what autograd saves inside the block (see the module docstring)."""
    saved = SavedActivations()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        local = _local(tensor)
        if isinstance(tensor, nn.Parameter) or isinstance(local, nn.Parameter):
            return tensor
        try:
            storage = local.untyped_storage()
            pointer = storage.data_ptr()
        except RuntimeError:
            return tensor
        if pointer not in saved.storages and pointer not in _parameter_storages(model):
            saved.storages[pointer] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield saved
