"""The planner's side of pipeline parallelism (stdlib only): the partition it predicts, the
bubble, the transfers, a pipelined step's time and memory, and ``pipeline_parallel_degree: auto``.

The stages' costs are :func:`dtrain.core.pipeline.transformer_unit_costs`, which count what the
runtime's measuring pass counts, and the cut is :func:`dtrain.core.pipeline.choose_partition`, the
runtime's own, so the partition ``dtrain plan`` prints is the one that runs. One optimizer step of
``A`` pipeline steps, each of ``m`` micro-batches on ``p`` ranks (``docs/cost-model.md``):

* the busiest rank computes ``t`` per micro-batch (its stages' share of the FLOPs, divided by
  ``tp``, plus its share of the tensor-parallel traffic); a step takes ``m·t / (1 − bubble)``;
* each micro-batch sends its activations forward and their gradients back across every cut;
  transfers overlap compute except while the pipeline fills and drains: ``2·(stages − 1)`` of
  them sit on the critical path;
* parameters stay unsharded through a step, so the partition group all-gathers them and
  reduce-scatters gradients once per pipeline step, and replicas all-reduce once per pipeline
  step (torch's schedule syncs at each step's last backward); these sit at the step's edges.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dtrain.core import pipeline as ppl
from dtrain.core.errors import SpecError
from dtrain.core.parallelism import (
    ParallelismError,
    ParallelismPlan,
    build_parallelism_plan,
    candidate_degrees,
)
from dtrain.core.sizing import DEFAULT_HEADROOM, MODEL_STATE_BYTES_PER_PARAM, memory_fixes
from dtrain.core.tensor_parallel import candidate_degrees as tp_degrees
from dtrain.planning import costmodel
from dtrain.planning.memory import Layout, MemoryEstimate, activation_bytes, memory_estimate

GIB = 2**30
# the pipeline settings as a plan without a pipeline takes them
UNSET = {key: "auto" for key in ("microbatches", "pipeline_schedule", "stages_per_rank",
                                 "partition")}


@dataclass
class PipelineEstimate:
    """What ``dtrain plan`` says about the pipeline of a plan with ``pp > 1``."""

    stages: list[str]  # "embeddings + blocks 0-6", per stage
    shares: list[float]  # each stage's share of the model's FLOPs
    bubble: float
    transfer_bytes: float  # per cut and micro-batch, one direction
    bytes_per_rank: float  # sent by the busiest rank per optimizer step
    across_nodes: bool  # some cut joins stages on different nodes
    step: costmodel.StepEstimate
    memory: MemoryEstimate
    problem: str = ""  # why no cut fits the devices (then the estimate is of the uniform cut)


@dataclass
class Candidate:
    """One ``(pp, tp, shard)`` layout ``auto`` weighed."""

    plan: ParallelismPlan
    memory_gib: float
    fits: bool
    step: costmodel.StepEstimate | None = None
    why_not: str = ""


@dataclass
class LayoutChoice:
    plan: ParallelismPlan | None
    reason: str
    candidates: list[Candidate] = field(default_factory=list)


def unit_costs(model: Any, *, bytes_per_value: int) -> list[ppl.UnitCost]:
    """The predicted units of ``model`` (a planner ``ModelShape``) for one micro-batch."""
    config = {"hidden_size": model.hidden_size, "num_hidden_layers": model.num_layers,
              "vocab_size": model.vocab_size, "intermediate_size": model.intermediate_size,
              "tie_word_embeddings": False}
    return ppl.transformer_unit_costs(config, seq_len=model.seq_len,
                                      micro_batch_size=model.micro_batch_size,
                                      bytes_per_value=bytes_per_value)


def partition_for(plan: ParallelismPlan, costs: list[ppl.UnitCost], *, compute_bytes: int,
                  device_gib: float) -> ppl.Partition:
    """The runtime's cut (``dtrain.runtime.distributed.pipeline.build_pipeline``)."""
    per_parameter = (MODEL_STATE_BYTES_PER_PARAM / plan.dp_shard + compute_bytes) / plan.tp
    budget = device_gib * GIB * (1 - DEFAULT_HEADROOM) / plan.stages_per_rank or None
    return ppl.choose_partition(plan.partition, costs, plan.num_stages,
                                bytes_per_parameter=per_parameter, budget_bytes=budget)


