"""Human-readable rendering of a Plan (what `dtrain plan` and `submit --dry-run` print)."""

from __future__ import annotations

from dtrain.planning.planner import Plan


def table(rows: list[list[str]], header: list[str] | None = None) -> str:
    """A plain text table with aligned columns (no dependency, fast to import)."""
    all_rows = ([header] if header else []) + rows
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(all_rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in all_rows]
    if header:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _gb(value: float) -> str:
    return f"{value / 1e9:,.2f} GB"


def _money(value: float | None) -> str:
    return "n/a" if value is None else f"${value:,.2f}"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}{'es' if noun.endswith('s') else 's'}"


def duration(seconds: float) -> str:
    """``600`` -> ``10 min``, ``7200`` -> ``2 h``, ``172800`` -> ``2 d``, ``5400`` -> ``1.5 h``."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:g} s"


# distribution.backend as the plan shows it beside the backend it resolves to
_BACKEND_SETTING = {"auto": "auto", "nccl": "as set: stock collectives only", "gloo": "as set"}


def render_plan(plan: Plan) -> str:
    spec = plan.spec
    p = plan.parallelism
    mesh = (" × ".join(f"{axis} {size}" for axis, size in zip(p.mesh_axis_names, p.mesh_shape))
            + f" ({p.strategy})") if p else "sharding degree resolved at run time"
    within = {None: "-", True: "yes", False: "no (spans nodes)"}[plan.group_within_node]
    rows = [
        ["job", f"{spec.name} ({spec.entry_point})"],
        ["target", f"{spec.compute.target} · {plan.num_nodes} × {plan.instance.name}"],
        ["world size", (f"{plan.world_size} ({plural(plan.num_nodes, 'node')} × "
                       f"{plural(plan.processes_per_node, 'process')})")],
        ["mesh", mesh],
        ["partition group in one node", within],
        *([["tensor parallel", f"{p.tensor_parallel_layout} ({plan.tensor_parallel_reason})"]]
          if p else []),
        ["backend", (f"{plan.backend} ({_BACKEND_SETTING[spec.distribution.backend]}; "
                     f"hierarchical all-gather: {'on' if plan.hierarchical_allgather else 'off'})")],
        ["mixed precision", plan.mixed_precision],
        ["grad accumulation", str(spec.distribution.gradient_accumulation_steps)],
    ]
    if plan.model:
        m = plan.model
        rows.append(["model", (f"{m.source}: {m.num_parameters / 1e6:,.1f}M params, "
                               f"seq {m.seq_len}, micro-batch {m.micro_batch_size}")])
    if plan.memory:
        mem = plan.memory
        rows.append(["memory per device", f"{mem.total_gib:.1f} GiB = states "
                     f"{mem.model_state_gib:.1f} + unsharded layers "
                     f"{mem.unsharded_layers_gib:.1f} + activations {mem.activation_gib:.1f}"
                     + (f" (of {mem.device_gib:.0f} GiB)" if mem.device_gib else "")])
    rows += _pipeline_rows(plan)
    chosen = plan.chosen
    if chosen and chosen.tensor_parallel > 1:
        traffic = f"{_gb(chosen.tp_bytes)} per step per device (inside a node)"
        rows.append(["tensor-parallel traffic", traffic])
    rows += [
        ["$/hour", (f"{_money(plan.cost_per_hour)} ({plan.num_nodes} × "
                    f"{_money(plan.price_per_hour)}, prices of {plan.instance.price_date})")],
        [f"$ for max_run ({duration(spec.compute.max_run)})", _money(plan.max_run_cost)],
    ]
    out = [table(rows)]
    if plan.strategies:
        out.append("\nper optimizer step and device, fastest first (latency–bandwidth model, see "
                   "docs;\nexposed = communication compute does not hide; * = this job):")
        out.append(table([_strategy_row(i, s, plan) for i, s in enumerate(plan.strategies, 1)],
                         ["#", "strategy", "degree", "intra-node", "inter-node", "compute",
                          "exposed comm", "(all-gather)", "step", "tokens/s"]))
    if plan.layout_choice and plan.layout_choice.candidates:
        out.append("\nlayouts weighed by pipeline_parallel_degree auto (memory fit first, then "
                   "predicted tokens/s):")
        out.append(table([_candidate_row(c, plan) for c in plan.layout_choice.candidates[:10]],
                         ["pp", "tp", "shard", "memory/device", "fits", "step", "tokens/s"]))
    out += [f"note: {n}" for n in plan.notes]
    return "\n".join(out)


def _pipeline_rows(plan: Plan) -> list[list[str]]:
    """The schedule and bubble, the partition with each stage's share of the FLOPs, the
    transfers between stages, and why this layout when ``auto`` chose it."""
    p, est = plan.parallelism, plan.pipeline
    rows = [["layout", plan.layout_choice.reason]] if plan.layout_choice else []
    if p is None or p.pp == 1:
        return rows
    schedule = (f"{p.num_stages} stages ({p.stages_per_rank} per rank), {p.pipeline_schedule}, "
                f"{p.microbatches} micro-batches per step; predicted bubble "
                f"{p.bubble_fraction:.1%}")
    rows.append(["pipeline", schedule])
    setting = (f"blocks from {list(p.partition)}" if isinstance(p.partition, tuple)
               else p.partition)
    if est is None:
        rows.append(["partition", f"{setting}: measured at run time (no model shape here)"])
        return rows
    stages = "; ".join(f"{k}: {units} ({share:.1%})"
                       for k, (units, share) in enumerate(zip(est.stages, est.shares)))
    rows.append(["partition", f"{setting}: {stages}"])
    where = "across nodes" if est.across_nodes else "inside a node"
    sent = (f"{_gb(est.bytes_per_rank)} per step sent by the busiest rank "
            f"({est.transfer_bytes / 1e6:,.2f} MB per micro-batch and cut, {where})")
    rows.append(["pipeline transfers", sent])
    return rows


def _candidate_row(c, plan: Plan) -> list[str]:
    chosen = c.plan == plan.parallelism
    return [str(c.plan.pp) + (" *" if chosen else ""), str(c.plan.tp), str(c.plan.dp_shard),
            f"{c.memory_gib:.1f} GiB", "yes" if c.fits else "no",
            f"{c.step.step_s:.3f} s" if c.step else "-",
            f"{c.step.tokens_per_s:,.0f}" if c.step else "-"]


def _strategy_row(rank: int, est, plan: Plan) -> list[str]:
    name = est.label + (" *" if est is plan.chosen else "")
    head = [str(rank) if est.fits else "-", name, str(est.sharding_degree), _gb(est.intra_bytes),
            _gb(est.inter_bytes), f"{est.compute_s:.3f} s"]
    if not est.fits:
        return [*head, f"does not fit: {est.memory_gib:,.0f} of {est.device_gib:.0f} GiB", "",
                "-", "-"]
    return [*head, f"{est.exposed.total_s:.3f} s", f"{est.exposed.all_gather_s:.3f} s",
            f"{est.step_s:.3f} s", f"{est.tokens_per_s:,.0f}"]
