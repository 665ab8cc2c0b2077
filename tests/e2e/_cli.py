"""Running the ``dtrain`` CLI as a user does, in a subprocess, and writing the small script job
that the job tests submit, for the end-to-end tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml


def dtrain(*args: str, check: bool = True, timeout: float = 300, cwd: str | Path | None = None,
           env: dict[str, str] | None = None, input: str | None = None,
           ) -> subprocess.CompletedProcess:
    """``dtrain ARGS`` with this interpreter, in ``cwd``, with ``env`` set over this process's
    environment and ``input`` (if given) as its stdin.

    With ``check`` it fails the test with the command's output unless it exits 0; tests that
    assert on the exit code themselves pass ``check=False``.
    """
    result = subprocess.run([sys.executable, "-m", "dtrain.cli.main", *args], capture_output=True,
                            text=True, timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})},
                            input=input, check=False)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def write_job(tmp_path: Path, script: str, *, name: str = "cli-job",
              absolute_source_dir: bool = False, **compute) -> str:
    """A spec ``tmp_path/job.yaml`` that runs ``script`` (dedented) as ``code/train.py`` on the
    local target; ``compute`` adds to or overrides ``instance_type: local, max_run: 120``.

    ``source_dir`` is written as the user usually does, relative to the spec, or with
    ``absolute_source_dir`` as an absolute path.
    """
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / "train.py").write_text(textwrap.dedent(script))
    spec = {"name": name, "entry_point": "train.py",
            "source_dir": str(code) if absolute_source_dir else "code",
            "compute": {"instance_type": "local", "max_run": 120, **compute}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)
