"""Model shape presets, as Hugging Face ``config.json`` dictionaries (stdlib only).

The planner reads them to size a job; the runtime builds models from them. Keys follow the
Hugging Face config of each family so a preset and a real checkpoint's config are interchangeable.
"""

from __future__ import annotations

import difflib
from typing import Any


def _neox(hidden: int, layers: int, heads: int, *, vocab: int = 50304, **extra: Any) -> dict:
    return {
        "model_type": "gpt_neox",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": 4 * hidden,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rotary_pct": 0.25,
        "rotary_emb_base": 10000,
        "use_parallel_residual": True,
        "layer_norm_eps": 1e-5,
        "hidden_act": "gelu",
        "tie_word_embeddings": False,
        **extra,
    }


PRESETS: dict[str, dict[str, Any]] = {
    # Tiny shapes for tests and the local example.
    "gpt-neox-tiny": _neox(64, 2, 4, vocab=512, max_position_embeddings=256),
    # ~30M parameters: the emulated-cluster benchmark's communication-bound model.
    "gpt-neox-30m": _neox(512, 8, 8, vocab=8192, max_position_embeddings=1024),
    # Pythia suite shapes (EleutherAI).
    "pythia-14m": _neox(128, 6, 4),
    "pythia-70m": _neox(512, 6, 8),
    "pythia-160m": _neox(768, 12, 12),
    "pythia-410m": _neox(1024, 24, 16),
    "pythia-1b": _neox(2048, 16, 8),
    "pythia-1.4b": _neox(2048, 24, 16),
    "pythia-2.8b": _neox(2560, 32, 32),
    "pythia-6.9b": _neox(4096, 32, 32),
    "pythia-12b": _neox(5120, 36, 40),
    # Planning shapes: GPT-NeoX 20B, and the 13B/50B/100B shapes SageMaker published for MiCS.
    "gpt-neox-1.3b": _neox(2048, 24, 16),
    "gpt-neox-13b": _neox(5120, 40, 40),
    "gpt-neox-20b": _neox(6144, 44, 64, vocab=50432),
    "gpt-neox-50b": _neox(8192, 62, 64),
    "gpt-neox-100b": _neox(10240, 80, 80),
}


def get_preset(name: str) -> dict[str, Any]:
    """Return a copy of the preset ``name``; ``ValueError`` names the closest preset."""
    try:
        return dict(PRESETS[name])
    except KeyError:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown model preset {name!r}.{hint} Known presets: {', '.join(PRESETS)}"
        ) from None


def count_parameters(config: dict[str, Any]) -> int:
    """Parameter count of a transformer from its HF-style config (planning accuracy).

    Counts attention (4·h² + 4·h), MLP (2·h·ffn + ffn + h), two layer norms per block, the token
    embedding, an untied output head, learned position embeddings where the family has them,
    and the final norm.
    """
    h = int(config["hidden_size"])
    layers = int(config["num_hidden_layers"])
    ffn = int(config.get("intermediate_size") or 4 * h)
    vocab = int(config["vocab_size"])
    per_layer = 4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h
    total = layers * per_layer + vocab * h + 2 * h
    if not config.get("tie_word_embeddings", True):
        total += vocab * h
    if config.get("model_type") in {"gpt2", "gpt_neo", "bert", "roberta"}:
        total += int(config.get("max_position_embeddings", 0)) * h
    return total
