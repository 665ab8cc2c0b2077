"""dtrain's MiCS beside DeepSpeed's ZeRO-3 and MiCS on an emulated 2-host cluster.

Run as root (it creates two network namespaces joined by a veth pair whose bandwidth ``tc tbf``
limits, and removes them on exit, on an exception, on SIGINT/SIGTERM/SIGHUP; ``--cleanup``
removes what a SIGKILLed run left):

    python benchmarks/mics_emulated_cluster.py                 # default rows, ~8 min at ratio 12
    python benchmarks/mics_emulated_cluster.py --full          # every row (about 25 min)
    python benchmarks/mics_emulated_cluster.py --ratio 24      # like 100 Gbps EFA vs NVSwitch
    python benchmarks/mics_emulated_cluster.py --overlap-micro-batch 64   # the overlap rows' size
    python benchmarks/mics_emulated_cluster.py --cleanup

It measures the loopback gloo bandwidth, limits each direction of the veth to bandwidth/ratio,
probes the link with raw gloo, times compute alone (all ranks at once, no communication; its
optimizer step apart, which gives the planner a FLOP rate per micro-batch size), then
starts 2 hosts × 2 workers through the node agent (``python -m dtrain.runtime --root HOST_DIR``,
one per namespace) for each row of :data:`ROWS`. Every row trains the same model on the same
tokens, with the optimizer a dtrain job builds, and measures at least ``--steps`` steps and
``--min-seconds`` of them (their median). Each prints its step, tokens/s, the bytes that crossed
the slow link, the link-time floor (those bytes ÷ the link's measured bandwidth per direction),
efficiency = max(floor, compute) ÷ step, how many of the machine's cores were busy during the
step (all processes, the kernel's work for the emulated link included), and the planner's
predicted step (``dtrain.planning.costmodel`` calibrated on this machine) with its ratio to the
reference row beside the measured one. For the overlapped sync's rows it also prints the sync's
own clocks: how long the replicas' all-reduce ran in a step and how much of it came after
backward had ended (exposed). DeepSpeed rows need the optional ``bench`` extra (see
``_deepspeed_rows.py``: version, adaptations, parity check). The ``PP 2`` rows run dtrain's
pipeline parallelism across the hosts, a stage per host (``_pipeline_rows.py``), on the same
global batch.

Adding a row: append a :class:`Row`; a dtrain setting the row needs goes into
:func:`dtrain_distribution`, its prediction into :func:`predict`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from _cluster_workers import (
    build_model,
    worker_compute,
    worker_fsdp2,
    worker_link,
    worker_loopback,
    worker_train,
)
from _emulated_cluster import PER_HOST, TMP_PREFIX, Launcher, create_cluster, destroy_cluster
from _emulated_cluster import limit_link as set_link_rate

NUM_HOSTS = 2
P4D_HOSTS = (16, 64)
OVERLAP_MICRO_BATCH = 32  # compute above the link time at ratio 12: the overlap target's setting


@dataclass(frozen=True)
class Row:
    """One configuration: who runs it, how it shards, and whether the default run includes it."""

    label: str
    impl: str  # "dtrain", "pipeline" (dtrain, 2 stages), "fsdp2" (raw FSDP2 HSDP), "deepspeed"
    degree: int  # partition-group size (DeepSpeed: mics_shard_size; 4 = ZeRO-3)
    accum: int = 1
    sync: str = "auto"  # dtrain's distribution.gradient_sync; the others sync as FSDP2 does
    hierarchical: bool = False  # dtrain: hierarchical_allgather; DeepSpeed: hierarchical gather
    micro_batch: int | None = None  # None: --micro-batch
    overlap: bool = False  # at --overlap-micro-batch instead: the overlap target's setting
    default: bool = True  # in the coffee-break run; --full runs every row

    @property
    def key(self) -> tuple:
        return (self.label, self.accum, self.micro_batch)


ROWS = [
    Row("dtrain MiCS", "dtrain", 2),
    Row("dtrain MiCS fsdp", "dtrain", 2, sync="fsdp"),
    Row("dtrain ZeRO-3", "dtrain", 4),
    Row("DS ZeRO-3", "deepspeed", 4),
    Row("DS MiCS", "deepspeed", 2),
    Row("dtrain MiCS", "dtrain", 2, accum=4),
    Row("DS MiCS", "deepspeed", 2, accum=4),
    Row("dtrain PP 2", "pipeline", 2),
    Row("dtrain MiCS", "dtrain", 2, overlap=True),
    Row("dtrain MiCS fsdp", "dtrain", 2, sync="fsdp", overlap=True),
    # --full only
    Row("dtrain DDP", "dtrain", 1, default=False),
    Row("dtrain DDP fsdp", "dtrain", 1, sync="fsdp", default=False),
    Row("HSDP raw", "fsdp2", 2, default=False),
    Row("dtrain ZeRO-3 hier", "dtrain", 4, hierarchical=True, default=False),
    Row("DS MiCS 4", "deepspeed", 4, default=False),  # one group over both hosts
    Row("DS MiCS 4 hier", "deepspeed", 4, hierarchical=True, default=False),
    Row("dtrain DDP", "dtrain", 1, accum=4, default=False),
    Row("dtrain MiCS fsdp", "dtrain", 2, accum=4, sync="fsdp", default=False),
    Row("HSDP raw", "fsdp2", 2, accum=4, default=False),
    Row("dtrain ZeRO-3", "dtrain", 4, accum=4, default=False),
    Row("DS ZeRO-3", "deepspeed", 4, accum=4, default=False),
    Row("dtrain PP 2", "pipeline", 2, accum=4, default=False),
]
REFERENCE = "dtrain MiCS"  # ratios are to this row at the same accumulation and micro-batch


def dtrain_distribution(row: Row) -> dict:
    return {"sharding_degree": row.degree, "gradient_accumulation_steps": row.accum,
            "gradient_sync": row.sync, "hierarchical_allgather": row.hierarchical,
            "mixed_precision": "fp32", "attention": "sdpa"}


# ---------------------------------------------------------------- the planner's predictions


def workload(args: argparse.Namespace, *, micro_batch: int, compute_bytes: int = 4):
    from dtrain.planning import costmodel

    model = build_model(args.model)
    return costmodel.Workload(
        num_parameters=sum(p.numel() for p in model.parameters()),
        num_layers=model.config.num_layers, hidden_size=model.config.hidden_size,
        seq_len=args.seq_len, micro_batch_size=micro_batch, compute_bytes=compute_bytes)


def calibrated_cluster(args, *, loopback: float, link: float, latency: float,
                       micro_batch: int, micro_compute_s: float):
    """This machine as the cost model sees it at ``micro_batch`` sequences per micro-step: gloo,
    the measured bandwidths and latency, and the FLOP rate of the compute-only steps at that
    size (one micro-batch's forward and backward: the accumulation-1 step less its optimizer
    step). A rate per size, since on CPU a small micro-batch runs well below a large one's rate;
    docs/benchmarks.md has the measurements, and what the rate from the difference of the
    accumulation-4 and accumulation-1 steps that this replaced did to the planner."""
    from dtrain.planning import costmodel

    unit = costmodel.Cluster(num_nodes=NUM_HOSTS, gpus_per_node=PER_HOST, tflops_per_gpu=1.0,
                             intra_gbytes_per_s=1.0, inter_gbits_per_s=1.0, efficiency=1.0)
    work = workload(args, micro_batch=micro_batch)
    tflops = costmodel.compute_seconds(work, unit) / micro_compute_s
    return costmodel.Cluster(num_nodes=NUM_HOSTS, gpus_per_node=PER_HOST, tflops_per_gpu=tflops,
                             intra_gbytes_per_s=loopback / 1e9,
                             inter_gbits_per_s=link * 8 / 1e9, latency_s=latency,
                             efficiency=1.0, backend="gloo")


def predict(args, row: Row, cluster) -> float:
    """The planner's step for ``row``; dtrain rows as the parallelism plan resolves them."""
    from dtrain.core.parallelism import build_parallelism_plan
    from dtrain.planning.costmodel import estimate_step

    work = workload(args, micro_batch=row.micro_batch)
    if row.impl == "pipeline":
        from _pipeline_rows import predicted_step

        return predicted_step(args, work, cluster, accum=row.accum)
    sync, hier = "fsdp", row.hierarchical
    if row.impl == "dtrain":
        plan = build_parallelism_plan(dtrain_distribution(row), world_size=NUM_HOSTS * PER_HOST,
                                      devices_per_node=PER_HOST)
        sync, hier = plan.gradient_sync, plan.hierarchical_allgather
    # DeepSpeed reduce-scatters with a ring's bytes (measured: 607 MB a ZeRO-3 step, not 806)
    factor = 1 if row.impl == "deepspeed" else None
    return estimate_step(work, cluster, sharding_degree=row.degree, accumulation=row.accum,
                         hierarchical=hier, gradient_sync=sync,
                         reduce_scatter_factor=factor).step_s


