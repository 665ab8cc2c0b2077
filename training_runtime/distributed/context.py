"""``dtrain.runtime.init()``: process group, node-aware groups, the MiCS mesh and job paths.

Process facts come from the variables torch elastic sets for each worker (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT); ranks are node-contiguous,
so node = rank // LOCAL_WORLD_SIZE. Paths come from the container contract (SM_* variables).
Without a launcher (plain ``python train.py``) it runs as a one-process world.

    import dtrain.runtime as rt
    ctx = rt.init()                    # reads DTRAIN_DISTRIBUTION
    model = rt.shard(model, ctx)       # the plan's mesh, MiCS via FSDP2

The mesh comes from the job's parallelism plan (:mod:`dtrain.core.parallelism`): the one the
launcher resolved and ``dtrain plan`` printed, or, for ``sharding_degree: auto`` without a known
model size, the plan the same function builds once ``shard`` knows the model.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dtrain.core import contract
from dtrain.core.parallelism import GRID_AXES, ParallelismPlan, build_parallelism_plan
from dtrain.core.tensor_parallel import ModelDims
from dtrain.runtime import torch_private
from dtrain.runtime.distributed import accumulation, comm_stats, gradient_sync
from dtrain.runtime.distributed.collectives import HierarchyGroups, build_hierarchy_groups
from dtrain.runtime.distributed.config import DistributionConfig
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DEFAULT_TIMEOUT_S = 1800.0
# the default process group's backend per device type, by the resolved backend
PROCESS_GROUP_BACKENDS = {"nccl": "cpu:gloo,cuda:nccl"}


@dataclass(frozen=True)
class ProcessFacts:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ProcessFacts:
        env = os.environ if environ is None else environ
        if "RANK" not in env:
            return cls(0, 0, 1, 1, 0)
        rank, world = int(env["RANK"]), int(env.get("WORLD_SIZE", "1"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        if local_world < 1 or world % local_world:
            raise ValueError(
                f"LOCAL_WORLD_SIZE={local_world} does not divide WORLD_SIZE={world}; start the "
                "same number of workers on every node"
            )
        node = rank // local_world
        if int(env.get("GROUP_RANK", node)) != node:
            raise ValueError(
                f"rank {rank} with LOCAL_WORLD_SIZE={local_world} is on node {node}, but "
                f"GROUP_RANK={env['GROUP_RANK']}; ranks must be node-contiguous (torchrun's "
                "default static rendezvous assigns them so)"
            )
        return cls(rank, int(env.get("LOCAL_RANK", rank % local_world)), world, local_world, node)


@dataclass
class RuntimeContext:
    """Everything a training script needs to know about where it runs."""

    facts: ProcessFacts
    config: DistributionConfig
    backend: str  # the resolved process-group backend: "nccl" or "gloo"
    device: torch.device
    intra_node_group: dist.ProcessGroup  # the ranks of my node
    inter_node_group: dist.ProcessGroup  # the ranks with my local rank, one per node
    comm_stats: comm_stats.CommStats
    model_dir: Path
    output_data_dir: Path
    checkpoint_dir: Path
    channels: dict[str, Path]
    checkpoint_interval_steps: int = 0  # the spec's checkpoint.interval_steps (0: off)
    checkpoint_keep_last: int = 2  # the spec's checkpoint.keep_last
    plan: ParallelismPlan | None = None
    mesh: DeviceMesh | None = None
    _hierarchy: HierarchyGroups | None = field(default=None, repr=False)
    _override_logged: bool = field(default=False, repr=False)
    # the plan's pipeline schedule waits for the model (``shard`` plans it again, same mesh)
    schedule_pending: bool = field(default=False, repr=False)

    rank = property(lambda self: self.facts.rank)
    local_rank = property(lambda self: self.facts.local_rank)
    world_size = property(lambda self: self.facts.world_size)
    local_world_size = property(lambda self: self.facts.local_world_size)
    node_rank = property(lambda self: self.facts.node_rank)
    num_nodes = property(lambda self: self.facts.num_nodes)

    @property
    def is_main(self) -> bool:
        return self.facts.rank == 0

    @property
    def sharding_degree(self) -> int | None:
        return self.plan.dp_shard if self.plan else None

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def channel(self, name: str) -> Path:
        try:
            return self.channels[name.lower()]
        except KeyError:
            raise ValueError(
                f"no input channel {name!r}; this job has {sorted(self.channels) or 'none'}. "
                "Add it under inputs in the job spec"
            ) from None

    def build_plan(self, *, sharding_degree: int | None = None, num_parameters: int | None = None,
                   device_memory_bytes: float | None = None, model_dims: ModelDims | None = None,
                   num_blocks: int | None = None) -> ParallelismPlan | None:
        """The job's parallelism plan on this world; see :func:`resolve_plan`."""
        return resolve_plan(self.config, self.facts, sharding_degree=sharding_degree,
                            num_parameters=num_parameters,
                            device_memory_bytes=device_memory_bytes, model_dims=model_dims,
                            num_blocks=num_blocks)

    def build_mesh(self, plan: ParallelismPlan) -> DeviceMesh:
        """The plan's ``pp × dp_replicate × dp_shard × tp`` mesh (built once per context)."""
        if (plan.world_size, plan.devices_per_node) != (self.world_size, self.local_world_size):
            raise ValueError(
                f"the parallelism plan is for {plan.world_size} ranks, {plan.devices_per_node} per "
                f"node, but this job runs {self.world_size}, {self.local_world_size} per node; "
                "submit the job again so the plan matches")
        if self.mesh is not None:
            if self.schedule_pending and plan.mesh_shape == self.plan.mesh_shape:
                self.plan, self.schedule_pending = plan, False  # the schedule, with the model
            if plan != self.plan:
                raise ValueError(
                    f"this context already has a mesh for sharding_degree={self.sharding_degree} "
                    "(the job's distribution settings); ask for degree "
                    f"{plan.dp_shard} there, or in dtrain.runtime.init(distribution="
                    f"{{'sharding_degree': {plan.dp_shard}}}), not in shard()"
                )
            return self.mesh
        self.mesh = init_device_mesh(self.device.type, plan.mesh_shape,
                                     mesh_dim_names=plan.mesh_axis_names)
        self.plan = plan
        self.comm_stats.set_tensor_parallel_size(plan.tp)
        return self.mesh

    @property
    def data_parallel_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards over: ``dp_replicate × dp_shard``, or ``dp_shard`` alone when
        there is one replica (a size-1 replicate axis would add a no-op all-reduce per layer) or
        when the overlapped gradient sync all-reduces across replicas instead of FSDP2."""
        if self.mesh is None or self.plan is None:
            raise ValueError("no mesh yet; call dtrain.runtime.shard(model, ctx) first")
        if self.plan.dp_replicate == 1 or self.plan.gradient_sync == "overlapped":
            return self.mesh["dp_shard"]
        return self.mesh["dp_replicate", "dp_shard"]

    @property
    def tensor_parallel_mesh(self) -> DeviceMesh | None:
        """The ``tp`` axis (1-D) or the ``tp_row × tp_col`` grid (2-D); None without one."""
        if self.mesh is None or self.plan is None or self.plan.tp == 1:
            return None
        return self.mesh[GRID_AXES] if self.plan.tp_grid else self.mesh["tp"]

    @property
    def dp_rank(self) -> int:
        """Which data-parallel share of the batch this rank reads (the same across its
        tensor-parallel group); the rank itself before a plan exists."""
        return self.plan.dp_rank(self.rank) if self.plan else self.rank

    @property
    def dp_world_size(self) -> int:
        """Data-parallel shares of the batch: ``dp_replicate × dp_shard``."""
        return self.plan.dp_degree if self.plan else self.world_size

    def loss_parallel(self) -> contextlib.AbstractContextManager:
        """Where a loss is computed on a tensor-parallel model's logits (sharded over the
        vocabulary) and backpropagated: the parallel cross-entropy, or nothing without one.
        ``micro_step`` and ``accumulate`` enter it for you."""
        if self.plan is None or self.plan.tp == 1:
            return contextlib.nullcontext()
        from dtrain.runtime.distributed.tensor_parallel import loss_parallel

        return loss_parallel(self.plan)

    def hierarchy_groups(self) -> HierarchyGroups:
        """Stage groups for the plan's hierarchical all-gather (created once)."""
        if self.plan is None:
            raise ValueError("no parallelism plan yet: call shard() (or build_mesh()) first")
        if not self.plan.hierarchical_allgather:
            raise ValueError("the parallelism plan does not use the hierarchical all-gather")
        if self._hierarchy is None:
            self._hierarchy = build_hierarchy_groups(self.plan, rank=self.rank)
        return self._hierarchy

    def new_replica_sync_group(self) -> dist.ProcessGroup:
        """A new gloo group over this rank's replicas for one model's overlapped gradient sync
        (collective). One per model: two models' communicator threads on one group would issue
        their all-reduces in a different interleaving on each rank when one backward runs
        through both (a joint loss), and sum the wrong buffers."""
        if self.plan is None or self.plan.gradient_sync != "overlapped":
            raise ValueError("the parallelism plan does not use the overlapped gradient sync")
        return gradient_sync.build_replica_group(self.plan, rank=self.rank)

    def micro_step(self, model: torch.nn.Module, *, boundary: bool):
        """Context for one micro-step; see :mod:`dtrain.runtime.distributed.accumulation`."""
        return accumulation.micro_step(model, boundary=boundary, within=self.loss_parallel)

    def accumulate(
        self, model: torch.nn.Module, batches: Iterable[Any], *,
        micro_batches_per_step: int | None = None, steps: int | None = None,
    ) -> Iterator[accumulation.MicroStep]:
        """Micro-steps with the 2-hop gradient sync, ``micro_batches_per_step`` of them per
        optimizer step: by default the job's ``distribution.gradient_accumulation_steps``; another
        value is logged as overriding it. ``steps`` is the old, deprecated name of the count."""
        if steps is not None:
            warnings.warn("ctx.accumulate(steps=N) is deprecated: N is micro-batches per "
                          "optimizer step; pass micro_batches_per_step=N",
                          DeprecationWarning, stacklevel=2)
            if micro_batches_per_step not in (None, steps):
                raise ValueError(f"ctx.accumulate: steps={steps} and micro_batches_per_step="
                                 f"{micro_batches_per_step} disagree; pass only the second")
            micro_batches_per_step = steps
        configured = self.config.gradient_accumulation_steps
        if micro_batches_per_step not in (None, configured) and not self._override_logged:
            self._override_logged = True
            logging.getLogger(__name__).warning(
                "ctx.accumulate: %d micro-batches per optimizer step, overriding the job's "
                "distribution.gradient_accumulation_steps=%d", micro_batches_per_step, configured)
        return accumulation.accumulate(
            model, batches, micro_batches_per_step=micro_batches_per_step or configured,
            within=self.loss_parallel)


