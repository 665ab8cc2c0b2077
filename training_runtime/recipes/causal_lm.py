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
from torch import nn


def next_token_loss(model: nn.Module, batch: TokenBatch) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy of predicting token t+1 from tokens ..t; logits upcast to fp32."""
    inputs, targets = batch.tokens[:, :-1], batch.tokens[:, 1:]
    device = next(model.parameters()).device
    logits = model(inputs.to(device))
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.to(device).flatten())
    return loss, targets.numel()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser("python -m dtrain.runtime.recipes.causal_lm", __doc__.split("\n")[0],
                          recipe="causal_lm", lr=3e-4)
    args = parse_args(parser, argv)
    # Windows of seq_len + 1 tokens: inputs and shifted targets come from the same window.
    return run_recipe(args, recipe="causal_lm", make_loss_fn=lambda *_: next_token_loss,
                      window=args.seq_len + 1)


if __name__ == "__main__":
    sys.exit(main())
