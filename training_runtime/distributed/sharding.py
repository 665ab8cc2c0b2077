"""``dtrain.runtime.shard()``: [pipeline stages], tensor parallelism, then MiCS sharded data
parallelism on FSDP2.

With a ``pp`` axis in the plan, the model is first cut into pipeline stages
(:mod:`dtrain.runtime.distributed.pipeline`) and each stage goes through the steps below.

With a ``tp`` axis in the plan, the model is first split by its family's tensor-parallel plan
(:mod:`dtrain.runtime.distributed.tensor_parallel`), then MiCS shards what each rank holds over
the data-parallel axes (parameters become DTensors on ``dp × tp``, torchtitan's order).

The plan's ``dp_shard`` mesh axis is a MiCS partition group: parameters, gradients
and optimizer states are sharded inside it and replicated across groups. ``fully_shard`` is
applied per transformer block, then on the root (torchtitan's order), so a block's parameters
are gathered just before it runs and freed after. An untied output layer (``lm_head``) is a unit
of its own, as in torchtitan, so its gradient is reduced first in backward, not last.

* degree 1: every group has one rank, FSDP2 replicates only (DDP: one all-reduce per step);
* degree = world size: one group, plain FSDP on the shard axis (ZeRO-3);
* in between: HSDP = MiCS; when a group spans nodes, the hierarchical all-gather of
  :mod:`dtrain.runtime.distributed.collectives` replaces the flat one (``hierarchical_allgather``).

Gradient sync with accumulation (2-hop) lives in :mod:`dtrain.runtime.distributed.accumulation`;
with ``gradient_sync: overlapped`` FSDP2 shards over the partition group only and the replicas'
all-reduce runs in the background (:mod:`dtrain.runtime.distributed.gradient_sync`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from dtrain.core.errors import ParallelismError
from dtrain.core.parallelism import ParallelismPlan
from dtrain.core.tensor_parallel import ModelDims
from dtrain.runtime import torch_private
from dtrain.runtime.distributed import gradient_sync
from dtrain.runtime.distributed.collectives import HierarchicalAllGather, gloo_reduce_scatter
from dtrain.runtime.distributed.context import RuntimeContext
from dtrain.runtime.distributed.tensor_parallel import apply_tensor_parallel
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def shard(
    model: nn.Module,
    ctx: RuntimeContext,
    *,
    block_classes: Iterable[type[nn.Module]] | None = None,
    mixed_precision: str | None = None,
    activation_checkpointing: bool | None = None,
    reshard_after_forward: bool | None = None,
    sharding_degree: int | None = None,
    fusion_buffer_bytes: int = gradient_sync.DEFAULT_BUFFER_BYTES,
    pipeline_sample: tuple[int, int] | None = None,
) -> nn.Module:
    """Shard ``model`` in place with MiCS and return it (an ``FSDPModule``); with a ``pp`` axis
    in the plan, return this rank's pipeline stages instead (a
    :class:`~dtrain.runtime.distributed.pipeline.PipelineModel`, driven by its ``step``).

    ``block_classes`` default to the classes named in the model's ``_no_split_modules``, else
    the children of its largest ``nn.ModuleList`` (:func:`find_blocks`, which logs its choice);
    ``mixed_precision`` / ``activation_checkpointing`` / ``sharding_degree`` default to the
    context's distribution settings. ``reshard_after_forward`` defaults to true, and to false
    under pipelining (:mod:`dtrain.runtime.distributed.pipeline` says why).
    ``pipeline_sample`` (sequences, tokens per micro-batch) is what automatic partitioning
    measures. A model built on the meta device is materialised on ``ctx.device`` after sharding
    and initialised with its ``init_weights()``. ``fusion_buffer_bytes`` sizes the overlapped
    gradient sync's buffers (``gradient_sync: overlapped`` in the plan).
    """
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(f"shard: {type(model).__name__} is sharded already (its parameters are "
                         "DTensors); call shard() once per model")
    ctx.build_mesh(_resolve_plan(model, ctx, sharding_degree))
    _check_same_model_everywhere(model, ctx)  # the collective first: every rank takes it
    _refuse_meta_without_init(model)
    _one_init_seed(model)
    precision = mixed_precision or ctx.config.mixed_precision
    options = {
        "policy": build_mixed_precision_policy(precision, device=ctx.device),
        "checkpointing": (ctx.config.activation_checkpointing if activation_checkpointing is None
                          else activation_checkpointing),
        "fusion_buffer_bytes": fusion_buffer_bytes,
    }
    if ctx.plan.pp > 1:
        from dtrain.runtime.distributed.pipeline import build_pipeline, reshard_after_forward_for

        reshard = reshard_after_forward_for(ctx.plan.pipeline_schedule, reshard_after_forward)
        return build_pipeline(
            model, ctx, budget_bytes=device_memory_bytes(ctx),
            compute_bytes=(options["policy"].param_dtype or torch.float32).itemsize,
            sample_shape=pipeline_sample,
            shard_stage=lambda stage: _shard_part(stage, ctx, blocks=[
                stage.get_submodule(path) for path in stage.block_paths],
                reshard_after_forward=reshard, **options))
    _shard_part(model, ctx, blocks=find_blocks(model, block_classes),
                reshard_after_forward=reshard_after_forward is not False, **options)
    return model


def _shard_part(model: nn.Module, ctx: RuntimeContext, *, blocks: list[nn.Module],
                policy: MixedPrecisionPolicy, checkpointing: bool,
                reshard_after_forward: bool, fusion_buffer_bytes: int) -> None:
    """Tensor parallelism, activation checkpointing, then ``fully_shard`` per block and on
    ``model`` (a whole model, or one pipeline stage)."""
    if ctx.plan.tp > 1:  # before checkpoint wrapping, which renames the modules a plan names
        apply_tensor_parallel(model, ctx.tensor_parallel_mesh, ctx.plan)
    if checkpointing:
        blocks = apply_activation_checkpointing(model, blocks)
    options = {"mesh": ctx.data_parallel_mesh, "mp_policy": policy,
               "reshard_after_forward": reshard_after_forward}
    for block in blocks:
        fully_shard(block, **options)
    head = output_head(model)
    if head is not None:
        # torchtitan's unit for the output layer: its gradient, first in backward, is reduced
        # (and handed to the overlapped sync) while the blocks compute, not with the root's at
        # the very end; backward needs it at once, so it stays gathered after forward.
        fully_shard(head, **{**options, "reshard_after_forward": False})
    fully_shard(model, **options)
    _configure_collectives(model, ctx, fusion_buffer_bytes=fusion_buffer_bytes)
    _materialize_if_meta(model, ctx)


def _resolve_plan(model: nn.Module, ctx: RuntimeContext,
                  override: int | None) -> ParallelismPlan:
    """The context's plan; with ``override`` or ``auto`` the same planning function again."""
    if ctx.plan is not None and override in (None, ctx.plan.dp_shard) and \
            not ctx.schedule_pending:
        return ctx.plan
    config = getattr(model, "hf_config_dict", None)
    plan = ctx.build_plan(sharding_degree=override,
                          num_parameters=sum(p.numel() for p in model.parameters()),
                          device_memory_bytes=device_memory_bytes(ctx),
                          model_dims=ModelDims.from_hf_config(config()) if config else None,
                          num_blocks=len(find_blocks(model, None)) if config else None)
    if plan is None:  # left to `dtrain submit` / `dtrain plan`, which see the whole job
        raise ParallelismError(
            "distribution.pipeline_parallel_degree",
            "auto is resolved by `dtrain submit` and `dtrain plan` from the job's model and "
            "instances; give a number when calling dtrain.runtime.init() yourself")
    return plan