def estimate(plan: ParallelismPlan, model: Any, work: costmodel.Workload,
             cluster: costmodel.Cluster, *, accumulation: int,
             device_gib: float) -> PipelineEstimate:
    """Step time, memory and transfers of ``plan``'s pipeline (module docstring)."""
    costs = unit_costs(model, bytes_per_value=work.compute_bytes)
    problem = ""
    try:
        part = partition_for(plan, costs, compute_bytes=work.compute_bytes, device_gib=device_gib)
    except ValueError as exc:  # nothing fits: say so, and estimate the cut without the limit
        problem = str(exc)
        part = partition_for(plan, costs, compute_bytes=work.compute_bytes, device_gib=0.0)
    flops, params = part.stage_flops(costs), part.stage_parameters(costs)
    total = sum(flops) or 1
    ranks = [ppl.stage_indices(r, pp=plan.pp, stages_per_rank=plan.stages_per_rank,
                               schedule=plan.pipeline_schedule) for r in range(plan.pp)]
    busiest = max(ranks, key=lambda stages: sum(flops[s] for s in stages))
    share = sum(flops[s] for s in busiest) / total
    rank_params = max(sum(params[s] for s in stages) for stages in ranks)

    tp_traffic = costmodel.tensor_parallel_traffic(work, cluster, tp=plan.tp, mode=plan.tp_mode)
    per_micro = (costmodel.compute_seconds(work, cluster) / plan.tp + tp_traffic.seconds) * share
    bubble = plan.bubble_fraction
    pipeline_s = plan.microbatches * per_micro / (1 - bubble)

    split = plan.sequence_parallel or plan.tp_mode == "2d"
    transfer = costs[0].output_bytes / (plan.tp if split else 1)
    per_stage = plan.world_size // plan.pp
    across = plan.num_nodes > 1  # pp is outermost: a pipeline over nodes has cuts between them
    senders = min(per_stage, cluster.gpus_per_node)  # ranks of a node sending across at once
    link = (cluster.inter_gbits_per_s * 1e9 / 8 / senders if across
            else cluster.intra_gbytes_per_s * 1e9)
    exposed = 2 * (plan.num_stages - 1) * (transfer / link + cluster.latency_s)
    sends = max(sum((s < plan.num_stages - 1) + (s > 0) for s in stages) for stages in ranks)
    sent = accumulation * plan.microbatches * sends * transfer

    gather, reduce, all_reduce = _stage_collectives(plan, rank_params / plan.tp, work, cluster)
    fsdp = costmodel.Traffic()
    for collective in (gather, reduce, all_reduce):
        fsdp.add(collective)
    step_s = accumulation * (pipeline_s + exposed + fsdp.seconds)
    edges = costmodel.Exposed(accumulation * gather.seconds, accumulation * reduce.seconds,
                              accumulation * all_reduce.seconds, accumulation * exposed)
    tokens = accumulation * plan.microbatches * work.seq_len * work.micro_batch_size \
        * plan.dp_degree
    inter = accumulation * fsdp.inter_bytes + (sent if across else 0.0)
    tp_bytes = accumulation * plan.microbatches * share * tp_traffic.intra_bytes
    step = costmodel.StepEstimate(
        strategy=f"PP {plan.pp} × {plan.strategy}", sharding_degree=plan.dp_shard,
        hierarchical=plan.hierarchical_allgather, compute_s=accumulation * pipeline_s, micro_comm=fsdp,
        boundary_comm=costmodel.Traffic(), step_s=step_s, tokens_per_s=tokens / step_s,
        intra_bytes=accumulation * fsdp.intra_bytes + (0.0 if across else sent) + tp_bytes,
        inter_bytes=inter, tensor_parallel=plan.tp, pipeline=plan.pp, exposed=edges,
        tp_bytes=tp_bytes)  # tensor parallelism's share of intra_bytes, as without a pipeline
    memory = _memory(plan, work, model, rank_params=rank_params,
                     holds_head=any(plan.num_stages - 1 in s for s in ranks),
                     layers=max(sum(_blocks(part, s) for s in stages) for stages in ranks),
                     device_gib=device_gib)
    return PipelineEstimate(
        stages=[part.describe(k) for k in range(part.num_stages)],
        shares=[f / total for f in flops], bubble=bubble, transfer_bytes=transfer,
        bytes_per_rank=sent, across_nodes=across, step=step, memory=memory, problem=problem)


