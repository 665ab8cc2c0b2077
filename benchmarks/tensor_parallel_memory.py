"""Memory per rank and step time of MiCS alone, 1-D and 2-D tensor parallelism, on 4 CPU ranks.

    python benchmarks/tensor_parallel_memory.py                    # the table in the docs
    python benchmarks/tensor_parallel_memory.py --micro-batches 2 4 8 --cap-mib 96

One GPT-NeoX shape (parallel residual, as Pythia; ``--sequential-residual`` for the other
block), four gloo ranks on this machine, one process group per layout, micro-batches in
ascending order. The layouts share the 4 ranks differently: MiCS alone (``sharding_degree 4``)
gives each rank its own micro-batch; 1-D ``tp 4`` (with and without sequence parallelism) and
2-D ``2 × 2`` have the four ranks work on one micro-batch together. A micro-batch is what one
data-parallel rank trains on per step, so at equal micro-batch size each layout trains its
ranks on the same shape of work.

Per layout and micro-batch, the worst rank's:

* ``act MiB``: bytes autograd keeps for backward (``dtrain.runtime.train.memory``: distinct
  storages, parameters left out), deterministic;
* ``peak MiB``: growth of the process's peak resident memory over the step (forward, loss,
  backward, MiCS's gathers and reduce-scatters), measured as ``benchmarks/attention_memory.py``
  does, with glibc's mmap threshold fixed so freed tensors leave the resident set;
* ``step s``: median forward+backward time of ``--steps`` steps (the machine is shared: compare
  within a run).

Then the largest micro-batch whose step peak stays under ``--cap-mib`` per rank, and the ratio
of 2-D's activation memory to 1-D's without sequence parallelism at each micro-batch.
"""

from __future__ import annotations

import argparse
import os
import pickle
import resource
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

WORLD = 4
LAYOUTS = {
    "MiCS only (shard 4)": {"sharding_degree": 4},
    "1-D tp 4": {"sharding_degree": 1, "tensor_parallel_degree": 4, "sequence_parallel": False},
    "1-D tp 4 + SP": {"sharding_degree": 1, "tensor_parallel_degree": 4,
                      "sequence_parallel": True},
    "2-D 2 x 2": {"sharding_degree": 1, "tensor_parallel_degree": 4,
                  "tensor_parallel_mode": "2d"},
}


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _measure(rank: int, port: int, out_dir: str, layout: str, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_WORLD_SIZE=str(WORLD), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    import dtrain.runtime as rt
    from dtrain.runtime.models import from_preset
    from dtrain.runtime.train.memory import saved_activations

    ctx = rt.init(distribution=LAYOUTS[layout])
    torch.manual_seed(0)
    model = rt.shard(from_preset(
        "gpt-neox-tiny", attention="flash", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_attention_heads=args.heads, num_hidden_layers=args.layers, vocab_size=args.vocab,
        max_position_embeddings=args.seq, use_parallel_residual=not args.sequential_residual),
        ctx)
    data = torch.Generator().manual_seed(ctx.dp_rank)

    def step(micro_batch: int, saved=None) -> float:
        tokens = torch.randint(0, args.vocab, (micro_batch, args.seq + 1), generator=data)
        start = time.perf_counter()
        with ctx.micro_step(model, boundary=True):
            # the logits are not held through backward, as in the trainer's loss functions
            with saved_activations(model) if saved is not None else nullcontext() as record:
                loss = F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1),
                                       tokens[:, 1:].flatten())
            if saved is not None:
                saved.append(record.bytes)
            loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step(args.micro_batches[0])  # warm-up: kernels, buffers, process groups
    rows = []
    for micro_batch in args.micro_batches:
        saved: list[int] = []
        before = _resident_bytes()
        step(micro_batch, saved)
        peak = _peak_bytes() - before
        seconds = statistics.median(step(micro_batch) for _ in range(args.steps))
        rows.append({"micro_batch": micro_batch, "activation_bytes": saved[0],
                     "peak_bytes": max(peak, 0), "seconds": seconds})
    torch.distributed.destroy_process_group()
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(rows, f)


def _run_layout(layout: str, args: argparse.Namespace) -> list[dict]:
    import torch.multiprocessing as mp
    from torch.distributed import TCPStore

    with tempfile.TemporaryDirectory() as out_dir:
        store = TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
        mp.start_processes(_measure, args=(store.port, out_dir, layout, args), nprocs=WORLD,
                           start_method="spawn")
        per_rank = [pickle.loads((Path(out_dir) / f"rank{r}.pkl").read_bytes())
                    for r in range(WORLD)]
    # the worst rank's memory, the slowest rank's time
    return [{key: max(ranks[i][key] for ranks in per_rank) for key in per_rank[0][i]}
            for i in range(len(per_rank[0]))]


def _print(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    mib = 2**20
    print(f"{'layout':<20} {'micro-batch':>11} {'act MiB':>9} {'peak MiB':>9} {'step s':>8}")
    for layout, rows in results.items():
        for row in rows:
            print(f"{layout:<20} {row['micro_batch']:>11} {row['activation_bytes'] / mib:>9.1f} "
                  f"{row['peak_bytes'] / mib:>9.1f} {row['seconds']:>8.2f}")
    print(f"largest micro-batch with a step peak under {args.cap_mib} MiB per rank:")
    for layout, rows in results.items():
        fits = [r["micro_batch"] for r in rows if r["peak_bytes"] <= args.cap_mib * mib]
        print(f"  {layout:<20} {max(fits) if fits else 'none of ' + str(args.micro_batches)}")
    one_d, two_d = results["1-D tp 4"], results["2-D 2 x 2"]
    ratios = [t["activation_bytes"] / o["activation_bytes"] for o, t in zip(one_d, two_d)]
    print("2-D / 1-D (no SP) activation memory per rank: "
          + ", ".join(f"{r:.2f} at {row['micro_batch']}" for r, row in zip(ratios, one_d))
          + f" (target <= 0.50: {'met' if max(ratios) <= 0.5 else 'NOT met'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--steps", type=int, default=2, help="timed steps per micro-batch")
    parser.add_argument("--cap-mib", type=float, default=128.0)
    parser.add_argument("--sequential-residual", action="store_true")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # inherited by the ranks
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.time()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs; "
          f"{WORLD} gloo ranks")
    block = "sequential" if args.sequential_residual else "parallel"
    print(f"# gpt-neox: hidden {args.hidden}, {args.heads} heads, {args.layers} layers "
          f"({block} residual), vocab {args.vocab}, seq {args.seq}, fp32, flash attention")
    results = {layout: _run_layout(layout, args) for layout in LAYOUTS}
    _print(results, args)
    print(f"# {time.time() - started:.0f} s in all; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
