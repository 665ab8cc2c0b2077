"""GPT-NeoX / Pythia causal LM with Hugging Face parameter names.

The fused ``query_key_value`` projection is laid out per head, ``[q_h0, k_h0, v_h0, q_h1, ...]``,
as HF and the EleutherAI checkpoints store it; rotary embeddings cover the first
``rotary_pct * head_dim`` dims of each head; ``use_parallel_residual`` picks
``x + attn(ln1(x)) + mlp(ln2(x))`` over the sequential ``x + attn``, ``+ mlp`` block.
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


@dataclass(frozen=True)
class GPTNeoXConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    rotary_pct: float
    rotary_base: float
    use_parallel_residual: bool
    layer_norm_eps: float
    hidden_act: str
    attention_bias: bool

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> GPTNeoXConfig:
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"GPT-NeoX rope scaling {rope!r} is not supported; "
                             "remove 'rope_scaling' or use rope_type 'default'")
        hidden = int(require(config, "hidden_size"))
        heads = int(require(config, "num_attention_heads"))
        if hidden % heads:
            raise ValueError(f"hidden_size={hidden} is not divisible by "
                             f"num_attention_heads={heads}; pick a multiple")
        return cls(
            hidden_size=hidden,
            num_layers=int(require(config, "num_hidden_layers")),
            num_heads=heads,
            intermediate_size=int(config_value(config, "intermediate_size", default=4 * hidden)),
            vocab_size=int(require(config, "vocab_size")),
            # v4 configs say rotary_pct/rotary_emb_base, v5 configs nest them in rope_parameters
            rotary_pct=float(config_value(rope, "partial_rotary_factor", default=None)
                             or config_value(config, "rotary_pct", "partial_rotary_factor",
                                             default=0.25)),
            rotary_base=float(config_value(rope, "rope_theta", default=None)
                              or config_value(config, "rotary_emb_base", "rope_theta",
                                              default=10000.0)),
            use_parallel_residual=bool(config.get("use_parallel_residual", True)),
            layer_norm_eps=float(config.get("layer_norm_eps", 1e-5)),
            hidden_act=str(config.get("hidden_act", "gelu")),
            attention_bias=bool(config.get("attention_bias", True)),
        )

    def to_hf(self) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size, "rotary_pct": self.rotary_pct,
            "rotary_emb_base": self.rotary_base,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rotary_base,
                                "partial_rotary_factor": self.rotary_pct},
            "use_parallel_residual": self.use_parallel_residual,
            "layer_norm_eps": self.layer_norm_eps, "hidden_act": self.hidden_act,
            "attention_bias": self.attention_bias,
        }


class GPTNeoXAttention(nn.Module):
    def __init__(self, config: GPTNeoXConfig, *, backend: str) -> None:
        super().__init__()
        self.backend = backend
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.rotary_dim = int(self.head_dim * config.rotary_pct)
        self.rotary_base = config.rotary_base
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size,
                                         bias=config.attention_bias)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.query_key_value(x).view(batch, seq, self.num_heads, 3 * self.head_dim)
        q, k, v = qkv.chunk(3, dim=-1)  # each (batch, seq, heads, head_dim)
        if self.rotary_dim:
            cos, sin = rotary_cos_sin(seq, self.rotary_dim, base=self.rotary_base,
                                      device=x.device, dtype=x.dtype, interleaved=False)
            q = apply_rotary(q, cos, sin, interleaved=False)
            k = apply_rotary(k, cos, sin, interleaved=False)
            # q and k are fresh tensors now; a view v would keep the whole fused projection
            # (3x its size) alive until backward, a copy frees it once attention has run.
            v = v.contiguous()
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        backend=self.backend, causal=True, key_padding_mask=attention_mask)
        return self.dense(out.transpose(1, 2).reshape(batch, seq, -1))


class GPTNeoXMLP(nn.Module):
    def __init__(self, config: GPTNeoXConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return activation_then_linear(self.dense_h_to_4h(x), self.act, self.dense_4h_to_h)


class GPTNeoXLayer(nn.Module):
    def __init__(self, config: GPTNeoXConfig, *, backend: str) -> None:
        super().__init__()
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = GPTNeoXAttention(config, backend=backend)
        self.mlp = GPTNeoXMLP(config)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        attn_out = self.attention(self.input_layernorm(x), attention_mask)
        if self.use_parallel_residual:
            return x + attn_out + self.mlp(self.post_attention_layernorm(x))
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


class GPTNeoXModel(nn.Module):
    def __init__(self, config: GPTNeoXConfig, *, backend: str) -> None:
        super().__init__()
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GPTNeoXLayer(config, backend=backend) for _ in range(config.num_layers)
        )
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.embed_in(input_ids)
        for layer in self.layers:
            x = layer(x, attention_mask)
        return self.final_layer_norm(x)


class GPTNeoXForCausalLM(HFCompatibleModel):
    model_type = "gpt_neox"
    hf_architecture = "GPTNeoXForCausalLM"
    base_model_prefix = "gpt_neox"
    _no_split_modules: ClassVar[list[str]] = ["GPTNeoXLayer"]
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "gpt_neox.embed_in.weight"}
    # v4 checkpoints stored causal-mask and rotary buffers next to the weights
    _ignored_hf_keys = (r"\.attention\.(bias|masked_bias)$", r"rotary_emb\.inv_freq$")

    def __init__(self, hf_config: dict[str, Any], *, attention: str = "flash") -> None:
        super().__init__(hf_config, attention=attention)
        self.config = GPTNeoXConfig.from_hf(hf_config)
        self.gpt_neox = GPTNeoXModel(self.config, backend=attention)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        self.tie_weights()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        return self.lm_head(self.gpt_neox(input_ids, attention_mask))

    def from_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # transformers v4 and the Pythia checkpoints call the output head embed_out
        renamed = {("lm_head.weight" if key == "embed_out.weight" else key): value
                   for key, value in state_dict.items()}
        return super().from_hf_state_dict(renamed)
