"""A job's training curves as a self-contained HTML page or one SVG chart (stdlib only).

    dtrain report local-cpu-lm                       # local-cpu-lm-report.html
    dtrain report JOB --format svg --metric tokens_per_s

Metrics come from rank 0's ``metrics.jsonl`` in a local job's folder (exact values) or else from
the ``dtrain-metrics`` lines in rank 0's logs (7 significant digits), so every target works.
The charts are drawn here as inline SVG: no plotting library, nothing fetched by the page.
"""

from __future__ import annotations

import html
import json
import math
import re
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from dtrain.core.errors import DtrainError, SpecError
from dtrain.core.metrics_format import format_metrics, parse_metrics
from dtrain.jobs.store import JobRecord, JobStore

JSONL_NAME = "metrics.jsonl"  # dtrain.runtime.train.metrics.JSONL_NAME, without importing torch
FORMATS = ("html", "svg")
# The HTML report's charts, in order; a chart whose metric the job never logged is left out.
HTML_METRICS = ("loss", "tokens_per_s", "mfu")
LABELS = {"loss": "training loss", "eval_loss": "eval loss",
          "tokens_per_s": "tokens/s (all ranks)", "mfu": "MFU (fraction of peak)",
          "tflops_per_gpu": "TFLOP/s per GPU", "lr": "learning rate", "grad_norm": "gradient norm"}
# Rates start their axis at zero so a small dip does not look like a collapse; loss does not.
FROM_ZERO = frozenset({"tokens_per_s", "mfu", "tflops_per_gpu"})

Row = dict[str, float]
Point = tuple[float, float]


# ------------------------------------------------------------------ reading metrics

def read_jsonl(path: str | Path) -> list[Row]:
    """The rows of a ``metrics.jsonl``; a partly written last line is skipped."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "step" in row:
                rows.append(row)
    return rows


def find_metrics_file(job_dir: str | Path) -> Path | None:
    """Rank 0's ``metrics.jsonl`` under any host's ``output/data/`` (rank 0 alone writes one)."""
    found = sorted(Path(job_dir).glob(f"*/output/data/{JSONL_NAME}"))
    return found[0] if found else None


def parse_log_lines(lines: Iterable[str]) -> list[Row]:
    """The rows of every ``dtrain-metrics`` line among ``lines``."""
    return [m for m in map(parse_metrics, lines) if m and "step" in m]


def by_step(rows: Iterable[Row]) -> list[Row]:
    """One row per step, in step order; a step logged again (a restart) keeps its last row."""
    latest: dict[float, Row] = {}
    for row in rows:
        latest[row["step"]] = row
    return [latest[step] for step in sorted(latest)]


def job_metrics(record: JobRecord, *, store: JobStore | None = None,
                clients: dict[str, Any] | None = None) -> list[Row]:
    """A job's logged metrics, one row per step. Raises DtrainError when there are none yet."""
    job_dir = (record.target_data or {}).get("job_dir") or record.output_location
    if record.target == "local" and job_dir and (path := find_metrics_file(job_dir)):
        rows = read_jsonl(path)
        if rows:
            return by_step(rows)
    from dtrain.jobs import api as jobs

    rows = parse_log_lines(jobs.logs(record.id, rank=0, store=store, clients=clients))
    if not rows:
        gone = jobs.deleted_job_folder(record)
        if gone:
            raise DtrainError(gone)
        what = "logged no metrics" if record.is_final else "has no metrics yet"
        raise DtrainError(f"job {record.id} ({record.status}) {what}: no {JSONL_NAME} and no "
                          f"`dtrain-metrics` lines in rank 0's logs; the trainer logs every "
                          f"log_interval steps, see `dtrain logs {record.id}`")
    return by_step(rows)


def series(rows: Sequence[Row], metric: str) -> list[Point]:
    """(step, value) for every row with a finite ``metric``; NaN and inf are left out."""
    points = []
    for row in rows:
        value = row.get(metric)
        if isinstance(value, (int, float)) and math.isfinite(value):
            points.append((float(row["step"]), float(value)))
    return points


# ------------------------------------------------------------------ SVG charts

def nice_ticks(low: float, high: float, *, count: int = 5) -> list[float]:
    """About ``count`` round tick values (1, 2, 2.5 or 5 × 10^k apart) covering [low, high]."""
    if high <= low:
        pad = abs(low) * 0.1 or 1.0
        low, high = low - pad, high + pad
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    spacing = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * 0.999)
    first = math.floor(low / spacing + 1e-9) * spacing
    last = math.ceil(high / spacing - 1e-9) * spacing
    return [first + i * spacing for i in range(round((last - first) / spacing) + 1)]


