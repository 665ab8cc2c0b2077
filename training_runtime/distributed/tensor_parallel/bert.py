"""BERT's and RoBERTa's tensor-parallel plans.

1-D on a post-LayerNorm encoder: each residual output (row-parallel dense, add, LayerNorm) runs
on the sequence slice with sequence parallelism, attention and the intermediate projection on
the gathered sequence. The embeddings (word: vocabulary-parallel; position, token type and their
LayerNorm: whole) are computed whole; the first layer keeps its slice of the sequence. The MLM
head's transform runs on the whole sequence, its decoder (tied to the word embeddings) and
vocabulary-sized bias are split over the vocabulary.
"""

from __future__ import annotations

from dtrain.runtime.distributed.tensor_parallel import layouts as L
from torch import nn

BLOCK = L.Block(norms=("attention.output.LayerNorm", "output.LayerNorm"),
                columns=("attention.self.query", "attention.self.key", "attention.self.value",
                         "intermediate.dense"),
                rows=("attention.output.dense", "output.dense"), heads="attention.self",
                whole_sequence=(("attention.self", 2), ("intermediate", 1)))


def one_d_plan(model: nn.Module, *, sequence_parallel: bool) -> L.OneDPlan:
    sp = sequence_parallel
    base = model.base_model_prefix  # "bert" or "roberta"
    plan = L.OneDPlan()
    plan.add(f"{base}.embeddings.word_embeddings", L.replicated_embedding())
    L.add_blocks(plan, model, f"{base}.encoder.layer", BLOCK, sequence_parallel=sp,
                 split_first=L.present(model, f"{base}.embeddings"))
    head = model.head_name  # "cls.predictions" or "lm_head"
    if sp:
        # BERT's transform is a submodule; RoBERTa's head computes it inline
        plan.add(f"{head}.transform" if L.present(model, f"{head}.transform") else head,
                 L.gather_sequence(1))
    plan.add(f"{head}.decoder", L.vocab_head(sp, gathered_input=True))
    plan.vocab_parameters.append(f"{head}.bias")
    return plan
