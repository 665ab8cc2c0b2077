"""Read and write Hugging Face model folders: ``config.json`` plus ``model.safetensors`` or
sharded ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``.

Local folders only: nothing here downloads from the Hub.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from dtrain.core import recipe_inputs
from dtrain.runtime.models import build_model
from safetensors.torch import load_file, save_file
from torch import nn

CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME = (recipe_inputs.HF_CONFIG, recipe_inputs.HF_WEIGHTS,
                                         recipe_inputs.HF_INDEX)
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def read_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"{Path(folder)} has no {CONFIG_NAME}; pass a folder written by "
                         "save_pretrained (a downloaded Hugging Face model folder works)")
    return json.loads(path.read_text())


def read_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint, on the CPU."""
    folder = Path(folder)
    if (folder / WEIGHTS_NAME).is_file():
        return load_file(folder / WEIGHTS_NAME)
    if (folder / INDEX_NAME).is_file():
        weight_map = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
        state_dict: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            state_dict.update(load_file(folder / shard))
        return state_dict
    raise ValueError(f"{folder} has neither {WEIGHTS_NAME} nor {INDEX_NAME}; convert the "
                     "checkpoint to safetensors (transformers: save_pretrained) and retry")


def _add_missing_prefix(model: nn.Module, state_dict: dict[str, torch.Tensor]
                        ) -> dict[str, torch.Tensor]:
    # A checkpoint of HF's bare base model (e.g. the original "gpt2") has no "transformer." prefix.
    prefix = f"{model.base_model_prefix}."
    if any(key.startswith(prefix) for key in state_dict):
        return state_dict
    return {prefix + key: value for key, value in state_dict.items()}


def _check_keys(model: nn.Module, missing: list[str], unexpected: list[str]) -> None:
    tied = set(model._tied_weights_keys) if model.tie_word_embeddings else set()
    missing = [key for key in missing if key not in tied]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match {type(model).__name__}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}; check that config.json describes these weights"
        )


def load_pretrained(
    folder: str | Path,
    *,
    attention: str = "flash",
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """Build the model ``config.json`` describes and load its safetensors weights.

    ``dtype=None`` keeps the dtype the weights were stored in.
    """
    config = read_config(folder)
    model = build_model(config, attention=attention, device="meta")
    raw = _add_missing_prefix(model, read_state_dict(folder))
    state_dict = model.from_hf_state_dict(raw)
    if dtype is None:
        dtype = next((t.dtype for t in state_dict.values() if t.is_floating_point()),
                     torch.float32)
    model.to_empty(device=device)
    model.tie_weights()
    model.to(dtype)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    _check_keys(model, missing, unexpected)
    return model.eval()


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string such as ``"5GB"`` or ``"200KiB"``."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", size.upper())
    if match is None:
        raise ValueError(f"max_shard_size={size!r} is not a size; write e.g. 5GB or 200MiB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""])


def _shards(state_dict: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    # Greedy in key order, as HF does; a tensor larger than the limit gets a shard of its own.
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for key, tensor in state_dict.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and used + size > max_bytes:
            shards.append({})
            used = 0
        shards[-1][key] = tensor
        used += size
    return shards


def _hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    tied = set(model._tied_weights_keys) if model.tie_word_embeddings else set()
    ours = {key: value.detach().to("cpu").contiguous()
            for key, value in model.state_dict().items() if key not in tied}
    return model.to_hf_state_dict(ours)


def save_pretrained(
    model: nn.Module, folder: str | Path, *, max_shard_size: int | str = "5GB"
) -> Path:
    """Write ``model`` as a Hugging Face folder that transformers and ``load_pretrained`` read.

    Expects full (unsharded) tensors: gather a sharded model's state dict first.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [*folder.glob("model*.safetensors"), folder / INDEX_NAME]:
        stale.unlink(missing_ok=True)  # a smaller re-save must not leave old shards behind
    state_dict = _hf_state_dict(model)
    shards = _shards(state_dict, parse_size(max_shard_size))
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        save_file(shards[0], folder / WEIGHTS_NAME, metadata=metadata)
    else:
        weight_map = {}
        for index, shard in enumerate(shards, start=1):
            name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, folder / name, metadata=metadata)
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in state_dict.values())
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_NAME).write_text(json.dumps(index_json, indent=2, sort_keys=True))
    config = model.hf_config_dict()
    dtype_name = str(next(model.parameters()).dtype).removeprefix("torch.")
    config["dtype"] = config["torch_dtype"] = dtype_name  # v5 reads "dtype", v4 "torch_dtype"
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder
