"""Training throughput, TFLOP/s per GPU and MFU of a GPT-NeoX on ONE device, through the recipe.

    python benchmarks/gpu_mfu.py                     # a GPU: gpt-neox-1.3b, bf16, flash, seq 2048
    python benchmarks/gpu_mfu.py --micro-batch-sizes 4 8 --activation-checkpointing true
    python benchmarks/gpu_mfu.py --device cpu --model gpt-neox-tiny --precision fp32 \\
        --seq-len 128 --micro-batch-sizes 4 --steps 8 --log-interval 2    # smoke run, no GPU

The target it measures (FlashAttention issue): a single-GPU bf16 run of a ~1B GPT-NeoX with the
flash kernel reports TFLOPs/GPU and MFU, MFU >= 45 %.

Each configuration is one fresh ``python -m dtrain.runtime.recipes.causal_lm`` process (the
built-in recipe a job runs: the Trainer, AdamW, clipping, the metrics it logs) with its contract
folders in a temporary directory and random tokens as its data channel. The table reads the
recipe's own ``metrics.jsonl``: the median of the logged intervals after the first (which holds
compilation and allocator warm-up), so the figures are the ones a job reports. MFU's peak is
the catalog figure of the GPU model the driver names (``DTRAIN_PEAK_TFLOPS`` overrides it;
see ``dtrain.runtime.train.metrics``), and the FLOPs per token are ``6·N + 12·L·h·s``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

COLUMNS = ("model", "mbs", "seq", "kernel", "tokens/s", "TFLOP/s/GPU", "MFU", "peak GiB", "s/step")


def _write_tokens(folder: Path, *, vocab: int, count: int, seed: int) -> None:
    from dtrain.runtime.train.data import TokenDataset

    tokens = np.random.default_rng(seed).integers(0, vocab, size=count)
    TokenDataset(tokens, {"vocab_size": vocab, "tokenizer": {"name": "random"}}).save(folder)


def _run(args: argparse.Namespace, micro_batch_size: int, root: Path) -> dict:
    from dtrain.core.presets import get_preset

    vocab = int(get_preset(args.model)["vocab_size"])
    data = root / "data"
    tokens_needed = (args.steps + 1) * micro_batch_size * (args.seq_len + 1)
    _write_tokens(data, vocab=vocab, count=max(tokens_needed, 4 * (args.seq_len + 1)), seed=0)
    out = root / "output"
    env = {
        **os.environ,
        "SM_MODEL_DIR": str(root / "model"), "SM_OUTPUT_DATA_DIR": str(out),
        "DTRAIN_CHECKPOINT_DIR": str(root / "checkpoints"),
        "DTRAIN_DISTRIBUTION": json.dumps({
            "backend": "nccl" if args.device == "cuda" else "gloo",
            "mixed_precision": args.precision, "attention": args.attention,
            "activation_checkpointing": args.activation_checkpointing,
        }),
        "DTRAIN_INSTANCE_TYPE": "local_gpu" if args.device == "cuda" else "local",
    }
    command = [sys.executable, "-m", "dtrain.runtime.recipes.causal_lm",
               "--model", args.model, "--data", str(data), "--steps", str(args.steps),
               "--micro_batch_size", str(micro_batch_size), "--seq_len", str(args.seq_len),
               "--log_interval", str(args.log_interval), "--warmup_steps", "2",
               "--checkpoint_interval", "0"]
    started = time.monotonic()
    proc = subprocess.run(command, check=False, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - started
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}:\n{log[-4000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    measured = records[1:] or records
    kernel = next((line.split("attention kernel:", 1)[1].split("(")[0].strip()
                   for line in log.splitlines() if "attention kernel:" in line), "?")

    def median(key: str) -> float:
        return statistics.median(r[key] for r in measured if key in r)

    return {"model": args.model, "mbs": micro_batch_size, "seq": args.seq_len, "kernel": kernel,
            "tokens/s": median("tokens_per_s"), "TFLOP/s/GPU": median("tflops_per_gpu"),
            "MFU": median("mfu"),
            "peak GiB": max(r.get("peak_memory_bytes", 0) for r in records) / 2**30,
            # one optimizer step is one micro-batch of mbs sequences (no accumulation here)
            "s/step": micro_batch_size * args.seq_len / median("tokens_per_s"),
            "wall s": elapsed}


def _format(row: dict) -> str:
    return (f"{row['model']:>14} {row['mbs']:>4} {row['seq']:>6} {row['kernel']:>14} "
            f"{row['tokens/s']:>10.0f} {row['TFLOP/s/GPU']:>12.2f} {row['MFU']:>7.1%} "
            f"{row['peak GiB']:>9.2f} {row['s/step']:>7.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-neox-1.3b", help="a dtrain preset (dtrain.core.presets)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--attention", choices=("flash", "sdpa", "eager"), default="flash")
    p.add_argument("--activation-checkpointing", choices=("true", "false"), default="false")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[4])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--log-interval", type=int, default=5)
    args = p.parse_args(argv)
    args.activation_checkpointing = args.activation_checkpointing == "true"
    if args.steps < 2 * args.log_interval:
        p.error("--steps must cover at least two --log-interval windows (the first is warm-up)")

    print(f"GPT-NeoX training step on one {args.device} device, {args.precision}, attention "
          f"{args.attention}, activation checkpointing {args.activation_checkpointing}; "
          f"median over logged intervals after the first")
    print(f"{'model':>14} {'mbs':>4} {'seq':>6} {'kernel':>14} {'tokens/s':>10} "
          f"{'TFLOP/s/GPU':>12} {'MFU':>7} {'peak GiB':>9} {'s/step':>7}")
    for mbs in args.micro_batch_sizes:
        with tempfile.TemporaryDirectory(prefix="dtrain-mfu-") as tmp:
            row = _run(args, mbs, Path(tmp))
        print(_format(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
