"""MiCS vs ZeRO-3 on an emulated 2-host cluster: two network namespaces joined by a slow veth.

Run as root (it creates two network namespaces, a veth pair and tc qdiscs, and removes them on
exit, on an exception, on SIGINT/SIGTERM/SIGHUP; ``--cleanup`` removes what a SIGKILLed run left):

    python benchmarks/mics_emulated_cluster.py                 # link = 1/12 of loopback gloo
    python benchmarks/mics_emulated_cluster.py --ratio 24      # like 100 Gbps EFA vs NVSwitch
    python benchmarks/mics_emulated_cluster.py --pipeline      # and a pp 2 row across the hosts
    python benchmarks/mics_emulated_cluster.py --cleanup

It measures the loopback gloo bandwidth, limits each direction of the veth with ``tc tbf`` to
bandwidth/ratio, probes the link with raw gloo (latency; all-gather vs all-reduce bandwidth, 2
ranks), then starts 2 hosts x 2 workers through the node agent (``python -m dtrain.runtime
--root HOST_DIR``, one per namespace, each reading its own container contract) for: dtrain at
sharding degree 1, 2 (MiCS), 4 (ZeRO-3, flat and hierarchical all-gather), and a baseline of raw
FSDP2 hybrid sharding (plain ``fully_shard`` on a 2-D ``init_device_mesh``, torch's defaults) on
the MiCS mesh; each with gradient accumulation 1 and 4. With ``--pipeline``, a row of pipeline
parallelism across the hosts (a stage per host, sharded over its two workers; ``_pipeline_rows.py``)
on the same global batch. Every row trains the same model on the same data for the same steps. It prints one table (median step time, tokens/s, inter-host bytes
per step from the veth counters and from ``ctx.comm_stats``, compute-only step time, and the
planner's predicted step time), the measured MiCS/ZeRO-3 ratios next to the planner's
(``dtrain.planning.costmodel`` calibrated on this machine), and the planner's ratios for 16 and 64
p4d.24xlarge hosts.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOSTS = ("dtrain_mics_h0", "dtrain_mics_h1")  # network namespaces; also the cleanup key
DEVS = ("dtmics0", "dtmics1")
ADDRS = ("10.213.77.1", "10.213.77.2")  # only inside the namespaces above
PER_HOST = 2
TMP_PREFIX = "dtrain_mics_"
# (label, implementation, sharding_degree, hierarchical all-gather)
ROWS = [
    ("DDP", "dtrain", 1, False),
    ("MiCS", "dtrain", 2, False),
    ("HSDP raw", "fsdp2", 2, False),
    ("ZeRO-3", "dtrain", 4, False),
    ("ZeRO-3", "dtrain", 4, True),
]
P4D_HOSTS = (16, 64)


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


# ---------------------------------------------------------------- the emulated cluster


def create_cluster() -> None:
    for ns in HOSTS:
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "link", "add", DEVS[0], "netns", HOSTS[0], "type", "veth",
       "peer", "name", DEVS[1], "netns", HOSTS[1])
    for ns, dev, addr in zip(HOSTS, DEVS, ADDRS):
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")


def limit_link(rate_bytes_per_s: float) -> None:
    """tbf on both veth ends: each shapes its egress, so each direction gets ``rate``."""
    rate_bits = int(rate_bytes_per_s * 8)
    burst = max(int(rate_bytes_per_s / 100), 65536)
    for ns, dev in zip(HOSTS, DEVS):
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
           "rate", f"{rate_bits}bit", "burst", str(burst), "latency", "200ms")


def destroy_cluster() -> None:
    """Kill what runs in our namespaces, delete them (veth and qdiscs go too), drop temp dirs."""
    existing = sh("ip", "netns", "list", check=False).stdout.split()
    for ns in HOSTS:
        if ns not in existing:
            continue
        for _ in range(3):  # bounded: agents may still be reaping workers
            pids = [int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        sh("ip", "netns", "del", ns, check=False)
    for path in glob.glob(os.path.join(tempfile.gettempdir(), TMP_PREFIX + "*")):
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- launching through the agent


def write_contracts(job_dir: Path, name: str, *, hosts: list[str], devs: list[str],
                    hyperparameters: dict, distribution: dict | None = None,
                    per_host: int = PER_HOST) -> list[str]:
    """One container-contract tree per host (as the local launcher writes them)."""
    from dtrain.core import contract

    settings = contract.Settings(
        entry_point=Path(__file__).name, job_name=name, instance_type="local",
        source_dir=str(Path(__file__).resolve().parent), distribution=distribution or {},
        processes_per_host=per_host)
    roots = []
    for host, dev in zip(hosts, devs):
        root = job_dir / name / host
        contract.write_host_contract(str(root), current_host=host, hosts=hosts,
                                     settings=settings, hyperparameters=hyperparameters,
                                     network_interface_name=dev)
        roots.append(str(root))
    return roots


def run_agents(roots: list[str], *, namespaces: tuple[str, ...], devs: list[str], port: int,
               timeout: float) -> None:
    """``python -m dtrain.runtime --root ROOT`` in each namespace; wait; stop all on failure."""
    procs = []
    try:
        for root, ns, dev in zip(roots, namespaces, devs):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": dev, "OMP_NUM_THREADS": "1",
                   "DTRAIN_MASTER_PORT": str(port), "DTRAIN_STOP_GRACE_PERIOD": "5"}
            log = open(os.path.join(root, "agent.log"), "w")  # noqa: SIM115 -- closed by exit
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "dtrain.runtime",
                 "--root", root], env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))
        deadline = time.monotonic() + timeout
        for proc, root in zip(procs, roots):
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode:
                failure = Path(root, "output", "failure")
                why = (failure if failure.exists() else Path(root, "agent.log")).read_text()
                raise RuntimeError(
                    f"node agent for {root} exited {proc.returncode}:\n{why[-3000:]}")
    finally:
        stop_processes(procs)


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each agent's session (it stops its workers), then SIGKILL what is left."""
    alive = [p for p in procs if p.poll() is None]
    for proc in alive:
        _signal_group(proc, signal.SIGTERM)
    for proc in alive:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


