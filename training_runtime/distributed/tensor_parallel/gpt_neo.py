"""GPT-Neo's tensor-parallel plans.

1-D: separate q, k, v projections split by columns (whole heads per rank). Local attention's
window is a mask over the whole sequence, which attention always sees (the sequence is gathered
on entry), so it is the same on every rank. Embeddings as GPT-2's.
"""

from __future__ import annotations

from dtrain.runtime.distributed.tensor_parallel import layouts as L
from torch import nn


def one_d_plan(model: nn.Module, *, sequence_parallel: bool) -> L.OneDPlan:
    sp = sequence_parallel
    plan = L.OneDPlan()
    plan.add("transformer.wte", L.replicated_embedding())
    for index, block in enumerate(L.children(model, "transformer.h")):
        attention = f"{block}.attn.attention"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan.add(f"{attention}.{name}", L.column())
        plan.rows.append(f"{attention}.out_proj")
        plan.add(f"{block}.mlp.c_fc", L.column())
        plan.rows.append(f"{block}.mlp.c_proj")
        if sp:
            if index == 0 and L.present(model, "transformer.wte"):
                plan.add(block, L.split_sequence(2))
            plan.add(f"{block}.ln_1", L.sequence_norm())
            plan.add(f"{block}.ln_2", L.sequence_norm())
            plan.add(f"{block}.attn", L.gather_sequence(2))
            plan.add(f"{block}.mlp", L.gather_sequence(1))
        plan.attention.append(attention)
    if sp:
        plan.add("transformer.ln_f", L.sequence_norm())
    plan.add("lm_head", L.vocab_head(sp))
    return plan
