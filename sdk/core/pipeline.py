"""Pipeline parallelism's rules (STDLIB ONLY): schedules, where stages live, the bubble, and how a
model's blocks are cut into stages.

A model is a sequence of *units*: its embeddings, each transformer block, then its head (final
norm and output layer). ``pp`` ranks with ``v`` stages each cut it into ``pp·v`` stages of
consecutive units. Where a rank's stages sit:

* ``loop`` layout (GPipe, 1F1B, interleaved schedules): rank ``r`` holds stages ``r, r+pp, …``;
* ``v`` layout (ZBV): rank ``r`` holds stages ``r`` and ``2·pp−1−r``, so the first and the last
  stage share a rank and the turn-around needs no transfer.

How the units are cut (``partition``):

* ``auto`` (SageMaker's automatic partitioning): from each unit's measured forward+backward FLOPs,
  parameters and output size, dynamic programming over the unit sequence picks the cuts that
  minimise the slowest stage, subject to each stage's model states fitting a device; among equally
  slow cuts, the one sending the smaller tensors across stages, then the earliest;
* ``uniform``: the blocks split evenly, the embeddings with the first stage, the head with the last;
* a list: the block each stage after the first starts with (``[4]`` at two stages: blocks 0–3 and
  4–end).

:func:`dtrain.core.parallelism.build_parallelism_plan` resolves the settings with these functions;
the planner predicts with them, the runtime builds its stages with them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dtrain.core.presets import unit_parameters


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule of ``torch.distributed.pipelining``."""

    name: str
    torch_class: str
    multi_stage: bool  # runs several stages per rank (virtual stages)
    zero_bubble: bool  # splits the backward into input and weight gradients
    v_layout: bool = False


SCHEDULES = {s.name: s for s in (
    Schedule("gpipe", "ScheduleGPipe", multi_stage=False, zero_bubble=False),
    Schedule("1f1b", "Schedule1F1B", multi_stage=False, zero_bubble=False),
    Schedule("interleaved-1f1b", "ScheduleInterleaved1F1B", multi_stage=True, zero_bubble=False),
    Schedule("interleaved-zero-bubble", "ScheduleInterleavedZeroBubble", multi_stage=True,
             zero_bubble=True),
    Schedule("zbv", "ScheduleZBVZeroBubble", multi_stage=True, zero_bubble=True, v_layout=True),
)}
SCHEDULE_CHOICES = (*SCHEDULES, "auto")
PARTITION_CHOICES = ("auto", "uniform")
NO_PIPELINE = "none"  # the schedule of a plan without pipeline stages


