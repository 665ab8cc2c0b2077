"""The training script of the p4d examples and the SMP ports: causal-LM pre-training with dtrain.

It starts dtrain's built-in ``causal_lm`` recipe, as a project's own ``train.py`` would start its
training: GPT-NeoX-family model from a preset (``--model pythia-1b`` in the examples), MiCS as the
job's ``distribution`` says, AdamW, checkpoints, metrics, the trained model in ``SM_MODEL_DIR``.
Hyperparameters arrive as ``--key value``; ``python train.py --help`` lists them (``--data``,
``--steps``, ``--seq_len``, ``--micro_batch_size``, ``--lr``, ...). A spec with
``entry_point: recipe:causal_lm`` and no ``source_dir`` runs the same without this folder.

The data is the ``train`` channel: a token channel (``python -m dtrain.runtime.train.tokenize``
writes one) or text files, tokenized byte-level when the job starts. ``estimator.fit("s3://...")``
names its one channel ``training``, as the SageMaker SDK does; that is read when there is no
``train`` channel and no ``--data``.

    dtrain submit examples/sagemaker-p4d.yaml --dry-run
"""

import os
import sys

from dtrain.runtime.recipes import causal_lm


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if ("--data" not in argv and "SM_CHANNEL_TRAIN" not in os.environ
            and "SM_CHANNEL_TRAINING" in os.environ):
        argv += ["--data", "training"]
    return causal_lm.main(argv)


if __name__ == "__main__":
    sys.exit(main())
