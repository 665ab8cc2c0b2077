"""A tiny training script for the SageMaker example: prints dtrain metric lines.

    dtrain submit examples/sagemaker-p4d.yaml --dry-run
"""

import argparse
import os

from dtrain.core.metrics_format import format_metrics


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--model", default="pythia-1b")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--micro_batch_size", type=int, default=4)
    args = parser.parse_args()
    print("training data in", os.environ.get("SM_CHANNEL_TRAIN"))
    for step in range(1, args.epochs + 1):
        print(format_metrics(step, loss=2.5 / step, lr=args.lr), flush=True)


if __name__ == "__main__":
    main()
