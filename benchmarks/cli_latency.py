"""Median wall time of the client's common commands (target: under 0.5 s each).

Run:  python benchmarks/cli_latency.py [--repeat 7]
Each command runs as a fresh process, as a user types it. When the `sagemaker` extra is
installed, `python -c "import sagemaker.train"` is timed too, for comparison.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "sagemaker-p4d.yaml"


def commands() -> list[tuple[str, list[str]]]:
    dtrain = shutil.which("dtrain") or sys.argv[0]
    spec = str(SPEC if SPEC.exists() else ROOT / "examples" / "local-cpu.yaml")
    rows = [
        ("dtrain --help", [dtrain, "--help"]),
        ("dtrain validate <example>", [dtrain, "validate", spec]),
        ("dtrain plan <example>", [dtrain, "plan", spec]),
        ("python -c 'import dtrain'", [sys.executable, "-c", "import dtrain"]),
    ]
    if importlib.util.find_spec("sagemaker") is not None:
        rows.append(("python -c 'import sagemaker.train'",
                     [sys.executable, "-c", "import sagemaker.train"]))
    return rows


def median_seconds(argv: list[str], repeat: int) -> float:
    subprocess.run(argv, capture_output=True, check=False)  # warm the file cache
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = subprocess.run(argv, capture_output=True, check=False)
        times.append(time.perf_counter() - start)
        if result.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed:\n{result.stderr.decode()}")
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    print(f"{'command':40} {'median':>8}  target")
    for label, argv in commands():
        seconds = median_seconds(argv, args.repeat)
        ok = "ok" if seconds < 0.5 or "sagemaker" in label else "SLOW"
        print(f"{label:40} {seconds:7.3f}s  {ok}")


if __name__ == "__main__":
    main()
