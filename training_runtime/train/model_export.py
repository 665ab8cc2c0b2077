"""The final model of any ``nn.Module``, in the format it can be read back in.

``model_format`` (``TrainerConfig``) picks it:

* ``auto`` (default): Hugging Face format for dtrain's model families (``dtrain.runtime.models``),
  which transformers and ``load_pretrained`` read; a consolidated safetensors state dict for any
  other module, or for a dtrain model whose parameters its family does not describe (a subclass
  that added some), with a warning;
* ``huggingface``: that format or an error before training starts;
* ``safetensors``: the state dict for any module::

      model/
          model.safetensors   every parameter and buffer, whole (unsharded), by state-dict name
          dtrain_model.json   {"format": "dtrain-safetensors/1", "class": "train.Net", ...}

  read back with ``model.load_state_dict(safetensors.torch.load_file("model/model.safetensors"))``;
* ``none``: no model is written (the last checkpoint has everything).

Both formats go through the same staging folder and are published file by file, the JSON last
(:mod:`dtrain.runtime.train.checkpoint`), so ``model/`` holds a whole model or the previous one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch.distributed as dist
from dtrain.runtime.train.checkpoint import (
    MODEL_INFO,
    _publish,
    full_state_dict,
    make_staging_dir,
    remove_partial_model_files,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import FSDPModule

MODEL_FORMATS = ("auto", "huggingface", "safetensors", "none")
SAFETENSORS_FORMAT = "dtrain-safetensors/1"
WEIGHTS_FILE = "model.safetensors"

logger = logging.getLogger(__name__)


def resolve_model_format(model: nn.Module, requested: str) -> str:
    """``huggingface``, ``safetensors`` or ``none`` for ``model``; a ValueError (before any
    training) when ``huggingface`` is asked of a module that cannot be written so."""
    if requested not in MODEL_FORMATS:
        raise ValueError(f"model_format {requested!r} is not one of {MODEL_FORMATS}")
    if requested in ("safetensors", "none"):
        return requested
    problem = hf_problem(model)
    if problem is None:
        return "huggingface"
    if requested == "huggingface":
        raise ValueError(f"model_format 'huggingface': {problem}; use 'auto' or 'safetensors'")
    if hasattr(model, "hf_config_dict"):
        logger.warning("the final model is saved as a safetensors state dict: %s", problem)
    return "safetensors"


def hf_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot be written in Hugging Face format (None: it can). Every rank gets
    the same answer, from parameter names alone (no gathering)."""
    config = getattr(model, "hf_config_dict", None)
    if not callable(config):
        return f"{_model_class(model).__name__} is not one of dtrain's model families"
    if callable(getattr(model, "gather_full_state_dict", None)):
        return None  # pipeline stages: built only for dtrain's families, under the model's names
    from dtrain.runtime.models import layout_model

    family = layout_model(config())
    expected = set(family.state_dict())
    tied = set(getattr(family, "_tied_weights_keys", None) or ())
    have = set(get_model_state_dict(model))
    if have - expected or expected - tied - have:
        extra = sorted(have - expected) or sorted(expected - tied - have)
        return (f"its parameters differ from its family's {type(family).__name__} "
                f"(e.g. {extra[0]!r})")
    return None


def save_safetensors_model(model: nn.Module, folder: str | Path) -> Path:
    """Gather the whole state dict and write it as ``model.safetensors`` plus
    ``dtrain_model.json`` from rank 0 (collective); see the module docstring."""
    from safetensors.torch import save_file

    full = full_state_dict(model)  # empty on ranks other than 0
    folder = Path(folder)
    if dist.get_rank() == 0:
        tensors, storages = {}, set()
        for name, tensor in full.items():
            tensor = tensor.detach().contiguous()
            if tensor.untyped_storage().data_ptr() in storages:
                tensor = tensor.clone()  # tied weights: safetensors refuses shared memory
            storages.add(tensor.untyped_storage().data_ptr())
            tensors[name] = tensor
        remove_partial_model_files(folder)  # left by a save that was killed
        staging = make_staging_dir(folder)
        save_file(tensors, staging / WEIGHTS_FILE, metadata={"format": "pt"})
        cls = _model_class(model)
        (staging / MODEL_INFO).write_text(json.dumps({
            "format": SAFETENSORS_FORMAT, "class": f"{cls.__module__}.{cls.__qualname__}",
            "weights": WEIGHTS_FILE, "parameters": sum(t.numel() for t in tensors.values()),
            "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()}),
            "load": f"model.load_state_dict(safetensors.torch.load_file('{WEIGHTS_FILE}'))",
        }, indent=2) + "\n")
        folder.mkdir(parents=True, exist_ok=True)
        _publish(staging, folder, last=MODEL_INFO)
    dist.barrier()
    return folder


def _model_class(model: nn.Module) -> type:
    """The user's class, not the one ``fully_shard`` derived from it."""
    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))