def resolve_plan(config: DistributionConfig, facts: ProcessFacts, *,
                 sharding_degree: int | None = None, num_parameters: int | None = None,
                 device_memory_bytes: float | None = None, model_dims: ModelDims | None = None,
                 num_blocks: int | None = None) -> ParallelismPlan | None:
    """The plan the runtime uses: the launcher's (what ``dtrain plan`` printed) when it was made
    for this world and nothing overrides it, else the planner's own function on this world
    (``sharding_degree`` overrides the setting). None: ``auto`` without ``num_parameters``."""
    plan = config.parallelism
    fits = plan is not None and (plan.world_size, plan.devices_per_node) == (
        facts.world_size, facts.local_world_size)
    if fits and (sharding_degree is None or sharding_degree == plan.dp_shard):
        return plan
    inputs = config.plan_inputs()
    if sharding_degree is not None:
        inputs["sharding_degree"] = sharding_degree
    return build_parallelism_plan(
        inputs, world_size=facts.world_size, devices_per_node=facts.local_world_size,
        num_parameters=num_parameters, device_memory_bytes=device_memory_bytes,
        model_dims=model_dims, num_blocks=num_blocks)


def resolve_backend(requested: str, *, cuda_available: bool) -> str:
    if requested == "nccl" and not cuda_available:
        raise ValueError(
            "distribution.backend='nccl' needs CUDA GPUs, but none is available; use "
            "backend 'auto' or 'gloo' on CPU"
        )
    if requested == "auto":
        return "nccl" if cuda_available else "gloo"
    return requested


