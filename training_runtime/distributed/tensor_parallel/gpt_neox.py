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
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

FAMILY = L.CausalLM(
    embedding="gpt_neox.embed_in", blocks="gpt_neox.layers", final_norm="gpt_neox.final_layer_norm",
    block=L.Block(norms=("input_layernorm", "post_attention_layernorm"),
                  columns=("attention.query_key_value", "mlp.dense_h_to_4h"),
                  rows=("attention.dense", "mlp.dense_4h_to_h"), heads="attention",
                  whole_sequence=(("attention", 2), ("mlp", 1))))


def one_d_plan(model: nn.Module, *, sequence_parallel: bool) -> L.OneDPlan:
    return L.causal_lm_plan(model, FAMILY, sequence_parallel=sequence_parallel)


def apply_two_d(model: nn.Module, mesh: DeviceMesh) -> None:
    G.apply_causal_lm(model, mesh, FAMILY)
