"""`dtrain report` as a user runs it (the quickstart's commands), on a recorded local job whose
folder holds rank 0's metrics.jsonl; no training run is needed."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from functools import partial

import _cli
from dtrain.jobs.store import COMPLETED, RUNNING, JobStore

# check=False: the exit code is what these tests assert on
dtrain = partial(_cli.dtrain, check=False, timeout=60)


def record_job(tmp_path, *, name: str, status: str, steps: int) -> str:
    job_dir = tmp_path / "jobs" / name
    data = job_dir / "algo-1" / "output" / "data"
    data.mkdir(parents=True)
    (data / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 6.0 - s / 10, "tokens_per_s": 9000.0, "mfu": 0.02}) + "\n"
        for s in range(10, 10 * steps + 1, 10)))
    spec = {"compute": {"instance_type": "local", "instance_count": 2,
                        "processes_per_instance": 2}}
    return JobStore().create(name=name, target="local", spec=spec, status=status,
                             output_location=str(job_dir),
                             target_data={"job_dir": str(job_dir), "hosts": ["algo-1"]}).id


def test_dtrain_report_writes_the_html_page_and_an_svg_chart(tmp_path):
    record_job(tmp_path, name="local-cpu-lm", status=COMPLETED, steps=4)

    result = dtrain("report", "local-cpu-lm", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "local-cpu-lm-report.html"
    page = (tmp_path / "local-cpu-lm-report.html").read_text()
    assert page.count("<svg ") == 3 and "dtrain-metrics step=40 loss=2" in page

    result = dtrain("report", "local-cpu-lm", "--format", "svg", "--metric", "tokens_per_s",
                    cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    svg = ET.parse(tmp_path / result.stdout.strip()).getroot()
    (line,) = svg.iter("{http://www.w3.org/2000/svg}polyline")
    assert len(line.get("points").split()) == 4


def test_dtrain_report_on_a_job_without_metrics_is_a_one_line_error(tmp_path):
    job_id = JobStore().create(name="fresh", target="local", spec={}, status=RUNNING,
                               output_location=str(tmp_path / "nothing"),
                               target_data={"job_dir": str(tmp_path / "nothing"),
                                            "hosts": ["algo-1"]}).id
    result = dtrain("report", job_id, "--file", "r.html", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: job {job_id} (Running) has no metrics yet")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "r.html").exists()
