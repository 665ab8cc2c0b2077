"""What the planner knows of the model: its shape, read from a job's hyperparameters (a preset or
a Hugging Face folder named by ``model``, plus explicit keys). Stdlib only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.core import presets
from dtrain.core.errors import SpecError
from dtrain.core.tensor_parallel import ModelDims

_SHAPE_KEYS = presets.SHAPE_HYPERPARAMETERS
DEFAULT_SEQ_LEN = 2048
DEFAULT_MICRO_BATCH = 1


@dataclass
class ModelShape:
    source: str
    num_parameters: int
    hidden_size: int
    num_layers: int
    vocab_size: int
    seq_len: int
    micro_batch_size: int
    num_heads: int | None = None
    intermediate_size: int | None = None
    model_type: str | None = None  # known for a preset or HF folder, as are the two below
    tied_embeddings: bool = False  # the output layer shares the token embedding
    not_sizes: dict[str, Any] = field(default_factory=dict)  # size keys below 1, left out

    @property
    def dims(self) -> ModelDims | None:
        """What tensor parallelism splits; None when the heads are not known."""
        if not self.num_heads:
            return None
        return ModelDims(self.num_heads, self.hidden_size,
                         self.intermediate_size or 4 * self.hidden_size, self.vocab_size)


def model_shape(hps: dict[str, Any]) -> ModelShape | None:
    """The model's size from ``hyperparameters``: a preset or HF folder, plus explicit keys."""
    config: dict[str, Any] = {}
    source = "hyperparameters"
    name = hps.get("model")
    if isinstance(name, str) and name:
        config, source = _model_config(name), name
    not_sizes = _below_one(hps)
    hps = {key: value for key, value in hps.items() if key not in not_sizes}
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
            num_heads=int(shape["num_heads"]) if shape["num_heads"] else None,
            intermediate_size=(int(shape["intermediate_size"]) if shape["intermediate_size"]
                               else None),
            model_type=config.get("model_type"),
            tied_embeddings=bool(config) and presets.ties_embeddings(config),
            not_sizes=not_sizes,
        )
    except (TypeError, ValueError):
        raise SpecError(
            "hyperparameters: model shape values must be numbers (num_parameters, hidden_size, "
            "num_layers, vocab_size, seq_len, micro_batch_size)"
        ) from None


def _below_one(hps: dict[str, Any]) -> dict[str, Any]:
    """The size keys whose number is below 1 (``seq_len: -1``, a script's own sentinel perhaps):
    not sizes, so the shape is read without them (a recipe refuses them before the plan)."""
    keys = ("num_parameters", *(name for names in _SHAPE_KEYS.values() for name in names))
    return {key: hps[key] for key in keys if isinstance(hps.get(key), (int, float))
            and not isinstance(hps[key], bool) and hps[key] < 1}


def _model_config(name: str) -> dict[str, Any]:
    folder = Path(name).expanduser()
    config = folder / "config.json"
    if config.is_file():
        try:
            return json.loads(config.read_text())
        except (ValueError, OSError) as exc:
            raise SpecError(f"hyperparameters.model: {config} is not a readable JSON model "
                            f"config ({exc}); fix it, or name a preset") from None
    try:
        return presets.get_preset(name)
    except ValueError as exc:
        if folder.is_dir():  # not a preset: the folder was meant
            raise SpecError(f"hyperparameters.model: the folder {name} has no config.json; "
                            "give a Hugging Face model folder (config.json and weights) or a "
                            "preset name") from None
        where = "" if folder.is_absolute() else f" (a relative folder is read from {Path.cwd()})"
        raise SpecError(f"hyperparameters.model: {exc}; or give a Hugging Face model "
                        f"folder{where}") from None


def _first(hps: dict, names: tuple[str, ...], config: dict) -> Any:
    for key in names:
        if hps.get(key) is not None:
            return hps[key]
    for key in names:
        if config.get(key) is not None:
            return config[key]
    return None


def _hidden_from_count(num: int) -> int:
    # A GPT-style model with about 100 layers per 10k hidden (num = 12 L h^2 with L = h / 100,
    # so h = (num / 0.12) ** (1/3)): 6.9B parameters give 3840 x 39, near Pythia-6.9B's 4096 x 32.
    return max(64, round((num / 0.12) ** (1 / 3) / 64) * 64)