def init(
    *,
    timeout: float | datetime.timedelta = DEFAULT_TIMEOUT_S,
    distribution: DistributionConfig | Mapping[str, Any] | None = None,
) -> RuntimeContext:
    """Join the job's process group and describe this process (see the module docstring).

    Reuses an already initialised default process group, so several configurations can run in
    one group (tests, benchmarks). The mesh is built here from the job's parallelism plan;
    ``sharding_degree: auto`` without a planned size needs the model's and is resolved by
    :func:`dtrain.runtime.shard`.
    """
    config = DistributionConfig.resolve(distribution)
    facts = ProcessFacts.from_env()
    _show_runtime_logs(facts.rank)
    cuda = torch.cuda.is_available()
    backend = resolve_backend(config.backend, cuda_available=cuda)
    device = torch.device("cuda", facts.local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _init_process_group(backend, facts, timeout)
    intra, inter = _node_groups(facts)
    stats = comm_stats.process_stats(local_world_size=facts.local_world_size)
    ctx = RuntimeContext(
        facts=facts,
        config=config,
        backend=backend,
        device=device,
        intra_node_group=intra,
        inter_node_group=inter,
        comm_stats=stats,
        **_from_contract(),
    )
    planned = config.parallelism
    if planned is not None and (planned.world_size, planned.devices_per_node) != (
            facts.world_size, facts.local_world_size):
        logging.getLogger(__name__).warning(
            "the job's parallelism plan is for %d ranks, %d per node, but %d run here, %d per "
            "node (local_gpu uses every GPU it finds); planning again for this world",
            planned.world_size, planned.devices_per_node, facts.world_size,
            facts.local_world_size)
    plan = ctx.build_plan()
    if plan is not None:
        ctx.build_mesh(plan)
        ctx.schedule_pending = _schedule_waits_for_the_model(config, plan)
    return ctx


def _schedule_waits_for_the_model(config: DistributionConfig, plan: ParallelismPlan) -> bool:
    """A pipeline plan made here, not the launcher's (which knew the model), whose schedule or
    stages per rank are automatic: they depend on the model's block count, so ``shard`` plans
    them again with the model (the degrees, and so the mesh and ``dp_rank``, stay): the same
    settings then give the same schedule however the script was started."""
    inputs = config.plan_inputs()
    return plan.pp > 1 and plan != config.parallelism and "auto" in (
        inputs["pipeline_schedule"], inputs["stages_per_rank"])


def _show_runtime_logs(rank: int) -> None:
    """Send the runtime's INFO lines (the attention kernel each model uses) to stderr, which the
    node agent keeps as the rank's log, unless the script has set up logging itself: a worker
    is a fresh interpreter, where Python drops INFO records that no handler takes."""
    runtime_logger = logging.getLogger("dtrain.runtime")
    if logging.getLogger().handlers or runtime_logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s dtrain rank {rank} %(message)s"))
    # Stand down once the script configures logging after init(): its handlers get the records.
    handler.addFilter(lambda _record: not logging.getLogger().handlers)
    runtime_logger.addHandler(handler)
    if runtime_logger.level == logging.NOTSET:
        runtime_logger.setLevel(logging.INFO)


def _init_process_group(
    backend: str, facts: ProcessFacts, timeout: float | datetime.timedelta
) -> None:
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if dist.is_initialized():
        if dist.get_world_size() != facts.world_size:
            raise ValueError(
                f"a process group of {dist.get_world_size()} ranks already exists but "
                f"WORLD_SIZE={facts.world_size}; destroy it before dtrain.runtime.init()"
            )
        return
    # NCCL carries CUDA tensors only; the Trainer's stop vote and metrics and the checkpoint's
    # shared-folder probe all-reduce small CPU tensors, so those go over gloo in the same group.
    backends = PROCESS_GROUP_BACKENDS.get(backend, backend)
    if "RANK" not in os.environ:
        # A one-process run needs no rendezvous: an in-memory store avoids picking a port.
        dist.init_process_group(
            backends, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        return
    dist.init_process_group(
        backends,
        init_method="env://",
        rank=facts.rank,
        world_size=facts.world_size,
        timeout=timeout,
    )


# Node groups are created once per process group: new_group is a world-wide collective.
_NODE_GROUPS: dict[int, tuple[Any, dist.ProcessGroup, dist.ProcessGroup]] = {}


def _node_groups(facts: ProcessFacts) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    world = torch_private.default_group()
    cached = _NODE_GROUPS.get(facts.local_world_size)
    if cached is not None and cached[0] is world:
        return cached[1], cached[2]
    lws, nodes = facts.local_world_size, facts.num_nodes
    intra = inter = None
    for node in range(nodes):
        group = dist.new_group([node * lws + j for j in range(lws)])
        intra = group if node == facts.node_rank else intra
    for local in range(lws):
        group = dist.new_group([n * lws + local for n in range(nodes)])
        inter = group if local == facts.local_rank else inter
    assert intra is not None and inter is not None
    _NODE_GROUPS[facts.local_world_size] = (world, intra, inter)
    return intra, inter


def _from_contract(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The job's paths and checkpoint settings, as the node agent passes them to workers; a
    script run by hand gets the folders under ``$DTRAIN_ROOT`` (default ``/opt/ml``)."""
    env = os.environ if environ is None else environ
    default = contract.host_paths(env.get(contract.ROOT_ENV) or contract.DEFAULT_ROOT)
    channels = {
        key[len("SM_CHANNEL_") :].lower(): Path(value)
        for key, value in env.items()
        if key.startswith("SM_CHANNEL_")
    }
    return {
        "model_dir": Path(env.get("SM_MODEL_DIR", default.model_dir)),
        "output_data_dir": Path(env.get("SM_OUTPUT_DATA_DIR", default.output_data_dir)),
        "checkpoint_dir": Path(env.get(contract.CHECKPOINT_DIR_ENV, default.checkpoints_dir)),
        "checkpoint_interval_steps": int(env.get(contract.CHECKPOINT_INTERVAL_ENV) or 0),
        "checkpoint_keep_last": int(env.get(contract.CHECKPOINT_KEEP_LAST_ENV) or 2),
        "channels": channels,
    }
