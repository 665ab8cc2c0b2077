"""The layer contracts of docs/architecture.md hold (import-linter on the installed layout).

The three import packages come from three folders (``sdk/`` is ``dtrain``, ``launcher/`` is
``dtrain.launcher``, ``training_runtime/`` is ``dtrain.runtime``); import-linter reads one
package tree from disk, so the test builds that tree from links to the real files.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "tests" / "import_layers.toml"
FOLDERS = {"dtrain": "sdk", "dtrain/launcher": "launcher", "dtrain/runtime": "training_runtime"}


def _mirror(site: Path) -> None:
    for package, folder in FOLDERS.items():
        source = ROOT / folder
        for path in source.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            target = site / package / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(path)


def test_layer_contracts_hold(tmp_path):
    site = tmp_path / "site"
    _mirror(site)
    env = dict(os.environ, PYTHONPATH=str(site))
    command = ("import sys; from importlinter.cli import lint_imports_command; "
               "sys.exit(lint_imports_command())")
    done = subprocess.run(
        [sys.executable, "-c", command, "--config", str(CONFIG), "--no-cache"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    report = done.stdout[done.stdout.find("Contracts"):] or done.stdout + done.stderr
    assert done.returncode == 0, report
    assert "BROKEN" not in report and "KEPT" in report, report


def test_every_package_folder_is_installed():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = set()
    for package, folder in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join([*package.split("/"), *rel]))
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
