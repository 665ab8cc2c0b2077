"""The parallelism plan: how a job's ranks form the mesh ``pp × dp_replicate × dp_shard × tp``.

STDLIB ONLY. One function, :func:`build_parallelism_plan`, turns the spec's distribution, the
world size, the devices per node and (for ``sharding_degree: auto``) the model size into a frozen
:class:`ParallelismPlan`. Spec validation, ``dtrain plan``, the container contract (the plan
travels to every host as is) and the runtime all call it, so a degree or the hierarchical
all-gather decision is made here and nowhere else.

Axes, outermost first (ranks are node-contiguous, so the innermost axes stay inside a node):

* ``pp``: pipeline stages (only point-to-point traffic crosses it, so it may span nodes);
* ``dp_replicate``: MiCS replicas of the partition group (gradients all-reduced once per step);
* ``dp_shard``: a MiCS partition group, ``sharding_degree`` ranks that shard the model states
  (1 = DDP, every data-parallel rank = ZeRO-3, in between = MiCS);
* ``tp``: tensor parallelism, innermost, inside a node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

AXES = ("pp", "dp_replicate", "dp_shard", "tp")
# Mixed-precision Adam keeps, per parameter: fp32 sharded parameter (4) + fp32 gradient (4) +
# Adam first and second moments (4 + 4) = 16 bytes, divided by the ranks that shard them.
MODEL_STATE_BYTES_PER_PARAM = 16
DEFAULT_HEADROOM = 0.2


class ParallelismError(ValueError):
    """A distribution the cluster cannot run; ``field`` is the spec field to change."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class ParallelismPlan:
    """The degrees of the four mesh axes and every fact derived from them."""

    world_size: int
    devices_per_node: int
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    hierarchical_allgather: bool

    def __post_init__(self) -> None:
        product = self.pp * self.dp_replicate * self.dp_shard * self.tp
        assert product == self.world_size, (self, product)
        assert self.world_size % self.devices_per_node == 0, self

    # ---------------------------------------------------------------- the mesh

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @property
    def mesh_axis_names(self) -> tuple[str, str, str, str]:
        return AXES

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.devices_per_node

    @property
    def sharding_degree(self) -> int:
        return self.dp_shard

    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks: replicas × partition-group size."""
        return self.dp_replicate * self.dp_shard

    @property
    def strategy(self) -> str:
        if self.dp_shard == 1:
            return "DDP"
        return "ZeRO-3" if self.dp_replicate == 1 else "MiCS"

    # ---------------------------------------------------------------- node alignment

    @property
    def shard_group_span(self) -> int:
        """Consecutive ranks one partition group covers (its members are ``tp`` apart)."""
        return self.dp_shard * self.tp

    @property
    def shard_group_spans_nodes(self) -> bool:
        return self.shard_group_span > self.devices_per_node

    @property
    def shard_group_nodes(self) -> int:
        """Nodes one partition group touches."""
        if not self.shard_group_spans_nodes:
            return 1
        return -(-self.shard_group_span // self.devices_per_node)

    @property
    def shard_group_whole_nodes(self) -> bool:
        """The partition group is made of whole nodes (the hierarchical all-gather needs it)."""
        return self.shard_group_spans_nodes and self.shard_group_span % self.devices_per_node == 0

    # ---------------------------------------------------------------- a rank's place

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s index on each axis (row-major over ``mesh_shape``)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")
        coords = {}
        for axis, size in zip(reversed(AXES), reversed(self.mesh_shape)):
            rank, coords[axis] = divmod(rank, size)
        return {axis: coords[axis] for axis in AXES}

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel shard of the batch ``rank`` reads."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def shard_group(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s partition group, in order."""
        c = self.coordinates(rank)
        return [self._rank_of({**c, "dp_shard": i}) for i in range(self.dp_shard)]

    def _rank_of(self, coords: Mapping[str, int]) -> int:
        rank = 0
        for axis, size in zip(AXES, self.mesh_shape):
            rank = rank * size + coords[axis]
        return rank

    # ---------------------------------------------------------------- transport

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mesh_shape": list(self.mesh_shape),
                "mesh_axis_names": list(AXES), "strategy": self.strategy,
                "shard_group_spans_nodes": self.shard_group_spans_nodes}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParallelismPlan:
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})


# ------------------------------------------------------------------------ building the plan