def tick_labels(ticks: Sequence[float]) -> list[str]:
    """Just enough decimals to tell evenly spaced ticks apart; thousands as k, millions as M."""
    spacing = ticks[1] - ticks[0]
    top = max(abs(t) for t in ticks)
    scale, suffix = next(((s, x) for s, x in ((1e6, "M"), (1e3, "k")) if top >= s), (1.0, ""))
    spacing /= scale
    decimals = max(0, -math.floor(math.log10(spacing) + 1e-9))
    if abs(spacing * 10 ** decimals - round(spacing * 10 ** decimals)) > 1e-6:
        decimals += 1  # 2.5 × 10^k steps need one more digit
    labels = []
    for tick in ticks:
        text = f"{tick / scale:.{decimals}f}"
        labels.append("0" if float(text) == 0 else text + suffix)
    return labels


class _Frame:
    """Maps data to SVG coordinates inside the margins; the axes span their outer ticks."""

    left, right, top, bottom = 72, 20, 36, 48

    def __init__(self, width: int, height: int, x_ticks: list[float], y_ticks: list[float]):
        self.width, self.height, self.x_ticks, self.y_ticks = width, height, x_ticks, y_ticks
        self.plot_w = width - self.left - self.right
        self.plot_h = height - self.top - self.bottom
        self.base = self.top + self.plot_h  # the x axis' SVG y

    def x(self, value: float) -> float:
        low, high = self.x_ticks[0], self.x_ticks[-1]
        return self.left + (value - low) / (high - low) * self.plot_w

    def y(self, value: float) -> float:
        low, high = self.y_ticks[0], self.y_ticks[-1]
        return self.base - (value - low) / (high - low) * self.plot_h


def _axes(frame: _Frame, *, x_label: str, y_label: str) -> list[str]:
    """Horizontal gridlines with y tick labels, x ticks with labels, the axis lines and names."""
    f = frame
    out = []
    for tick, label in zip(f.y_ticks, tick_labels(f.y_ticks)):
        y = f.y(tick)
        out.append(f'<line x1="{f.left}" x2="{f.left + f.plot_w}" y1="{y:.1f}" y2="{y:.1f}" '
                   f'stroke="#e3e3e3"/>')
        out.append(f'<text x="{f.left - 6}" y="{y + 4:.1f}" text-anchor="end" fill="#444">'
                   f"{label}</text>")
    for tick, label in zip(f.x_ticks, tick_labels(f.x_ticks)):
        x = f.x(tick)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{f.base}" y2="{f.base + 5}" '
                   f'stroke="#444"/>')
        out.append(f'<text x="{x:.1f}" y="{f.base + 18}" text-anchor="middle" fill="#444">'
                   f"{label}</text>")
    out.append(f'<path d="M{f.left},{f.top}V{f.base}H{f.left + f.plot_w}" fill="none" '
               f'stroke="#444"/>')
    out.append(f'<text x="{f.left + f.plot_w / 2:g}" y="{f.height - 10}" '
               f'text-anchor="middle">{_esc(x_label)}</text>')
    out.append(f'<text transform="translate(16 {f.top + f.plot_h / 2:g}) rotate(-90)" '
               f'text-anchor="middle">{_esc(y_label)}</text>')
    return out


def svg_line_chart(points: Sequence[Point], *, title: str, x_label: str, y_label: str,
                   y_from_zero: bool = False, width: int = 640, height: int = 320) -> str:
    """One line chart as a standalone ``<svg>`` element: title, gridlines, labelled ticks."""
    if not points:
        raise ValueError(f"{title}: no finite values to plot")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    frame = _Frame(width, height, nice_ticks(min(xs), max(xs)),
                   nice_ticks(min(0.0, min(ys)) if y_from_zero else min(ys), max(ys)))
    coords = " ".join(f"{frame.x(x):.1f},{frame.y(y):.1f}" for x, y in points)
    out = [
        (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'viewBox="0 0 {width} {height}" role="img" '
         f'font-family="system-ui, sans-serif" font-size="12">'),
        f"<title>{_esc(title)}</title>",
        f'<rect width="{width}" height="{height}" fill="white"/>',
        (f'<text x="{width / 2:g}" y="22" text-anchor="middle" font-size="15" '
         f'font-weight="600">{_esc(title)}</text>'),
        *_axes(frame, x_label=x_label, y_label=y_label),
        (f'<polyline points="{coords}" fill="none" stroke="#1f6fb4" stroke-width="2" '
         f'stroke-linejoin="round"/>'),
    ]
    if len(points) <= 50:  # markers show where the logged steps are; past 50 they are a smear
        out += [f'<circle cx="{frame.x(x):.1f}" cy="{frame.y(y):.1f}" r="3" fill="#1f6fb4"/>'
                for x, y in points]
    out.append("</svg>")
    return "\n".join(out) + "\n"