class Launcher:
    """Runs one benchmark role on the emulated hosts and returns rank 0's JSON result."""

    def __init__(self, args: argparse.Namespace, job_dir: Path) -> None:
        self.args, self.job_dir, self.port, self.count = args, job_dir, 29611, 0

    def run(self, role: str, *, hosts: int = 2, per_host: int = PER_HOST,
            distribution: dict | None = None, **params) -> dict:
        self.count += 1
        self.port += 1
        name = f"{self.count:02d}-{role}"
        out = self.job_dir / f"{name}.json"
        loopback = hosts == 1 and role == "loopback"
        addrs = [ADDRS[0]] if hosts == 1 else list(ADDRS)
        devs = ["lo"] if loopback else list(DEVS[:hosts])
        hps = {"role": role, "out": str(out), **params}
        roots = write_contracts(self.job_dir, name, hosts=addrs, devs=devs, hyperparameters=hps,
                                distribution=distribution, per_host=per_host)
        run_agents(roots, namespaces=HOSTS[:hosts], devs=devs, port=self.port,
                   timeout=self.args.timeout)
        return json.loads(out.read_text())


# ---------------------------------------------------------------- workers (started by the agent)


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


def timed_steps(args: argparse.Namespace, model, one_step, *, stats=None) -> dict:
    """Warm-up steps of one micro-batch, then measured optimizer steps; returns the medians.

    Every row (and the compute-only run) uses the same steps: a full window per warm-up step
    would only add link-bound minutes to the slowest rows without changing what is measured.
    """
    import torch
    import torch.distributed as dist

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab, rank = model.config.vocab_size, dist.get_rank()
    times, veth, stat_bytes = [], [], []
    for step in range(args.warmup + args.steps):
        batches = make_batches(args, vocab, rank=rank, step=step)
        if step < args.warmup:
            batches = batches[:1]  # warm-up: connections, allocator, lazy init; not timed
        dist.barrier()
        if stats is not None:
            stats.reset()
        tx0 = _veth_bytes()
        start = time.perf_counter()
        one_step(batches)
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            times.append(elapsed)
            veth.append(_veth_bytes() - tx0)
            if stats is not None:
                stat_bytes.append(stats.snapshot()["total"]["inter_bytes"])
    result = {"step_s": statistics.median(times), "veth_bytes": statistics.median(veth)}
    if stats is not None:
        # comm_stats counts this rank's share; all ranks together move what crosses hosts.
        total = torch.tensor([statistics.mean(stat_bytes)], dtype=torch.float64)
        dist.all_reduce(total)
        result["stats_inter_bytes"] = float(total[0])
    return result


