"""GPT-2 causal LM with Hugging Face parameter names.

HF implements GPT-2's projections as ``Conv1D``, whose weight is the transpose of an
``nn.Linear`` weight; we use ``nn.Linear`` (what FSDP, compile and the fused kernels expect) and
transpose those four weights in the checkpoint mapping instead.

HF's fused ``c_attn`` lays its outputs out as ``[q | k | v]``; ours are per head,
``[q_h0, k_h0, v_h0, q_h1, ...]``, as GPT-NeoX stores them, so that any contiguous split of the
rows is a set of whole heads (tensor parallelism splits it that way, whatever the degree, and a
checkpoint keeps one layout at every degree). The checkpoint mapping reorders the rows.
"""

from __future__ import annotations

import math
import re
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

# the Conv1D weights of a GPT-2 checkpoint, stored (in_features, out_features)
_CONV1D_WEIGHT = re.compile(r"\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
_C_ATTN = re.compile(r"\.attn\.c_attn\.(weight|bias)$")


@dataclass(frozen=True)
class GPT2Config:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    layer_norm_eps: float
    activation_function: str
    scale_attn_weights: bool
    scale_attn_by_inverse_layer_idx: bool

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> GPT2Config:
        if config.get("add_cross_attention"):
            raise ValueError("GPT-2 cross-attention is not supported; "
                             "set add_cross_attention to false")
        hidden = int(require(config, "n_embd", "hidden_size"))
        heads = int(require(config, "n_head", "num_attention_heads"))
        if hidden % heads:
            raise ValueError(f"n_embd={hidden} is not divisible by n_head={heads}; "
                             "pick a multiple")
        return cls(
            hidden_size=hidden,
            num_layers=int(require(config, "n_layer", "num_hidden_layers")),
            num_heads=heads,
            intermediate_size=int(config_value(config, "n_inner", "intermediate_size",
                                               default=4 * hidden)),
            vocab_size=int(require(config, "vocab_size")),
            max_positions=int(config_value(config, "n_positions", "max_position_embeddings",
                                           default=1024)),
            layer_norm_eps=float(config_value(config, "layer_norm_epsilon", default=1e-5)),
            activation_function=str(config_value(config, "activation_function",
                                                 default="gelu_new")),
            scale_attn_weights=bool(config.get("scale_attn_weights", True)),
            scale_attn_by_inverse_layer_idx=bool(
                config.get("scale_attn_by_inverse_layer_idx", False)),
        )

    def to_hf(self) -> dict[str, Any]:
        return {
            "n_embd": self.hidden_size, "hidden_size": self.hidden_size,
            "n_layer": self.num_layers, "num_hidden_layers": self.num_layers,
            "n_head": self.num_heads, "num_attention_heads": self.num_heads,
            "n_inner": self.intermediate_size, "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "n_positions": self.max_positions, "max_position_embeddings": self.max_positions,
            "layer_norm_epsilon": self.layer_norm_eps,
            "activation_function": self.activation_function,
            "scale_attn_weights": self.scale_attn_weights,
            "scale_attn_by_inverse_layer_idx": self.scale_attn_by_inverse_layer_idx,
        }


class GPT2Attention(nn.Module):
    def __init__(self, config: GPT2Config, *, layer_idx: int, backend: str) -> None:
        super().__init__()
        self.backend = backend
        self.num_heads = config.num_heads
        head_dim = config.hidden_size // config.num_heads
        self.scale = 1.0 / math.sqrt(head_dim) if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:  # a GPT-2 training-stability option
            self.scale /= layer_idx + 1
        self.c_attn = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.c_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.c_attn(x).view(batch, seq, self.num_heads, -1)  # per head: [q, k, v]
        q, k, v = (t.transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        out = attention(q, k, v, backend=self.backend, causal=True,
                        key_padding_mask=attention_mask, scale=self.scale)
        return self.c_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class GPT2MLP(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return activation_then_linear(self.c_fc(x), self.act, self.c_proj)


class GPT2Block(nn.Module):
    def __init__(self, config: GPT2Config, *, layer_idx: int, backend: str) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = GPT2Attention(config, layer_idx=layer_idx, backend=backend)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attention_mask)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, config: GPT2Config, *, backend: str) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_positions, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, layer_idx=i, backend=backend)
                               for i in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x, attention_mask)
        return self.ln_f(x)


class GPT2LMHeadModel(HFCompatibleModel):
    model_type = "gpt2"
    hf_architecture = "GPT2LMHeadModel"
    base_model_prefix = "transformer"
    _no_split_modules: ClassVar[list[str]] = ["GPT2Block"]
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "transformer.wte.weight"}
    # older checkpoints (the original "gpt2") saved the causal-mask buffers
    _ignored_hf_keys = (r"\.attn\.(bias|masked_bias)$",)
    state_layout = 2  # c_attn per head (1: HF's [q | k | v], before tensor parallelism)

    def __init__(self, hf_config: dict[str, Any], *, attention: str = "flash") -> None:
        super().__init__(hf_config, attention=attention)
        self.config = GPT2Config.from_hf(hf_config)
        self.transformer = GPT2Model(self.config, backend=attention)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        self.tie_weights()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        return self.lm_head(self.transformer(input_ids, attention_mask))

    def from_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ours = _transpose_conv1d(super().from_hf_state_dict(state_dict))
        return _reorder_qkv(ours, self.config.num_heads, to_per_head=True)

    def to_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hf = _reorder_qkv(super().to_hf_state_dict(state_dict), self.config.num_heads,
                          to_per_head=False)
        return _transpose_conv1d(hf)


def _transpose_conv1d(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # The transpose is its own inverse, so one function maps both ways.
    return {key: value.t().contiguous() if _CONV1D_WEIGHT.search(key) else value
            for key, value in state_dict.items()}


def _reorder_qkv(state_dict: dict[str, torch.Tensor], heads: int, *, to_per_head: bool
                 ) -> dict[str, torch.Tensor]:
    """``c_attn`` rows (as an ``nn.Linear`` weight or bias): HF's ``[q | k | v]`` <-> per head."""
    def reorder(value: torch.Tensor) -> torch.Tensor:
        rest = value.shape[1:]
        if to_per_head:  # (3, heads, d, ...) -> (heads, 3, d, ...)
            grouped = value.reshape(3, heads, -1, *rest).transpose(0, 1)
        else:  # (heads, 3, d, ...) -> (3, heads, d, ...)
            grouped = value.reshape(heads, 3, -1, *rest).transpose(0, 1)
        return grouped.reshape(value.shape).contiguous()

    return {key: reorder(value) if _C_ATTN.search(key) else value
            for key, value in state_dict.items()}