# ---------------------------------------------------------------- the benchmark


def run_rows(launch: Launcher, args, rows: list[Row]) -> list[dict]:
    """Time ``rows`` of one implementation: dtrain's in one launch (one process group, a fresh
    context and model per row), the others one launch each."""
    params = {"model": args.model, "steps": args.steps, "min-seconds": args.min_seconds,
              "warmup": args.warmup, "seq-len": args.seq_len}
    if rows[0].impl == "dtrain":
        specs = [{"distribution": dtrain_distribution(r), "accum": r.accum,
                  "micro_batch": r.micro_batch} for r in rows]
        return launch.run("dtrain", distribution=specs[0]["distribution"],
                          rows=json.dumps(specs), **params)["rows"]
    if rows[0].impl == "pipeline":
        from _pipeline_rows import distribution

        return [launch.run("pipeline", distribution=distribution(row.accum), **params,
                           **{"micro-batch": row.micro_batch}, accum=row.accum) for row in rows]
    return [launch.run(row.impl, **params, **{"micro-batch": row.micro_batch}, accum=row.accum,
                       degree=row.degree, hierarchical=int(row.hierarchical)) for row in rows]


def select_rows(args: argparse.Namespace) -> list[Row]:
    """The rows ``--full``/``--only`` ask for, at their micro-batches; exits when none match."""
    rows = [replace(r, micro_batch=args.overlap_micro_batch if r.overlap
                    else r.micro_batch or args.micro_batch)
            for r in ROWS if (args.full or r.default) and (not args.only or r.label in args.only)]
    rows = list({r.key: r for r in rows}.values())  # --overlap-micro-batch = --micro-batch
    if not rows:
        sys.exit(f"no row is labelled {' or '.join(map(repr, args.only))}; the labels: "
                 + ", ".join(sorted({r.label for r in ROWS})))
    return rows