def worker_train(args: argparse.Namespace) -> None:
    """dtrain: ``init`` reads DTRAIN_DISTRIBUTION from the contract, ``shard``, ``accumulate``."""
    import dtrain.runtime as rt
    import torch

    torch.set_num_threads(1)
    ctx = rt.init()
    torch.manual_seed(0)
    model = rt.shard(build_model(args.model), ctx)

    def one_step(batches: list) -> None:
        for micro in ctx.accumulate(model, batches):
            micro.scale(lm_loss(model, micro.batch)).backward()

    result = timed_steps(args, model, one_step, stats=ctx.comm_stats)
    if ctx.is_main:
        Path(args.out).write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def worker_pipeline(args: argparse.Namespace) -> None:
    """dtrain's pipeline stages across the hosts (``_pipeline_rows.py``)."""
    from _pipeline_rows import train_pipelined

    train_pipelined(args, build_model=build_model, make_batches=make_batches,
                    timed_steps=timed_steps)


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

    def one_step(batches: list) -> None:
        for i, batch in enumerate(batches):
            # torch's HSDP accumulation knob: replica all-reduce only on the last micro-batch.
            model.set_requires_all_reduce(i == len(batches) - 1)
            (lm_loss(model, batch) / len(batches)).backward()

    result = timed_steps(args, model, one_step)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _veth_bytes() -> int:
    """tx + rx of this namespace's veth end: every inter-host byte, both directions."""
    for dev in DEVS:
        stats = Path(f"/sys/class/net/{dev}/statistics")
        if stats.exists():
            return int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text())
    return 0