class PipelineSettingError(ValueError):
    """A pipeline setting no pipeline can run; ``field`` is the spec field to change."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class PipelineSettings:
    """The resolved pipeline settings a parallelism plan carries."""

    schedule: str = NO_PIPELINE
    microbatches: int = 1
    stages_per_rank: int = 1
    partition: str | tuple[int, ...] = "auto"


# ------------------------------------------------------------------------ the settings


def resolve_settings(distribution: Mapping[str, Any], *, pp: int, dp_shard: int | None,
                     world_size: int, devices_per_node: int,
                     num_blocks: int | None = None) -> PipelineSettings:
    """Resolve ``pipeline_schedule``, ``microbatches``, ``stages_per_rank`` and ``partition`` for
    ``pp`` ranks; raises :class:`PipelineSettingError`. ``num_blocks`` (the model's transformer
    blocks), when known, is checked against the stages and lets ``auto`` pick interleaving;
    ``dp_shard`` (None: not sized yet) decides whether it may be zero-bubble."""
    raw = {key: distribution.get(key, "auto") for key in
           ("pipeline_schedule", "microbatches", "stages_per_rank", "partition")}
    if pp == 1:
        for key, value in raw.items():
            if value != "auto":
                raise PipelineSettingError(
                    f"distribution.{key}", f"{value!r} applies to pipeline parallelism; set "
                    "pipeline_parallel_degree above 1 or remove it")
        return PipelineSettings()
    _check_node_alignment(pp, world_size, devices_per_node)
    microbatches = _microbatches(raw["microbatches"], pp)
    per_rank = raw["stages_per_rank"]
    if per_rank == "auto" and isinstance(raw["partition"], (list, tuple)) and (
            len(raw["partition"]) + 1) % pp == 0:
        per_rank = (len(raw["partition"]) + 1) // pp  # the stages a partition lists
    schedule, per_rank = _schedule(raw["pipeline_schedule"], per_rank, pp=pp,
                                   microbatches=microbatches, dp_shard=dp_shard,
                                   num_blocks=num_blocks)
    problem = microbatch_problem(schedule, microbatches=microbatches, pp=pp)
    if problem:
        raise PipelineSettingError("distribution.microbatches", problem)
    num_stages = pp * per_rank
    if num_blocks is not None and num_stages > num_blocks:
        raise PipelineSettingError(
            "distribution.pipeline_parallel_degree",
            f"{pp} ranks × {per_rank} stages per rank = {num_stages} stages, but the model has "
            f"{num_blocks} blocks; use at most {num_blocks} stages in all")
    partition = _partition_setting(raw["partition"], num_stages=num_stages, num_blocks=num_blocks)
    return PipelineSettings(schedule, microbatches, per_rank, partition)


def _check_node_alignment(pp: int, world_size: int, devices_per_node: int) -> None:
    """``pp`` is the outermost axis: a stage's ranks fill part of one node or whole nodes, so only
    the stages' point-to-point transfers cross between nodes, never a stage's collectives."""
    per_stage = world_size // pp
    if world_size % pp == 0 and (per_stage % devices_per_node == 0
                                 or devices_per_node % per_stage == 0):
        return
    good = [d for d in range(1, world_size + 1) if world_size % d == 0 and (
        (world_size // d) % devices_per_node == 0 or devices_per_node % (world_size // d) == 0)]
    why = (f"{pp} does not divide the world size {world_size} into stages of equal ranks"
           if world_size % pp else
           f"{pp} stages of {per_stage} ranks straddle nodes of {devices_per_node}; a stage must "
           "fill part of one node or whole nodes")
    raise PipelineSettingError("distribution.pipeline_parallel_degree",
                               f"{why}: use one of {', '.join(map(str, good))}")


def _microbatches(value: Any, pp: int) -> int:
    if value == "auto":
        return 2 * pp  # the 1F1B bubble is then (pp−1)/(3·pp−1): under a third
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PipelineSettingError("distribution.microbatches",
                                   f"{value!r} is not an integer >= 1 (or auto)")
    return value


def _schedule(name: Any, per_rank: Any, *, pp: int, microbatches: int, dp_shard: int | None,
              num_blocks: int | None) -> tuple[str, int]:
    field = "distribution.stages_per_rank"
    if per_rank != "auto" and (isinstance(per_rank, bool) or not isinstance(per_rank, int)
                               or per_rank < 1):
        raise PipelineSettingError(field, f"{per_rank!r} is not an integer >= 1 (or auto)")
    if name == "auto":
        name = _auto_schedule(per_rank, pp=pp, microbatches=microbatches, dp_shard=dp_shard,
                              num_blocks=num_blocks)
    if name not in SCHEDULES:
        raise PipelineSettingError("distribution.pipeline_schedule",
                                   f"{name!r}: use one of {', '.join(SCHEDULE_CHOICES)}")
    schedule = SCHEDULES[name]
    if not schedule.multi_stage:
        if per_rank not in ("auto", 1):
            raise PipelineSettingError(
                field, f"{per_rank}: {name} runs one stage per rank; use interleaved-1f1b, "
                "interleaved-zero-bubble or zbv for several, or stages_per_rank 1")
        return name, 1
    if schedule.v_layout and per_rank not in ("auto", 2):
        raise PipelineSettingError(field, f"{per_rank}: zbv runs exactly 2 stages per rank (its "
                                          "V layout); use 2 or another schedule")
    if per_rank == 1:
        raise PipelineSettingError(field, f"1: {name} interleaves several stages per rank; use "
                                          "2 or more, or the schedule 1f1b")
    return name, 2 if per_rank == "auto" else per_rank


def _auto_schedule(per_rank: Any, *, pp: int, microbatches: int, dp_shard: int | None,
                   num_blocks: int | None) -> str:
    """Interleave two stages per rank when the model is known to have the blocks for it (a
    smaller bubble), or the stages per rank given are more than one; zero-bubble where no
    partition group reshards parameters (it needs them kept whole between forward and
    backward); else 1F1B, or GPipe below ``pp`` micro-batches."""
    stages = 2 if per_rank == "auto" else per_rank
    # several stages a rank asked for by number: interleaved (the block count, once the model is
    # known, is checked with the partition); asked for by auto: only where the blocks are there
    enough = per_rank != "auto" or (num_blocks is not None and num_blocks >= stages * pp)
    if per_rank != 1 and enough:
        name = "interleaved-zero-bubble" if dp_shard == 1 else "interleaved-1f1b"
        # stages asked for by number stay interleaved: a micro-batch count it cannot run is
        # then said for that schedule, not as 1f1b refusing the stages
        if per_rank != "auto" or microbatch_problem(name, microbatches=microbatches,
                                                    pp=pp) is None:
            return name
    return "1f1b" if microbatches >= pp else "gpipe"


def microbatch_problem(schedule: str, *, microbatches: int, pp: int) -> str | None:
    """Why ``schedule`` cannot run ``microbatches`` on ``pp`` ranks (torch's rules), or None."""
    if schedule == "1f1b" and microbatches < pp:
        return (f"{microbatches}: 1f1b needs at least as many micro-batches as pipeline ranks "
                f"({pp}); use microbatches >= {pp}, or pipeline_schedule gpipe")
    if SCHEDULES[schedule].multi_stage and not SCHEDULES[schedule].v_layout:
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            good = [m for m in range(1, 4 * pp + 1) if m % max(1, m // pp) == 0]
            return (f"{microbatches}: {schedule} runs micro-batches in rounds of about {pp} "
                    f"(the pipeline ranks) and needs a whole number of rounds; use one of "
                    f"{', '.join(map(str, good))}, or any multiple of {pp}")
    return None


def _partition_setting(value: Any, *, num_stages: int,
                       num_blocks: int | None) -> str | tuple[int, ...]:
    field = "distribution.partition"
    if value in PARTITION_CHOICES:
        return value
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise PipelineSettingError(field, f"{value!r}: use auto, uniform, or a list of the block "
                                          "each stage after the first starts with")
    starts = tuple(value)
    if len(starts) != num_stages - 1:
        count = f"{num_stages - 1} block ind{'ex' if num_stages == 2 else 'ices'}"
        raise PipelineSettingError(field, f"{list(starts)} gives {len(starts) + 1} stages but the "
                                          f"pipeline has {num_stages}; list {count}")
    top = num_blocks if num_blocks is not None else None
    if any(b <= a for a, b in zip((0, *starts), starts)) or (top is not None and starts
                                                               and starts[-1] >= top):
        limit = f"1 to {top - 1}" if top is not None else "1 up"
        raise PipelineSettingError(field, f"{list(starts)}: block indices must rise strictly, "
                                          f"from {limit}, so every stage holds a block")
    return starts


# ------------------------------------------------------------------------ where stages live


def stage_indices(pp_rank: int, *, pp: int, stages_per_rank: int, schedule: str
                  ) -> tuple[int, ...]:
    """The stages rank ``pp_rank`` of the pipeline holds, in order."""
    if SCHEDULES[schedule].v_layout:
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return tuple(pp_rank + k * pp for k in range(stages_per_rank))


def stage_rank(stage: int, *, pp: int, schedule: str) -> int:
    """The pipeline rank that holds ``stage``."""
    if SCHEDULES[schedule].v_layout and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


def bubble_fraction(schedule: str, *, pp: int, microbatches: int,
                    stages_per_rank: int) -> float:
    """The idle share of a step: ``(p−1)/(k·v·m + p−1)`` for ``p`` ranks, ``m`` micro-batches,
    ``v`` stages per rank; ``k`` = 1, or 3 for zero-bubble schedules (only the input-gradient part
    of the backward, about a third of the work, waits on the next stage). GPipe and 1F1B idle
    alike; 1F1B keeps fewer micro-batches' activations."""
    if schedule == NO_PIPELINE or pp == 1:
        return 0.0
    k = 3 if SCHEDULES[schedule].zero_bubble else 1
    return (pp - 1) / (k * stages_per_rank * microbatches + pp - 1)


# ------------------------------------------------------------------------ partitioning


@dataclass(frozen=True)
class UnitCost:
    """What a unit costs for one micro-batch."""

    name: str  # "embeddings", "block 3", "head"
    flops: int  # forward + backward
    parameters: int
    output_bytes: int  # the tensor it hands to the next unit (what crosses a cut after it)


@dataclass(frozen=True)
class Partition:
    """Stage ``k`` holds units ``starts[k]`` up to ``starts[k+1]`` (or the last)."""

    starts: tuple[int, ...]
    num_units: int

    @property
    def num_stages(self) -> int:
        return len(self.starts)

    def units(self, stage: int) -> range:
        end = self.starts[stage + 1] if stage + 1 < len(self.starts) else self.num_units
        return range(self.starts[stage], end)

    def stage_flops(self, costs: Sequence[UnitCost]) -> list[int]:
        return [sum(costs[u].flops for u in self.units(k)) for k in range(self.num_stages)]

    def stage_parameters(self, costs: Sequence[UnitCost]) -> list[int]:
        return [sum(costs[u].parameters for u in self.units(k)) for k in range(self.num_stages)]

    def cut_bytes(self, costs: Sequence[UnitCost]) -> list[int]:
        """The tensor crossing each cut, per micro-batch (its gradient crosses back)."""
        return [costs[start - 1].output_bytes for start in self.starts[1:]]

    def describe(self, stage: int) -> str:
        """``embeddings + blocks 0-3``, ``block 7 + head``."""
        units = self.units(stage)
        blocks = [u - 1 for u in units if 0 < u < self.num_units - 1]
        parts = ["embeddings"] if units[0] == 0 else []
        if blocks:
            parts.append(f"block {blocks[0]}" if len(blocks) == 1
                         else f"blocks {blocks[0]}-{blocks[-1]}")
        if units[-1] == self.num_units - 1:
            parts.append("head")
        return " + ".join(parts)


def uniform_partition(num_blocks: int, num_stages: int) -> Partition:
    """Blocks split evenly (the first stages take one more when they do not divide)."""
    sizes = [num_blocks // num_stages + (k < num_blocks % num_stages) for k in range(num_stages)]
    starts = [0] + [1 + sum(sizes[:k]) for k in range(1, num_stages)]
    return Partition(tuple(starts), num_blocks + 2)


def explicit_partition(block_starts: Sequence[int], num_blocks: int) -> Partition:
    return Partition((0, *(1 + b for b in block_starts)), num_blocks + 2)


def balanced_partition(costs: Sequence[UnitCost], num_stages: int, *,
                       bytes_per_parameter: float = 0.0,
                       budget_bytes: float | None = None) -> Partition:
    """The cut minimising the slowest stage's FLOPs, each stage's ``parameters ×
    bytes_per_parameter`` within ``budget_bytes``; ties go to smaller cross-cut tensors, then to
    the earliest cuts. Raises ValueError when no cut fits."""
    n = len(costs)
    flops, params = [0], [0]
    for cost in costs:
        flops.append(flops[-1] + cost.flops)
        params.append(params[-1] + cost.parameters)
    # best[i]: (slowest stage, cut bytes, starts) for units [0, i) in the stages placed so far
    best: list[tuple | None] = [(0, 0, ())] + [None] * n
    for k in range(1, num_stages + 1):
        current: list[tuple | None] = [None] * (n + 1)
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                prev = best[j]
                if prev is None:
                    continue
                if budget_bytes is not None and (
                        (params[i] - params[j]) * bytes_per_parameter > budget_bytes):
                    continue
                cut = prev[1] + (costs[j - 1].output_bytes if j else 0)
                candidate = (max(prev[0], flops[i] - flops[j]), cut, (*prev[2], j))
                if current[i] is None or candidate < current[i]:
                    current[i] = candidate
        best = current
    if best[n] is None:
        need = params[n] * bytes_per_parameter / num_stages
        raise ValueError(
            f"no cut into {num_stages} stages fits the model's states in "
            f"{budget_bytes / 2**30:.1f} GiB per stage (they need {need / 2**30:.1f} GiB per "
            "stage at the very least); raise pipeline_parallel_degree, sharding_degree or "
            "tensor_parallel_degree")
    return Partition(best[n][2], n)


def choose_partition(setting: str | Sequence[int], costs: Sequence[UnitCost], num_stages: int,
                     *, bytes_per_parameter: float = 0.0,
                     budget_bytes: float | None = None) -> Partition:
    """The partition ``setting`` (auto, uniform or block starts) asks for, over ``costs``."""
    num_blocks = len(costs) - 2
    if setting == "auto":
        return balanced_partition(costs, num_stages, bytes_per_parameter=bytes_per_parameter,
                                  budget_bytes=budget_bytes)
    if setting == "uniform":
        return uniform_partition(num_blocks, num_stages)
    return explicit_partition(setting, num_blocks)


def transformer_unit_costs(config: Mapping[str, Any], *, seq_len: int, micro_batch_size: int,
                           bytes_per_value: int = 2) -> list[UnitCost]:
    """Predicted unit costs of an HF-style config, counted as ``FlopCounterMode`` counts them
    (matrix products only: ``2·m·n·k`` each, the attention scores ``4·b·s²·h``; backward twice the
    forward), so they match the runtime's measuring pass for dtrain's model families."""
    h = int(config["hidden_size"])
    ffn = int(config.get("intermediate_size") or 4 * h)
    vocab = int(config["vocab_size"])
    layers = int(config["num_hidden_layers"])
    tokens = seq_len * micro_batch_size
    embeddings, block, head = unit_parameters(config)
    block_forward = 2 * tokens * (4 * h * h + 2 * h * ffn) + 4 * micro_batch_size * seq_len**2 * h
    hidden_bytes = tokens * h * bytes_per_value
    units = [UnitCost("embeddings", 0, embeddings, hidden_bytes)]
    units += [UnitCost(f"block {i}", 3 * block_forward, block, hidden_bytes)
              for i in range(layers)]
    units.append(UnitCost("head", 3 * 2 * tokens * h * vocab, head,
                          tokens * vocab * bytes_per_value))
    return units


def tied_head_problem(model_type: str) -> str:
    """Why a model whose output layer shares the token embedding cannot be pipelined."""
    return (f"{model_type} here ties its output layer to the token embedding "
            "(tie_word_embeddings), which the first and the last pipeline stage cannot share; "
            "set tie_word_embeddings false in the model config, or pipeline_parallel_degree 1")
