"""Automatic versus uniform pipeline partitioning on a deliberately unbalanced model.

A GPT-NeoX of 8 blocks whose vocabulary makes the head cost about six blocks, cut into 2 stages
on 2 gloo ranks (one CPU thread each): ``uniform`` gives each stage 4 blocks (the head joins the
last), ``auto`` balances the FLOPs the measuring pass counts. It prints each cut's stages, their
measured FLOPs (deterministic), and the measured step time of 1F1B with 4 micro-batches: both
pipelines are built in one process group and their steps alternate, so machine noise falls on
both alike; the median of ``--steps`` steps is reported.

    python benchmarks/pipeline_partition.py                # 12 measured steps each
    python benchmarks/pipeline_partition.py --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

# hidden 256 (4 heads, MLP 1024), 8 blocks; at 64 tokens a block's forward is 1.64 MFLOP per
# token and the head's 2·256·19200 = 9.8 MFLOP, six blocks' worth
MODEL = {"hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024,
         "num_hidden_layers": 8, "vocab_size": 19200, "max_position_embeddings": 256}
PARTITIONS = ("uniform", "auto")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12, help="measured steps per partition")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=4)
    return p.parse_args(argv)


def worker(rank: int, port: int, out: str, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_WORLD_SIZE="2", GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    import dtrain.runtime as rt
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from dtrain.runtime.models import from_preset

    torch.set_num_threads(1)
    pipelines = {}
    for partition in PARTITIONS:
        ctx = rt.init(distribution={
            "pipeline_parallel_degree": 2, "sharding_degree": 1, "pipeline_schedule": "1f1b",
            "microbatches": args.microbatches, "partition": partition,
            "mixed_precision": "fp32", "attention": "sdpa"})
        torch.manual_seed(0)
        model = from_preset("gpt-neox-tiny", attention="sdpa", **MODEL)
        pipelines[partition] = rt.shard(model, ctx,
                                        pipeline_sample=(args.micro_batch, args.seq_len))

    def criterion(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    data = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {p: [] for p in PARTITIONS}
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, MODEL["vocab_size"],
                               (args.microbatches * args.micro_batch, args.seq_len + 1),
                               generator=data)
        for partition in PARTITIONS if step % 2 else reversed(PARTITIONS):
            dist.barrier()
            start = time.perf_counter()
            pipelines[partition].step(tokens[:, :-1], tokens[:, 1:], criterion)
            elapsed = time.perf_counter() - start
            if step >= args.warmup:
                times[partition].append(elapsed)
    if rank == 0:
        result = {}
        for partition, piped in pipelines.items():
            costs = piped.unit_costs or _measured(piped, args)
            part = piped.partition
            result[partition] = {
                "stages": [part.describe(k) for k in range(part.num_stages)],
                "stage_flops": part.stage_flops(costs), "step_s": statistics.median(times[partition]),
                "spread_s": [min(times[partition]), max(times[partition])]}
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _measured(piped, args):
    """The uniform cut measures nothing at build time; measure the same model for the table."""
    from dtrain.runtime.distributed.pipeline.measure import measure_unit_costs
    from dtrain.runtime.distributed.pipeline.units import model_units
    from dtrain.runtime.models import from_preset

    model = from_preset("gpt-neox-tiny", device="meta", **MODEL)
    return measure_unit_costs(model, model_units(model), micro_batch_size=args.micro_batch,
                              seq_len=args.seq_len)


def main() -> None:
    args = parse_args()
    import torch.multiprocessing as mp
    from torch.distributed import TCPStore

    started = time.monotonic()
    store = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    out = Path(tempfile.mkdtemp(prefix="dtrain_pp_partition_")) / "result.json"
    mp.start_processes(worker, args=(store.port, str(out), args), nprocs=2, start_method="spawn")
    result = json.loads(out.read_text())
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs; 2 gloo ranks, "
          "1 thread each")
    print(f"# GPT-NeoX {MODEL['num_hidden_layers']} blocks × {MODEL['hidden_size']}, vocabulary "
          f"{MODEL['vocab_size']}; 1F1B, {args.microbatches} micro-batches of {args.micro_batch} × "
          f"{args.seq_len} tokens; median of {args.steps} steps (alternating), fp32")
    print(f"{'partition':<9} {'stage 0':<24} {'stage 1':<20} {'stage GFLOP':>16} "
          f"{'slowest':>8} {'step s':>7} {'min-max s':>11}")
    for partition in PARTITIONS:
        r = result[partition]
        gflop = [f / 1e9 for f in r["stage_flops"]]
        print(f"{partition:<9} {r['stages'][0]:<24} {r['stages'][1]:<20} "
              f"{gflop[0]:>7.2f} / {gflop[1]:<6.2f} {max(gflop):>8.2f} {r['step_s']:>7.3f} "
              f"{r['spread_s'][0]:>5.2f}-{r['spread_s'][1]:<5.2f}")
    auto, uniform = result["auto"], result["uniform"]
    flops = max(auto["stage_flops"]) / max(uniform["stage_flops"])
    print(f"auto / uniform: slowest stage {flops:.2f}x by measured FLOPs "
          f"({1 - flops:.0%} cheaper; target >= 25 %), step time {auto['step_s'] / uniform['step_s']:.2f}x "
          f"measured (target: not worse than 1.00x)")
    print(f"# {time.monotonic() - started:.0f} s in all")


if __name__ == "__main__":
    main()