def build_parallelism_plan(
    distribution: Mapping[str, Any],
    *,
    world_size: int,
    devices_per_node: int,
    num_parameters: int | None = None,
    device_memory_bytes: float | None = None,
    other_bytes_per_device: float = 0.0,
) -> ParallelismPlan | None:
    """The plan for ``distribution`` on ``world_size`` ranks, ``devices_per_node`` per node.

    ``distribution`` holds the spec's keys (``sharding_degree``, ``hierarchical_allgather``,
    ``backend``, ``tensor_parallel_degree``, ``pipeline_parallel_degree``; missing ones take
    their defaults). Returns None when ``sharding_degree`` is ``auto`` and the model size or the
    device memory is not known yet: the runtime then calls this again with the real model.
    Raises :class:`ParallelismError` naming the spec field when no plan exists.
    """
    if devices_per_node < 1 or world_size % devices_per_node:
        raise ParallelismError(
            "compute.processes_per_instance",
            f"{devices_per_node} processes per node do not divide the world size {world_size}; "
            "start the same number of processes on every node")
    tp = _degree(distribution, "tensor_parallel_degree")
    pp = _degree(distribution, "pipeline_parallel_degree")
    if devices_per_node % tp:
        raise ParallelismError(
            "distribution.tensor_parallel_degree",
            f"{tp} does not divide the {devices_per_node} devices of a node; a tensor-parallel "
            f"group must stay inside a node: use one of {_divisors(devices_per_node)}")
    if world_size % (tp * pp):
        raise ParallelismError(
            "distribution.pipeline_parallel_degree",
            f"pipeline {pp} × tensor {tp} does not divide the world size {world_size}")
    dp = world_size // (tp * pp)
    setting, backend = _hierarchical_setting(distribution)
    degree = _sharding_degree(distribution, dp=dp, dp_per_node=max(1, devices_per_node // tp),
                              tp=tp, pp=pp, num_parameters=num_parameters,
                              device_memory_bytes=device_memory_bytes,
                              other_bytes_per_device=other_bytes_per_device)
    if degree is None:
        return None
    plan = ParallelismPlan(world_size=world_size, devices_per_node=devices_per_node, pp=pp,
                           dp_replicate=dp // degree, dp_shard=degree, tp=tp,
                           hierarchical_allgather=False)
    hierarchical = _hierarchical(plan, setting, backend)
    return ParallelismPlan(**{**asdict(plan), "hierarchical_allgather": hierarchical})


def _degree(distribution: Mapping[str, Any], key: str) -> int:
    value = distribution.get(key, 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParallelismError(f"distribution.{key}", f"{value!r} is not an integer >= 1")
    return value


def _sharding_degree(distribution: Mapping[str, Any], *, dp: int, dp_per_node: int, tp: int,
                     pp: int, num_parameters: int | None, device_memory_bytes: float | None,
                     other_bytes_per_device: float) -> int | None:
    requested = distribution.get("sharding_degree", "auto")
    field = "distribution.sharding_degree"
    if requested == "full":
        return dp
    if requested == "auto":
        if num_parameters is None or not device_memory_bytes:
            return None
        try:
            return choose_sharding_degree(
                num_parameters=num_parameters // (tp * pp), world_size=dp,
                gpus_per_node=dp_per_node, device_memory_bytes=device_memory_bytes,
                other_bytes_per_gpu=other_bytes_per_device)
        except ValueError as exc:
            raise ParallelismError(field, f"auto: {exc}") from None
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ParallelismError(
            field, f"got {requested!r}; use 1 for plain data parallel, a divisor of the "
            "data-parallel size for MiCS, 'full' for ZeRO-3, or 'auto'")
    if dp % requested:
        shape = (f"world size {dp}" if tp * pp == 1 else
                 f"{dp} data-parallel ranks (world size ÷ tensor {tp} ÷ pipeline {pp})")
        verb = "exceeds" if requested > dp else "does not divide"
        raise ParallelismError(field, f"{requested} {verb} the {shape}; use one of "
                                      f"{_short_list(_divisors(dp))}")
    return requested


def _hierarchical_setting(distribution: Mapping[str, Any]) -> tuple[Any, str]:
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


def _hierarchical(plan: ParallelismPlan, setting: Any, backend: str) -> bool:
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
            whole = [d for d in _divisors(plan.dp_degree) if d % per_node == 0]
            raise ParallelismError(
                field, f"true needs partition groups of whole nodes, but sharding_degree "
                f"{plan.dp_shard} is not a multiple of the {per_node} data-parallel ranks per "
                f"node; use sharding_degree {_short_list(whole)}, or hierarchical_allgather "
                "auto")
        return False
    return setting is True or backend == "auto"


# ------------------------------------------------------------------------ sharding_degree: auto

def model_state_bytes_per_gpu(num_parameters: int, sharding_degree: int) -> float:
    """Parameters + gradients + optimizer states held by one GPU at this sharding degree."""
    return num_parameters * MODEL_STATE_BYTES_PER_PARAM / sharding_degree


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
) -> int:
    """The smallest node-aligned partition group whose GPUs hold the model states with headroom.

    ``other_bytes_per_gpu`` is what does not shrink with sharding (activations, the unsharded
    layer being computed). Raises ``ValueError`` when even a full shard does not fit.
    """
    budget = device_memory_bytes * (1.0 - headroom) - other_bytes_per_gpu
    for degree in candidate_degrees(world_size, gpus_per_node):
        if model_state_bytes_per_gpu(num_parameters, degree) <= budget:
            return degree
    need = model_state_bytes_per_gpu(num_parameters, world_size) + other_bytes_per_gpu
    raise ValueError(
        f"the model ({num_parameters / 1e9:.2f}B parameters) needs {need / 2**30:.1f} GiB per "
        f"device even fully sharded over {world_size} devices, more than "
        f"{device_memory_bytes * (1 - headroom) / 2**30:.1f} GiB usable; add instances, use a "
        "larger instance type, or enable distribution.activation_checkpointing"
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _short_list(values: list[int]) -> str:
    shown = values if len(values) <= 12 else [*values[:6], "…", *values[-3:]]
    return ", ".join(str(v) for v in shown) or "none"
