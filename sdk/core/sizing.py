"""Sizing a partition group to a model (STDLIB ONLY): ``sharding_degree``, ``auto`` included.

:func:`dtrain.core.parallelism.build_parallelism_plan` resolves the degree with these functions
(:func:`resolve_sharding_degree`); the planner passes the bytes a device needs beyond the model states (activations, the
unsharded layer being computed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Mixed-precision Adam keeps, per parameter: fp32 sharded parameter (4) + fp32 gradient (4) +
# Adam first and second moments (4 + 4) = 16 bytes, divided by the ranks that shard them.
MODEL_STATE_BYTES_PER_PARAM = 16
DEFAULT_HEADROOM = 0.2


def model_state_bytes_per_gpu(num_parameters: int, sharding_degree: int) -> float:
    """Parameters + gradients + optimizer states held by one GPU at this sharding degree."""
    return num_parameters * MODEL_STATE_BYTES_PER_PARAM / sharding_degree


def fits(num_parameters: int | None, sharding_degree: int, device_memory_bytes: float | None,
         other_bytes_per_gpu: float, *, headroom: float = DEFAULT_HEADROOM) -> bool:
    """Whether one GPU holds its model states and ``other_bytes_per_gpu`` with headroom."""
    if num_parameters is None or not device_memory_bytes:
        return True
    budget = device_memory_bytes * (1.0 - headroom) - other_bytes_per_gpu
    return model_state_bytes_per_gpu(num_parameters, sharding_degree) <= budget


def candidate_degrees(world_size: int, gpus_per_node: int) -> list[int]:
    """Partition-group sizes that keep groups aligned to nodes, smallest first.

    A group is either a divisor of one node's GPUs (it stays inside a node) or a whole number
    of nodes (it never splits a node). Every candidate divides the world size.
    """
    per_node = max(1, min(gpus_per_node, world_size))
    sizes = {d for d in range(1, per_node + 1) if per_node % d == 0}
    sizes |= {k * per_node for k in range(1, world_size // per_node + 1)}
    return sorted(d for d in sizes if world_size % d == 0)


def choose_sharding_degree(
    *,
    num_parameters: int,
    world_size: int,
    gpus_per_node: int,
    device_memory_bytes: float,
    other_bytes_per_gpu: float = 0.0,
    headroom: float = DEFAULT_HEADROOM,
    fixes: str | None = None,
) -> int:
    """The smallest node-aligned partition group whose GPUs hold the model states with headroom.

    ``other_bytes_per_gpu`` is what does not shrink with sharding (activations, the unsharded
    layer being computed). Raises ``ValueError`` when even a full shard does not fit, offering
    ``fixes`` (default: :func:`memory_fixes` of data parallelism alone).
    """
    budget = device_memory_bytes * (1.0 - headroom) - other_bytes_per_gpu
    for degree in candidate_degrees(world_size, gpus_per_node):
        if model_state_bytes_per_gpu(num_parameters, degree) <= budget:
            return degree
    need = model_state_bytes_per_gpu(num_parameters, world_size) + other_bytes_per_gpu
    raise ValueError(
        f"the model ({num_parameters / 1e9:.2f}B parameters) needs {need / 2**30:.1f} GiB per "
        f"device even fully sharded over {world_size} devices, more than "
        f"{device_memory_bytes * (1 - headroom) / 2**30:.1f} GiB usable; "
        f"{fixes or memory_fixes({}, dp_shard=world_size, dp=world_size, tp=1, devices_per_node=1)}"
    )


def memory_fixes(distribution: Mapping[str, Any], *, dp_shard: int, dp: int, tp: int,
                 devices_per_node: int) -> str:
    """What would make a layout that overflows the device fit, given the ``distribution``
    settings it came from: the changes they leave open (a degree already at its most or chosen
    by ``auto``, activation checkpointing already on, are not offered), then more or larger
    instances."""
    fixes = []
    if dp_shard < dp:  # replicas left to shard over
        fixes.append("raise sharding_degree")
    if distribution.get("tensor_parallel_degree", 1) != "auto" and tp < devices_per_node:
        fixes.append("raise tensor_parallel_degree" if tp > 1
                     else "set tensor_parallel_degree (or auto)")
    pp = distribution.get("pipeline_parallel_degree", 1)
    if pp != "auto" and dp > 1:  # ranks to spare for stages
        fixes.append("raise pipeline_parallel_degree" if pp > 1
                     else "set pipeline_parallel_degree (or auto)")
    if not distribution.get("activation_checkpointing"):
        fixes.append("enable activation_checkpointing")
    return either([*fixes, "use more or larger instances"])


def resolve_sharding_degree(requested: Any, *, dp: int, dp_per_node: int, tp: int, pp: int,
                            num_parameters: int | None, device_memory_bytes: float | None,
                            other_bytes_per_device: float,
                            fixes: str | None = None) -> int | None:
    """``sharding_degree`` (an int, ``full`` or ``auto``) over ``dp`` data-parallel ranks; None
    for ``auto`` before the model is sized. Raises ``ValueError`` with the fix (``fixes`` for
    a model that fits at no degree)."""
    if requested == "full":
        return dp
    if requested == "auto":
        if num_parameters is None or not device_memory_bytes:
            return None
        try:
            return choose_sharding_degree(
                num_parameters=num_parameters // (tp * pp), world_size=dp,
                gpus_per_node=dp_per_node, device_memory_bytes=device_memory_bytes,
                other_bytes_per_gpu=other_bytes_per_device, fixes=fixes)
        except ValueError as exc:
            raise ValueError(f"auto: {exc}") from None
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"got {requested!r}; use 1 for plain data parallel, a divisor of the "
                         "data-parallel size for MiCS, 'full' for ZeRO-3, or 'auto'")
    if dp % requested:
        shape = (f"world size {dp}" if tp * pp == 1 else
                 f"{dp} data-parallel ranks (world size ÷ tensor {tp} ÷ pipeline {pp})")
        verb = "exceeds" if requested > dp else "does not divide"
        raise ValueError(f"{requested} {verb} the {shape}; use one of "
                         f"{short_list(divisors(dp))}")
    return requested


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def short_list(values: list[int]) -> str:
    shown = values if len(values) <= 12 else [*values[:6], "…", *values[-3:]]
    return ", ".join(str(v) for v in shown) or "none"


def either(choices: list[str]) -> str:
    """``a, b or c``: the fixes or values a message offers."""
    return ", ".join(choices[:-1]) + (" or " if len(choices) > 1 else "") + choices[-1]
