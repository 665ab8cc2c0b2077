"""Draw the quickstart's loss and throughput charts (docs/img/local-cpu-*.svg) from a real run.

    python docs/gen_metrics_plot.py               # run examples/local-cpu.yaml (~40 s of CPU)
    python docs/gen_metrics_plot.py --job JOB     # chart a job that already ran

The charts are what `dtrain report JOB --format svg` writes, so the docs show the real output.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/local-cpu.yaml"
CHARTS = {"loss": REPO / "docs" / "img" / "local-cpu-loss.svg",
          "tokens_per_s": REPO / "docs" / "img" / "local-cpu-throughput.svg"}


def run_example(log_interval: int) -> str:
    """Submit the quickstart's job, wait for it, and return its id."""
    command = [sys.executable, "-m", "dtrain.cli.main", "submit", EXAMPLE,
               "--set", "hyperparameters.steps=40",
               "--set", f"hyperparameters.log_interval={log_interval}", "-o", "json"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"{' '.join(command[2:])} failed:\n{result.stdout}{result.stderr}")
    return json.loads(result.stdout)["id"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", help="id or name of a finished job to chart instead of a new run")
    parser.add_argument("--log-interval", type=int, default=2,
                        help="steps between metric lines of the new run (more points)")
    args = parser.parse_args(argv)

    from dtrain.jobs.report import write_report

    job = args.job or run_example(args.log_interval)
    for metric, path in CHARTS.items():
        print(write_report(job, output=str(path), fmt="svg", metric=metric))
    return 0


if __name__ == "__main__":
    sys.exit(main())
