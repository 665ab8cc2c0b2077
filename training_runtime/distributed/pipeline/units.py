"""How a model of dtrain's families is cut into pipeline units: embeddings, blocks, head.

A unit is named by the modules it holds (their paths in the whole model) and a function that runs
it on whatever module holds those paths. A stage (:class:`StageModule`) holds some consecutive
units under the same paths, so its parameter names are the whole model's: checkpoints, the HF
export and the tensor-parallel plans need no renaming, and the measuring pass
(:mod:`.measure`) runs the same functions on a whole model. The models know nothing of this;
``tests/unit/test_pipeline_partition.py`` checks that the units, run in order, are the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from dtrain.core import pipeline as ppl
from dtrain.runtime.models.common import HFCompatibleModel
from torch import nn

Run = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _call(path: str, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module.get_submodule(path)(x)


def _embed_with_positions(tokens: str, positions: str, module: nn.Module,
                          ids: torch.Tensor) -> torch.Tensor:
    where = torch.arange(ids.shape[1], device=ids.device)
    return module.get_submodule(tokens)(ids) + module.get_submodule(positions)(where)


def _norm_then_head(norm: str, head: str, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module.get_submodule(head)(module.get_submodule(norm)(x))


def _bert_embed(path: str, module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return module.get_submodule(path)(ids, None)


@dataclass(frozen=True)
class Family:
    """Where a family keeps its embeddings, blocks and head, and how its forward chains them."""

    embeddings: tuple[str, ...]
    blocks: str  # the ModuleList of blocks
    head: tuple[str, ...]
    embed: Run
    finish: Run


def _gpt(prefix: str, *, positions: bool) -> Family:
    wte, wpe = f"{prefix}.wte", f"{prefix}.wpe"
    return Family(
        embeddings=(wte, wpe) if positions else (wte,), blocks=f"{prefix}.h",
        head=(f"{prefix}.ln_f", "lm_head"),
        embed=partial(_embed_with_positions, wte, wpe) if positions else partial(_call, wte),
        finish=partial(_norm_then_head, f"{prefix}.ln_f", "lm_head"))


def _bert(prefix: str, head: str) -> Family:
    return Family(embeddings=(f"{prefix}.embeddings",), blocks=f"{prefix}.encoder.layer",
                  head=(head,), embed=partial(_bert_embed, f"{prefix}.embeddings"),
                  finish=partial(_call, head))


FAMILIES = {
    "gpt_neox": Family(embeddings=("gpt_neox.embed_in",), blocks="gpt_neox.layers",
                       head=("gpt_neox.final_layer_norm", "lm_head"),
                       embed=partial(_call, "gpt_neox.embed_in"),
                       finish=partial(_norm_then_head, "gpt_neox.final_layer_norm", "lm_head")),
    "gpt2": _gpt("transformer", positions=True),
    "gpt_neo": _gpt("transformer", positions=True),
    "gptj": _gpt("transformer", positions=False),
    "bert": _bert("bert", "cls"),
    "roberta": _bert("roberta", "lm_head"),
}


@dataclass(frozen=True)
class Unit:
    name: str  # "embeddings", "block 3", "head"
    paths: tuple[str, ...]
    run: Run
    is_block: bool = False


def model_units(model: nn.Module) -> list[Unit]:
    """The units of ``model`` in forward order; ValueError for a model dtrain cannot cut."""
    family = FAMILIES.get(getattr(model, "model_type", None))
    if family is None:
        raise ValueError(
            f"distribution.pipeline_parallel_degree: pipeline stages are cut from dtrain's model "
            f"families ({', '.join(sorted(FAMILIES))}), not {type(model).__name__}; build the "
            "model with dtrain.runtime.models or set pipeline_parallel_degree 1")
    count = len(model.get_submodule(family.blocks))
    units = [Unit("embeddings", family.embeddings, family.embed)]
    units += [Unit(f"block {i}", (f"{family.blocks}.{i}",), partial(_call, f"{family.blocks}.{i}"),
                   is_block=True) for i in range(count)]
    units.append(Unit("head", family.head, family.finish))
    return units


def check_untied(model: nn.Module) -> None:
    """Stages cannot share a parameter: the embeddings sit on the first, the head on the last."""
    if getattr(model, "tie_word_embeddings", False) and getattr(model, "_tied_weights_keys", None):
        raise ValueError("distribution.pipeline_parallel_degree: "
                         + ppl.tied_head_problem(model.model_type))


def graft(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` at ``path`` under ``root``, creating empty containers on the way (a
    ``ModuleDict`` where the children are numbered, as a ``ModuleList``'s are)."""
    *parents, leaf = path.split(".")
    owner = root
    for depth, name in enumerate(parents):
        if not hasattr(owner, name):
            child = (path.split(".")[depth + 1]).isdigit()
            owner.add_module(name, nn.ModuleDict() if child else nn.Module())
        owner = getattr(owner, name)
    owner.add_module(leaf, module)


class StageModule(nn.Module):
    """Consecutive units of a model under their own paths; ``forward`` runs them in order.

    It answers what the tensor-parallel plans and the sharding code ask of a model
    (``model_type``, ``hf_config_dict``, ``tie_weights``, ``init_weights``).
    """

    def __init__(self, model: nn.Module, units: list[Unit]) -> None:
        super().__init__()
        self._runs = [unit.run for unit in units]
        self.unit_names = [unit.name for unit in units]
        self.block_paths = [unit.paths[0] for unit in units if unit.is_block]
        self.unit_paths = [path for unit in units for path in unit.paths]
        for unit in units:
            for path in unit.paths:
                graft(self, path, model.get_submodule(path))
        # checkpoints record the family's parameter layout (train.checkpoint.state_layout)
        self.model_type, self.state_layout = model.model_type, getattr(model, "state_layout", 1)
        self.initializer_range = getattr(model, "initializer_range", 0.02)
        self.init_seed = model.init_seed  # each parameter's values are the whole model's
        self._hf_config = model.hf_config_dict()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for run in self._runs:
            x = run(self, x)
        return x

    def hf_config_dict(self) -> dict:
        return dict(self._hf_config)

    def tie_weights(self) -> None:
        """Nothing is tied inside a stage (:func:`check_untied`)."""

    def init_weights(self) -> None:
        """The whole model's initialisation, on this stage's modules (a model built on meta):
        each parameter gets the values it has in the whole model, whichever stage holds it."""
        HFCompatibleModel.init_weights(self)
