"""The parallelism plan: how a job's ranks form the mesh ``pp × dp_replicate × dp_shard × tp``.

STDLIB ONLY. One function, :func:`build_parallelism_plan`, turns the spec's distribution, the
world size, the devices per node and (for ``sharding_degree: auto``) the model size into a frozen
:class:`ParallelismPlan`. Spec validation, ``dtrain plan``, the container contract (the plan
travels to every host as is) and the runtime all call it, so a degree or the hierarchical
all-gather decision is made here and nowhere else.

Axes, outermost first (ranks are node-contiguous, so the innermost axes stay inside a node):

* ``pp``: pipeline stages (only point-to-point traffic crosses it, so it may span nodes; a
  stage's ranks fill part of one node or whole nodes). The schedule, the micro-batches, the stages
  per rank and the partition setting are resolved here too (:mod:`dtrain.core.pipeline`);
* ``dp_replicate``: MiCS replicas of the partition group (gradients all-reduced once per step);
* ``dp_shard``: a MiCS partition group, ``sharding_degree`` ranks that shard the model states
  (1 = DDP, every data-parallel rank = ZeRO-3, in between = MiCS);
* ``tp``: tensor parallelism, innermost, inside a node. In the ``2d`` (Optimus) layout the mesh
  splits it into a ``tp_row × tp_col`` grid (``q × q``); the ranks and their order are the same.

The plan also says how the replicas' gradient all-reduce runs (``gradient_sync``): ``fsdp``, FSDP2's
own all-reduce per block inside backward, or ``overlapped``, SDP-style fusion buffers all-reduced by
a background communicator while backward goes on (see ``docs/concepts/overlapped-gradient-sync.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from dtrain.core import pipeline as ppl
from dtrain.core import tensor_parallel as tpl
from dtrain.core.collective_choices import (
    GRADIENT_SYNCS,
    gradient_sync,
    hierarchical,
    hierarchical_setting,
)
from dtrain.core.errors import ParallelismError
from dtrain.core.sizing import (  # noqa: F401 -- re-exported: the plan's sizing functions
    DEFAULT_HEADROOM,
    MODEL_STATE_BYTES_PER_PARAM,
    candidate_degrees,
    choose_sharding_degree,
    divisors,
    fits,
    memory_fixes,
    model_state_bytes_per_gpu,
    resolve_sharding_degree,
    short_list,
)
from dtrain.core.tensor_parallel import ModelDims

AXES = ("pp", "dp_replicate", "dp_shard", "tp")
GRID_AXES = ("tp_row", "tp_col")  # the 2-D layout's tp axis, as the mesh names it


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
    tp_mode: str = "1d"  # "1d" (Megatron) or "2d" (Optimus q × q grid)
    sequence_parallel: bool = False  # 1-D only: norms and residuals split the sequence
    gradient_sync: str = "fsdp"  # "overlapped" only with replicas to all-reduce across
    pipeline_schedule: str = ppl.NO_PIPELINE  # a name of dtrain.core.pipeline.SCHEDULES when pp > 1
    microbatches: int = 1  # per pipeline step, each a micro-batch of the data loader
    stages_per_rank: int = 1
    partition: str | tuple[int, ...] = "auto"  # auto, uniform, or the blocks stages start at

    def __post_init__(self) -> None:
        product = self.pp * self.dp_replicate * self.dp_shard * self.tp
        assert product == self.world_size, (self, product)
        assert self.world_size % self.devices_per_node == 0, self
        assert self.tp_mode == "1d" or tpl.grid_side(self.tp), self
        assert self.gradient_sync in GRADIENT_SYNCS, self
        assert self.gradient_sync == "fsdp" or self.dp_replicate > 1, self
        assert (self.pp > 1) == (self.pipeline_schedule != ppl.NO_PIPELINE), self
        if isinstance(self.partition, list):  # from JSON
            object.__setattr__(self, "partition", tuple(self.partition))

    # ---------------------------------------------------------------- the mesh

    @property
    def degrees(self) -> tuple[int, int, int, int]:
        """The degrees of :data:`AXES` (the 2-D grid counted as one ``tp`` axis)."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @property
    def tp_grid(self) -> int | None:
        """``q`` of the 2-D layout's ``q × q`` grid; None in 1-D."""
        return tpl.grid_side(self.tp) if self.tp_mode == "2d" else None

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        if self.tp_grid:
            return (self.pp, self.dp_replicate, self.dp_shard, self.tp_grid, self.tp_grid)
        return self.degrees

    @property
    def mesh_axis_names(self) -> tuple[str, ...]:
        return (*AXES[:-1], *GRID_AXES) if self.tp_grid else AXES

    @property
    def tensor_parallel_layout(self) -> str:
        """One line for ``dtrain plan``."""
        if self.tp == 1:
            return "none"
        if self.tp_grid:
            return f"2-D (Optimus) {self.tp_grid} × {self.tp_grid} grid"
        return f"1-D (Megatron) over {self.tp}" + (
            " with sequence parallelism" if self.sequence_parallel else "")

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stage_indices(self, rank: int) -> tuple[int, ...]:
        """The pipeline stages ``rank`` holds (all of them: one, without pipelining)."""
        if self.pp == 1:
            return (0,)
        return ppl.stage_indices(self.coordinates(rank)["pp"], pp=self.pp,
                                 stages_per_rank=self.stages_per_rank,
                                 schedule=self.pipeline_schedule)

    @property
    def bubble_fraction(self) -> float:
        return ppl.bubble_fraction(self.pipeline_schedule, pp=self.pp,
                                   microbatches=self.microbatches,
                                   stages_per_rank=self.stages_per_rank)

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
        for axis, size in zip(reversed(AXES), reversed(self.degrees)):
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

    def replica_group(self, rank: int) -> list[int]:
        """The ranks holding the same shard as ``rank`` in the other replicas, in order: the
        group the replicas' gradient all-reduce runs over."""
        c = self.coordinates(rank)
        return [self._rank_of({**c, "dp_replicate": i}) for i in range(self.dp_replicate)]

    @property
    def replica_group_spans_nodes(self) -> bool:
        """The replicas' gradient all-reduce crosses nodes (same shape for every rank)."""
        return len({r // self.devices_per_node for r in self.replica_group(0)}) > 1

    def tp_group(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s tensor-parallel group (consecutive: ``tp`` is innermost)."""
        first = rank - self.coordinates(rank)["tp"]
        return list(range(first, first + self.tp))

    def _rank_of(self, coords: Mapping[str, int]) -> int:
        rank = 0
        for axis, size in zip(AXES, self.degrees):
            rank = rank * size + coords[axis]
        return rank

    # ---------------------------------------------------------------- transport

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mesh_shape": list(self.mesh_shape),
                "mesh_axis_names": list(self.mesh_axis_names), "strategy": self.strategy,
                "shard_group_spans_nodes": self.shard_group_spans_nodes}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParallelismPlan:
        # fields with defaults may be absent from a plan an older client wrote
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


# ------------------------------------------------------------------------ building the plan

# Bytes per device beyond the model states: a number, or a function of the tensor-parallel degree
# (the planner's activation estimate shrinks with it).
OtherBytes = float | Callable[[int], float]


def build_parallelism_plan(
    distribution: Mapping[str, Any],
    *,
    world_size: int,
    devices_per_node: int,
    num_parameters: int | None = None,
    device_memory_bytes: float | None = None,
    other_bytes_per_device: OtherBytes = 0.0,
    model_dims: ModelDims | None = None,
    num_blocks: int | None = None,
) -> ParallelismPlan | None:
    """The plan for ``distribution`` on ``world_size`` ranks, ``devices_per_node`` per node.

    ``distribution`` holds the spec's keys (``sharding_degree``, ``hierarchical_allgather``,
    ``gradient_sync``, ``backend``, ``tensor_parallel_degree``, ``tensor_parallel_mode``, ``sequence_parallel``,
    ``pipeline_parallel_degree``, ``microbatches``, ``pipeline_schedule``, ``stages_per_rank``,
    ``partition``; missing ones take their defaults). ``model_dims``, when known, refuses
    tensor-parallel degrees that do not split the model; ``num_blocks`` (transformer blocks), when
    known, refuses more pipeline stages than blocks. Returns None when a degree is ``auto`` and the
    model size or the device memory is not known yet: the runtime then calls this again with the
    real model (``pipeline_parallel_degree: auto`` is the planner's to resolve, by its cost
    model). Raises :class:`ParallelismError` naming the spec field when no plan exists.
    """
    if devices_per_node < 1 or world_size % devices_per_node:
        raise ParallelismError(
            "compute.processes_per_instance",
            f"{devices_per_node} processes per node do not divide the world size {world_size}; "
            "start the same number of processes on every node")
    if distribution.get("pipeline_parallel_degree", 1) == "auto":
        return None
    pp = _degree(distribution, "pipeline_parallel_degree")
    _pipeline_settings(distribution, pp=pp, dp_shard=None, world_size=world_size,
                       devices_per_node=devices_per_node, num_blocks=num_blocks)
    mode = distribution.get("tensor_parallel_mode", "1d")
    problem = tpl.mode_problem(mode, 1)
    if problem:
        raise ParallelismError("distribution.tensor_parallel_mode", problem)
    allowed = [t for t in tpl.candidate_degrees(devices_per_node, mode, model_dims)
               if world_size % (t * pp) == 0]
    shape = _Shape(world_size=world_size, devices_per_node=devices_per_node, pp=pp, mode=mode,
                   num_parameters=num_parameters, device_memory_bytes=device_memory_bytes,
                   other_bytes=other_bytes_per_device, num_blocks=num_blocks)
    if distribution.get("tensor_parallel_degree", 1) == "auto":
        return _auto_tensor_parallel(distribution, shape, allowed)
    tp = _degree(distribution, "tensor_parallel_degree")
    field = "distribution.tensor_parallel_degree"
    if devices_per_node % tp:
        raise ParallelismError(
            field, f"{tp} does not divide the {devices_per_node} devices of a node; a "
            f"tensor-parallel group must stay inside a node: use one of {divisors(devices_per_node)}")
    problem = tpl.mode_problem(mode, tp, devices_per_node=devices_per_node)
    if problem:
        raise ParallelismError("distribution.tensor_parallel_mode", problem)
    if model_dims is not None:
        problem = tpl.shape_problem(tp, mode, model_dims, allowed=allowed)
        if problem:
            raise ParallelismError(field, problem)
    return _plan_at(distribution, shape, tp=tp, explicit_tp=True, must_fit=False)


@dataclass(frozen=True)
class _Shape:
    """What a plan is built for, besides the distribution's settings."""

    world_size: int
    devices_per_node: int
    pp: int
    mode: str
    num_parameters: int | None
    device_memory_bytes: float | None
    other_bytes: OtherBytes
    num_blocks: int | None = None

    @property
    def sized(self) -> bool:
        return self.num_parameters is not None and bool(self.device_memory_bytes)

    def other_bytes_at(self, tp: int) -> float:
        return self.other_bytes(tp) if callable(self.other_bytes) else float(self.other_bytes)


def _plan_at(distribution: Mapping[str, Any], shape: _Shape, *, tp: int, explicit_tp: bool,
             must_fit: bool) -> ParallelismPlan | None:
    """The plan at tensor-parallel degree ``tp``; with ``must_fit``, None when it does not fit."""
    world_size, pp = shape.world_size, shape.pp
    if world_size % (tp * pp):
        raise ParallelismError(
            "distribution.pipeline_parallel_degree",
            f"pipeline {pp} × tensor {tp} does not divide the world size {world_size}")
    try:
        sequence_parallel = tpl.sequence_parallel_enabled(
            distribution.get("sequence_parallel", "auto"), tp=tp, mode=shape.mode,
            explicit_tp=explicit_tp)
    except ValueError as exc:
        raise ParallelismError("distribution.sequence_parallel", str(exc)) from None
    dp = world_size // (tp * pp)
    setting, backend = hierarchical_setting(distribution)
    other = shape.other_bytes_at(tp)
    try:
        degree = resolve_sharding_degree(
            distribution.get("sharding_degree", "auto"), dp=dp,
            dp_per_node=max(1, shape.devices_per_node // tp), tp=tp, pp=pp,
            num_parameters=shape.num_parameters, device_memory_bytes=shape.device_memory_bytes,
            other_bytes_per_device=other,
            fixes=memory_fixes(distribution, dp_shard=dp, dp=dp, tp=tp,
                               devices_per_node=shape.devices_per_node))
    except ValueError as exc:
        raise ParallelismError("distribution.sharding_degree", str(exc)) from None
    if degree is None:
        return None
    params = None if shape.num_parameters is None else shape.num_parameters // (tp * pp)
    if must_fit and not fits(params, degree, shape.device_memory_bytes, other):
        return None
    pipeline = _pipeline_settings(distribution, pp=pp, dp_shard=degree, world_size=world_size,
                                  devices_per_node=shape.devices_per_node,
                                  num_blocks=shape.num_blocks)
    plan = ParallelismPlan(world_size=world_size, devices_per_node=shape.devices_per_node, pp=pp,
                           dp_replicate=dp // degree, dp_shard=degree, tp=tp,
                           hierarchical_allgather=False, tp_mode=shape.mode,
                           sequence_parallel=sequence_parallel,
                           pipeline_schedule=pipeline.schedule,
                           microbatches=pipeline.microbatches,
                           stages_per_rank=pipeline.stages_per_rank, partition=pipeline.partition)
    return ParallelismPlan(**{
        **asdict(plan), "hierarchical_allgather": hierarchical(plan, setting, backend),
        "gradient_sync": gradient_sync(plan, distribution.get("gradient_sync", "auto"), backend)})


def _auto_tensor_parallel(distribution: Mapping[str, Any], shape: _Shape,
                          allowed: list[int]) -> ParallelismPlan | None:
    """``tensor_parallel_degree: auto``: the smallest degree at which the model fits (1 when
    MiCS alone holds it), trying the node's degrees that split the model, smallest first."""
    field = "distribution.tensor_parallel_degree"
    if not allowed:
        raise ParallelismError(field, "auto: no degree inside a node splits this model; set "
                               "tensor_parallel_degree 1")
    if not shape.sized:
        return None
    reason = ""
    for tp in allowed:
        try:
            plan = _plan_at(distribution, shape, tp=tp, explicit_tp=False, must_fit=True)
        except ParallelismError as exc:
            if not str(exc).startswith("distribution.sharding_degree: auto:"):
                raise
            reason = str(exc).split("auto: ", 1)[1]
            continue
        if plan is not None:
            return plan
    raise ParallelismError(field, f"auto: not even tensor parallel {allowed[-1]} fits the model: "
                           + (reason or "add instances, use a larger instance type, or enable "
                              "distribution.activation_checkpointing"))


def _pipeline_settings(distribution: Mapping[str, Any], **facts: Any) -> ppl.PipelineSettings:
    try:
        return ppl.resolve_settings(distribution, **facts)
    except ppl.PipelineSettingError as exc:
        raise ParallelismError(exc.field, exc.message) from None


def _degree(distribution: Mapping[str, Any], key: str) -> int:
    value = distribution.get(key, 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParallelismError(f"distribution.{key}", f"{value!r} is not an integer >= 1")
    return value


