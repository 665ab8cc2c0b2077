"""Every shell command the quickstart shows works: cheap ones run here, as a user types them in
the repository root; the others are matched to the test or CI step that runs them."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "docs" / "quickstart.md"
# Commands cheap enough to run in a unit test (no job, no network).
RUN_HERE = ("dtrain validate ", "dtrain plan ", "dtrain list", "dtrain instances",
            "dtrain schema", "dtrain --help", "dtrain --version")
# Where the other commands are run; a command is matched when every one of its words (the last
# path component for paths) appears in one file there.
ELSEWHERE_ROOTS = (REPO / ".ci", REPO / "tests")


def quickstart_commands() -> list[str]:
    """Commands of the ```bash blocks, continuation lines joined, prompts and comments dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", QUICKSTART.read_text(), re.MULTILINE | re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip().removeprefix("$ ")
            if line and not line.startswith("#"):
                commands.append(" ".join(line.split()))
    return commands


def _words(command: str) -> list[str]:
    words = [w for w in shlex.split(command) if w not in ("-q", "python", "-m")]
    return [w.rsplit("/", 1)[-1] if "/" in w else w for w in words]


def _files_running(command: str) -> list[Path]:
    words = _words(command)
    found = []
    for root in ELSEWHERE_ROOTS:
        for path in sorted(root.rglob("*")):
            if not path.is_file() or path.name.startswith("test_docs") or path.suffix == ".pyc":
                continue
            text = path.read_text(errors="replace")
            if all(word in text for word in words):
                found.append(path)
    return found


def test_quickstart_shows_install_test_and_the_main_job():
    commands = quickstart_commands()
    assert 'pip install -c constraints.txt -e ".[dev]"' in commands
    assert "python -m pytest -q" in commands
    assert any(c.startswith("dtrain submit examples/") for c in commands)


@pytest.mark.parametrize("command", [c for c in quickstart_commands()
                                     if not c.startswith(RUN_HERE)])
def test_quickstart_command_is_run_by_another_test_or_ci(command):
    assert _files_running(command), (
        f"docs/quickstart.md shows `{command}`, but no file under .ci/ or tests/ runs it; "
        "write a test that does, or list a cheap command in RUN_HERE of this file")


def _dtrain() -> list[str]:
    script = shutil.which("dtrain")
    return [script] if script else [sys.executable, "-m", "dtrain.cli.main"]


@pytest.mark.parametrize("command", [c for c in quickstart_commands() if c.startswith(RUN_HERE)])
def test_quickstart_command_runs(command, tmp_path):
    env = {**os.environ, "DTRAIN_HOME": str(tmp_path / "dtrain-home")}
    result = subprocess.run(_dtrain() + shlex.split(command)[1:], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, f"`{command}` failed:\n{result.stdout}\n{result.stderr}"
