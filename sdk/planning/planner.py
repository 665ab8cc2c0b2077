"""plan(spec): resolve every ``auto`` in a JobSpec and estimate memory, traffic, time and cost.

The plan is what every launcher backend builds its request from, and what ``dtrain plan`` and
``dtrain submit --dry-run`` print. The estimates follow ``dtrain.planning.costmodel`` (documented there).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dtrain.core import instances, presets
from dtrain.core.errors import SpecError
from dtrain.core.parallelism import (
    ParallelismError,
    ParallelismPlan,
    build_parallelism_plan,
    model_state_bytes_per_gpu,
)
from dtrain.planning import costmodel
from dtrain.spec.model import JobSpec

# hyperparameter names the planner reads the model's shape from (first one present wins)
_SHAPE_KEYS = {
    "hidden_size": ("hidden_size", "d_model", "n_embd"),
    "num_layers": ("num_layers", "num_hidden_layers", "n_layer"),
    "vocab_size": ("vocab_size",),
    "seq_len": ("seq_len", "sequence_length", "max_seq_length", "max_context_width"),
    "micro_batch_size": ("micro_batch_size", "train_batch_size", "batch_size"),
}
DEFAULT_SEQ_LEN = 2048
DEFAULT_MICRO_BATCH = 1
# Bytes per token per layer of saved activations in half precision, as dtrain's layers save them
# with a flash kernel: 8 hidden-sized tensors (block input, both layer-norm outputs, q, k, v, the
# attention output, the second residual input) and the MLP's 4h pre-activation, at 2 bytes each.
# Korthikanti et al. 2022 count 34 for Megatron's layers; the difference is their dropout masks
# and the activation output, which dtrain's MLPs recompute (tests/unit/test_models_memory.py).
ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN = 24


@dataclass
class ModelShape:
    source: str
    num_parameters: int
    hidden_size: int
    num_layers: int
    vocab_size: int
    seq_len: int
    micro_batch_size: int


@dataclass
class MemoryEstimate:
    model_state_gib: float
    unsharded_layers_gib: float
    activation_gib: float
    device_gib: float

    @property
    def total_gib(self) -> float:
        return self.model_state_gib + self.unsharded_layers_gib + self.activation_gib


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
        return next((s for s in self.strategies if s.sharding_degree == self.sharding_degree
                     and s.hierarchical == self.hierarchical_allgather), None)

    def runtime_distribution(self) -> dict[str, Any]:
        """The resolved distribution the runtime reads (``DTRAIN_DISTRIBUTION``).

        ``backend`` stays the user's choice: the runtime resolves ``auto`` against the devices
        it finds, and ``auto`` versus ``nccl`` also says whether dtrain's collectives may run.
        """
        dist = self.spec.distribution
        return {
            **dist.model_dump(mode="json"),
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
    model = model_shape(spec.hyperparameters)
    precision = resolve_mixed_precision(dist.mixed_precision, inst)
    backend = "gloo" if dist.backend == "gloo" or not inst.has_gpu else "nccl"
    cluster = cluster_for(inst, nodes=compute.instance_count, processes_per_node=ppn)
    work = workload(model, precision, dist.activation_checkpointing) if model else None
    notes: list[str] = []
    if model is None:
        notes.append("no model size in hyperparameters (model: <preset or HF folder>, "
                     "num_parameters, or hidden_size + num_layers + vocab_size): memory, "
                     "traffic and step time are not estimated")

    parallelism = _parallelism(spec, model, work, notes)
    degree = parallelism.dp_shard if parallelism else None
    memory = memory_estimate(model, work, inst, degree) if model and degree else None
    if memory and memory.device_gib and memory.total_gib > memory.device_gib:
        notes.append(
            f"estimated {memory.total_gib:.1f} GiB per device exceeds its {memory.device_gib:.0f}"
            " GiB; raise sharding_degree or enable activation_checkpointing"
        )
    strategies = _strategies(work, cluster, degree, dist.gradient_accumulation_steps) \
        if work else []
    price = compute.price_per_hour or inst.price_per_hour(compute.target)
    return Plan(spec, inst, compute.instance_count, ppn, world, parallelism, backend, precision,
                model, memory, strategies, price, notes)


def resolve_mixed_precision(requested: str, inst: instances.InstanceType) -> str:
    if requested != "auto":
        return requested
    if not inst.has_gpu or inst.name == "local_gpu":
        return "fp32" if not inst.has_gpu else "bf16"
    return "bf16" if inst.peak_bf16_tflops > 0 else "fp16"


def cluster_for(inst: instances.InstanceType, *, nodes: int,
                processes_per_node: int) -> costmodel.Cluster:
    tflops = inst.peak_tflops if inst.has_gpu and inst.peak_tflops else instances.LOCAL_CPU_TFLOPS
    return costmodel.Cluster(
        num_nodes=nodes, gpus_per_node=processes_per_node, tflops_per_gpu=tflops,
        intra_gbytes_per_s=inst.intra_node_gbytes_per_s or 5.0,
        inter_gbits_per_s=inst.network_gbits_per_s or 40.0,
    )


def workload(model: ModelShape, precision: str, checkpointing: bool) -> costmodel.Workload:
    return costmodel.Workload(
        num_parameters=model.num_parameters, num_layers=model.num_layers,
        hidden_size=model.hidden_size, seq_len=model.seq_len,
        micro_batch_size=model.micro_batch_size,
        compute_bytes=4 if precision == "fp32" else 2, activation_checkpointing=checkpointing,
    )


def model_shape(hps: dict[str, Any]) -> ModelShape | None:
    """The model's size from ``hyperparameters``: a preset or HF folder, plus explicit keys."""
    config: dict[str, Any] = {}
    source = "hyperparameters"
    name = hps.get("model")
    if isinstance(name, str) and name:
        config, source = _model_config(name), name
    shape = {key: _first(hps, names, config) for key, names in _SHAPE_KEYS.items()}
    explicit = hps.get("num_parameters")
    if explicit is None and not all(shape[k] for k in ("hidden_size", "num_layers", "vocab_size")):
        return None  # a script's own hyperparameters: nothing to size the model from
    try:
        if explicit is not None:
            num = int(float(explicit))
        else:
            num = presets.count_parameters({**config, "hidden_size": shape["hidden_size"],
                                            "num_hidden_layers": shape["num_layers"],
                                            "vocab_size": shape["vocab_size"]})
        hidden = int(shape["hidden_size"] or _hidden_from_count(num))
        layers = int(shape["num_layers"] or max(1, round(num / (12 * hidden * hidden))))
        return ModelShape(
            source=source, num_parameters=num, hidden_size=hidden, num_layers=layers,
            vocab_size=int(shape["vocab_size"] or 50304),
            seq_len=int(shape["seq_len"] or config.get("max_position_embeddings")
                        or DEFAULT_SEQ_LEN),
            micro_batch_size=int(shape["micro_batch_size"] or DEFAULT_MICRO_BATCH),
        )
    except (TypeError, ValueError):
        raise SpecError(
            "hyperparameters: model shape values must be numbers (num_parameters, hidden_size, "
            "num_layers, vocab_size, seq_len, micro_batch_size)"
        ) from None


