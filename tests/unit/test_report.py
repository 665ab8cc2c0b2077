"""`dtrain report`: a job's metrics become valid SVG charts and a self-contained HTML page."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from dtrain.core.errors import DtrainError, SpecError
from dtrain.jobs import report
from dtrain.jobs.store import COMPLETED, JobStore

SVG = "{http://www.w3.org/2000/svg}"
SPEC = {"name": "tiny-lm", "compute": {"target": "local", "instance_type": "local",
                                       "instance_count": 2, "processes_per_instance": 2}}


def metric_rows(steps: int = 25, *, mfu: bool = True) -> list[dict]:
    rows = []
    for i in range(1, steps + 1):
        row = {"step": i * 2, "loss": 5.0 / i + 2.0, "lr": 0.003, "tokens_per_s": 9000.0 + i}
        if mfu:
            row["mfu"] = 0.02 + i / 1000
        rows.append(row)
    return rows


def write_jsonl(path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # json.dumps writes NaN/Infinity literals, as the runtime's MetricsLogger does
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def local_job(tmp_path, rows=None, *, log_lines=(), name="tiny-lm"):
    """A finished local job record whose folder holds rank 0's metrics.jsonl and agent logs."""
    job_dir = tmp_path / "jobs" / name
    if rows is not None:
        write_jsonl(job_dir / "algo-1" / "output" / "data" / "metrics.jsonl", rows)
    log = job_dir / "algo-1" / "output" / "agent.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(line + "\n" for line in log_lines))
    return JobStore().create(name=name, target="local", spec=SPEC, status=COMPLETED,
                             output_location=str(job_dir), log_location=str(job_dir),
                             target_data={"job_dir": str(job_dir), "hosts": ["algo-1"]})


def polyline_points(svg: str) -> list[tuple[float, float]]:
    root = ET.fromstring(svg)
    (line,) = root.iter(f"{SVG}polyline")
    return [tuple(map(float, p.split(","))) for p in line.get("points").split()]


def texts(svg: str) -> list[str]:
    return [t.text for t in ET.fromstring(svg).iter(f"{SVG}text")]


def test_chart_is_valid_svg_with_one_point_per_metric_row_and_labelled_axes():
    rows = metric_rows(25)
    svg = report.metric_chart(rows, "loss", job_name="tiny-lm")
    assert ET.fromstring(svg).tag == f"{SVG}svg"
    assert len(polyline_points(svg)) == len(rows)
    labels = texts(svg)
    assert "tiny-lm: training loss" in labels and "step" in labels
    assert "training loss" in labels, "the y axis is labelled"
    assert {"10", "20", "30", "40", "50"} <= set(labels), "x ticks are round step numbers"


def test_points_go_left_to_right_and_higher_loss_is_drawn_higher():
    points = polyline_points(report.metric_chart(metric_rows(10), "loss", job_name="j"))
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    assert xs == sorted(xs)
    assert ys == sorted(ys), "loss falls, so SVG y (down is larger) rises"


def test_nan_and_inf_values_are_left_out_of_the_line(tmp_path):
    rows = metric_rows(8)
    rows[2]["loss"], rows[5]["loss"], rows[6]["loss"] = math.nan, math.inf, -math.inf
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    read = report.read_jsonl(tmp_path / "metrics.jsonl")
    svg = report.metric_chart(read, "loss", job_name="j")
    points = polyline_points(svg)
    assert len(points) == 5
    assert all(math.isfinite(v) for p in points for v in p)
    assert "nan" not in svg.lower() and "inf" not in svg.lower()


def test_a_metric_that_is_never_finite_is_an_error_naming_the_choices():
    rows = [{"step": 1, "loss": math.nan, "lr": 0.1}]
    with pytest.raises(DtrainError, match=r"'loss' has no finite values.*from: loss, lr") as got:
        report.metric_chart(rows, "loss", job_name="j")
    assert not isinstance(got.value, SpecError)  # the job's doing: exit 1
    with pytest.raises(SpecError, match=r"'nosuch' has no finite values.*from: loss, lr"):
        report.metric_chart(rows, "nosuch", job_name="j")  # a bad --metric: exit 2, as a bad
        # --rank or --host


def test_one_point_and_a_flat_line_still_draw_a_readable_chart():
    for rows in ([{"step": 40, "loss": 2.9}], [{"step": s, "loss": 1.0} for s in (1, 2, 3)]):
        svg = report.metric_chart(rows, "loss", job_name="j")
        assert len(polyline_points(svg)) == len(rows)
        assert len(list(ET.fromstring(svg).iter(f"{SVG}circle"))) == len(rows)