def device_memory_bytes(ctx: RuntimeContext) -> float:
    """Memory one rank may use: the GPU's, or this machine's RAM split between its workers."""
    if ctx.device.type == "cuda":
        return float(torch.cuda.get_device_properties(ctx.device).total_memory)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram / ctx.local_world_size


def build_mixed_precision_policy(precision: str, *, device: torch.device) -> MixedPrecisionPolicy:
    """Compute in ``precision``; reduce gradients in fp32 so accumulation does not lose bits."""
    if precision == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        precision = "bf16" if bf16 else "fp32"
    if precision not in _DTYPES:
        raise ValueError(
            f"mixed_precision must be one of auto, bf16, fp16, fp32; got {precision!r}"
        )
    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=_DTYPES[precision], reduce_dtype=torch.float32)


def find_blocks(
    model: nn.Module, block_classes: Iterable[type[nn.Module]] | None
) -> list[nn.Module]:
    """The blocks to shard one by one (outermost matches only): instances of ``block_classes``,
    else of the classes named in ``_no_split_modules``, else the children of the model's largest
    ``nn.ModuleList`` (by parameters), else none (the root is sharded as one unit)."""
    if block_classes is not None:
        classes = tuple(block_classes)
        matches = lambda m: isinstance(m, classes)
    else:
        names = set(getattr(type(model), "_no_split_modules", None) or ())
        if not names:
            return _guess_blocks(model)
        matches = lambda m: type(m).__name__ in names
    blocks: list[nn.Module] = []
    for module in model.modules():
        nested = any(_contains(block, module) for block in blocks)
        if module is not model and matches(module) and not nested:
            blocks.append(module)
    if not blocks:
        wanted = ", ".join(c.__name__ for c in classes) if block_classes is not None else \
            f"_no_split_modules ({', '.join(sorted(names))})"
        raise ValueError(f"no blocks of {wanted} found in {type(model).__name__}; pass "
                         "block_classes=[...] with the class of its repeated blocks")
    return blocks


