"""MiCS vs ZeRO-3 on an emulated 2-host cluster: two network namespaces joined by a slow veth.

Run as root (it creates namespaces, a veth pair and a tc qdisc, and always removes them):

    python benchmarks/mics_emulated_cluster.py                 # link = 1/12 of loopback gloo
    python benchmarks/mics_emulated_cluster.py --ratio 24

It measures the loopback gloo bandwidth, limits the veth with ``tc tbf`` to bandwidth/ratio,
then starts 2 hosts x 2 workers for sharding degree 1, 2, 4 (flat) and 4 (hierarchical), with
gradient accumulation 1 and 4, and prints median step time, tokens/s, inter-host bytes per
step (veth counters and ``ctx.comm_stats``) and the compute-only step time (one process, no
communication). Workers start with torch's elastic launcher (``torch.distributed.run``) in each
namespace, not the node agent: the agent needs a full container-contract tree per host, which
this benchmark does not otherwise need.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOSTS = ("dtrain_mics_h0", "dtrain_mics_h1")
DEVS = ("dtmics0", "dtmics1")
ADDRS = ("10.213.77.1", "10.213.77.2")
PER_HOST = 2
CONFIGS = [(1, False), (2, False), (4, False), (4, True)]  # (sharding_degree, hierarchical)


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def create_cluster() -> None:
    for ns in HOSTS:
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh(
        "ip",
        "link",
        "add",
        DEVS[0],
        "netns",
        HOSTS[0],
        "type",
        "veth",
        "peer",
        "name",
        DEVS[1],
        "netns",
        HOSTS[1],
    )
    for ns, dev, addr in zip(HOSTS, DEVS, ADDRS):
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")


def destroy_cluster() -> None:
    for ns in HOSTS:  # deleting a namespace deletes its veth end, the peer and the qdisc
        sh("ip", "netns", "del", ns, check=False)


def limit_link(rate_bytes_per_s: float) -> None:
    rate_bits = int(rate_bytes_per_s * 8)
    burst = max(int(rate_bytes_per_s / 100), 65536)
    for ns, dev in zip(HOSTS, DEVS):
        sh(
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "replace",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            f"{rate_bits}bit",
            "burst",
            str(burst),
            "latency",
            "200ms",
        )


def run_hosts(args: argparse.Namespace, worker_args: list[str], port: int) -> None:
    """Start torch elastic on both hosts (2 workers each) and wait; kill both on failure."""
    procs = []
    try:
        for node, (ns, dev) in enumerate(zip(HOSTS, DEVS)):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": dev, "OMP_NUM_THREADS": "1"}
            cmd = [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                str(PER_HOST),
                "--node-rank",
                str(node),
                "--master-addr",
                ADDRS[0],
                "--master-port",
                str(port),
                __file__,
                "--worker",
                *worker_args,
            ]
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
                )
            )
        for proc in procs:
            _, err = proc.communicate(timeout=args.timeout)
            if proc.returncode:
                raise RuntimeError(f"workers failed:\n{err[-3000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def measure_loopback_bandwidth() -> float:
    """Bytes/s one gloo rank sends to another over loopback (all-gather of 64 MiB)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bw.json"
        sh(
            "ip",
            "netns",
            "exec",
            HOSTS[0],
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            "29601",
            __file__,
            "--worker-bandwidth",
            str(out),
        )
        return json.loads(out.read_text())["bytes_per_s"]


def worker_bandwidth(out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    shard = torch.ones(16 * 2**20)  # 64 MiB per rank
    full = torch.empty(2 * shard.numel())
    dist.all_gather_into_tensor(full, shard)
    start = time.perf_counter()
    for _ in range(5):
        dist.all_gather_into_tensor(full, shard)
    elapsed = (time.perf_counter() - start) / 5
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"bytes_per_s": shard.numel() * 4 / elapsed}))
    dist.destroy_process_group()


def build_model(name: str):
    from dtrain.runtime.models import from_preset

    return from_preset(name, attention="sdpa")


def worker_train(args: argparse.Namespace) -> None:
    import dtrain.runtime as rt
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    ctx = rt.init(
        distribution={
            "sharding_degree": args.degree,
            "gradient_accumulation_steps": args.accum,
            "hierarchical_allgather": args.hier == "on",
        }
    )
    torch.manual_seed(0)
    model = rt.shard(build_model(args.model), ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.config.vocab_size
    times, stat_bytes, veth = [], [], []
    for step in range(args.warmup + args.steps):
        batches = [
            torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1)) for _ in range(args.accum)
        ]
        ctx.comm_stats.reset()
        tx0 = _veth_bytes()
        start = time.perf_counter()
        for micro in ctx.accumulate(model, batches):
            logits = model(micro.batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), micro.batch[:, 1:].flatten())
            micro.scale(loss).backward()
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            times.append(elapsed)
            stat_bytes.append(ctx.comm_stats.snapshot()["total"]["inter_bytes"])
            veth.append(_veth_bytes() - tx0)
    # comm_stats counts this rank's share; the host's ranks together move what crosses hosts.
    totals = torch.tensor([sum(stat_bytes) / len(stat_bytes)], dtype=torch.float64)
    torch.distributed.all_reduce(totals)
    if ctx.is_main:
        Path(args.out).write_text(
            json.dumps(
                {
                    "step_s": statistics.median(times),
                    "veth_bytes": statistics.median(veth),
                    "stats_inter_bytes": float(totals[0]),
                }
            )
        )
    torch.distributed.destroy_process_group()


