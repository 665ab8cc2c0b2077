"""Causal language-model pre-training (GPT-NeoX, GPT-2, GPT-J, GPT-Neo): next-token prediction.

As a dtrain job (``entry_point: recipe:causal_lm``, hyperparameters become ``--key value``)::

    dtrain submit examples/local-cpu.yaml

or directly, one process, on a text file tokenized byte-level on the fly::

    python -m dtrain.runtime.recipes.causal_lm --model gpt-neox-tiny --data README.md \
        --steps 30 --micro_batch_size 4 --seq_len 64 --lr 3e-3 --warmup_steps 5 --log_interval 5

``--model`` is a preset of ``dtrain.core.presets`` or a Hugging Face folder (fine-tuning); ``--data``
a channel name (default ``train``), a token channel folder, a ``.bin`` or a text file. Metrics go
to stdout, ``metrics.jsonl`` in SM_OUTPUT_DATA_DIR; checkpoints to DTRAIN_CHECKPOINT_DIR; the
trained model to SM_MODEL_DIR as a Hugging Face folder.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from dtrain.runtime.recipes.common import build_parser, parse_args, run_recipe
from dtrain.runtime.train.data import TokenBatch
from dtrain.runtime.train.trainer import SplitLoss


def next_tokens(batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(inputs, targets, tokens trained on): tokens ..t predict token t+1."""
    inputs, targets = batch.tokens[:, :-1], batch.tokens[:, 1:]
    return inputs, targets, targets.numel()


def next_token_criterion(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next tokens; logits upcast to fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ``next_token_loss(model, batch) -> (loss, tokens)``; split in two for pipeline stages
next_token_loss = SplitLoss(next_tokens, next_token_criterion)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser("python -m dtrain.runtime.recipes.causal_lm", __doc__.split("\n")[0],
                          recipe="causal_lm", lr=3e-4)
    args = parse_args(parser, argv)
    # Windows of seq_len + 1 tokens: inputs and shifted targets come from the same window.
    return run_recipe(args, recipe="causal_lm", make_loss_fn=lambda *_: next_token_loss,
                      window=args.seq_len + 1)


if __name__ == "__main__":
    sys.exit(main())
