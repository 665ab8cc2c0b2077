"""Tensor parallelism for dtrain's model families, applied before MiCS shards what it leaves.

* ``1d`` (Megatron, with or without sequence parallelism): DTensor's ``parallelize_module`` with a
  plan per family (:mod:`.layouts` holds the building blocks, one module per family the plan);
* ``2d`` (Optimus): every linear layer of a block, the embedding, the norms and the LM head split
  over a ``q × q`` grid, activations too, with SUMMA products (:mod:`.optimus`); GPT-NeoX and
  GPT-2.

The models know nothing of this: a plan names their modules, replaces none of their code (2-D
swaps layers for grid layers under the same names, so parameter names and checkpoints keep
theirs), and sets each attention module's ``num_heads`` to the heads its rank holds. A pipeline
stage (a model holding some of the blocks) takes the same plan: modules it lacks are skipped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from importlib import import_module

from dtrain.core import tensor_parallel as tpl
from dtrain.core.parallelism import ParallelismPlan
from dtrain.runtime.distributed.tensor_parallel.layouts import apply_plan
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

# model_type -> the module holding its plans
FAMILIES = {"gpt_neox": "gpt_neox", "gpt2": "gpt2", "gptj": "gptj", "gpt_neo": "gpt_neo",
            "bert": "bert", "roberta": "bert"}


def check_model(model: nn.Module, plan: ParallelismPlan) -> None:
    """Refuse, in one line with the fix, a model this plan's tensor parallelism cannot split."""
    field = "distribution.tensor_parallel_degree"
    model_type = getattr(model, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(
            f"{field}: tensor parallelism has plans for dtrain's model families "
            f"({', '.join(sorted(FAMILIES))}), not {type(model).__name__}; build the model with "
            "dtrain.runtime.models or set tensor_parallel_degree 1")
    problem = tpl.two_d_family_problem(model_type) if plan.tp_grid else None
    if problem:
        raise ValueError(f"distribution.tensor_parallel_mode: {problem}")
    dims = tpl.ModelDims.from_hf_config(model.hf_config_dict())
    allowed = tpl.candidate_degrees(plan.devices_per_node, plan.tp_mode, dims)
    problem = tpl.shape_problem(plan.tp, plan.tp_mode, dims, allowed=allowed)
    if problem:
        raise ValueError(f"{field}: {problem}")


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, plan: ParallelismPlan
                          ) -> nn.Module:
    """Split ``model`` over ``mesh`` (the ``tp`` axis, or the 2-D grid) in place; returns it."""
    check_model(model, plan)
    family = import_module(f"{__name__}.{FAMILIES[model.model_type]}")
    if plan.tp_grid:
        family.apply_two_d(model, mesh)
    else:
        apply_plan(model, mesh, family.one_d_plan(model, sequence_parallel=plan.sequence_parallel),
                   sequence_parallel=plan.sequence_parallel)
    model.tie_weights()  # the plan split a tied weight once; its other user takes that one
    return model


@contextlib.contextmanager
def loss_parallel(plan: ParallelismPlan) -> Iterator[None]:
    """``F.cross_entropy`` on logits split over the vocabulary, without gathering them: torch's
    loss parallelism in 1-D, the grid's own in 2-D. The backward must run inside too."""
    if plan.tp_grid:
        from dtrain.runtime.distributed.tensor_parallel.grid_layers import grid_cross_entropy

        with grid_cross_entropy():
            yield
        return
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

    with torch_loss_parallel():
        yield
