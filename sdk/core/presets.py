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


def _gpt2(hidden: int, layers: int, heads: int, *, vocab: int = 50257, positions: int = 1024,
          **extra: Any) -> dict:
    # HF's GPT-2 names (n_embd, ...) plus the generic ones count_parameters and the planner read.
    return {
        "model_type": "gpt2",
        "n_embd": hidden, "hidden_size": hidden,
        "n_layer": layers, "num_hidden_layers": layers,
        "n_head": heads, "num_attention_heads": heads,
        "n_inner": None, "intermediate_size": 4 * hidden,
        "vocab_size": vocab,
        "n_positions": positions, "max_position_embeddings": positions,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
        **extra,
    }


def _gptj(hidden: int, layers: int, heads: int, rotary_dim: int, *, vocab: int = 50400,
          **extra: Any) -> dict:
    return {
        **_gpt2(hidden, layers, heads, vocab=vocab, positions=2048),
        "model_type": "gptj",
        "rotary_dim": rotary_dim,
        "tie_word_embeddings": False,
        **extra,
    }


def _gpt_neo(hidden: int, layers: int, heads: int, *, vocab: int = 50257, window: int = 256,
             **extra: Any) -> dict:
    return {
        "model_type": "gpt_neo",
        "hidden_size": hidden,
        "num_layers": layers, "num_hidden_layers": layers,
        "num_heads": heads, "num_attention_heads": heads,
        "intermediate_size": None,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        # alternating global/local attention layers, as the released GPT-Neo models
        "attention_types": [[["global", "local"], layers // 2]],
        "window_size": window,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
        **extra,
    }


def _bert(hidden: int, layers: int, heads: int, *, model_type: str = "bert", vocab: int = 30522,
          **extra: Any) -> dict:
    return {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": 4 * hidden,
        "vocab_size": vocab,
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-12,
        "pad_token_id": 0,
        "tie_word_embeddings": True,
        **extra,
    }


def _roberta(hidden: int, layers: int, heads: int, *, vocab: int = 50265, **extra: Any) -> dict:
    # RoBERTa offsets positions by pad_token_id + 1, hence 2 extra position rows.
    return _bert(hidden, layers, heads, model_type="roberta", vocab=vocab, pad_token_id=1,
                 max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5,
                 bos_token_id=0, eos_token_id=2, **extra)


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
    # Other Hugging Face families the runtime's model zoo builds (training_runtime/models/).
    "gpt2": _gpt2(768, 12, 12),
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt-j-6b": _gptj(4096, 28, 16, 64),
    "gpt-neo-125m": _gpt_neo(768, 12, 12),
    "gpt-neo-1.3b": _gpt_neo(2048, 24, 16),
    "bert-base": _bert(768, 12, 12),
    "bert-large": _bert(1024, 24, 16),
    "roberta-base": _roberta(768, 12, 12),
    # Tiny shapes of those families for tests (GPT-Neo's window is short so it matters).
    "gpt2-tiny": _gpt2(64, 2, 4, vocab=512, positions=256),
    "gpt-j-tiny": _gptj(64, 2, 4, 8, vocab=512),
    "gpt-neo-tiny": _gpt_neo(64, 2, 4, vocab=512, window=4),
    "bert-tiny": _bert(64, 2, 4, vocab=512),
    "roberta-tiny": _roberta(64, 2, 4, vocab=512),
}


def get_preset(name: str) -> dict[str, Any]:
    """Return a copy of the preset ``name``; ``ValueError`` names the closest preset."""
    try:
        return dict(PRESETS[name])
    except KeyError:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"unknown model preset {name!r}; {hint}known presets: {', '.join(PRESETS)}"
        ) from None


# Hyperparameter names the planner reads a model's shape from (first one present wins), beside
# ``model`` (a preset or Hugging Face folder) and ``num_parameters``.
SHAPE_HYPERPARAMETERS = {
    "hidden_size": ("hidden_size", "d_model", "n_embd"),
    "num_layers": ("num_layers", "num_hidden_layers", "n_layer"),
    "vocab_size": ("vocab_size",),
    "seq_len": ("seq_len", "sequence_length", "max_seq_length", "max_context_width"),
    "micro_batch_size": ("micro_batch_size", "train_batch_size", "batch_size"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads"),
    "intermediate_size": ("intermediate_size", "n_inner"),
}

# Whether a family's output layer shares the token embedding when its config.json does not say
# (Hugging Face's defaults: GPT-NeoX and GPT-J configs default to untied, the others to tied).
_TIED_BY_DEFAULT = {"gpt_neox": False, "gptj": False}


def ties_embeddings(config: dict[str, Any]) -> bool:
    """Whether the model ``config`` (a ``config.json``) describes ties its output layer to the
    token embedding; the runtime's models and the planner both read it here."""
    default = _TIED_BY_DEFAULT.get(config.get("model_type"), True)
    return bool(config.get("tie_word_embeddings", default))


def count_parameters(config: dict[str, Any]) -> int:
    """Parameter count of a transformer from its HF-style config (planning accuracy).

    Counts attention (4·h² + 4·h), MLP (2·h·ffn + ffn + h), two layer norms per block, the token
    embedding, an untied output head, learned position embeddings where the family has them,
    and the final norm.
    """
    embeddings, block, head = unit_parameters(config)
    return embeddings + int(config["num_hidden_layers"]) * block + head


def unit_parameters(config: dict[str, Any]) -> tuple[int, int, int]:
    """Parameters of the embeddings, of one block and of the head (final norm + an untied output
    layer): the units a pipeline cuts a model into (:mod:`dtrain.core.pipeline`)."""
    h = int(config["hidden_size"])
    ffn = int(config.get("intermediate_size") or 4 * h)
    vocab = int(config["vocab_size"])
    block = 4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h
    embeddings = vocab * h
    if config.get("model_type") in {"gpt2", "gpt_neo", "bert", "roberta"}:
        embeddings += int(config.get("max_position_embeddings", 0)) * h
    head = 2 * h + (0 if config.get("tie_word_embeddings", True) else vocab * h)
    return embeddings, block, head
