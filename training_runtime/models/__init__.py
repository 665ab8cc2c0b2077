"""Hugging Face-compatible transformer models. Nothing here imports torch.distributed.

``build_model(config)`` builds the family a HF ``config.json`` dict names (``model_type``);
``from_preset(name)`` does the same for a shape in ``dtrain.core.presets``. Models are built on the
meta device and then materialised, so the flow the sharding code uses (meta build,
``to_empty``, ``init_weights``) is the only flow there is.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

import torch
from dtrain.core.presets import get_preset
from dtrain.runtime.models.attention import ATTENTION_BACKENDS, check_backend, used_kernels
from torch import nn

__all__ = [
    "ATTENTION_BACKENDS", "build_model", "from_preset", "layout_model", "model_class",
    "num_parameters", "used_kernels",
]

# HF model_type -> "module:class"; imported on first use so one family's bug can't break another
_FAMILIES = {
    "gpt_neox": "gpt_neox:GPTNeoXForCausalLM",
    "gpt2": "gpt2:GPT2LMHeadModel",
    "gptj": "gptj:GPTJForCausalLM",
    "gpt_neo": "gpt_neo:GPTNeoForCausalLM",
    "bert": "bert:BertForMaskedLM",
    "roberta": "bert:RobertaForMaskedLM",
}


def model_class(model_type: str | None) -> type[nn.Module]:
    """The model class for an HF ``model_type``."""
    target = _FAMILIES.get(model_type or "")
    if target is None:
        raise ValueError(
            f"model_type={model_type!r} is not supported; set config['model_type'] to one of "
            f"{', '.join(_FAMILIES)}"
        )
    module_name, class_name = target.split(":")
    return getattr(import_module(f"{__name__}.{module_name}"), class_name)


def build_model(
    config: dict[str, Any],
    *,
    attention: str = "flash",
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Build and initialise the model an HF config describes.

    ``device="meta"`` returns the unmaterialised model (call ``to_empty`` then
    ``init_weights()`` later, e.g. after sharding); any other device (default CPU) returns it
    initialised. Either way the build draws the model's ``init_seed`` from the torch RNG, so the
    same seed gives the same weights either way (on the same device type), and the next model
    built differs. For a model wanted only for its names and shapes, :func:`layout_model`.
    """
    check_backend(attention)
    cls = model_class(config.get("model_type"))
    with torch.device("meta"):
        model = cls(config, attention=attention)
    if dtype is not None:
        model.to(dtype)
    if torch.device(device or "cpu").type == "meta":
        return model
    model.to_empty(device=device or "cpu")
    model.init_weights()
    return model


def layout_model(config: dict[str, Any], *, attention: str = "flash") -> nn.Module:
    """The model an HF config describes, on the meta device, for its parameter names and shapes
    only: unlike :func:`build_model`, it leaves the torch RNG as it was (a layout read on one
    rank must not move that rank's random stream away from the others')."""
    with torch.random.fork_rng(devices=[]):
        return build_model(config, attention=attention, device="meta")


def from_preset(
    name: str,
    *,
    attention: str = "flash",
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **config_overrides: Any,
) -> nn.Module:
    """Build the preset ``name`` (see ``dtrain.core.presets``), with config keys overridden."""
    config = {**get_preset(name), **config_overrides}
    return build_model(config, attention=attention, device=device, dtype=dtype)


def num_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Parameter count; tied parameters count once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
