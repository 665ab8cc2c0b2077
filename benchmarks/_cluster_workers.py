"""What the node agents run for ``mics_emulated_cluster.py``: link probes, compute-only steps,
and the dtrain and raw-FSDP2 training rows (DeepSpeed's rows are in ``_deepspeed_rows.py``).

Each worker reads its settings from the parsed hyperparameters (``args``) and rank 0 writes one
JSON result to ``args.out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from _emulated_cluster import DEVS

MAX_MEASURED_STEPS = 50  # however short a row's steps, it stops after this many


def worker_loopback(args: argparse.Namespace) -> None:
    """Bytes/s one gloo rank sends another on one host (all-gather of 64 MiB per rank)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    shard = torch.ones(16 * 2**20)
    full = torch.empty(dist.get_world_size() * shard.numel())
    dist.all_gather_into_tensor(full, shard)
    start = time.perf_counter()
    for _ in range(5):
        dist.all_gather_into_tensor(full, shard)
    elapsed = (time.perf_counter() - start) / 5
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"bytes_per_s": shard.numel() * 4 / elapsed}))
    dist.destroy_process_group()


def worker_link(args: argparse.Namespace) -> None:
    """Raw gloo across the limited link, 2 ranks: latency, all-gather and all-reduce speed.

    Bytes per direction: all-gather of 2 x S/2 moves S/2 each way; all-reduce of S (ring:
    reduce-scatter + all-gather) moves S each way; reduce-scatter of S moves S/2 each way in a
    ring, but gloo's reduce_scatter_tensor runs as an all-reduce (measured: S each way).
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tiny, size = torch.ones(1), 8 * 2**20  # 32 MiB of fp32
    lat = []
    for _ in range(30):
        start = time.perf_counter()
        dist.all_reduce(tiny)
        lat.append(time.perf_counter() - start)
    full, half = torch.ones(size), torch.ones(size // 2)

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(2):  # the first call also grows TCP windows
            dist.barrier()
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return best

    res = {"latency_s": statistics.median(lat[5:]) / 2}  # a 2-rank all-reduce = 2 ring steps
    res["all_gather_Bps"] = size * 2 / timed(lambda: dist.all_gather_into_tensor(full, half))
    res["all_reduce_Bps"] = size * 4 / timed(lambda: dist.all_reduce(full))
    res["reduce_scatter_Bps"] = size * 2 / timed(lambda: dist.reduce_scatter_tensor(half, full))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(res))
    dist.destroy_process_group()


def build_model(name: str):
    from dtrain.runtime.models import from_preset

    return from_preset(name, attention="sdpa")


def make_batches(args: argparse.Namespace, vocab: int, *, rank: int, step: int) -> list:
    """The same tokens for every row: seeded by (rank, step) only."""
    import torch

    gen = torch.Generator().manual_seed(1_000_003 * rank + step)
    shape = (args.micro_batch, args.seq_len + 1)
    return [torch.randint(0, vocab, shape, generator=gen) for _ in range(args.accum)]


def lm_loss(model, tokens):
    import torch.nn.functional as F

    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def timed_steps(args: argparse.Namespace, vocab: int, one_step: Callable[[list], None], *,
                stats=None, warmup_window: int = 1) -> dict:
    """Warm-up steps, then measured optimizer steps (``one_step`` runs one, optimizer included);
    returns the medians. A warm-up step runs ``warmup_window`` micro-batches: a full window
    would only add link-bound time to the slowest rows without changing what is measured.

    At least ``args.steps`` steps are measured, and more (up to :data:`MAX_MEASURED_STEPS`) until
    they add up to ``args.min_seconds``, so that a one-second row is not one sample. The ranks
    agree on when to stop (the slowest rank's total), outside the timed region."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    times, sent, received, stat_bytes, cpu = [], [], [], [], []
    step = 0
    while True:
        batches = make_batches(args, vocab, rank=rank, step=step)
        if step < args.warmup:
            batches = batches[:warmup_window]  # connections, allocator, lazy init; not timed
        dist.barrier()
        if stats is not None:
            stats.reset()
        tx0, rx0 = veth_bytes()
        cpu0 = cpu_busy_seconds()
        start = time.perf_counter()
        one_step(batches)
        elapsed = time.perf_counter() - start
        # every rank done: this host's other rank may still be sending its last all-reduce
        # when this one's step ends, and those bytes are this step's
        dist.barrier()
        tx1, rx1 = veth_bytes()
        cpu1, window = cpu_busy_seconds(), time.perf_counter() - start
        step += 1
        if step <= args.warmup:
            continue
        times.append(elapsed)
        sent.append(tx1 - tx0)
        received.append(rx1 - rx0)
        cpu.append((cpu1 - cpu0) / window)  # the window waited for every rank
        if stats is not None:
            stat_bytes.append(stats.snapshot()["total"]["inter_bytes"])
        if len(times) >= args.steps and (len(times) >= MAX_MEASURED_STEPS
                                         or _slowest(sum(times)) >= args.min_seconds):
            break
    result = {"step_s": statistics.median(times), "veth_tx": statistics.median(sent),
              "veth_rx": statistics.median(received), "cpus_busy": statistics.median(cpu)}
    if stats is not None:
        # comm_stats counts this rank's share; all ranks together move what crosses hosts.
        total = torch.tensor([statistics.mean(stat_bytes)], dtype=torch.float64)
        dist.all_reduce(total)
        result["stats_inter_bytes"] = float(total[0])
    result["step_s"] = _slowest(result["step_s"])  # a rank's own figure may be lower
    return result


def _slowest(seconds: float) -> float:
    """The largest of the ranks' ``seconds``: the same answer on every rank."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value[0])


def cpu_busy_seconds() -> float:
    """CPU-seconds this machine has spent busy so far, all cores and all processes (the kernel's
    network work for the emulated link included): ``/proc/stat`` is not per namespace."""
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, stat.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def veth_bytes() -> tuple[int, int]:
    """(tx, rx) of this namespace's veth end: every inter-host byte, by direction."""
    for dev in DEVS:
        stats = Path(f"/sys/class/net/{dev}/statistics")
        if stats.exists():
            return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())
    return 0, 0