def run_benchmark(args: argparse.Namespace, rows: list[Row], job_dir: Path) -> None:
    started = time.monotonic()
    deepspeed = deepspeed_available()
    launch = Launcher(args, job_dir)
    loopback = launch.run("loopback", hosts=1)["bytes_per_s"]
    set_link_rate(loopback / args.ratio)
    probe = launch.run("link", per_host=1)
    link = probe["all_reduce_Bps"]  # what gloo gets through the link, per direction
    # accumulation 1 at every row's micro-batch: the planner's FLOP rate at that size
    settings = sorted({(r.micro_batch, r.accum) for r in rows}
                      | {(r.micro_batch, 1) for r in rows})
    compute = launch.run("compute", model=args.model, steps=args.steps, warmup=1,
                         **{"seq-len": args.seq_len, "min-seconds": args.min_seconds,
                            "settings": ",".join(f"{m}:{a}" for m, a in settings)})
    compute = {tuple(int(v) for v in k.split(":")): res for k, res in compute.items()}
    clusters = {micro: calibrated_cluster(args, loopback=loopback, link=link,
                                          latency=probe["latency_s"], micro_batch=micro,
                                          micro_compute_s=res["step_s"] - res["optimizer_s"])
                for (micro, accum), res in compute.items() if accum == 1}
    print_header(args, loopback, probe, deepspeed, clusters)
    results = {}
    # dtrain's rows first (one launch), the reference row of each setting before the others
    for group in (
            [r for r in rows if r.impl == "dtrain"],
            *([r] for r in rows if r.impl in ("fsdp2", "pipeline")
              or (r.impl == "deepspeed" and deepspeed))):
        if not group:
            continue
        try:
            measured = run_rows(launch, args, group)
        except RuntimeError as exc:
            print(f"{group[0].label:<18} accum {group[0].accum}: FAILED: "
                  f"{str(exc).splitlines()[-1]}", flush=True)
            print(f"{group[0].label} failed:\n{exc}", file=sys.stderr, flush=True)  # the agent's log
            continue
        for row, res in zip(group, measured):
            res["compute_s"] = compute[(row.micro_batch, row.accum)]["step_s"]
            res["compute_cpus_busy"] = compute[(row.micro_batch, row.accum)]["cpus_busy"]
            res["model_s"] = predict(args, row, clusters[row.micro_batch])
            results[row.key] = res
            print_row(args, row, res, link, results)
    report(args, rows, results, link)
    print(f"# {time.monotonic() - started:.0f} s in all; load average {_load()} at the end")