def _blocks(part: ppl.Partition, stage: int) -> int:
    return sum(1 for u in part.units(stage) if 0 < u < part.num_units - 1)


def _stage_collectives(plan: ParallelismPlan, params: float, work: costmodel.Workload,
                       cluster: costmodel.Cluster) -> tuple[costmodel.Traffic, ...]:
    """One pipeline step's FSDP collectives of a rank holding ``params`` (its tensor-parallel
    share): an all-gather (the hierarchical one where the plan has it, as the stages' FSDP2
    units do) and a reduce-scatter in the partition group, a replica all-reduce."""
    gpn = cluster.gpus_per_node
    nodes, per_node = costmodel.group_layout(plan.dp_shard, stride=plan.tp, gpus_per_node=gpn)
    shape = {"ranks": plan.dp_shard, "nodes": nodes, "per_node": per_node, "cluster": cluster}
    gather = (costmodel.hierarchical_allgather if plan.hierarchical_allgather
              else costmodel.ring)(params * work.compute_bytes, **shape)
    reduce = costmodel.ring(params * costmodel.GRAD_REDUCE_BYTES, **shape,
                            factor=costmodel.reduce_scatter_factor_of(
                                cluster, ranks=plan.dp_shard, nodes=nodes))
    r_nodes, r_per_node = costmodel.group_layout(plan.dp_replicate, stride=plan.dp_shard * plan.tp,
                                                 gpus_per_node=gpn)
    all_reduce = costmodel.ring(params * costmodel.GRAD_REDUCE_BYTES / plan.dp_shard,
                                ranks=plan.dp_replicate, nodes=r_nodes, per_node=r_per_node,
                                cluster=cluster, factor=2)
    return gather, reduce, all_reduce


def _memory(plan: ParallelismPlan, work: costmodel.Workload, model: Any, *, rank_params: int,
            holds_head: bool, layers: int, device_gib: float) -> MemoryEstimate:
    """The busiest rank: its stages' states, its stages' parameters whole through the step,
    and the activations of the micro-batches in flight (all of them for GPipe; for the 1F1B
    family, up to ``pp``)."""
    layout = Layout(plan.tp, plan.tp_mode, plan.sequence_parallel)
    in_flight = plan.microbatches if plan.pipeline_schedule == "gpipe" else min(
        plan.microbatches, plan.pp * plan.stages_per_rank)
    stage_work = costmodel.Workload(
        num_parameters=rank_params, num_layers=layers, hidden_size=work.hidden_size,
        seq_len=work.seq_len, micro_batch_size=work.micro_batch_size,
        compute_bytes=work.compute_bytes, activation_checkpointing=work.activation_checkpointing)
    kept = in_flight * activation_bytes(stage_work, layout, vocab_size=0)
    if holds_head:
        kept += activation_bytes(stage_work, layout, vocab_size=model.vocab_size) - \
            activation_bytes(stage_work, layout, vocab_size=0)
    states = memory_estimate(stage_work, layout, sharding_degree=plan.dp_shard,
                             vocab_size=0, device_gib=device_gib).model_state_gib
    return MemoryEstimate(model_state_gib=states,
                          unsharded_layers_gib=rank_params / plan.tp * work.compute_bytes / GIB,
                          activation_gib=kept / GIB, device_gib=device_gib)


