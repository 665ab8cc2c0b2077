"""The 1-D (Megatron) building blocks every family's plan is made of, on DTensor.

Activations between blocks ("the residual stream") are, per rank of the ``tp`` group:

* without sequence parallelism: the whole tensor, the same on every rank (plain tensors);
* with sequence parallelism: this rank's slice of the sequence, a ``Shard(1)`` DTensor, so layer
  norms and residual adds hold ``1/tp`` of the activations. Entering attention or the MLP, the
  sequence is all-gathered; leaving them, the row-parallel projection reduce-scatters it back
  (Korthikanti et al. 2022), instead of the all-reduce without it.

Inside attention and the MLP, the column-parallel projection leaves each rank its heads (or its
slice of the MLP's inner size) as a plain local tensor, which the model's own code computes on;
the row-parallel projection (:mod:`.row_parallel`) sums the ranks' partial outputs. The embedding is vocabulary-
parallel (each rank holds ``vocab/tp`` rows; a token's row comes from the rank that holds it) and
the LM head column-parallel over the vocabulary, its logits left sharded for the parallel
cross-entropy of :mod:`.loss`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dtrain.runtime.distributed.tensor_parallel.row_parallel import RowParallelLinear
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


@dataclass
class OneDPlan:
    """What to do to a model: styles per module, heads to share out, parameters to shard."""

    styles: list[tuple[str, ParallelStyle]] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)  # linear layers made row-parallel
    attention: list[str] = field(default_factory=list)  # modules whose num_heads is split
    vocab_parameters: list[str] = field(default_factory=list)  # 1-D vocabulary-sized params

    def add(self, fqn: str, style: ParallelStyle) -> None:
        self.styles.append((fqn, style))


@dataclass(frozen=True)
class Block:
    """The parts of a family's transformer block a plan splits, named inside the block."""

    norms: tuple[str, ...]  # layer norms: sequence-parallel (1-D with SP) or grid norms (2-D)
    columns: tuple[str, ...]  # projections split by output features (heads, MLP inner size)
    rows: tuple[str, ...]  # projections split by input features, partial sums reduced
    heads: str  # the module whose num_heads is shared out
    whole_sequence: tuple[tuple[str, int], ...]  # (module, its inputs) that need the sequence


def add_blocks(plan: OneDPlan, model: nn.Module, blocks: str, block: Block, *,
               sequence_parallel: bool, split_first: bool = False) -> None:
    """The 1-D plan of every block under ``blocks``; ``split_first``: the first block takes
    whole embeddings and keeps its slice of the sequence (with sequence parallelism)."""
    for index, fqn in enumerate(children(model, blocks)):
        for name in block.columns:
            plan.add(f"{fqn}.{name}", column())
        plan.rows += [f"{fqn}.{name}" for name in block.rows]
        plan.attention.append(f"{fqn}.{block.heads}")
        if not sequence_parallel:
            continue
        if index == 0 and split_first:
            plan.add(fqn, split_sequence(2))
        for name in block.norms:
            plan.add(f"{fqn}.{name}", sequence_norm())
        for name, inputs in block.whole_sequence:
            plan.add(f"{fqn}.{name}", gather_sequence(inputs))


@dataclass(frozen=True)
class CausalLM:
    """Where a decoder family keeps what a plan splits (module names in the model)."""

    embedding: str  # the token embedding
    blocks: str  # the container of the transformer blocks
    block: Block
    final_norm: str
    position_embedding: str | None = None  # learned positions, added to the token embedding
    head: str = "lm_head"


def causal_lm_plan(model: nn.Module, family: CausalLM, *, sequence_parallel: bool) -> OneDPlan:
    """The 1-D plan of a decoder: vocabulary-parallel embedding, blocks, norm, head. With
    position embeddings the embeddings are added whole and the first block keeps its slice."""
    sp = sequence_parallel
    plan = OneDPlan()
    added = family.position_embedding is not None
    plan.add(family.embedding, replicated_embedding() if added else vocab_embedding(sp))
    add_blocks(plan, model, family.blocks, family.block, sequence_parallel=sp,
               split_first=added and present(model, family.embedding))
    if sp:
        plan.add(family.final_norm, sequence_norm())
    plan.add(family.head, vocab_head(sp))
    return plan