def deepspeed_available() -> str | None:
    try:
        from _deepspeed_rows import ADAPTATIONS
    except ImportError:
        return None
    import importlib.util

    return ADAPTATIONS if importlib.util.find_spec("deepspeed") else None


def print_header(args, loopback: float, probe: dict, deepspeed: str | None,
                 clusters: dict) -> None:
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, load average {_load()} at start; "
          f"torch {_torch_version()}; {os.cpu_count()} CPUs")
    print(f"# model {args.model}, fp32, {args.seq_len} tokens per sequence, 2 hosts x {PER_HOST} "
          f"workers via the node agent; {args.warmup} warm-up (1 micro-batch) + at least "
          f"{args.steps} measured steps and {args.min_seconds:g} s of them (median) per row")
    print(f"# loopback gloo {loopback / 1e6:.0f} MB/s; veth tbf {loopback / args.ratio / 1e6:.1f}"
          f" MB/s each direction (1/{args.ratio:g}); raw gloo over it, 2 ranks, MB/s per "
          f"direction: all-gather {probe['all_gather_Bps'] / 1e6:.1f}, all-reduce "
          f"{probe['all_reduce_Bps'] / 1e6:.1f}, reduce-scatter "
          f"{probe['reduce_scatter_Bps'] / 1e6:.1f}; latency {probe['latency_s'] * 1e6:.0f} us")
    print(f"# DeepSpeed rows: {deepspeed or 'not installed (the bench extra), skipped'}; "
          "DS rows: parity checked, then timed; their warm-up is the parity window")
    print(f"# floor = max bytes per direction / {probe['all_reduce_Bps'] / 1e6:.1f} MB/s; "
          "eff = max(floor, compute) / step; cpus: cores busy during the step, machine-wide; "
          "ratios: tokens/s over the dtrain MiCS row of the "
          "same accum and micro-batch, measured and planner")
    print("# planner's FLOP rate per rank (compute-only step less its optimizer step): "
          + ", ".join(f"micro-batch {micro} {c.tflops_per_gpu * 1e3:.1f} GFLOP/s"
                      for micro, c in sorted(clusters.items())))
    print(f"{'row':<18} {'deg':>3} {'acc':>3} {'mb':>3} {'step s':>7} {'tok/s':>7} "
          f"{'link MB':>8} {'floor s':>7} {'comp s':>6} {'eff':>5} {'cpus':>4} {'model s':>7} "
          f"{'ratio':>6} {'model':>6}", flush=True)


