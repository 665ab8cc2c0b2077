"""Which tensor-parallel degrees a node and a model's shape allow (STDLIB ONLY).

Two layouts of the ``tp`` mesh axis, both inside one node (the group talks every layer):

* ``1d`` (Megatron): the ``tp`` ranks split the attention heads, the MLP's inner size and the
  vocabulary; with sequence parallelism the layer norms and residual adds split the sequence.
* ``2d`` (Optimus): the ``tp`` ranks form a ``q × q`` grid (``tp = q²``); every linear layer of a
  block is split over both grid axes and the activations too (batch over grid rows, features
  over grid columns), so heads, the hidden size, the MLP size and the vocabulary split ``q`` ways.

:func:`dtrain.core.parallelism.build_parallelism_plan` calls these checks; the planner and the
runtime pass the model's shape (:class:`ModelDims`), so a degree that does not divide it is
refused with the degrees that do, before a machine starts or a weight is split.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TP_MODES = ("1d", "2d")
# Megatron pads the vocabulary to a multiple of 128 × tp; so does the fix dtrain suggests.
VOCAB_PAD_MULTIPLE = 128


@dataclass(frozen=True)
class ModelDims:
    """The sizes tensor parallelism splits."""

    num_heads: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelDims | None:
        """Read a Hugging Face ``config.json`` dict; None when it lacks the sizes."""
        heads = _first(config, "num_attention_heads", "n_head", "num_heads")
        hidden = _first(config, "hidden_size", "n_embd", "d_model")
        vocab = _first(config, "vocab_size")
        if not (heads and hidden and vocab):
            return None
        inner = _first(config, "intermediate_size", "n_inner") or 4 * int(hidden)
        return cls(int(heads), int(hidden), int(inner), int(vocab))


def _first(config: Mapping[str, Any], *names: str) -> Any:
    return next((config[n] for n in names if config.get(n) is not None), None)


def grid_side(tp: int) -> int | None:
    """``q`` when ``tp = q²`` (a 2-D grid), else None."""
    side = math.isqrt(tp)
    return side if side * side == tp else None


def split_ways(tp: int, mode: str) -> int:
    """How many ways one dimension of a weight is split: ``tp`` in 1-D, ``q`` in 2-D."""
    return tp if mode == "1d" else (grid_side(tp) or tp)


def mode_problem(mode: Any, tp: int, *, devices_per_node: int | None = None) -> str | None:
    """Why ``mode`` cannot run at degree ``tp``; the squares offered instead are those that
    fit a node of ``devices_per_node`` (a tensor-parallel group stays inside one)."""
    if mode not in TP_MODES:
        return f"{mode!r}: use 1d (Megatron) or 2d (Optimus)"
    if mode == "2d" and tp > 1 and grid_side(tp) is None:
        squares = [q * q for q in range(2, 9)
                   if devices_per_node is None or devices_per_node % (q * q) == 0]
        if not squares:
            return (f"2d needs a square tensor_parallel_degree (a q × q grid), and no square "
                    f"above 1 divides the {devices_per_node} devices of a node; use "
                    "tensor_parallel_mode 1d")
        return (f"2d needs a square tensor_parallel_degree (a q × q grid), but it is {tp}; use "
                f"{'one of ' if len(squares) > 1 else ''}{', '.join(map(str, squares))}, or "
                "tensor_parallel_mode 1d")
    return None


def shape_problem(tp: int, mode: str, dims: ModelDims, *, allowed: list[int]) -> str | None:
    """Why ``tp`` cannot split ``dims`` (``allowed``: the degrees that can, for the fix)."""
    ways = split_ways(tp, mode)
    if ways == 1:
        return None
    fix = f"use one of {', '.join(map(str, allowed))}"
    for what, size in (("attention heads", dims.num_heads), ("hidden size", dims.hidden_size),
                       ("MLP size (intermediate_size)", dims.intermediate_size)):
        if size % ways:
            return f"{tp} does not divide the model's {size} {what} {_how(tp, mode)}; {fix}"
    if dims.vocab_size % ways:
        padded = -(-dims.vocab_size // (VOCAB_PAD_MULTIPLE * ways)) * VOCAB_PAD_MULTIPLE * ways
        return (f"{tp} does not divide the model's vocabulary of {dims.vocab_size} "
                f"{_how(tp, mode)}; pad vocab_size to {padded} in the model config (as Megatron "
                f"does), or {fix}")
    return None


def _how(tp: int, mode: str) -> str:
    ways = split_ways(tp, mode)
    return (f"(1-D splits it {ways} ways)" if mode == "1d"
            else f"(2-D splits it {ways} ways on a {ways} × {ways} grid)")


def candidate_degrees(devices_per_node: int, mode: str, dims: ModelDims | None) -> list[int]:
    """Degrees that stay inside a node, fit the mode and split ``dims``; smallest first."""
    out = []
    for tp in range(1, devices_per_node + 1):
        if devices_per_node % tp or (mode == "2d" and grid_side(tp) is None):
            continue
        if dims is not None and shape_problem(tp, mode, dims, allowed=[]) is not None:
            continue
        out.append(tp)
    return out


def sequence_parallel_enabled(setting: Any, *, tp: int, mode: str, explicit_tp: bool) -> bool:
    """Resolve ``sequence_parallel``; raises ValueError (the message) when it cannot apply."""
    if setting not in ("auto", True, False):
        raise ValueError(f"{setting!r}: use auto, true or false")
    if setting is True and mode == "2d":
        raise ValueError("true applies to tensor_parallel_mode 1d; 2d already splits every "
                         "activation over the grid: remove sequence_parallel")
    if setting is True and tp == 1 and explicit_tp:
        raise ValueError("true needs tensor_parallel_degree above 1 (it splits the sequence "
                         "over the tensor-parallel group); raise the degree or remove it")
    if setting == "auto":
        return tp > 1 and mode == "1d"
    return bool(setting) and tp > 1


# The families with 2-D (Optimus) plans; every family has 1-D ones.
TWO_D_FAMILIES = ("gpt_neox", "gpt2")


def two_d_family_problem(model_type: str | None) -> str | None:
    """Why a ``model_type`` cannot run 2-D tensor parallelism (None: it can)."""
    if model_type in TWO_D_FAMILIES:
        return None
    return (f"2d has plans for {', '.join(TWO_D_FAMILIES)}, not {model_type}; use "
            "tensor_parallel_mode 1d")


def sequence_split_problem(positions: int, ways: int) -> str | None:
    """Why sequence parallelism cannot split ``positions`` over ``ways`` ranks (None: it can)."""
    if positions % ways == 0:
        return None
    return (f"sequence parallelism splits each sequence over {ways} ranks, but it has "
            f"{positions} positions; use a seq_len that is a multiple of {ways}, or "
            "sequence_parallel: false")


def grid_batch_problem(sequences: int, rows: int) -> str | None:
    """Why a 2-D grid of ``rows`` rows cannot split a micro-batch of ``sequences`` (None: it
    can)."""
    if sequences % rows == 0:
        return None
    return (f"2-D tensor parallelism splits each micro-batch over {rows} grid rows, but it has "
            f"{sequences} sequences; use a micro_batch_size that is a multiple of {rows}")