def auto_layout(spec: Any, model: Any, work: costmodel.Workload | None,
                cluster: costmodel.Cluster, notes: list[str]) -> LayoutChoice | None:
    """``pipeline_parallel_degree: auto`` for a spec (:func:`choose_layout`); without the model's
    size or a device's memory, no pipeline (a note says so)."""
    inst, compute, dist = spec.compute.instance, spec.compute, spec.distribution
    if model is None or not inst.gpu_memory_gib:
        notes.append("pipeline_parallel_degree auto: needs the model's size (hyperparameters) "
                     "and a GPU instance type's memory; planned without pipeline stages")
        return None
    try:
        return choose_layout(
            dist.model_dump(mode="json"), world_size=compute.world_size,
            devices_per_node=compute.resolved_processes_per_instance, model=model, work=work,
            cluster=cluster, accumulation=dist.gradient_accumulation_steps,
            device_gib=float(inst.gpu_memory_gib))
    except ParallelismError as exc:
        raise SpecError(str(exc)) from None


def choose_layout(distribution: dict, *, world_size: int, devices_per_node: int, model: Any,
                  work: costmodel.Workload, cluster: costmodel.Cluster, accumulation: int,
                  device_gib: float) -> LayoutChoice:
    """``pipeline_parallel_degree: auto``: every ``(pp, tp, shard)`` the cluster allows (``auto``
    degrees searched, set ones kept), the layouts whose memory fits first, then the fastest
    predicted (tokens/s); the smaller pipeline, then the smaller tensor-parallel degree on ties."""
    tps = ([distribution["tensor_parallel_degree"]]
           if distribution.get("tensor_parallel_degree", 1) != "auto"
           else tp_degrees(devices_per_node, distribution.get("tensor_parallel_mode", "1d"),
                           model.dims))
    candidates = []
    # a tied output layer cannot be cut from the embedding it shares: no pipeline for it
    deepest = 1 if model.tied_embeddings else model.num_layers
    for pp in [d for d in range(1, deepest + 1) if world_size % d == 0]:
        for tp in [t for t in tps if world_size % (pp * t) == 0]:
            dp = world_size // (pp * tp)
            shards = ([distribution["sharding_degree"]]
                      if distribution.get("sharding_degree", "auto") != "auto"
                      else candidate_degrees(dp, max(1, devices_per_node // tp)))
            for shard in shards:
                candidate = _candidate(distribution, pp=pp, tp=tp, shard=shard,
                                       world_size=world_size, devices_per_node=devices_per_node,
                                       model=model, work=work, cluster=cluster,
                                       accumulation=accumulation, device_gib=device_gib)
                if candidate is not None:
                    candidates.append(candidate)
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        smallest = min(candidates, key=lambda c: c.memory_gib, default=None)
        fixes = memory_fixes(distribution, dp_shard=smallest.plan.dp_shard,
                             dp=smallest.plan.dp_degree, tp=smallest.plan.tp,
                             devices_per_node=devices_per_node) if smallest else None
        raise ParallelismError(
            "distribution.pipeline_parallel_degree",
            f"auto: no pipeline × tensor × sharding layout fits the model (the smallest needs "
            f"{smallest.memory_gib if smallest else 0.0:.1f} GiB per device, "
            f"{device_gib * (1 - DEFAULT_HEADROOM):.1f} GiB usable); "
            f"{fixes or 'use more or larger instances'}")
    fitting.sort(key=lambda c: (-c.step.tokens_per_s, c.plan.pp, c.plan.tp))
    best = fitting[0]
    reason = (f"auto: of {len(candidates)} layouts, {len(fitting)} fit in "
              f"{device_gib * (1 - DEFAULT_HEADROOM):.0f} GiB usable per device; the fastest "
              f"predicted is pp {best.plan.pp} × tp {best.plan.tp} × shard {best.plan.dp_shard}"
              f" ({best.step.tokens_per_s:,.0f} tokens/s)")
    if len(fitting) > 1:
        runner = fitting[1]
        reason += (f", ahead of pp {runner.plan.pp} × tp {runner.plan.tp} × shard "
                   f"{runner.plan.dp_shard} ({runner.step.tokens_per_s:,.0f})")
    return LayoutChoice(best.plan, reason, sorted(candidates, key=_rank))


def _rank(c: Candidate) -> tuple:
    return (not c.fits, -(c.step.tokens_per_s if c.step else 0.0), c.plan.pp, c.plan.tp)


def _candidate(distribution: dict, *, pp: int, tp: int, shard: int, world_size: int,
               devices_per_node: int, model: Any, work: costmodel.Workload,
               cluster: costmodel.Cluster, accumulation: int,
               device_gib: float) -> Candidate | None:
    settings = {**distribution, "pipeline_parallel_degree": pp, "tensor_parallel_degree": tp,
                "sharding_degree": shard}
    if pp == 1:  # the pipeline settings mean nothing without a pipeline
        settings.update(UNSET)
    try:
        plan = build_parallelism_plan(settings, world_size=world_size,
                                      devices_per_node=devices_per_node, model_dims=model.dims,
                                      num_blocks=model.num_layers)
    except ParallelismError:
        return None
    if pp > 1:
        est = estimate(plan, model, work, cluster, accumulation=accumulation,
                       device_gib=device_gib)
        if est.problem:
            return Candidate(plan, est.memory.total_gib, False, est.step, why_not=est.problem)
        memory, step = est.memory, est.step
    else:
        layout = Layout(plan.tp, plan.tp_mode, plan.sequence_parallel)
        memory = memory_estimate(work, layout, sharding_degree=plan.dp_shard,
                                 vocab_size=model.vocab_size, device_gib=device_gib)
        # the collectives the plan runs, as the planner's row for it (Plan.chosen) counts them
        step = costmodel.estimate_step(work, cluster, sharding_degree=plan.dp_shard,
                                       accumulation=accumulation, tp=plan.tp, tp_mode=plan.tp_mode,
                                       hierarchical=plan.hierarchical_allgather,
                                       gradient_sync=plan.gradient_sync)
    usable = device_gib * (1 - DEFAULT_HEADROOM)
    return Candidate(plan, memory.total_gib, memory.total_gib <= usable, step)


def summary(plan: ParallelismPlan | None, est: PipelineEstimate | None,
            choice: LayoutChoice | None) -> dict[str, Any] | None:
    """The pipeline part of ``dtrain plan -o json``."""
    if plan is None or (plan.pp == 1 and choice is None):
        return None
    out: dict[str, Any] = {
        "degree": plan.pp, "schedule": plan.pipeline_schedule, "stages": plan.num_stages,
        "stages_per_rank": plan.stages_per_rank, "microbatches": plan.microbatches,
        "partition": list(plan.partition) if isinstance(plan.partition, tuple)
        else plan.partition, "bubble": plan.bubble_fraction}
    if est is not None:
        out.update(stage_units=est.stages, stage_flop_shares=est.shares,
                   transfer_bytes_per_microbatch=est.transfer_bytes,
                   bytes_sent_per_step_per_rank=est.bytes_per_rank,
                   across_nodes=est.across_nodes)
    if choice is not None:
        out["reason"] = choice.reason
        out["candidates"] = [
            {"pp": c.plan.pp, "tp": c.plan.tp, "shard": c.plan.dp_shard,
             "memory_gib": c.memory_gib, "fits": c.fits,
             "step_s": c.step.step_s if c.step else None,
             "tokens_per_s": c.step.tokens_per_s if c.step else None} for c in choice.candidates]
    return out
