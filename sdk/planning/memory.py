"""Memory per device of a layout: model states, unsharded layers, activations (stdlib only).

``docs/cost-model.md`` states the formulas. Tensor parallelism divides the model states and the
unsharded layer by ``tp`` (each rank holds ``1/tp`` of every split layer before MiCS shards it
``dp_shard`` ways); activations shrink per layout, as ``benchmarks/tensor_parallel_memory.py``
measures them:

* 1-D without sequence parallelism: the block input, both layer-norm outputs and the second
  residual input stay whole on every rank (4 of the 12 ``h``-sized tensors a layer keeps per
  token), the rest is split;
* 1-D with sequence parallelism: the block input and the residual split along the sequence too,
  but the column-parallel layers keep the layer-norm outputs they gathered (2 stay whole);
* 2-D: everything is split over the ``q × q`` grid.

The logits are split over the vocabulary in every layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.core.sizing import model_state_bytes_per_gpu
from dtrain.planning.costmodel import Workload

# h-sized tensors a layer keeps per token with a flash kernel: eight h-sized (block input, both
# layer-norm outputs, q, k, v, attention output, second residual input) and the MLP's 4h
# pre-activation (its activation is recomputed). At 2 bytes, 24·h bytes per token per layer;
# Korthikanti et al. 2022 count 34 for Megatron's layers, whose dropout masks dtrain's lack.
ACTIVATION_TENSORS_PER_LAYER = 12
WHOLE_IN_1D = 4
WHOLE_IN_1D_WITH_SP = 2


@dataclass(frozen=True)
class Layout:
    """How a layer is split: ``tp`` ranks, ``1d``/``2d``, sequence parallelism."""

    tp: int = 1
    mode: str = "1d"
    sequence_parallel: bool = False


@dataclass
class MemoryEstimate:
    model_state_gib: float
    unsharded_layers_gib: float
    activation_gib: float
    device_gib: float

    @property
    def total_gib(self) -> float:
        return self.model_state_gib + self.unsharded_layers_gib + self.activation_gib


def activation_tensors_per_layer(layout: Layout) -> float:
    """The ``h``-sized tensors one rank keeps per token and layer."""
    total = ACTIVATION_TENSORS_PER_LAYER
    if layout.tp == 1:
        return total
    if layout.mode == "2d":
        return total / layout.tp
    whole = WHOLE_IN_1D_WITH_SP if layout.sequence_parallel else WHOLE_IN_1D
    return whole + (total - whole) / layout.tp


def activation_bytes(work: Workload, layout: Layout, *, vocab_size: int) -> float:
    """Bytes one rank keeps for backward: layers plus logits (and the fp32 loss)."""
    tokens = work.seq_len * work.micro_batch_size
    per_token = work.hidden_size * tokens * work.compute_bytes
    per_layer = activation_tensors_per_layer(layout) * per_token
    if work.activation_checkpointing:
        # every layer's input, then one layer recomputed at a time
        split_input = layout.mode == "2d" or layout.sequence_parallel
        layers = work.num_layers * per_token / (layout.tp if split_input else 1) + per_layer
    else:
        layers = work.num_layers * per_layer
    logits = tokens * vocab_size * (work.compute_bytes + 4) / layout.tp
    return layers + logits


def unsharded_bytes(work: Workload, layout: Layout) -> float:
    """FSDP holds the block being computed and the prefetched next one whole (of this rank's
    tensor-parallel share)."""
    return 2 * work.num_parameters / (work.num_layers + 1) * work.compute_bytes / layout.tp


def other_bytes(work: Workload, layout: Layout, *, vocab_size: int) -> float:
    """What sharding does not shrink: activations and the unsharded layers."""
    return activation_bytes(work, layout, vocab_size=vocab_size) + unsharded_bytes(work, layout)


def memory_estimate(work: Workload, layout: Layout, *, sharding_degree: int, vocab_size: int,
                    device_gib: float) -> MemoryEstimate:
    gib = 2**30
    states = model_state_bytes_per_gpu(work.num_parameters // layout.tp, sharding_degree)
    return MemoryEstimate(
        model_state_gib=states / gib,
        unsharded_layers_gib=unsharded_bytes(work, layout) / gib,
        activation_gib=activation_bytes(work, layout, vocab_size=vocab_size) / gib,
        device_gib=device_gib,
    )
