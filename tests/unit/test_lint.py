"""The tree stays clean under the pinned ruff (constraints.txt), configured in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ruff_check_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format=concise", "."],
                            cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    version = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True,
                             text=True, check=False).stdout.strip()
    # the version is shown because another ruff than the pinned one may flag other things
    assert result.returncode == 0, f"{version}:\n{result.stdout}{result.stderr}"