def print_row(args, row: Row, res: dict, link: float, results: dict) -> None:
    tokens = res["tokens_per_s"] = (NUM_HOSTS * PER_HOST * row.accum * row.micro_batch
                                    * args.seq_len / res["step_s"])
    floor = res["floor_s"] = max(res["veth_tx"], res["veth_rx"]) / link
    res["efficiency"] = max(floor, res["compute_s"]) / res["step_s"]
    ref = results.get((REFERENCE, row.accum, row.micro_batch))
    measured = model = "-"
    if ref is not None:
        res["ratio"] = tokens / ref["tokens_per_s"]
        res["model_ratio"] = ref["model_s"] / res["model_s"]
        measured, model = f"{res['ratio']:.2f}", f"{res['model_ratio']:.2f}"
    print(f"{row.label:<18} {row.degree:>3} {row.accum:>3} {row.micro_batch:>3} "
          f"{res['step_s']:>7.2f} {tokens:>7.1f} {(res['veth_tx'] + res['veth_rx']) / 1e6:>8.1f} "
          f"{floor:>7.2f} {res['compute_s']:>6.2f} {res['efficiency']:>5.2f} "
          f"{res['cpus_busy']:>4.2f} "
          f"{res['model_s']:>7.2f} {measured:>6} {model:>6}", flush=True)


def report(args, rows: list[Row], results: dict, link: float) -> None:
    mb = args.micro_batch

    def ratio(a: str, b: str, accum: int, micro: int = mb) -> float | None:
        x, y = results.get((a, accum, micro)), results.get((b, accum, micro))
        return x["tokens_per_s"] / y["tokens_per_s"] if x and y else None

    def line(text: str, value: float | None, target: str, met: bool | None) -> None:
        if value is not None:
            verdict = "met" if met else "NOT met"
            print(f"{text} = {value:.3f} (target {target}: {verdict})")

    for accum in (1, 4):
        r = ratio(REFERENCE, "DS MiCS", accum)
        line(f"accum {accum}: dtrain MiCS / DeepSpeed MiCS tokens/s", r, ">= 1.2", r and r >= 1.2)
        r = ratio(REFERENCE, "DS ZeRO-3", accum)
        line(f"accum {accum}: dtrain MiCS / DeepSpeed ZeRO-3 tokens/s", r, ">= 2", r and r >= 2)
        zero3 = results.get(("dtrain ZeRO-3", accum, mb))
        if zero3 and "ratio" in zero3:
            print(f"accum {accum}: MiCS/ZeRO-3 tokens/s = {1 / zero3['ratio']:.2f}x measured, "
                  f"{1 / zero3['model_ratio']:.2f}x planner")
        piped = results.get(("dtrain PP 2", accum, mb))
        if piped and "ratio" in piped:
            said = (f"accum {accum}: PP 2 / MiCS tokens/s = {piped['ratio']:.2f}x measured, "
                    f"{piped['model_ratio']:.2f}x planner")
            if zero3 and "ratio" in zero3:
                said += (f"; PP 2 / ZeRO-3 = {piped['ratio'] / zero3['ratio']:.2f}x measured, "
                         f"{piped['model_ratio'] / zero3['model_ratio']:.2f}x planner")
            print(said)
    mics = results.get((REFERENCE, 1, mb))
    line("MiCS efficiency against the link floor, accum 1", mics and mics["efficiency"],
         ">= 0.85", mics and mics["efficiency"] >= 0.85)
    overlap_mb = args.overlap_micro_batch
    for micro in dict.fromkeys((mb, overlap_mb)):
        res = results.get((REFERENCE, 1, micro), {})
        if "sync_busy_s" in res:
            print(f"micro-batch {micro}, overlapped sync: the replicas' all-reduce ran "
                  f"{res['sync_busy_s']:.2f} s of the {res['step_s']:.2f} s step; "
                  f"{res['sync_exposed_s']:.2f} s of it after backward had ended (exposed)")
    over = results.get((REFERENCE, 1, overlap_mb))
    fsdp = results.get(("dtrain MiCS fsdp", 1, overlap_mb))
    if over and fsdp:
        print(f"overlap setting: micro-batch {overlap_mb}, compute {over['compute_s']:.2f}"
              f" s = {over['compute_s'] / over['floor_s']:.2f} x the link floor "
              f"{over['floor_s']:.2f} s (needs >= 1/3)")
        r = fsdp["step_s"] / over["step_s"]
        line("overlap setting: overlapped / FSDP2 synchronous speed", r, ">= 1.2", r >= 1.2)
        r = over["step_s"] / max(over["floor_s"], over["compute_s"])
        line("overlap setting: overlapped step / max(floor, compute)", r, "<= 1.15", r <= 1.15)
        print(f"overlap setting: CPU-seconds a step, all {os.cpu_count()} cores: overlapped "
              f"{over['cpus_busy'] * over['step_s']:.1f} ({over['cpus_busy']:.2f} cores busy), "
              f"compute-only {over['compute_cpus_busy'] * over['compute_s']:.1f} "
              f"({over['compute_cpus_busy']:.2f} cores busy)")
    errors = {f"{label} a{acc} mb{mbs}": res["model_ratio"] / res["ratio"] - 1
              for (label, acc, mbs), res in results.items() if "ratio" in res}
    if errors:
        worst = max(errors, key=lambda k: abs(errors[k]))
        within = all(abs(e) <= 0.15 for e in errors.values())
        print(f"planner ratios vs measured: worst {worst} {errors[worst]:+.0%} "
              f"(target within 15% for every row: {'met' if within else 'NOT met'})")
    report_p4d(args)


