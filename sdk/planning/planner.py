"""plan(spec): resolve every ``auto`` in a JobSpec and estimate memory, traffic, time and cost.

The plan is what every launcher backend builds its request from, and what ``dtrain plan`` and
``dtrain submit --dry-run`` print. The estimates follow ``dtrain.planning.costmodel`` (documented there).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dtrain.core import instances, recipe_inputs
from dtrain.core import pipeline as ppl
from dtrain.core import tensor_parallel as tpl
from dtrain.core.errors import SpecError
from dtrain.core.parallelism import ParallelismError, ParallelismPlan, build_parallelism_plan
from dtrain.core.sizing import DEFAULT_HEADROOM, memory_fixes
from dtrain.planning import costmodel
from dtrain.planning import pipeline as pipelining
from dtrain.planning.memory import Layout, MemoryEstimate, memory_estimate, other_bytes
from dtrain.planning.model_shape import ModelShape, model_shape
from dtrain.spec.model import JobSpec


@dataclass
class Plan:
    spec: JobSpec
    instance: instances.InstanceType
    num_nodes: int
    processes_per_node: int
    world_size: int
    parallelism: ParallelismPlan | None  # None: sharding_degree auto, resolved at run time
    backend: str
    mixed_precision: str
    model: ModelShape | None
    memory: MemoryEstimate | None
    strategies: list[costmodel.StepEstimate]
    price_per_hour: float | None  # one instance
    notes: list[str] = field(default_factory=list)
    tensor_parallel_reason: str = ""  # why this tensor-parallel layout, for dtrain plan
    pipeline: pipelining.PipelineEstimate | None = None  # pp > 1 with a known model
    layout_choice: pipelining.LayoutChoice | None = None  # pipeline_parallel_degree auto

    @property
    def sharding_degree(self) -> int | None:
        return self.parallelism.dp_shard if self.parallelism else None

    @property
    def hierarchical_allgather(self) -> bool:
        return bool(self.parallelism and self.parallelism.hierarchical_allgather)

    @property
    def replicate_degree(self) -> int | None:
        return self.parallelism.dp_replicate if self.parallelism else None

    @property
    def group_within_node(self) -> bool | None:
        return None if self.parallelism is None else not self.parallelism.shard_group_spans_nodes

    @property
    def cost_per_hour(self) -> float | None:
        return None if self.price_per_hour is None else self.price_per_hour * self.num_nodes

    @property
    def max_run_cost(self) -> float | None:
        per_hour = self.cost_per_hour
        return None if per_hour is None else per_hour * self.spec.compute.max_run / 3600

    @property
    def chosen(self) -> costmodel.StepEstimate | None:
        """The estimate for the configuration this job will run."""
        tp = self.parallelism.tp if self.parallelism else 1
        pp = self.parallelism.pp if self.parallelism else 1
        sync = self.parallelism.gradient_sync if self.parallelism else "fsdp"
        return next((s for s in self.strategies if s.sharding_degree == self.sharding_degree
                     and s.hierarchical == self.hierarchical_allgather
                     and s.tensor_parallel == tp and s.pipeline == pp
                     and s.gradient_sync == sync), None)

    def tensor_parallel_summary(self) -> dict[str, Any] | None:
        """The tensor-parallel layout, why, and its bytes per step per device."""
        p = self.parallelism
        if p is None:
            return None
        chosen = self.chosen
        return {"degree": p.tp, "mode": p.tp_mode, "sequence_parallel": p.sequence_parallel,
                "layout": p.tensor_parallel_layout, "reason": self.tensor_parallel_reason,
                "bytes_per_step_per_device": chosen.tp_bytes if chosen else None}

    def runtime_distribution(self) -> dict[str, Any]:
        """The resolved distribution the runtime reads (``DTRAIN_DISTRIBUTION``).

        ``backend`` stays the user's choice: the runtime resolves ``auto`` against the devices
        it finds, and ``auto`` versus ``nccl`` also says whether dtrain's collectives may run.
        """
        dist = self.spec.distribution
        chosen: dict[str, Any] = {}
        p = self.parallelism
        if dist.pipeline_parallel_degree == "auto":
            # the planner's choice (the runtime cannot weigh layouts): the runtime gets degrees
            chosen = {"pipeline_parallel_degree": p.pp if p else 1}
            if p is None or p.pp == 1:
                chosen.update(pipelining.UNSET)
            if self.layout_choice is not None:
                chosen.update(tensor_parallel_degree=p.tp, sharding_degree=p.dp_shard)
        return {
            **dist.model_dump(mode="json"), **chosen,
            "mixed_precision": self.mixed_precision,
            "parallelism": self.parallelism.to_dict() if self.parallelism else None,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.spec.name,
            "target": self.spec.compute.target,
            "instance_type": self.instance.name,
            "num_nodes": self.num_nodes,
            "processes_per_node": self.processes_per_node,
            "world_size": self.world_size,
            "parallelism": self.parallelism.to_dict() if self.parallelism else None,
            "partition_group_within_node": self.group_within_node,
            "tensor_parallel": self.tensor_parallel_summary(),
            "pipeline": pipelining.summary(self.parallelism, self.pipeline, self.layout_choice),
            "distribution": self.runtime_distribution(),
            "model": asdict(self.model) if self.model else None,
            "memory_per_device_gib": (
                {**asdict(self.memory), "total_gib": self.memory.total_gib}
                if self.memory else None
            ),
            "strategies": [s.to_dict() for s in self.strategies],
            "price_per_hour": self.price_per_hour,
            "cost_per_hour": self.cost_per_hour,
            "max_run_hours": self.spec.compute.max_run / 3600,
            "max_run_cost": self.max_run_cost,
            "price_date": self.instance.price_date,
            "notes": self.notes,
        }


def plan(spec: JobSpec) -> Plan:
    """Resolve ``spec`` into a Plan. Raises SpecError when no valid configuration exists."""
    compute, dist = spec.compute, spec.distribution
    inst = compute.instance
    ppn = compute.resolved_processes_per_instance
    world = compute.world_size
    # a recipe's hyperparameters with the defaults it fills in: what it will train
    hps = recipe_inputs.as_the_recipe_reads(spec.entry_point, spec.hyperparameters)
    model = model_shape(hps)
    precision = resolve_mixed_precision(dist.mixed_precision, inst)
    backend = "gloo" if dist.backend == "gloo" or not inst.has_gpu else "nccl"
    cluster = cluster_for(inst, nodes=compute.instance_count, processes_per_node=ppn,
                          backend=backend, precision=precision)
    if compute.target == "local" and not inst.has_gpu:
        # every "host" of a local job is this machine: its workers share its cores
        share = min(1.0, (os.cpu_count() or 1) / world)
        cluster = replace(cluster, tflops_per_gpu=cluster.tflops_per_gpu * share)
    work = workload(model, precision, dist.activation_checkpointing) if model else None
    notes: list[str] = []
    if model is not None and model.not_sizes:
        given = ", ".join(f"{key} {value!r}" for key, value in model.not_sizes.items())
        notes.append(f"hyperparameters {given}: not a size (below 1), so the estimates leave it "
                     "out and take the model's or the default size")
    if model is None:
        notes.append("no model size in hyperparameters (model: <preset or HF folder>, "
                     "num_parameters, or hidden_size + num_layers + vocab_size): memory, "
                     "traffic and step time are not estimated")

    choice = pipelining.auto_layout(spec, model, work, cluster, notes) \
        if dist.pipeline_parallel_degree == "auto" else None
    parallelism = choice.plan if choice else _parallelism(spec, model, work, notes)
    if parallelism and model:
        _refuse_what_the_runtime_would(parallelism, model, hps if spec.is_recipe else {})
    degree = parallelism.dp_shard if parallelism else None
    layout = _layout(parallelism)
    piped = pipelining.estimate(
        parallelism, model, work, cluster, accumulation=dist.gradient_accumulation_steps,
        device_gib=float(inst.gpu_memory_gib)) if model and parallelism and parallelism.pp > 1 \
        else None
    memory = piped.memory if piped else memory_estimate(
        work, layout, sharding_degree=degree, vocab_size=model.vocab_size,
        device_gib=float(inst.gpu_memory_gib)) if model and degree else None
    if memory and memory.device_gib and memory.total_gib > memory.device_gib:
        fixes = memory_fixes(dist.model_dump(), dp_shard=parallelism.dp_shard,
                             dp=parallelism.dp_degree, tp=parallelism.tp,
                             devices_per_node=parallelism.devices_per_node)
        notes.append(f"estimated {memory.total_gib:.1f} GiB per device exceeds its "
                     f"{memory.device_gib:.0f} GiB; {fixes}")
    strategies = _strategies(model, work, cluster, degree, dist.gradient_accumulation_steps,
                             layout, device_gib=float(inst.gpu_memory_gib)) if work else []
    if piped:  # the pipeline beside what the same ranks would do without one
        step = piped.step
        if inst.gpu_memory_gib:
            step = costmodel.with_memory(step, memory_gib=piped.memory.total_gib,
                                         device_gib=piped.memory.device_gib)
        strategies = _fastest_first([step, *strategies])
        if piped.problem:
            notes.append(f"partition: {piped.problem}")
    price = compute.price_per_hour or inst.price_per_hour(compute.target)
    return Plan(spec, inst, compute.instance_count, ppn, world, parallelism, backend, precision,
                model, memory, strategies, price, notes,
                tensor_parallel_reason="auto: weighed with the pipeline (see layout)"
                if choice and spec.distribution.tensor_parallel_degree == "auto"
                else _tensor_parallel_reason(spec, parallelism, model, work),
                pipeline=piped, layout_choice=choice)


def _refuse_what_the_runtime_would(plan: ParallelismPlan, model: ModelShape,
                                   hps: dict[str, Any]) -> None:
    """The model and batch checks the runtime makes at its first step, made here instead, so
    `dtrain plan` and submit refuse the job before any instance is paid for (one message,
    the runtime's, from ``dtrain.core``). The batch shape is checked where a recipe's
    hyperparameters give it (``seq_len``, ``micro_batch_size``, given or the recipe's defaults;
    a script's ``hps`` are not passed: its names may mean something else)."""
    if plan.pp > 1 and model.tied_embeddings:
        raise SpecError("distribution.pipeline_parallel_degree: "
                        + ppl.tied_head_problem(model.model_type or model.source))
    problems = []
    if plan.tp_grid:
        if model.model_type:
            problems.append(("distribution.tensor_parallel_mode",
                             tpl.two_d_family_problem(model.model_type)))
        if "micro_batch_size" in hps:
            problems.append(("hyperparameters.micro_batch_size",
                             tpl.grid_batch_problem(model.micro_batch_size, plan.tp_grid)))
    elif plan.tp > 1 and plan.sequence_parallel and "seq_len" in hps:
        problems.append(("hyperparameters.seq_len",
                         tpl.sequence_split_problem(model.seq_len, plan.tp)))
    for where, problem in problems:
        if problem:
            raise SpecError(f"{where}: {problem}")


def resolve_mixed_precision(requested: str, inst: instances.InstanceType) -> str:
    if requested != "auto":
        return requested
    if not inst.has_gpu or inst.name == "local_gpu":
        return "fp32" if not inst.has_gpu else "bf16"
    return "bf16" if inst.peak_bf16_tflops > 0 else "fp16"


def cluster_for(inst: instances.InstanceType, *, nodes: int, processes_per_node: int,
                backend: str | None = None, precision: str = "bf16") -> costmodel.Cluster:
    """The cost model's cluster; its GPUs compute at their peak in ``precision``."""
    peak = inst.peak_tflops_in(precision) if inst.has_gpu else 0.0
    tflops = peak or instances.LOCAL_CPU_TFLOPS
    return costmodel.Cluster(
        num_nodes=nodes, gpus_per_node=processes_per_node, tflops_per_gpu=tflops,
        intra_gbytes_per_s=inst.intra_node_gbytes_per_s or 5.0,
        inter_gbits_per_s=inst.network_gbits_per_s or 40.0,
        backend=backend or ("nccl" if inst.has_gpu else "gloo"),
    )


def workload(model: ModelShape, precision: str, checkpointing: bool) -> costmodel.Workload:
    return costmodel.Workload(
        num_parameters=model.num_parameters, num_layers=model.num_layers,
        hidden_size=model.hidden_size, seq_len=model.seq_len,
        micro_batch_size=model.micro_batch_size,
        compute_bytes=4 if precision == "fp32" else 2, activation_checkpointing=checkpointing,
        vocab_size=model.vocab_size,
    )


def _parallelism(spec, model, work, notes) -> ParallelismPlan | None:
    """The parallelism plan (``dtrain.core.parallelism``), with ``auto`` sized by the model."""
    inst = spec.compute.instance
    dist = spec.distribution
    known = model is not None and inst.gpu_memory_gib
    sequence_parallel = dist.sequence_parallel is not False

    def beyond_states(tp: int) -> float:
        layout = Layout(tp, dist.tensor_parallel_mode, sequence_parallel and tp > 1)
        return other_bytes(work, layout, vocab_size=model.vocab_size)

    try:
        settings = dist.model_dump(mode="json")
        if settings["pipeline_parallel_degree"] == "auto":  # unsized: no pipeline
            settings.update({"pipeline_parallel_degree": 1, **pipelining.UNSET})
        result = build_parallelism_plan(
            settings, world_size=spec.compute.world_size,
            devices_per_node=spec.compute.resolved_processes_per_instance,
            num_parameters=model.num_parameters if known else None,
            device_memory_bytes=inst.gpu_memory_gib * 2**30 if known else None,
            other_bytes_per_device=beyond_states if known else 0.0,
            model_dims=model.dims if model else None,
            num_blocks=model.num_layers if model else None)
    except ParallelismError as exc:
        raise SpecError(str(exc)) from None
    if result is None:
        why = ("give hyperparameters.model or num_parameters to plan it here" if model is None
               else f"{inst.name} has no device memory to size it against here")
        notes.append("sharding_degree / tensor_parallel_degree auto: resolved at run time from "
                     f"the model's parameter count ({why})")
    return result


def _layout(parallelism: ParallelismPlan | None) -> Layout:
    if parallelism is None:
        return Layout()
    return Layout(parallelism.tp, parallelism.tp_mode, parallelism.sequence_parallel)


def _tensor_parallel_reason(spec, parallelism, model, work) -> str:
    """Why the plan has this tensor-parallel layout (``dtrain plan`` prints it)."""
    dist = spec.distribution
    if parallelism is None:
        return "resolved at run time"
    if dist.tensor_parallel_degree != "auto":
        return ("off: tensor_parallel_degree 1" if parallelism.tp == 1
                else "as set in distribution.tensor_parallel_degree")
    usable = spec.compute.instance.gpu_memory_gib * (1 - DEFAULT_HEADROOM)
    if parallelism.tp == 1:
        return f"auto: MiCS alone fits in the {usable:.0f} GiB usable per device"
    alone = memory_estimate(work, Layout(), sharding_degree=parallelism.dp_degree * parallelism.tp,
                            vocab_size=model.vocab_size, device_gib=0.0)
    return (f"auto: MiCS alone needs {alone.total_gib:.1f} GiB per device even fully sharded "
            f"(states {alone.model_state_gib:.1f}, layer {alone.unsharded_layers_gib:.1f}, "
            f"activations {alone.activation_gib:.1f}), more than the {usable:.0f} GiB usable; "
            f"the smallest tensor-parallel degree that fits is {parallelism.tp}")


def _strategies(model, work, cluster, degree, accumulation, layout: Layout, *,
                device_gib: float) -> list[costmodel.StepEstimate]:
    """DDP, ZeRO-3 and MiCS at the chosen degree (flat and hierarchical all-gather where it
    differs, FSDP2's and the overlapped gradient sync where there are replicas), at the plan's
    tensor-parallel layout, fastest first; those whose memory does not fit the device last,
    without a step time."""
    tp = layout.tp
    dp = cluster.world_size // tp
    dp_per_node = max(1, cluster.gpus_per_node // tp)
    configs = [(1, False), (dp, False)]
    # the hierarchical all-gather runs only on groups of whole nodes (dtrain.core.parallelism)
    if dp > dp_per_node:
        configs.append((dp, True))
    if degree and degree not in (1, dp):
        configs.append((degree, False))
        if degree > dp_per_node and degree % dp_per_node == 0:
            configs.append((degree, True))
    out = []
    for d, hier in dict.fromkeys(configs):
        for sync in ("fsdp", "overlapped") if d < dp else ("fsdp",):
            est = costmodel.estimate_step(work, cluster, sharding_degree=d,
                                          accumulation=accumulation, hierarchical=hier,
                                          tp=tp, tp_mode=layout.mode, gradient_sync=sync)
            if device_gib:
                mem = memory_estimate(work, layout, sharding_degree=d,
                                      vocab_size=model.vocab_size, device_gib=device_gib)
                est = costmodel.with_memory(est, memory_gib=mem.total_gib,
                                            device_gib=mem.device_gib)
            out.append(est)
    return _fastest_first(out)


def _fastest_first(strategies: list[costmodel.StepEstimate]) -> list[costmodel.StepEstimate]:
    """Those that fit, most tokens/s first; then those whose memory does not fit the device."""
    return sorted(strategies, key=lambda s: (not s.fits, -(s.tokens_per_s or 0.0)))
