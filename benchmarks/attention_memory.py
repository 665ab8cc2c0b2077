"""Peak memory and time of forward+backward through ONE GPT-NeoX layer, per attention backend.

    python benchmarks/attention_memory.py                      # CPU, the table in the report
    python benchmarks/attention_memory.py --seq-lens 1024 2048 --hidden 512 --heads 8
    python benchmarks/attention_memory.py --attention-only   # the layer's attention module alone

Each (sequence length, backend) runs in a fresh subprocess, so peak memory is honest on a CPU,
where torch keeps no allocator statistics: it is the growth of the process's peak RSS
(``ru_maxrss``) over the forward+backward, measured after the layer was built and warmed up on a
short sequence. Time is the best of ``--repeats`` forward+backward passes after that first one.
On CUDA (``--device cuda``) the allocator's peak statistics are used instead.

The children run with glibc's mmap threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``, the
same for every backend): by default the threshold slides up as large blocks are freed, so later
tensors of up to 32 MiB come from the heap, whose freed pages stay resident, and the peak RSS
depends on allocation history (+-10 % between identical runs). With the threshold fixed, each
tensor's pages are returned when it is freed and the peak RSS follows the peak of live memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

BACKENDS = ("eager", "sdpa", "flash")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _measure(args: argparse.Namespace) -> dict:
    """Child process: one backend, one sequence length."""
    import torch
    from dtrain.runtime.models import used_kernels
    from dtrain.runtime.models.gpt_neox import GPTNeoXAttention, GPTNeoXConfig, GPTNeoXLayer

    torch.manual_seed(0)
    device = torch.device(args.device)
    config = GPTNeoXConfig.from_hf({
        "model_type": "gpt_neox", "hidden_size": args.hidden, "num_hidden_layers": 1,
        "num_attention_heads": args.heads, "vocab_size": 8, "rotary_pct": 0.25,
    })
    if args.attention_only:  # separates the kernel's memory from the MLP's activations
        attention = GPTNeoXAttention(config, backend=args.backend).to(device)

        def layer(x: torch.Tensor) -> torch.Tensor:
            return attention(x, None)
    else:
        layer = GPTNeoXLayer(config, backend=args.backend).to(device)

    def step(seq: int) -> None:
        x = torch.randn(1, seq, args.hidden, device=device, requires_grad=True)
        layer(x).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    step(128)  # warm-up: kernels chosen, thread pools and libraries loaded
    before = _peak_rss_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    step(args.seq)
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda"
            else _peak_rss_bytes()) - before
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step(args.seq)
        times.append(time.perf_counter() - start)
    return {"backend": args.backend, "seq": args.seq, "peak_bytes": peak,
            "seconds": min(times), "kernels": sorted(used_kernels())}


def _run_child(args: argparse.Namespace, backend: str, seq: int) -> dict:
    command = [sys.executable, __file__, "--child", "--backend", backend, "--seq", str(seq),
               "--hidden", str(args.hidden), "--heads", str(args.heads),
               "--repeats", str(args.repeats), "--device", args.device]
    command += ["--attention-only"] if args.attention_only else []
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}  # see the module docstring
    result = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if result.returncode != 0:
        return {"backend": backend, "seq": seq, "error": result.stderr.strip().splitlines()[-1]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def _print_table(rows: list[dict], args: argparse.Namespace) -> None:
    part = "attention module of one GPT-NeoX layer" if args.attention_only else "One GPT-NeoX layer"
    print(f"{part}, hidden {args.hidden}, {args.heads} heads, batch 1, fp32, "
          f"{args.device}; forward+backward")
    print(f"{'seq':>6} {'backend':>8} {'kernel':>12} {'peak MiB':>10} {'time s':>8} "
          f"{'mem vs eager':>13} {'speed vs eager':>15}")
    by_key = {(row["seq"], row["backend"]): row for row in rows}
    for row in rows:
        if "error" in row:
            print(f"{row['seq']:>6} {row['backend']:>8}  failed: {row['error']}")
            continue
        eager = by_key.get((row["seq"], "eager"), {})
        mem_ratio = (f"{row['peak_bytes'] / eager['peak_bytes']:.3f}x"
                     if eager.get("peak_bytes") else "-")
        speed = f"{eager['seconds'] / row['seconds']:.2f}x" if "seconds" in eager else "-"
        print(f"{row['seq']:>6} {row['backend']:>8} {','.join(row['kernels']):>12} "
              f"{row['peak_bytes'] / 2**20:>10.1f} {row['seconds']:>8.3f} {mem_ratio:>13} "
              f"{speed:>15}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention-only", action="store_true",
                        help="measure the layer's attention module without its MLP")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="eager", help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=1024, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args)))
        return
    rows = [_run_child(args, backend, seq) for seq in args.seq_lens for backend in args.backends]
    _print_table(rows, args)


if __name__ == "__main__":
    main()
