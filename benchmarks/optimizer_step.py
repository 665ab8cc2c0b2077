"""One AdamW step on a rank's shard of a model: torch's three implementations side by side.

Run:  python benchmarks/optimizer_step.py [--model gpt-neox-30m] [--degree 2] [--repeat 7]

The shard is what one rank of a partition group of ``--degree`` holds: the model's parameters
split ``degree`` ways as FSDP2 splits them (dim 0), as plain CPU tensors with gradients, one
thread (as each worker of the emulated-cluster benchmark runs). Prints the median step of the
single-tensor loop (torch's default on CPU), ``foreach=True`` and ``fused=True`` (what dtrain's
``build_optimizer`` uses), and the fused step's speed-up. The optimizer step sits between the
last gradient and the next forward: nothing crosses the link while it runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def shard_parameters(model_name: str, degree: int) -> list:
    import torch
    from dtrain.runtime.models import from_preset

    model = from_preset(model_name, device="meta")
    shards = []
    for p in model.parameters():
        rows = -(-p.shape[0] // degree)  # FSDP2's dim-0 shard, the first rank's (the largest)
        shard = torch.nn.Parameter(torch.randn(rows, *p.shape[1:]))
        shard.grad = torch.randn_like(shard)
        shards.append(shard)
    return shards


def median_step(params: list, repeat: int, **impl) -> float:
    import torch

    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=1e-4, **impl)
    opt.step()  # state allocation is not part of a step
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-neox-30m", help="a preset from dtrain.core.presets")
    p.add_argument("--degree", type=int, default=2, help="ranks the parameters are sharded over")
    p.add_argument("--repeat", type=int, default=7, help="timed steps per implementation")
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    params = shard_parameters(args.model, args.degree)
    count = sum(p.numel() for p in params)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}; torch {torch.__version__}; {os.cpu_count()} "
          f"CPUs, 1 thread; load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"# {args.model}, one rank's shard at degree {args.degree}: {count / 1e6:.1f} M "
          f"parameters in {len(params)} tensors, fp32; median of {args.repeat} steps")
    print(f"{'implementation':<22}{'step s':>9}{'speed-up':>10}")
    rows = [("single-tensor loop", {"foreach": False}), ("foreach", {"foreach": True}),
            ("fused (dtrain)", {"fused": True})]
    baseline = None
    for label, impl in rows:
        seconds = median_step(params, args.repeat, **impl)
        baseline = baseline or seconds
        print(f"{label:<22}{seconds:>9.4f}{baseline / seconds:>9.2f}x")


if __name__ == "__main__":
    main()
