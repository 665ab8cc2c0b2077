"""Pieces every model family shares: config reading, activations, rotary embeddings, and the
base class that gives each model deterministic initialisation, weight tying and HF key mapping.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from dtrain.runtime.models.attention import check_backend
from torch import nn

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    # HF's "gelu_new"/"gelu_fast" are the tanh approximation under other names.
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function an HF config names (``hidden_act``/``activation_function``)."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"activation {name!r} is not supported; use one of {', '.join(_ACTIVATIONS)}"
        ) from None


def config_value(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of ``names`` present (and not None) in an HF config; HF renamed keys over time."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


def require(config: dict[str, Any], *names: str) -> Any:
    value = config_value(config, *names)
    if value is None:
        raise ValueError(
            f"model config for {config.get('model_type')!r} lacks {names[0]!r}; "
            "add it to the config.json (or preset)"
        )
    return value


def rotary_cos_sin(
    seq_len: int, dim: int, *, base: float, device: torch.device, dtype: torch.dtype,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``(seq_len, dim)``, recomputed each forward: a buffer built on the meta
    device would hold garbage after ``to_empty``, and this costs little next to attention."""
    exponent = torch.arange(0, dim, 2, device=device, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base ** exponent)
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    if interleaved:  # GPT-J pairs (0,1), (2,3), ...
        angles = freqs.repeat_interleave(2, dim=-1)
    else:  # GPT-NeoX pairs dim i with dim i + dim/2
        angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool
) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x`` (batch, heads, seq, head_dim)."""
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    if interleaved:
        rotated = torch.stack((-x_rot[..., 1::2], x_rot[..., ::2]), dim=-1).flatten(-2)
    else:
        half = rot_dim // 2
        rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


class HFCompatibleModel(nn.Module):
    """Base class: HF names, tying, deterministic init, and the HF state-dict mapping.

    Subclasses set the class attributes below and build their modules under HF's names, so the
    key mapping to a HF checkpoint is the identity unless a family overrides it (GPT-2).
    """

    model_type: str = ""
    hf_architecture: str = ""
    base_model_prefix: str = ""
    _no_split_modules: ClassVar[list[str]] = []
    # our key -> the key it shares storage with, when the config ties embeddings
    _tied_weights_keys: ClassVar[dict[str, str]] = {}
    # HF checkpoint keys that hold no weights we need (old persistent buffers)
    _ignored_hf_keys: tuple[str, ...] = ()

    def __init__(self, hf_config: dict[str, Any], *, attention: str) -> None:
        super().__init__()
        self.attention_backend = check_backend(attention)
        self.hf_config = dict(hf_config)
        self.initializer_range = float(hf_config.get("initializer_range") or 0.02)
        self.tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", True))

    def tie_weights(self) -> None:
        """Share tied parameters; also re-ties after ``to_empty``, which breaks sharing."""
        if not self.tie_word_embeddings:
            return
        for target, source in self._tied_weights_keys.items():
            owner_name, _, attr = target.rpartition(".")
            owner = self.get_submodule(owner_name)
            source_param = self.get_parameter(source)
            if getattr(owner, attr) is not source_param:
                setattr(owner, attr, source_param)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter from the torch RNG, in module order (deterministic).

        Linear/Embedding weights ~ N(0, initializer_range), biases 0, LayerNorm 1/0, padding
        embedding rows 0, any other parameter 0. Works after ``to_empty`` from the meta device.
        """
        self.tie_weights()
        std = self.initializer_range
        done: set[int] = set()
        for module in self.modules():
            for name, param in module.named_parameters(recurse=False):
                if id(param) in done:
                    continue
                done.add(id(param))
                _init_parameter(module, name, param, std=std)

    def hf_config_dict(self) -> dict[str, Any]:
        """The ``config.json`` content: the given config, with the fields the family normalised
        (every family keeps its parsed config as ``self.config``, with ``to_hf()``)."""
        return {**self.hf_config, "model_type": self.model_type,
                "architectures": [self.hf_architecture],
                "tie_word_embeddings": self.tie_word_embeddings, **self.config.to_hf()}

    def from_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Map an HF checkpoint's tensors to our keys (drops known non-weight buffers)."""
        ignored = [re.compile(pattern) for pattern in self._ignored_hf_keys]
        return {key: value for key, value in state_dict.items()
                if not any(pattern.search(key) for pattern in ignored)}

    def to_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our tensors under HF's keys; the inverse of :meth:`from_hf_state_dict`."""
        return dict(state_dict)


def _init_parameter(module: nn.Module, name: str, param: nn.Parameter, *, std: float) -> None:
    if isinstance(module, nn.LayerNorm):
        param.fill_(1.0 if name == "weight" else 0.0)
    elif isinstance(module, (nn.Linear, nn.Embedding)) and name == "weight":
        param.normal_(mean=0.0, std=std)
        padding_idx = getattr(module, "padding_idx", None)
        if padding_idx is not None:
            param[padding_idx].zero_()
    else:
        param.zero_()
