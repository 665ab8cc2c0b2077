"""GPT-J's tensor-parallel plans.

1-D: separate q, k, v projections split by columns (whole heads per rank); the interleaved
rotary embedding acts on each local head as on the whole model. Attention and the MLP run in
parallel from one layer norm. The untied LM head's bias is split with its rows.
"""

from __future__ import annotations

from dtrain.runtime.distributed.tensor_parallel import layouts as L
from torch import nn

FAMILY = L.CausalLM(
    embedding="transformer.wte", blocks="transformer.h", final_norm="transformer.ln_f",
    block=L.Block(norms=("ln_1",),
                  columns=("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"),
                  rows=("attn.out_proj", "mlp.fc_out"), heads="attn",
                  whole_sequence=(("attn", 2), ("mlp", 1))))


def one_d_plan(model: nn.Module, *, sequence_parallel: bool) -> L.OneDPlan:
    return L.causal_lm_plan(model, FAMILY, sequence_parallel=sequence_parallel)
