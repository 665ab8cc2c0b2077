"""GPT-Neo's tensor-parallel plans.

1-D: separate q, k, v projections split by columns (whole heads per rank). Local attention's
window is a mask over the whole sequence, which attention always sees (the sequence is gathered
on entry), so it is the same on every rank. Embeddings as GPT-2's.
"""

from __future__ import annotations

from dtrain.runtime.distributed.tensor_parallel import layouts as L
from torch import nn

FAMILY = L.CausalLM(
    embedding="transformer.wte", position_embedding="transformer.wpe", blocks="transformer.h",
    final_norm="transformer.ln_f",
    block=L.Block(norms=("ln_1", "ln_2"),
                  columns=("attn.attention.q_proj", "attn.attention.k_proj",
                           "attn.attention.v_proj", "mlp.c_fc"),
                  rows=("attn.attention.out_proj", "mlp.c_proj"), heads="attn.attention",
                  whole_sequence=(("attn", 2), ("mlp", 1))))


def one_d_plan(model: nn.Module, *, sequence_parallel: bool) -> L.OneDPlan:
    return L.causal_lm_plan(model, FAMILY, sequence_parallel=sequence_parallel)