def metric_chart(rows: Sequence[Row], metric: str, *, job_name: str) -> str:
    """The chart of one metric against step; DtrainError when the job never logged it."""
    points = series(rows, metric)
    if not points:
        logged = sorted({k for row in rows for k in row} - {"step"})
        # a name the job never logged is a bad --metric (exit 2); one it logged only as nan/inf
        # (a diverged run) is the job's
        error = DtrainError if metric in logged else SpecError
        raise error(f"metric {metric!r} has no finite values in this job's metrics; "
                    f"choose --metric from: {', '.join(logged) or 'none'}")
    label = LABELS.get(metric, metric)
    return svg_line_chart(points, title=f"{job_name}: {label}", x_label="step", y_label=label,
                          y_from_zero=metric in FROM_ZERO)


# ------------------------------------------------------------------ HTML report

def job_facts(record: JobRecord) -> list[tuple[str, str]]:
    from dtrain.jobs import api as jobs

    compute = record.spec.get("compute") or {}
    instances = f"{compute.get('instance_count', '-')} × {compute.get('instance_type', '-')}"
    size = jobs.world_size(record)
    return [("job", f"{record.name} ({record.id})"), ("target", record.target),
            ("status", record.status), ("duration", record.duration),
            ("instances", instances),
            ("world size", str(size) if size else "-"),
            ("output", record.output_location or "-")]


def last_metrics_line(rows: Sequence[Row]) -> str:
    last = dict(rows[-1])
    step = last.pop("step")
    # 7 significant digits, as the trainer prints them
    return format_metrics(step, **{k: float(f"{v:.7g}") for k, v in last.items()
                                   if isinstance(v, (int, float))})


def render_html(record: JobRecord, rows: Sequence[Row], *,
                metrics: Sequence[str] = HTML_METRICS) -> str:
    """The whole report page: facts, one chart per metric that has values, the last metrics."""
    charts = [metric_chart(rows, m, job_name=record.name) for m in metrics if series(rows, m)]
    if not charts:  # never logged, or only as nan/inf (a diverged run): said, not a blank page
        charts.append(f"<p>No chart: the job logged no finite value of "
                      f"{_esc(', '.join(metrics))}.</p>")
    facts = "\n".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>"
                      for k, v in job_facts(record))
    steps = f"{len(rows)} logged steps, {rows[0]['step']:g}–{rows[-1]['step']:g}"
    return _PAGE.format(title=_esc(f"dtrain report: {record.name} ({record.id})"), facts=facts,
                        steps=_esc(steps), charts="\n".join(charts),
                        last=_esc(last_metrics_line(rows)),
                        generated=_esc(time.strftime("%Y-%m-%d %H:%M:%S")))


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 680px; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1.5rem; }}
th {{ text-align: left; padding: 2px 1.5rem 2px 0; color: #555; font-weight: 500; }}
svg {{ display: block; margin: 0 0 1.5rem; }}
pre {{ white-space: pre-wrap; word-break: break-all; background: #f5f5f5; padding: .75rem; }}
</style>
</head>
<body>
<h1>{title}</h1>
<table>
{facts}
</table>
<p>{steps}</p>
{charts}
<h2>Last metrics</h2>
<pre>{last}</pre>
<p><small>generated {generated} by <code>dtrain report</code></small></p>
</body>
</html>
"""


# ------------------------------------------------------------------ entry point

def default_output(job: str, *, fmt: str, metric: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", job).strip("-") or "job"
    return f"{stem}-report.html" if fmt == "html" else f"{stem}-{metric}.svg"


def write_report(job: str, *, output: str | None = None, fmt: str = "html",
                 metric: str | None = None, store: JobStore | None = None,
                 clients: dict[str, Any] | None = None) -> Path:
    """Write ``job``'s HTML report, or its ``metric`` chart (loss by default) as SVG.

    ``metric`` with HTML adds that chart to the default ones. Returns the path written.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {FORMATS}")
    from dtrain.jobs import api as jobs

    record = jobs.get(job, store=store, clients=clients)
    rows = job_metrics(record, store=store, clients=clients)
    if fmt == "svg":
        text = metric_chart(rows, metric or "loss", job_name=record.name)
    else:
        if metric and not series(rows, metric):
            metric_chart(rows, metric, job_name=record.name)  # raises, naming the choices
        extra = (metric,) if metric and metric not in HTML_METRICS else ()
        text = render_html(record, rows, metrics=(*HTML_METRICS, *extra))
    path = Path(output or default_output(job, fmt=fmt, metric=metric or "loss"))
    if not path.parent.is_dir():
        raise DtrainError(f"--file {str(path)!r}: the folder {str(path.parent)!r} does not "
                          "exist; create it or write elsewhere")
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise DtrainError(f"--file {str(path)!r}: {exc.strerror}") from None
    return path


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)
