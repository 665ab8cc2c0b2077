"""GPT-2's tensor-parallel plans.

1-D: ``c_attn`` is stored per head (see :mod:`dtrain.runtime.models.gpt2`), so its column split
hands each rank whole heads. Token and position embeddings are added whole (the vocabulary-
parallel token embedding all-reduces), and the first block keeps its slice of the sequence. The
LM head shares the token embedding's weight, split the same way (rows = vocabulary).

2-D: as GPT-NeoX's, with the position embedding's feature slice held by every grid row; the
tied head computes with the embedding table in the layout the embedding keeps it (SUMMA "ABT").
"""

from __future__ import annotations

from dtrain.runtime.distributed.tensor_parallel import grid_layers as G
from dtrain.runtime.distributed.tensor_parallel import layouts as L
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

FAMILY = L.CausalLM(
    embedding="transformer.wte", position_embedding="transformer.wpe", blocks="transformer.h",
    final_norm="transformer.ln_f",
    block=L.Block(norms=("ln_1", "ln_2"), columns=("attn.c_attn", "mlp.c_fc"),
                  rows=("attn.c_proj", "mlp.c_proj"), heads="attn",
                  whole_sequence=(("attn", 2), ("mlp", 1))))


def one_d_plan(model: nn.Module, *, sequence_parallel: bool) -> L.OneDPlan:
    return L.causal_lm_plan(model, FAMILY, sequence_parallel=sequence_parallel)


def apply_two_d(model: nn.Module, mesh: DeviceMesh) -> None:
    G.apply_causal_lm(model, mesh, FAMILY)
