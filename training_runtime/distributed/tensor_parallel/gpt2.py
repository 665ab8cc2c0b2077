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
from dtrain.runtime.distributed.tensor_parallel.optimus import Grid
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def one_d_plan(model: nn.Module, *, sequence_parallel: bool) -> L.OneDPlan:
    sp = sequence_parallel
    plan = L.OneDPlan()
    plan.add("transformer.wte", L.replicated_embedding())
    blocks = L.children(model, "transformer.h")
    for index, block in enumerate(blocks):
        plan.add(f"{block}.attn.c_attn", L.column())
        plan.rows.append(f"{block}.attn.c_proj")
        plan.add(f"{block}.mlp.c_fc", L.column())
        plan.rows.append(f"{block}.mlp.c_proj")
        if sp:
            if index == 0 and L.present(model, "transformer.wte"):
                plan.add(block, L.split_sequence(2))
            plan.add(f"{block}.ln_1", L.sequence_norm())
            plan.add(f"{block}.ln_2", L.sequence_norm())
            plan.add(f"{block}.attn", L.gather_sequence(2))
            plan.add(f"{block}.mlp", L.gather_sequence(1))
        plan.attention.append(f"{block}.attn")
    if sp:
        plan.add("transformer.ln_f", L.sequence_norm())
    plan.add("lm_head", L.vocab_head(sp))
    return plan


def apply_two_d(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every linear layer, norm, both embeddings and the (tied) head on the grid."""
    grid = Grid.from_mesh(mesh)
    G.replace_module(model, "transformer.wte", G.GridEmbedding.from_embedding, grid)
    G.replace_module(model, "transformer.wpe", G.GridPositionEmbedding.from_embedding, grid)
    attention = []
    for block in L.children(model, "transformer.h"):
        for norm in ("ln_1", "ln_2"):
            G.replace_module(model, f"{block}.{norm}", G.GridLayerNorm.from_layer_norm, grid)
        for linear in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            G.replace_module(model, f"{block}.{linear}", G.GridLinear.from_linear, grid)
        attention.append(f"{block}.attn")
    G.replace_module(model, "transformer.ln_f", G.GridLayerNorm.from_layer_norm, grid)
    G.replace_module(model, "lm_head", G.GridHead.from_linear, grid)
    if L.present(model, "transformer"):
        G.slice_attention_mask(model.transformer, grid)
    L.share_heads(model, attention, grid.q)
