"""GPT-J's tensor-parallel plans.

1-D: separate q, k, v projections split by columns (whole heads per rank); the interleaved
rotary embedding acts on each local head as on the whole model. Attention and the MLP run in
parallel from one layer norm. The untied LM head's bias is split with its rows.
"""

from __future__ import annotations

from dtrain.runtime.distributed.tensor_parallel import layouts as L
from torch import nn


def one_d_plan(model: nn.Module, *, sequence_parallel: bool) -> L.OneDPlan:
    sp = sequence_parallel
    plan = L.OneDPlan()
    plan.add("transformer.wte", L.vocab_embedding(sp))
    for block in L.children(model, "transformer.h"):
        for name in ("q_proj", "k_proj", "v_proj"):
            plan.add(f"{block}.attn.{name}", L.column())
        plan.rows.append(f"{block}.attn.out_proj")
        plan.add(f"{block}.mlp.fc_in", L.column())
        plan.rows.append(f"{block}.mlp.fc_out")
        if sp:
            plan.add(f"{block}.ln_1", L.sequence_norm())
            plan.add(f"{block}.attn", L.gather_sequence(2))
            plan.add(f"{block}.mlp", L.gather_sequence(1))
        plan.attention.append(f"{block}.attn")
    if sp:
        plan.add("transformer.ln_f", L.sequence_norm())
    plan.add("lm_head", L.vocab_head(sp))
    return plan