def residual_layout(sequence_parallel: bool) -> Shard | Replicate:
    return Shard(1) if sequence_parallel else Replicate()


def column() -> ColwiseParallel:
    """Weight rows split: each rank computes its heads / inner features, kept local."""
    return ColwiseParallel()


def vocab_embedding(sequence_parallel: bool) -> RowwiseParallel:
    return RowwiseParallel(input_layouts=Replicate(),
                           output_layouts=residual_layout(sequence_parallel),
                           use_local_output=not sequence_parallel)


def replicated_embedding() -> RowwiseParallel:
    """A vocabulary-parallel embedding whose output others add to as plain tensors."""
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())


def vocab_head(sequence_parallel: bool, *, gathered_input: bool = False) -> ColwiseParallel:
    """Logits sharded over the vocabulary, as a DTensor for the parallel cross-entropy."""
    layout = Replicate() if gathered_input else residual_layout(sequence_parallel)
    return ColwiseParallel(input_layouts=layout, output_layouts=Shard(-1),
                           use_local_output=False)


def sequence_norm() -> SequenceParallel:
    return SequenceParallel()


def gather_sequence(num_inputs: int) -> PrepareModuleInput:
    """Into attention / MLP / a replicated head: the whole sequence, as a plain tensor. The
    first input is the activation; the others (an attention mask) pass unchanged."""
    rest = (None,) * (num_inputs - 1)
    return PrepareModuleInput(input_layouts=(Shard(1), *rest),
                              desired_input_layouts=(Replicate(), *rest), use_local_output=True)


def split_sequence(num_inputs: int) -> PrepareModuleInput:
    """Into the first block, from embeddings computed whole: keep this rank's slice (no
    communication; the backward all-gathers the gradient)."""
    rest = (None,) * (num_inputs - 1)
    return PrepareModuleInput(input_layouts=(Replicate(), *rest),
                              desired_input_layouts=(Shard(1), *rest), use_local_output=False)


def children(model: nn.Module, fqn: str) -> list[str]:
    """The FQNs of the blocks under ``fqn`` that this model holds (a pipeline stage: some)."""
    if not present(model, fqn):
        return []
    return [f"{fqn}.{name}" for name, _ in model.get_submodule(fqn).named_children()]


def present(model: nn.Module, fqn: str) -> bool:
    """Whether ``model`` has the module ``fqn`` (a pipeline stage holds only some)."""
    try:
        return model.get_submodule(fqn) is not None
    except AttributeError:
        return False


def apply_plan(model: nn.Module, mesh: DeviceMesh, plan: OneDPlan, *,
               sequence_parallel: bool) -> None:
    """Apply the styles, make the row layers row-parallel (:mod:`.row_parallel`), shard the
    vocabulary-sized parameters, share out the heads."""
    for fqn, style in plan.styles:
        if present(model, fqn):
            parallelize_module(model.get_submodule(fqn), mesh, style)
    for fqn in plan.rows:
        if present(model, fqn):
            owner_name, _, attr = fqn.rpartition(".")
            owner = model.get_submodule(owner_name)
            setattr(owner, attr, RowParallelLinear.from_linear(
                getattr(owner, attr), mesh, sequence_parallel=sequence_parallel))
    for name in plan.vocab_parameters:
        owner_name, _, attr = name.rpartition(".")
        if not present(model, owner_name):
            continue
        owner = model.get_submodule(owner_name)
        param = getattr(owner, attr)
        owner.register_parameter(attr, nn.Parameter(
            distribute_tensor(param.detach(), mesh, [Shard(0)]), param.requires_grad))
    share_heads(model, plan.attention, mesh.size())


def share_heads(model: nn.Module, attention: Sequence[str], ways: int) -> None:
    """Each rank's attention modules hold ``num_heads / ways`` heads."""
    for fqn in attention:
        if present(model, fqn):
            module = model.get_submodule(fqn)
            assert module.num_heads % ways == 0, (fqn, module.num_heads, ways)
            module.num_heads //= ways