def adamw(model):
    """The optimizer dtrain's Trainer builds (fused AdamW), for every row alike."""
    from dtrain.runtime.train.optim import build_optimizer

    return build_optimizer(model, lr=1e-4)


def worker_train(args: argparse.Namespace) -> None:
    """dtrain, one row after another in one process group (``args.rows``: a JSON list of
    ``{"distribution", "accum", "micro_batch"}``): ``init``, ``shard``, ``accumulate``."""
    import dtrain.runtime as rt
    import torch
    from dtrain.runtime.distributed import gradient_sync

    torch.set_num_threads(1)
    results = []
    for spec in json.loads(args.rows):
        args.accum, args.micro_batch = spec["accum"], spec["micro_batch"]
        ctx = rt.init(distribution=spec["distribution"])
        torch.manual_seed(0)
        model = rt.shard(build_model(args.model), ctx)
        opt = adamw(model)

        sync, sync_steps = gradient_sync.attached(model), []

        def one_step(batches: list, model=model, opt=opt, ctx=ctx, sync=sync,
                     sync_steps=sync_steps) -> None:
            for micro in ctx.accumulate(model, batches):
                micro.scale(lm_loss(model, micro.batch)).backward()
            opt.step()
            opt.zero_grad()
            if sync is not None:
                sync_steps.append(sync.take_timing())

        result = timed_steps(args, model.config.vocab_size, one_step, stats=ctx.comm_stats)
        results.append({**result, "gradient_sync": ctx.plan.gradient_sync})
        if sync is not None:
            # the overlapped sync's own clocks over the measured steps, mean of the ranks
            measured = sync_steps[args.warmup:]
            mine = torch.tensor([statistics.median(t[key] for t in measured)
                                 for key in ("busy_s", "exposed_s")], dtype=torch.float64)
            torch.distributed.all_reduce(mine)
            results[-1]["sync_busy_s"], results[-1]["sync_exposed_s"] = (
                mine / torch.distributed.get_world_size()).tolist()
            sync.close()
    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"rows": results}))
    torch.distributed.destroy_process_group()


def worker_fsdp2(args: argparse.Namespace) -> None:
    """Baseline: raw FSDP2 HSDP on a 2-D mesh, torch's defaults; no dtrain runtime code."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.degree, args.degree),
                            mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = build_model(args.model)
    for module in model.modules():
        if type(module).__name__ in model._no_split_modules:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = adamw(model)

    def one_step(batches: list) -> None:
        for i, batch in enumerate(batches):
            # torch's HSDP accumulation knob: replica all-reduce only on the last micro-batch.
            model.set_requires_all_reduce(i == len(batches) - 1)
            (lm_loss(model, batch) / len(batches)).backward()
        opt.step()
        opt.zero_grad()

    result = timed_steps(args, model.config.vocab_size, one_step)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


def worker_compute(args: argparse.Namespace) -> None:
    """Compute only, on every rank at once (the ranks share this machine's cores as the
    training rows do): the whole model, no communication inside a step. One result per
    ``micro_batch:accum`` setting in ``args.settings``: the slowest rank's median step, and
    ``optimizer_s``, the slowest rank's median optimizer step within it (timed apart, so that
    the planner's FLOP rate comes from forward and backward alone)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = build_model(args.model)
    opt = adamw(model)
    optimizer_s: list[float] = []

    def one_step(batches: list) -> None:
        for batch in batches:
            (lm_loss(model, batch) / len(batches)).backward()
        start = time.perf_counter()
        opt.step()
        opt.zero_grad()
        optimizer_s.append(time.perf_counter() - start)

    out = {}
    for setting in args.settings.split(","):
        args.micro_batch, args.accum = (int(v) for v in setting.split(":"))
        optimizer_s.clear()
        out[setting] = timed_steps(args, model.config.vocab_size, one_step)
        measured = optimizer_s[args.warmup:]  # timed_steps' warm-up steps come first
        out[setting]["optimizer_s"] = _slowest(statistics.median(measured))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()