def report_p4d(args) -> None:
    from dtrain.core import instances
    from dtrain.planning import planner
    from dtrain.planning.costmodel import estimate_step

    p4d = instances.get("p4d.24xlarge")
    work = workload(args, micro_batch=args.micro_batch, compute_bytes=2)
    for nodes in P4D_HOSTS:
        c = planner.cluster_for(p4d, nodes=nodes, processes_per_node=p4d.gpus)
        ratios = []
        for accum in (1, 4):
            mics = estimate_step(work, c, sharding_degree=p4d.gpus, accumulation=accum,
                                 gradient_sync="overlapped")
            zero3 = estimate_step(work, c, sharding_degree=c.world_size, accumulation=accum)
            ratios.append(f"accum {accum}: {zero3.step_s / mics.step_s:.2f}x")
        print(f"planner, {nodes} x p4d.24xlarge (bf16, same model and tokens per GPU): "
              f"MiCS (degree {p4d.gpus}) / ZeRO-3 (degree {c.world_size}) = {', '.join(ratios)}")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _torch_version() -> str:
    import torch

    return torch.__version__


# ---------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ratio", type=float, default=12.0, help="loopback bandwidth / link bandwidth")
    p.add_argument("--full", action="store_true", help="every row, not only the default ones")
    p.add_argument("--only", nargs="+", metavar="LABEL", help="only rows with these labels")
    p.add_argument("--model", default="gpt-neox-30m", help="a preset from dtrain.core.presets")
    p.add_argument("--steps", type=int, default=1,
                   help="measured optimizer steps per row, at least")
    p.add_argument("--min-seconds", type=float, default=5.0,
                   help="a row measures more steps until they add up to this (short rows)")
    p.add_argument("--warmup", type=int, default=1,
                   help="unmeasured one-micro-batch steps first")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per micro-step")
    p.add_argument("--overlap-micro-batch", type=int, default=OVERLAP_MICRO_BATCH,
                   help="micro-batch of the overlap target's two rows (compute against the link)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds per launch (dtrain's rows share one launch, the others have "
                        "one each)")
    p.add_argument("--cleanup", action="store_true",
                   help="only remove namespaces, processes and temp dirs a killed run left")
    # Set by the benchmark in the contract's hyperparameters for the workers the agent starts.
    for hidden in ("--role", "--out", "--settings", "--rows"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    for hidden in ("--degree", "--accum", "--hierarchical"):
        p.add_argument(hidden, type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def worker_deepspeed(args: argparse.Namespace) -> None:
    from _deepspeed_rows import worker_deepspeed as run

    run(args)


def worker_pipeline(args: argparse.Namespace) -> None:
    from _pipeline_rows import worker_pipeline as run

    run(args)


WORKERS = {"loopback": worker_loopback, "link": worker_link, "compute": worker_compute,
           "dtrain": worker_train, "fsdp2": worker_fsdp2, "deepspeed": worker_deepspeed,
           "pipeline": worker_pipeline}


def main() -> None:
    args = parse_args()
    if args.role:
        return WORKERS[args.role](args)
    rows = select_rows(args)  # a wrong --only says so before anything is set up
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
        run_benchmark(args, rows, job_dir)
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let cleanup finish
        destroy_cluster()
    return None


if __name__ == "__main__":
    main()
