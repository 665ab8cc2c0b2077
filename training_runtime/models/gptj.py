"""GPT-J causal LM with Hugging Face parameter names.

GPT-J rotates the first ``rotary_dim`` dims of each head with *interleaved* pairs
(dims 0/1, 2/3, ...; GPT-NeoX pairs i with i + d/2), and runs attention and MLP in parallel
from one layer norm: ``x + attn(ln_1(x)) + mlp(ln_1(x))``. Its output head has a bias.
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
    apply_rotary,
    config_value,
    require,
    rotary_cos_sin,
)
from torch import nn

ROTARY_BASE = 10000.0  # fixed in GPT-J; its config has no field for it


@dataclass(frozen=True)
class GPTJConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    rotary_dim: int
    max_positions: int
    layer_norm_eps: float
    activation_function: str

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> GPTJConfig:
        hidden = int(require(config, "n_embd", "hidden_size"))
        heads = int(require(config, "n_head", "num_attention_heads"))
        if hidden % heads:
            raise ValueError(f"n_embd={hidden} is not divisible by n_head={heads}; "
                             "pick a multiple")
        head_dim = hidden // heads
        rotary_dim = int(config_value(config, "rotary_dim", default=head_dim))
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim={rotary_dim} must be even and at most the head size "
                             f"{head_dim}; fix rotary_dim in the config")
        return cls(
            hidden_size=hidden,
            num_layers=int(require(config, "n_layer", "num_hidden_layers")),
            num_heads=heads,
            intermediate_size=int(config_value(config, "n_inner", "intermediate_size",
                                               default=4 * hidden)),
            vocab_size=int(require(config, "vocab_size")),
            rotary_dim=rotary_dim,
            max_positions=int(config_value(config, "n_positions", "max_position_embeddings",
                                           default=2048)),
            layer_norm_eps=float(config_value(config, "layer_norm_epsilon", default=1e-5)),
            activation_function=str(config_value(config, "activation_function",
                                                 default="gelu_new")),
        )

    def to_hf(self) -> dict[str, Any]:
        return {
            "n_embd": self.hidden_size, "hidden_size": self.hidden_size,
            "n_layer": self.num_layers, "num_hidden_layers": self.num_layers,
            "n_head": self.num_heads, "num_attention_heads": self.num_heads,
            "n_inner": self.intermediate_size, "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size, "rotary_dim": self.rotary_dim,
            "n_positions": self.max_positions, "max_position_embeddings": self.max_positions,
            "layer_norm_epsilon": self.layer_norm_eps,
            "activation_function": self.activation_function,
        }


class GPTJAttention(nn.Module):
    def __init__(self, config: GPTJConfig, *, backend: str) -> None:
        super().__init__()
        self.backend = backend
        self.num_heads = config.num_heads
        self.rotary_dim = config.rotary_dim
        hidden = config.hidden_size
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.out_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (proj(x).view(batch, seq, self.num_heads, -1)  # (batch, seq, heads, dim)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = rotary_cos_sin(seq, self.rotary_dim, base=ROTARY_BASE, device=x.device,
                                  dtype=x.dtype, interleaved=True)
        q = apply_rotary(q, cos, sin, interleaved=True)
        k = apply_rotary(k, cos, sin, interleaved=True)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        backend=self.backend, causal=True, key_padding_mask=attention_mask)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class GPTJMLP(nn.Module):
    def __init__(self, config: GPTJConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc_out = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return activation_then_linear(self.fc_in(x), self.act, self.fc_out)


class GPTJBlock(nn.Module):
    def __init__(self, config: GPTJConfig, *, backend: str) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = GPTJAttention(config, backend=backend)
        self.mlp = GPTJMLP(config)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        normed = self.ln_1(x)
        return x + self.attn(normed, attention_mask) + self.mlp(normed)


class GPTJModel(nn.Module):
    def __init__(self, config: GPTJConfig, *, backend: str) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList(GPTJBlock(config, backend=backend)
                               for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.wte(input_ids)
        for block in self.h:
            x = block(x, attention_mask)
        return self.ln_f(x)


class GPTJForCausalLM(HFCompatibleModel):
    model_type = "gptj"
    hf_architecture = "GPTJForCausalLM"
    base_model_prefix = "transformer"
    _no_split_modules: ClassVar[list[str]] = ["GPTJBlock"]
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "transformer.wte.weight"}
    _ignored_hf_keys = (r"\.attn\.(bias|masked_bias|embed_positions)$",)

    def __init__(self, hf_config: dict[str, Any], *, attention: str = "flash") -> None:
        super().__init__(hf_config, attention=attention)  # untied unless the config ties
        self.config = GPTJConfig.from_hf(hf_config)
        self.transformer = GPTJModel(self.config, backend=attention)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size)
        self.tie_weights()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        return self.lm_head(self.transformer(input_ids, attention_mask))
