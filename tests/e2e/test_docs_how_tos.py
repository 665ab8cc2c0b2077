"""The how-tos' code runs as written: their files are laid out as a project and its tests run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
BLOCK = re.compile(r"```(?:python|yaml)\n# ([\w./-]+)\n(.*?)```", re.DOTALL)


def project_from(page: Path, root: Path) -> list[str]:
    """Write every code block of ``page`` whose first line names a file; return the names."""
    written = []
    for name, body in BLOCK.findall(page.read_text()):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {name}\n{body}")
        written.append(name)
    return written


@pytest.mark.slow
def test_the_ci_with_moto_how_to_runs_as_written(tmp_path):
    files = project_from(DOCS / "how-to" / "ci-with-moto.md", tmp_path)
    assert {"jobs/train.yaml", "conftest.py", "tests/test_specs.py", "tests/test_submit.py",
            "tests/test_request.py"} <= set(files)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PYTEST_"))}
    for attempt in ("first", "second"):  # the second run compares with the reviewed request
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300, check=False)
        assert done.returncode == 0, f"{attempt} run:\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
        assert "3 passed" in done.stdout
    assert (tmp_path / "tests" / "train-sagemaker-request.json").exists()