def _model_config(name: str) -> dict[str, Any]:
    folder = Path(name).expanduser()
    if (folder / "config.json").is_file():
        return json.loads((folder / "config.json").read_text())
    try:
        return presets.get_preset(name)
    except ValueError as exc:
        raise SpecError(f"hyperparameters.model: {exc}") from None


def _first(hps: dict, names: tuple[str, ...], config: dict) -> Any:
    for key in names:
        if hps.get(key) is not None:
            return hps[key]
    for key in names:
        if config.get(key) is not None:
            return config[key]
    return None


def _hidden_from_count(num: int) -> int:
    # A GPT-style model with about 100 layers per 10k hidden; rough but only used for latency.
    return max(64, round((num / 1.2e-3) ** (1 / 3) / 64) * 64)


def memory_estimate(model: ModelShape, work: costmodel.Workload, inst: instances.InstanceType,
                    degree: int) -> MemoryEstimate:
    gib = 2**30
    states = model_state_bytes_per_gpu(model.num_parameters, degree)
    return MemoryEstimate(
        model_state_gib=states / gib,
        unsharded_layers_gib=_unsharded_bytes(model, work) / gib,
        activation_gib=_activation_bytes(model, work) / gib,
        device_gib=float(inst.gpu_memory_gib),
    )


def _unsharded_bytes(model: ModelShape, work: costmodel.Workload) -> float:
    # FSDP2 holds the block being computed and the prefetched next one unsharded.
    return 2 * model.num_parameters / (model.num_layers + 1) * work.compute_bytes


def _activation_bytes(model: ModelShape, work: costmodel.Workload) -> float:
    tokens = model.seq_len * model.micro_batch_size
    scale = work.compute_bytes / 2
    per_layer = ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN * model.hidden_size * tokens * scale
    if work.activation_checkpointing:
        layers = model.num_layers * 2 * model.hidden_size * tokens * scale + per_layer
    else:
        layers = model.num_layers * per_layer
    logits = tokens * model.vocab_size * (work.compute_bytes + 4)  # logits + fp32 loss
    return layers + logits


def _parallelism(spec, model, work, notes) -> ParallelismPlan | None:
    """The parallelism plan (``dtrain.core.parallelism``), with ``auto`` sized by the model."""
    inst = spec.compute.instance
    known = model is not None and inst.gpu_memory_gib
    try:
        result = build_parallelism_plan(
            spec.distribution.model_dump(mode="json"), world_size=spec.compute.world_size,
            devices_per_node=spec.compute.resolved_processes_per_instance,
            num_parameters=model.num_parameters if known else None,
            device_memory_bytes=inst.gpu_memory_gib * 2**30 if known else None,
            other_bytes_per_device=(_activation_bytes(model, work)
                                    + _unsharded_bytes(model, work)) if known else 0.0,
            num_blocks=model.num_layers if model else None)
    except ParallelismError as exc:
        raise SpecError(str(exc)) from None
    if result is None:
        notes.append("sharding_degree auto: resolved at run time from the model's parameter count"
                     " (give hyperparameters.model or num_parameters to plan it here)")
    return result


def _strategies(work, cluster, degree, accumulation) -> list[costmodel.StepEstimate]:
    """DDP, ZeRO-3 and MiCS at the chosen degree (flat and hierarchical where it differs)."""
    world = cluster.world_size
    configs = [(1, False), (world, False)]
    # the hierarchical all-gather runs only on groups of whole nodes (dtrain.core.parallelism)
    if world > cluster.gpus_per_node:
        configs.append((world, True))
    if degree and degree not in (1, world):
        configs.append((degree, False))
        if degree > cluster.gpus_per_node and degree % cluster.gpus_per_node == 0:
            configs.append((degree, True))
    seen, out = set(), []
    for d, hier in configs:
        if (d, hier) not in seen:
            seen.add((d, hier))
            out.append(costmodel.estimate_step(work, cluster, sharding_degree=d,
                                               accumulation=accumulation, hierarchical=hier))
    return out