def test_ticks_are_round_and_cover_the_data():
    ticks = report.nice_ticks(4443.0, 10662.0)
    assert ticks[0] <= 4443 and ticks[-1] >= 10662 and 4 <= len(ticks) <= 7
    assert report.tick_labels(ticks) == ["4k", "6k", "8k", "10k", "12k"]
    assert report.tick_labels(report.nice_ticks(0.0, 0.029)) == ["0", "0.01", "0.02", "0.03"]
    assert report.tick_labels([0.0, 2.5, 5.0]) == ["0", "2.5", "5.0"]


def test_rates_start_at_zero_and_loss_does_not():
    rows = metric_rows(5)
    assert "0" in texts(report.metric_chart(rows, "tokens_per_s", job_name="j"))
    assert "0" not in texts(report.metric_chart(rows, "loss", job_name="j"))


def test_html_report_has_the_job_facts_a_chart_per_metric_and_the_last_line(tmp_path):
    record = local_job(tmp_path, metric_rows(25))
    page = report.render_html(record, report.job_metrics(record))
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "http" not in \
        page.replace("http://www.w3.org/2000/svg", ""), "self-contained: nothing is fetched"
    assert page.count("<svg ") == 3, "loss, tokens/s and MFU"
    for fact in ("<th>world size</th><td>4</td>", "<th>target</th><td>local</td>",
                 "<th>status</th><td>Completed</td>", "<th>instances</th><td>2 × local</td>"):
        assert fact in page
    assert "dtrain-metrics step=50 loss=2.2 lr=0.003 tokens_per_s=9025 mfu=0.045" in page


def test_html_report_leaves_out_metrics_the_job_never_logged(tmp_path):
    record = local_job(tmp_path, metric_rows(5, mfu=False))
    assert report.render_html(record, report.job_metrics(record)).count("<svg ") == 2
    # a diverged run (nan/inf only): a page that says why it has no chart, not a blank one
    diverged = local_job(tmp_path, [{"step": 1, "loss": math.nan}, {"step": 2, "loss": math.inf}])
    page = report.render_html(diverged, report.job_metrics(diverged))
    assert "<svg " not in page
    assert "No chart: the job logged no finite value of loss, tokens_per_s, mfu." in page


def test_a_restarted_job_keeps_the_last_row_of_each_step(tmp_path):
    rows = metric_rows(4) + [{"step": 4, "loss": 9.0}, {"step": 2, "loss": 8.0}]
    record = local_job(tmp_path, rows)
    read = report.job_metrics(record)
    assert [r["step"] for r in read] == [2, 4, 6, 8]
    assert [r["loss"] for r in read[:2]] == [8.0, 9.0]


def test_without_metrics_jsonl_the_report_reads_rank_0_log_lines(tmp_path):
    lines = ["[algo-1 0]:dtrain-metrics step=10 loss=5.285473 tokens_per_s=4443.48",
             "[algo-1 1]:dtrain-metrics step=10 loss=7.0 tokens_per_s=1",
             "[algo-1 0]:loading data",
             "[algo-1 0]:dtrain-metrics step=20 loss=3.517951 tokens_per_s=9651.687"]
    record = local_job(tmp_path, log_lines=lines)
    assert report.job_metrics(record) == [
        {"step": 10, "loss": 5.285473, "tokens_per_s": 4443.48},
        {"step": 20, "loss": 3.517951, "tokens_per_s": 9651.687}]


def test_a_job_without_metrics_is_a_one_line_error_saying_whether_it_ended(tmp_path):
    record = local_job(tmp_path, log_lines=["[algo-1 0]:starting"])
    with pytest.raises(DtrainError, match=f"job {record.id} \\(Completed\\) logged no metrics:") \
            as info:
        report.write_report(record.id, output=str(tmp_path / "r.html"))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "r.html").exists()


def test_write_report_writes_html_or_one_svg_where_asked(tmp_path, monkeypatch):
    local_job(tmp_path, metric_rows(6))
    monkeypatch.chdir(tmp_path)
    assert str(report.write_report("tiny-lm")) == "tiny-lm-report.html"
    path = report.write_report("tiny-lm", fmt="svg", metric="tokens_per_s")
    assert str(path) == "tiny-lm-tokens_per_s.svg"
    assert "tokens/s" in path.read_text()
    with pytest.raises(DtrainError, match=r"the folder .*out' does not exist; create it"):
        report.write_report("tiny-lm", fmt="svg", output=str(tmp_path / "out" / "l.svg"))
    (tmp_path / "out").mkdir()
    nested = report.write_report("tiny-lm", fmt="svg", output=str(tmp_path / "out" / "l.svg"))
    assert len(polyline_points(nested.read_text())) == 6
    html = report.write_report("tiny-lm", metric="lr").read_text()
    assert html.count("<svg ") == 4, "--metric adds a chart to the HTML report"


def test_report_module_loads_no_plotting_or_tensor_library():
    probe = "import dtrain.jobs.report, json, sys; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    heavy = {m for m in json.loads(out) if m.split(".")[0] in
             ("torch", "numpy", "matplotlib", "pydantic")}
    assert not heavy
