"""Masked language-model pre-training (BERT, RoBERTa): predict 15% of tokens that were hidden.

As a dtrain job: ``entry_point: recipe:masked_lm``. Directly, one process::

    python -m dtrain.runtime.recipes.masked_lm --model bert-tiny --data README.md \
        --steps 30 --micro_batch_size 4 --seq_len 64 --lr 1e-3 --warmup_steps 5 --log_interval 5

Masking follows BERT: of the chosen 15%, 80% become ``<mask>``, 10% a random token, 10% stay.
It is drawn from a generator seeded by (seed, micro-batch number, rank), so it is deterministic
and survives a resume without saving any RNG. The loss is the mean over each rank's masked
tokens (ranks with more masked tokens weigh the same as the others; fine for pre-training).
The ranks of a tensor-parallel group, of a pipeline, draw the same masks (the seed takes the
data-parallel rank). Under pipeline parallelism the loss is the mean over each micro-batch's
masked tokens, averaged over the micro-batches.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dtrain.runtime.recipes.common import build_parser, parse_args, run_recipe
from dtrain.runtime.train.data import TokenBatch, TokenDataset
from dtrain.runtime.train.trainer import SplitLoss

IGNORE_INDEX = -100


def mask_tokens(tokens: torch.Tensor, rng: np.random.Generator, *, mask_id: int,
                vocab_size: int, probability: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels): BERT's 80/10/10 masking; labels are IGNORE_INDEX where not chosen."""
    ids = tokens.numpy()
    chosen = rng.random(ids.shape) < probability
    chosen[np.arange(ids.shape[0]), rng.integers(0, ids.shape[1], ids.shape[0])] = True
    action = rng.random(ids.shape)
    inputs = np.where(chosen & (action < 0.8), mask_id, ids)
    swap = chosen & (action >= 0.8) & (action < 0.9)
    inputs = np.where(swap, rng.integers(0, vocab_size, ids.shape), inputs)
    labels = np.where(chosen, ids, IGNORE_INDEX)
    return torch.from_numpy(inputs.astype(np.int64)), torch.from_numpy(labels.astype(np.int64))


def masked_lm_loss(args: argparse.Namespace, dataset: TokenDataset,
                   ctx: Any = None) -> SplitLoss:
    mask_id = dataset.special_tokens.get("<mask>")
    if mask_id is None:
        raise ValueError("the data's tokenizer has no <mask> token; tokenize it with "
                         "`python -m dtrain.runtime.train.tokenize` (byte or bpe both add one)")
    # the data-parallel rank: the ranks of a tensor-parallel group mask their batch alike
    rank = ctx.dp_rank if ctx is not None else (dist.get_rank() if dist.is_initialized() else 0)

    def masked(batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
        rng = np.random.default_rng([args.seed, batch.index, rank])
        inputs, labels = mask_tokens(batch.tokens, rng, mask_id=mask_id,
                                     vocab_size=dataset.vocab_size)
        return inputs, labels, inputs.numel()  # the encoder processes every token

    return SplitLoss(masked, masked_token_criterion)


def masked_token_criterion(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the masked positions; logits upcast to fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                           ignore_index=IGNORE_INDEX)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser("python -m dtrain.runtime.recipes.masked_lm", __doc__.split("\n")[0],
                          recipe="masked_lm", lr=1e-3)
    args = parse_args(parser, argv)
    return run_recipe(args, recipe="masked_lm", make_loss_fn=masked_lm_loss, window=args.seq_len)


if __name__ == "__main__":
    sys.exit(main())