def compute_only_step(args: argparse.Namespace) -> float:
    """One process, no communication: the same per-rank work as a distributed step."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(args.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for step in range(args.warmup + args.steps):
        batches = make_batches(args, model.config.vocab_size, rank=0, step=step)
        if step < args.warmup:
            batches = batches[:1]
        start = time.perf_counter()
        for batch in batches:
            (lm_loss(model, batch) / len(batches)).backward()
        opt.step()
        opt.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---------------------------------------------------------------- the planner's predictions


def calibrated_cluster(args, work, *, loopback: float, link: float, latency: float,
                       compute_s: float):
    """This machine as the cost model sees it; FLOP rate from the compute-only step."""
    from dtrain.planning import costmodel

    unit = costmodel.Cluster(num_nodes=2, gpus_per_node=PER_HOST, tflops_per_gpu=1.0,
                             intra_gbytes_per_s=1.0, inter_gbits_per_s=1.0, efficiency=1.0)
    tflops = costmodel.compute_seconds(work, unit) / compute_s
    return costmodel.Cluster(num_nodes=2, gpus_per_node=PER_HOST, tflops_per_gpu=tflops,
                             intra_gbytes_per_s=loopback / 1e9,
                             inter_gbits_per_s=link * 8 / 1e9, latency_s=latency,
                             efficiency=1.0)


def workload(args: argparse.Namespace, *, compute_bytes: int):
    from dtrain.planning import costmodel

    model = build_model(args.model)
    return costmodel.Workload(
        num_parameters=sum(p.numel() for p in model.parameters()),
        num_layers=model.config.num_layers, hidden_size=model.config.hidden_size,
        seq_len=args.seq_len,
        micro_batch_size=args.micro_batch, compute_bytes=compute_bytes)


def predicted_ratio(work, cluster, *, mics: int, zero3: int, accum: int) -> float:
    from dtrain.planning.costmodel import estimate_step

    a = estimate_step(work, cluster, sharding_degree=mics, accumulation=accum)
    b = estimate_step(work, cluster, sharding_degree=zero3, accumulation=accum)
    return b.step_s / a.step_s


# ---------------------------------------------------------------- the benchmark


def run_benchmark(args: argparse.Namespace, job_dir: Path) -> None:
    from dtrain.core import instances
    from dtrain.planning import planner
    from dtrain.planning.costmodel import estimate_step

    started = time.monotonic()
    launch = Launcher(args, job_dir)
    loopback = launch.run("loopback", hosts=1)["bytes_per_s"]
    link = loopback / args.ratio
    limit_link(link)
    probe = launch.run("link", per_host=1)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, load average {_load()} at start; "
          f"torch {_torch_version()}; {os.cpu_count()} CPUs")
    print(f"# model {args.model}, fp32, micro-batch {args.micro_batch} x {args.seq_len} tokens "
          f"per rank, accumulation {'/'.join(map(str, args.accum_steps))}, "
          f"{args.warmup} warm-up (1 micro-batch) + {args.steps} measured steps (median) per row; "
          f"2 hosts x {PER_HOST} workers via the node agent")
    print(f"# loopback gloo {loopback / 1e6:.0f} MB/s; veth tbf {link / 1e6:.1f} MB/s each "
          f"direction (1/{args.ratio:g}); raw gloo over it, 2 ranks, MB/s per direction: "
          f"all-gather {probe['all_gather_Bps'] / 1e6:.1f}, all-reduce "
          f"{probe['all_reduce_Bps'] / 1e6:.1f}, reduce-scatter "
          f"{probe['reduce_scatter_Bps'] / 1e6:.1f}; latency {probe['latency_s'] * 1e6:.0f} us")
    work = workload(args, compute_bytes=4)
    print(f"{'row':<9} {'degree':>6} {'all-gather':>12} {'accum':>5} {'step s':>8} "
          f"{'tokens/s':>9} {'veth MB/step':>12} {'stats MB/step':>13} {'compute s':>9} "
          f"{'model s':>8}", flush=True)
    measured, cluster = {}, None
    for accum in args.accum_steps:
        args.accum = accum
        compute = compute_only_step(args)
        if cluster is None or accum == 1:
            per_micro = compute / accum
            cluster = calibrated_cluster(args, work, loopback=loopback, link=link,
                                         latency=probe["latency_s"], compute_s=per_micro)
        for label, impl, degree, hier in ROWS:
            if degree not in args.degrees:
                continue
            params = {"model": args.model, "steps": args.steps, "warmup": args.warmup,
                      "micro-batch": args.micro_batch, "seq-len": args.seq_len,
                      "accum": accum, "degree": degree}
            dist_cfg = {"sharding_degree": degree, "gradient_accumulation_steps": accum,
                        "hierarchical_allgather": hier, "mixed_precision": "fp32",
                        "attention": "sdpa"}
            res = launch.run(impl, distribution=dist_cfg if impl == "dtrain" else None,
                             **params)
            tokens = 2 * PER_HOST * accum * args.micro_batch * args.seq_len / res["step_s"]
            measured[(label, hier, accum)] = tokens
            model_s = estimate_step(work, cluster, sharding_degree=degree, accumulation=accum,
                                    hierarchical=hier).step_s
            stats = res.get("stats_inter_bytes")
            print(f"{label:<9} {degree:>6} {'hierarchical' if hier else 'flat':>12} {accum:>5} "
                  f"{res['step_s']:>8.2f} {tokens:>9.1f} {res['veth_bytes'] / 1e6:>12.1f} "
                  f"{'-' if stats is None else f'{stats / 1e6:.1f}':>13} {compute:>9.2f} "
                  f"{model_s:>8.2f}", flush=True)
            if label == "ZeRO-3" and not hier:
                measured[("zero3_step", accum)] = (res["step_s"], compute)
        if args.pipeline:
            run_pipeline_row(args, launch, measured, work, cluster, accum=accum, compute=compute)
    report_ratios(args, measured, work, cluster, instances, planner)
    print(f"# {time.monotonic() - started:.0f} s in all; load average {_load()} at the end")


def run_pipeline_row(args, launch, measured, work, cluster, *, accum: int,
                     compute: float) -> None:
    from _pipeline_rows import distribution, predicted_step

    params = {"model": args.model, "steps": args.steps, "warmup": args.warmup,
              "micro-batch": args.micro_batch, "seq-len": args.seq_len, "accum": accum}
    res = launch.run("pipeline", distribution=distribution(accum), **params)
    tokens = 2 * PER_HOST * accum * args.micro_batch * args.seq_len / res["step_s"]
    measured[("PP 2", False, accum)] = tokens
    model_s = predicted_step(args, work, cluster, accum=accum)
    measured[("PP 2 model", accum)] = model_s
    print(f"{'PP 2':<9} {2:>6} {'pipeline':>12} {accum:>5} {res['step_s']:>8.2f} {tokens:>9.1f} "
          f"{res['veth_bytes'] / 1e6:>12.1f} {res['stats_inter_bytes'] / 1e6:>13.1f} "
          f"{compute:>9.2f} {model_s:>8.2f}", flush=True)


def report_ratios(args, measured, work, cluster, instances, planner) -> None:
    for accum in args.accum_steps:
        target = 2.0 if accum == 1 else 3.5
        mics, zero3 = measured.get(("MiCS", False, accum)), measured.get(("ZeRO-3", False, accum))
        raw = measured.get(("HSDP raw", False, accum))
        if mics and zero3:
            pred = predicted_ratio(work, cluster, mics=2, zero3=2 * PER_HOST, accum=accum)
            print(f"accum {accum}: MiCS/ZeRO-3 tokens/s = {mics / zero3:.2f}x measured, "
                  f"{pred:.2f}x planner (target >= {target}x: "
                  f"{'met' if mics / zero3 >= target else 'NOT met'})")
        if mics and raw:
            print(f"accum {accum}: dtrain MiCS / raw FSDP2 HSDP tokens/s = {mics / raw:.3f} "
                  f"(target >= 0.95: {'met' if mics / raw >= 0.95 else 'NOT met'})")
        pp = measured.get(("PP 2", False, accum))
        if pp and mics and zero3:  # same global batch: the ratio of step times
            from dtrain.planning.costmodel import estimate_step

            pp_model = measured[("PP 2 model", accum)]
            steps = {d: estimate_step(work, cluster, sharding_degree=d, accumulation=accum).step_s
                     for d in (2, 2 * PER_HOST)}
            print(f"accum {accum}: PP 2 / MiCS tokens/s = {pp / mics:.2f}x measured, "
                  f"{steps[2] / pp_model:.2f}x planner; PP 2 / ZeRO-3 = {pp / zero3:.2f}x "
                  f"measured, {steps[2 * PER_HOST] / pp_model:.2f}x planner")
        if ("zero3_step", accum) in measured:
            step, compute = measured[("zero3_step", accum)]
            print(f"accum {accum}: ZeRO-3 step / compute-only step = {step / compute:.1f}x "
                  f"(communication-bound needs >= 3x)")
    p4d = instances.get("p4d.24xlarge")
    bf16 = workload(args, compute_bytes=2)
    for nodes in P4D_HOSTS:
        c = planner.cluster_for(p4d, nodes=nodes, processes_per_node=p4d.gpus)
        ratios = ", ".join(
            f"accum {a}: "
            f"{predicted_ratio(bf16, c, mics=p4d.gpus, zero3=c.world_size, accum=a):.2f}x"
            for a in args.accum_steps)
        print(f"planner, {nodes} x p4d.24xlarge (bf16, same model and tokens per GPU): "
              f"MiCS (degree {p4d.gpus}) / ZeRO-3 (degree {c.world_size}) = {ratios}")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _torch_version() -> str:
    import torch

    return torch.__version__


# ---------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ratio", type=float, default=12.0, help="loopback bandwidth / link bandwidth")
    p.add_argument("--model", default="gpt-neox-30m", help="a preset from dtrain.core.presets")
    p.add_argument("--steps", type=int, default=1, help="measured optimizer steps per row")
    p.add_argument("--warmup", type=int, default=1,
                   help="unmeasured one-micro-batch steps first")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per micro-step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--accum-steps", type=int, nargs="+", default=[1, 4])
    p.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--pipeline", action="store_true",
                   help="add a row of 2 pipeline stages across the hosts (same global batch)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per row")
    p.add_argument("--cleanup", action="store_true",
                   help="only remove namespaces, processes and temp dirs a killed run left")
    # Set by the benchmark in the contract's hyperparameters for the workers the agent starts.
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--degree", type=int, help=argparse.SUPPRESS)
    p.add_argument("--accum", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


WORKERS = {"loopback": worker_loopback, "link": worker_link, "dtrain": worker_train,
           "fsdp2": worker_fsdp2, "pipeline": worker_pipeline}


def main() -> None:
    args = parse_args()
    if args.role:
        return WORKERS[args.role](args)
    if os.geteuid() != 0:
        sys.exit("run as root: the benchmark creates network namespaces and tc qdiscs")
    for sig in (signal.SIGTERM, signal.SIGHUP):  # must also reach the finally below
        signal.signal(sig, _interrupt)
    destroy_cluster()  # leftovers of a run killed with SIGKILL
    if args.cleanup:
        return None
    job_dir = Path(tempfile.mkdtemp(prefix=TMP_PREFIX))
    os.chmod(job_dir, 0o755)
    try:
        create_cluster()
        run_benchmark(args, job_dir)
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let cleanup finish
        destroy_cluster()
    return None


if __name__ == "__main__":
    main()
