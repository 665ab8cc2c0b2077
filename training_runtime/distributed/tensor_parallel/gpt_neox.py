"""GPT-NeoX's tensor-parallel plans.

1-D: the fused ``query_key_value`` is stored per head (``[q_h0, k_h0, v_h0, q_h1, ...]``), so
its column split hands each rank whole heads with their q, k and v; rotary embeddings then act
on each local head exactly as on the whole model. The token embedding reduce-scatters straight
into the sequence-parallel residual stream.

2-D: the embedding, every norm and linear layer of the blocks and the LM head become grid
layers (:mod:`.grid_layers`); the per-head layout makes the grid column's slice of the fused
projection whole heads as well. Attention masks are cut to the grid row's batch slice.
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
    plan.add("gpt_neox.embed_in", L.vocab_embedding(sp))
    for layer in L.children(model, "gpt_neox.layers"):
        plan.add(f"{layer}.attention.query_key_value", L.column())
        plan.rows.append(f"{layer}.attention.dense")
        plan.add(f"{layer}.mlp.dense_h_to_4h", L.column())
        plan.rows.append(f"{layer}.mlp.dense_4h_to_h")
        if sp:
            plan.add(f"{layer}.input_layernorm", L.sequence_norm())
            plan.add(f"{layer}.post_attention_layernorm", L.sequence_norm())
            plan.add(f"{layer}.attention", L.gather_sequence(2))
            plan.add(f"{layer}.mlp", L.gather_sequence(1))
        plan.attention.append(f"{layer}.attention")
    if sp:
        plan.add("gpt_neox.final_layer_norm", L.sequence_norm())
    plan.add("lm_head", L.vocab_head(sp))
    return plan


def apply_two_d(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every linear layer, norm, the embedding and the head on the grid (see :mod:`.optimus`)."""
    grid = Grid.from_mesh(mesh)
    G.replace_module(model, "gpt_neox.embed_in", G.GridEmbedding.from_embedding, grid)
    attention = []
    for layer in L.children(model, "gpt_neox.layers"):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            G.replace_module(model, f"{layer}.{norm}", G.GridLayerNorm.from_layer_norm, grid)
        for linear in ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h",
                       "mlp.dense_4h_to_h"):
            G.replace_module(model, f"{layer}.{linear}", G.GridLinear.from_linear, grid)
        attention.append(f"{layer}.attention")
    G.replace_module(model, "gpt_neox.final_layer_norm", G.GridLayerNorm.from_layer_norm, grid)
    G.replace_module(model, "lm_head", G.GridHead.from_linear, grid)
    if L.present(model, "gpt_neox"):
        G.slice_attention_mask(model.gpt_neox, grid)
    L.share_heads(model, attention, grid.q)