def _guess_blocks(model: nn.Module) -> list[nn.Module]:
    """A plain model's blocks: the children of its largest ``nn.ModuleList``; logged, since the
    choice decides what is gathered at once."""
    lists = [(sum(p.numel() for p in m.parameters()), name, m)
             for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    name = type(model).__name__
    if not lists:
        logger.info("shard: %s has no _no_split_modules and no nn.ModuleList; sharding it as one "
                    "unit (pass block_classes=[...] to shard its blocks one by one)", name)
        return []
    _, path, blocks = max(lists, key=lambda found: found[0])
    kinds = sorted({type(block).__name__ for block in blocks})
    logger.info("shard: %s has no _no_split_modules; sharding the %d children of %s.%s (%s) one "
                "by one (pass block_classes=[...] to choose others)", name, len(blocks), name,
                path, ", ".join(kinds))
    return list(blocks)


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's untied output layer (``lm_head``, as Hugging Face names it), or None."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Module) or not any(p.requires_grad for p in head.parameters()):
        return None
    inside = {id(m) for m in head.modules()}
    own = {id(p) for p in head.parameters()}
    for module in model.modules():
        if id(module) not in inside and own & {id(p) for p in module.parameters(recurse=False)}:
            return None  # tied to the input embedding: one parameter cannot be in two units
    return head


def _contains(parent: nn.Module, module: nn.Module) -> bool:
    return any(m is module for m in parent.modules())


def apply_activation_checkpointing(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """Wrap each block in torch's checkpoint wrapper (before sharding) and return the wrappers."""
    wrapped = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if any(child is block for block in blocks):
                wrapper = torch_private.checkpoint_wrapper(child)
                setattr(parent, name, wrapper)
                wrapped.append(wrapper)
    assert len(wrapped) == len(blocks)
    return wrapped


def _configure_collectives(model: nn.Module, ctx: RuntimeContext, *,
                           fusion_buffer_bytes: int) -> None:
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    overlapped = ctx.plan.gradient_sync == "overlapped"
    if ctx.backend == "gloo" or overlapped:
        # gloo has no ReduceOp.AVG: reduce with SUM and let FSDP2 divide afterwards.
        for module in fsdp_modules:
            module.set_force_sum_reduction_for_comms(True)
    reduce_scatter = gloo_reduce_scatter(ctx.plan) if ctx.backend == "gloo" else None
    if reduce_scatter is not None:  # a ring's bytes where gloo's would move an all-reduce's
        for module in fsdp_modules:
            module.set_custom_reduce_scatter(reduce_scatter)
    if overlapped:  # FSDP2 averages over the partition group, gradient_sync over replicas
        gradient_sync.attach(model, ctx.new_replica_sync_group(), device=ctx.device,
                             buffer_bytes=fusion_buffer_bytes)
    if ctx.plan.hierarchical_allgather:
        comm = HierarchicalAllGather(ctx.hierarchy_groups())
        for module in fsdp_modules:
            module.set_custom_all_gather(comm)


def _one_init_seed(model: nn.Module) -> None:
    """Rank 0's ``init_seed`` on every rank, for a model still on the meta device: a script
    that seeds each rank differently still starts every replica and shard from one model
    (before the pipeline stages copy it)."""
    seed = getattr(model, "init_seed", None)
    if seed is None or not dist.is_initialized() or dist.get_world_size() == 1 or \
            not any(t.is_meta for t in model.parameters()):
        return
    shared = [seed]
    dist.broadcast_object_list(shared, src=0)
    model.init_seed = shared[0]


def _check_same_model_everywhere(model: nn.Module, ctx: RuntimeContext) -> None:
    """Refuse a model whose weights differ between ranks (a script that seeds each rank
    differently before building it on a real device): its replicas would train apart and its
    shards mix different models, silently. So is a model on the meta device on some ranks only.
    One collective every rank takes, whatever its model: three numbers compared exactly."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    params = list(model.parameters())
    real = [p for p in params if not p.is_meta]
    sums = torch.tensor([  # one parameter in float64 at a time
        float(len(real) < len(params)), sum(float(p.detach().double().sum()) for p in real),
        sum(float(p.detach().double().abs().sum()) for p in real)],
        dtype=torch.float64).nan_to_num()
    low, high = sums.to(ctx.device), sums.to(ctx.device, copy=True)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if low[0] != high[0]:
        raise ValueError("shard: the model is on the meta device on some ranks and built on "
                         "others; build it the same way on every rank")
    if not torch.equal(low, high):
        meta = " or build it on the meta device (device='meta'), where shard() initialises " \
            "it alike on every rank with its init_weights()" \
            if callable(getattr(model, "init_weights", None)) else ""
        raise ValueError(
            "shard: the model's weights differ between ranks, so its replicas would train apart "
            "and its shards mix different models; set the same seed on every rank before "
            f"building it (torch.manual_seed(seed)){meta}")


def _refuse_meta_without_init(model: nn.Module) -> None:
    """A model on the meta device holds no values: without ``init_weights`` to write them after
    materialisation it would train on whatever memory ``to_empty`` left (NaN, 1e35)."""
    on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    if on_meta and not callable(getattr(model, "init_weights", None)):
        raise ValueError(
            f"shard: {type(model).__name__} is on the meta device but has no init_weights() to "
            "give it values once it is materialised; define init_weights() to fill every "
            "parameter and buffer (copy whole values in: param.copy_(values)), or build the "
            "model on a real device with the same seed on every rank")


def _materialize_if_meta(model: nn.Module, ctx: RuntimeContext) -> None:
    tensors = list(model.parameters()) + list(model.buffers())
    if not any(t.is_meta for t in tensors):
        return
    model.to_empty(device=ctx.device)
    with torch.no_grad(), WholeIntoSlice():  # shard() refused a meta model without it
        model.init_weights()


class WholeIntoSlice(TorchFunctionMode):
    """While a split model initialises: a whole tensor copied into a split parameter (a DTensor,
    ``param.copy_(values)``) lands as this rank's slice of it, without communication (each rank
    computed the whole). Models write whole values and know nothing of DTensor
    (``HFCompatibleModel.init_weights``); DTensor's own ``copy_`` refuses a plain tensor, and
    under implicit replication refuses to split one into a shard."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.copy_ and isinstance(args[0], DTensor):
            into, args = args[0], args[1:]
            src = args[0] if args else kwargs.pop("src")
            if not isinstance(src, DTensor):
                src = distribute_tensor(src.to(into.device), into.device_mesh, into.placements,
                                        src_data_rank=None)
            return func(into, src, *args[1:], **kwargs)
        return func(*args, **kwargs)
