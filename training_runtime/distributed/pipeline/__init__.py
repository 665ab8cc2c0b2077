"""Pipeline parallelism for dtrain's model families, on ``torch.distributed.pipelining``.

``dtrain.runtime.shard`` calls :func:`build_pipeline` when the plan has a ``pp`` axis. Per stage,
in torchtitan's order: cut the model into stages that keep the whole model's parameter names
(:mod:`.units`), apply the tensor-parallel plan, ``fully_shard`` each block and then the stage
over the data-parallel axes, then the pipeline stage and the schedule (:mod:`.stages`).

The cut (``partition``): ``auto`` measures every unit's FLOPs, parameters and output size
(:mod:`.measure`) and balances them with :func:`dtrain.core.pipeline.balanced_partition`, within
the device's memory; ``uniform`` and explicit block lists need no measuring.

Parameters stay unsharded from a step's first forward to its last backward
(``reshard_after_forward=False``, torchtitan's default under pipelining): resharding would make
every micro-batch all-gather them again. Zero-bubble schedules (interleaved-zero-bubble, zbv)
*require* it: with resharding after forward, torch 2.13 computes wrong weight gradients for them
without an error (``notes/parallelism-on-gloo``), so for those it is forced, whatever the caller
asks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dtrain.core import pipeline as ppl
from dtrain.core.sizing import DEFAULT_HEADROOM, MODEL_STATE_BYTES_PER_PARAM
from dtrain.runtime import torch_private
from dtrain.runtime.distributed.pipeline.measure import measure_unit_costs
from dtrain.runtime.distributed.pipeline.stages import PipelineModel
from dtrain.runtime.distributed.pipeline.units import StageModule, Unit, check_untied, model_units
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["PipelineModel", "build_pipeline", "reshard_after_forward_for"]

log = logging.getLogger(__name__)
DEFAULT_SAMPLE_SEQ_LEN = 2048


def reshard_after_forward_for(schedule: str, requested: bool | None) -> bool:
    """Whether FSDP may reshard parameters after a stage's forward (see the module docstring)."""
    if ppl.SCHEDULES[schedule].zero_bubble:
        if requested:
            log.info("pipeline schedule %s: parameters stay unsharded between forward and "
                     "backward (reshard_after_forward=True gives wrong gradients there)", schedule)
        return False
    return bool(requested)


def build_pipeline(model: nn.Module, ctx, *, shard_stage: Callable[[StageModule], None],
                   budget_bytes: float, compute_bytes: int,
                   sample_shape: tuple[int, int] | None = None) -> PipelineModel:
    """This rank's stages of ``model``, each prepared by ``shard_stage`` (tensor parallelism and
    FSDP), with the plan's schedule. ``budget_bytes`` is what one device may hold;
    ``sample_shape`` (sequences, tokens) the micro-batch the measuring pass uses."""
    plan = ctx.plan
    units = model_units(model)
    check_untied(model)
    blocks = len(units) - 2
    if plan.num_stages > blocks:
        raise ValueError(
            f"distribution.pipeline_parallel_degree: {plan.pp} ranks × {plan.stages_per_rank} "
            f"stages per rank = {plan.num_stages} stages, but the model has {blocks} blocks; use "
            f"at most {blocks} stages in all")
    costs = measure_unit_costs(model, units, **_sample(model, sample_shape)) \
        if plan.partition == "auto" else None
    per_parameter = (MODEL_STATE_BYTES_PER_PARAM / plan.dp_shard + compute_bytes) / plan.tp
    partition = ppl.choose_partition(
        plan.partition, costs or [ppl.UnitCost(u.name, 0, 0, 0) for u in units], plan.num_stages,
        bytes_per_parameter=per_parameter,
        budget_bytes=budget_bytes * (1 - DEFAULT_HEADROOM) / plan.stages_per_rank)
    indices = plan.stage_indices(ctx.rank)
    stage_modules = [_stage(model, units, partition, index) for index in indices]
    for module in stage_modules:
        shard_stage(module)
        if ppl.SCHEDULES[plan.pipeline_schedule].zero_bubble:  # the trap of the module docstring
            assert not any(reshards for m in module.modules() if isinstance(m, FSDPModule)
                           for reshards in torch_private.fsdp_reshards_after_forward(m))
    if ctx.is_main:
        log.info("pipeline: %s", describe(partition, costs, plan))
    pipelined = PipelineModel(
        stage_modules, stage_indices=indices, num_stages=plan.num_stages,
        schedule=plan.pipeline_schedule, microbatches=plan.microbatches,
        mesh=ctx.mesh, device=ctx.device,
        num_model_parameters=sum(p.numel() for p in model.parameters()),
        hf_config=model.hf_config_dict())
    pipelined.partition, pipelined.unit_costs = partition, costs
    return pipelined


def _stage(model: nn.Module, units: list[Unit], partition: ppl.Partition,
           index: int) -> StageModule:
    return StageModule(model, [units[u] for u in partition.units(index)])


def _sample(model: nn.Module, shape: tuple[int, int] | None) -> dict[str, int]:
    if shape is None:
        config = model.hf_config_dict()
        longest = config.get("max_position_embeddings") or config.get("n_positions")
        shape = (1, min(int(longest or DEFAULT_SAMPLE_SEQ_LEN), DEFAULT_SAMPLE_SEQ_LEN))
    return {"micro_batch_size": shape[0], "seq_len": shape[1]}


def describe(partition: ppl.Partition, costs: list[ppl.UnitCost] | None, plan) -> str:
    """One line: the schedule, then each stage's units and share of the measured FLOPs."""
    head = (f"{plan.num_stages} stages on {plan.pp} ranks, {plan.pipeline_schedule}, "
            f"{plan.microbatches} micro-batches, partition {plan.partition}")
    shares = partition.stage_flops(costs) if costs else None
    total = sum(shares) if shares else 0
    stages = [f"stage {k} = {partition.describe(k)}"
              + (f" ({100 * shares[k] / total:.1f} % of FLOPs)" if total else "")
              for k in range(partition.num_stages)]
    return head + ": " + "; ".join(stages)
