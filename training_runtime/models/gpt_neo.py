"""GPT-Neo causal LM with Hugging Face parameter names.

Layers alternate global (full causal) and local attention as ``attention_types`` lists them;
a local layer sees only the ``window_size`` most recent tokens. GPT-Neo does not scale attention
scores by 1/sqrt(head_dim) (the released weights were trained that way), so neither do we.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from dtrain.runtime.models.attention import attention
from dtrain.runtime.models.common import (
    HFCompatibleModel,
    activation,
    activation_then_linear,
    config_value,
    require,
)
from torch import nn

ATTENTION_KINDS = ("global", "local")


def expand_attention_types(attention_types: list, num_layers: int) -> tuple[str, ...]:
    """``[[["global", "local"], 12]]`` -> 24 per-layer kinds, checked against ``num_layers``."""
    layers = tuple(kind for kinds, repeat in attention_types for _ in range(repeat)
                   for kind in kinds)
    if len(layers) != num_layers or any(kind not in ATTENTION_KINDS for kind in layers):
        raise ValueError(
            f"attention_types={attention_types!r} gives {len(layers)} layers of kinds "
            f"{sorted(set(layers))}, but num_layers={num_layers}; list one of "
            f"{ATTENTION_KINDS} per layer"
        )
    return layers


@dataclass(frozen=True)
class GPTNeoConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    attention_types: list
    attention_layers: tuple[str, ...]
    window_size: int
    layer_norm_eps: float
    activation_function: str

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> GPTNeoConfig:
        hidden = int(require(config, "hidden_size"))
        heads = int(require(config, "num_heads", "num_attention_heads"))
        layers = int(require(config, "num_layers", "num_hidden_layers"))
        if hidden % heads:
            raise ValueError(f"hidden_size={hidden} is not divisible by num_heads={heads}; "
                             "pick a multiple")
        attention_types = config_value(config, "attention_types",
                                       default=[[["global", "local"], layers // 2]])
        return cls(
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            intermediate_size=int(config_value(config, "intermediate_size", default=4 * hidden)),
            vocab_size=int(require(config, "vocab_size")),
            max_positions=int(config_value(config, "max_position_embeddings", default=2048)),
            attention_types=attention_types,
            attention_layers=expand_attention_types(attention_types, layers),
            window_size=int(config_value(config, "window_size", default=256)),
            layer_norm_eps=float(config_value(config, "layer_norm_epsilon", default=1e-5)),
            activation_function=str(config_value(config, "activation_function",
                                                 default="gelu_new")),
        )

    def to_hf(self) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden_size, "num_layers": self.num_layers,
            "num_hidden_layers": self.num_layers, "num_heads": self.num_heads,
            "num_attention_heads": self.num_heads, "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size, "max_position_embeddings": self.max_positions,
            "attention_types": self.attention_types,
            "attention_layers": list(self.attention_layers), "window_size": self.window_size,
            "layer_norm_epsilon": self.layer_norm_eps,
            "activation_function": self.activation_function,
        }


class GPTNeoSelfAttention(nn.Module):
    def __init__(self, config: GPTNeoConfig, *, kind: str, backend: str) -> None:
        super().__init__()
        self.backend = backend
        self.num_heads = config.num_heads
        self.window_size = config.window_size if kind == "local" else None
        hidden = config.hidden_size
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (proj(x).view(batch, seq, self.num_heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = attention(q, k, v, backend=self.backend, causal=True, scale=1.0,
                        key_padding_mask=attention_mask, window_size=self.window_size)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class GPTNeoAttention(nn.Module):
    """HF nests the attention one level deeper (``attn.attention.q_proj``); so do we."""

    def __init__(self, config: GPTNeoConfig, *, kind: str, backend: str) -> None:
        super().__init__()
        self.attention_type = kind
        self.attention = GPTNeoSelfAttention(config, kind=kind, backend=backend)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return self.attention(x, attention_mask)


class GPTNeoMLP(nn.Module):
    def __init__(self, config: GPTNeoConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return activation_then_linear(self.c_fc(x), self.act, self.c_proj)


class GPTNeoBlock(nn.Module):
    def __init__(self, config: GPTNeoConfig, *, kind: str, backend: str) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = GPTNeoAttention(config, kind=kind, backend=backend)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = GPTNeoMLP(config)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attention_mask)
        return x + self.mlp(self.ln_2(x))


class GPTNeoModel(nn.Module):
    def __init__(self, config: GPTNeoConfig, *, backend: str) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_positions, config.hidden_size)
        self.h = nn.ModuleList(GPTNeoBlock(config, kind=kind, backend=backend)
                               for kind in config.attention_layers)
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x, attention_mask)
        return self.ln_f(x)


class GPTNeoForCausalLM(HFCompatibleModel):
    model_type = "gpt_neo"
    hf_architecture = "GPTNeoForCausalLM"
    base_model_prefix = "transformer"
    _no_split_modules: ClassVar[list[str]] = ["GPTNeoBlock"]
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "transformer.wte.weight"}
    # older checkpoints saved the (local) causal-mask buffers
    _ignored_hf_keys = (r"\.attn\.attention\.(bias|masked_bias)$",)

    def __init__(self, hf_config: dict[str, Any], *, attention: str = "flash") -> None:
        super().__init__(hf_config, attention=attention)
        self.config = GPTNeoConfig.from_hf(hf_config)
        self.transformer = GPTNeoModel(self.config, backend=attention)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        self.tie_weights()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        return self.lm_head(self.transformer(input_ids, attention_mask))
