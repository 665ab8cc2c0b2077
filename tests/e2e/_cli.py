"""Running the ``dtrain`` CLI as a user does, in a subprocess, for the end-to-end tests."""

from __future__ import annotations

import os
import subprocess
import sys


def dtrain(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``dtrain ARGS`` with this interpreter; fails the test with its output unless it exits 0."""
    result = subprocess.run([sys.executable, "-m", "dtrain.cli.main", *args], capture_output=True,
                            text=True, timeout=timeout, env=dict(os.environ), check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result