def _veth_bytes() -> int:
    stats = Path(f"/sys/class/net/{DEVS[0]}/statistics")
    if not stats.exists():
        return 0
    return int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text())


def compute_only_step(args: argparse.Namespace, accum: int) -> float:
    """One process, no communication: the same per-rank work as a distributed step."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    model = build_model(args.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.config.vocab_size
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        for _ in range(accum):
            batch = torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1))
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()) / accum
            loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_benchmark(args: argparse.Namespace) -> None:
    loopback = measure_loopback_bandwidth()
    limit_link(loopback / args.ratio)
    print(
        f"loopback gloo: {loopback / 1e6:.0f} MB/s; veth limited to "
        f"{loopback / args.ratio / 1e6:.1f} MB/s (1/{args.ratio}); model {args.model}, "
        f"micro-batch {args.micro_batch}x{args.seq_len} tokens per rank, 2 hosts x 2 workers"
    )
    header = (
        f"{'degree':>6} {'all-gather':>12} {'accum':>5} {'step s':>8} {'tokens/s':>9} "
        f"{'veth MB/step':>12} {'stats MB/step':>13} {'compute s':>9}"
    )
    print(header)
    results = {}
    port = 29611
    for accum in args.accum_steps:
        compute = compute_only_step(args, accum)
        for degree, hier in CONFIGS:
            if degree not in args.degrees:
                continue
            port += 1
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "result.json"
                os.chmod(tmp, 0o777)
                worker_args = [
                    "--degree",
                    str(degree),
                    "--accum",
                    str(accum),
                    "--hier",
                    "on" if hier else "off",
                    "--out",
                    str(out),
                    *_shared_args(args),
                ]
                run_hosts(args, worker_args, port)
                res = json.loads(out.read_text())
            tokens = 2 * PER_HOST * accum * args.micro_batch * args.seq_len / res["step_s"]
            results[(degree, hier, accum)] = tokens
            kind = "hierarchical" if hier else "flat"
            print(
                f"{degree:>6} {kind:>12} {accum:>5} {res['step_s']:>8.2f} {tokens:>9.0f} "
                f"{res['veth_bytes'] / 1e6:>12.1f} {res['stats_inter_bytes'] / 1e6:>13.1f} "
                f"{compute:>9.2f}",
                flush=True,
            )
    for accum in args.accum_steps:
        if not all((d, h, accum) in results for d, h in CONFIGS[1:]):
            continue
        mics, zero3 = results[(2, False, accum)], results[(4, False, accum)]
        best3 = max(zero3, results[(4, True, accum)])
        print(
            f"accum {accum}: MiCS (degree 2) / ZeRO-3 flat = {mics / zero3:.2f}x, "
            f"/ best ZeRO-3 = {mics / best3:.2f}x"
        )


def _shared_args(args: argparse.Namespace) -> list[str]:
    return [
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--micro-batch",
        str(args.micro_batch),
        "--seq-len",
        str(args.seq_len),
    ]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ratio", type=float, default=12.0, help="loopback bandwidth / link bandwidth")
    p.add_argument("--model", default="gpt-neox-30m", help="a preset from dtrain.presets")
    p.add_argument("--steps", type=int, default=4, help="measured optimizer steps per config")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per micro-step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--accum-steps", type=int, nargs="+", default=[1, 4])
    p.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-bandwidth", help=argparse.SUPPRESS)
    p.add_argument("--degree", type=int, help=argparse.SUPPRESS)
    p.add_argument("--accum", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--hier", default="off", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    args = parse_args()
    if args.worker_bandwidth:
        return worker_bandwidth(args.worker_bandwidth)
    if args.worker:
        return worker_train(args)
    if os.geteuid() != 0:
        sys.exit("run as root: the benchmark creates network namespaces and a tc qdisc")
    destroy_cluster()  # leftovers of a run killed with SIGKILL
    # SIGTERM (timeout, kill) must also reach the finally below.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        create_cluster()
        run_benchmark(args)
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        sys.exit(130)
    finally:
        destroy_cluster()


if __name__ == "__main__":
    main()
