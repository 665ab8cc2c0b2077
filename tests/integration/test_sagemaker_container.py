"""The SageMaker container path without a container: entry script -> wheel -> agent -> script.

What SageMaker would do is laid out under a temp ``DTRAIN_ROOT`` (the ``dtrain_code`` channel as
S3 would deliver it, ``hyperparameters.json`` and ``resourceconfig.json`` as SageMaker writes
them), then ``sagemaker_entry.sh`` runs in a fresh virtual environment that has torch (the test
interpreter's site-packages, on its path) but not this checkout's dtrain, so the runtime really
comes from the wheel. It works whether the tests run in a virtualenv or the system Python.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from dtrain.core import contract, toolkit
from dtrain.launcher import packaging
from dtrain.launcher.sagemaker.launcher import entry_script_text
from dtrain.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
TRAIN = """\
import sys
from dtrain.core.metrics_format import format_metrics
print("args", sys.argv[1:], flush=True)
print(format_metrics(1, loss=1.5), flush=True)
"""


def make_venv_with_this_interpreters_packages(env_dir: Path) -> None:
    """A venv that sees the running interpreter's site-packages (torch) through .pth path
    lines: every site folder on its path, whether it is the system Python, a virtualenv, or a
    virtualenv that also sees the system's. ``system_site_packages`` would give the base
    interpreter's only; and a path line, unlike a site dir, runs none of that folder's .pth
    files, so this checkout's editable dtrain stays invisible."""
    venv.EnvBuilder(with_pip=False).create(env_dir)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = env_dir / "lib" / version / "site-packages"
    paths = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]
    (site / "parent-site-packages.pth").write_text("\n".join(dict.fromkeys(paths)) + "\n")


@pytest.mark.slow
def test_entry_script_installs_the_wheel_and_runs_the_user_script(tmp_path):
    root, src, env_dir = tmp_path / "opt_ml", tmp_path / "src", tmp_path / "venv"
    code = root / "input" / "data" / "dtrain_code"
    code.mkdir(parents=True)
    src.mkdir()
    (src / "train.py").write_text(TRAIN)
    packaging.pack_source(src, code)
    packaging.build_runtime_wheel(code)
    (code / "sagemaker_entry.sh").write_text(entry_script_text())
    config = root / "input" / "config"
    config.mkdir(parents=True)
    (config / "resourceconfig.json").write_text(json.dumps(
        {"current_host": "algo-1", "hosts": ["algo-1"], "network_interface_name": "lo"}))
    settings = contract.Settings(entry_point="train.py", job_name="j", instance_type="local",
                                 processes_per_host=1, distribution={"backend": "gloo"})
    hps = {"epochs": 2, "sagemaker_program": "train.py", **settings.to_hyperparameters()}
    (config / "hyperparameters.json").write_text(json.dumps(toolkit.encode_hyperparameters(hps)))

    make_venv_with_this_interpreters_packages(env_dir)
    bin_dir = env_dir / "bin"
    env = {**os.environ, "DTRAIN_ROOT": str(root), "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "PYTHONNOUSERSITE": "1", "VIRTUAL_ENV": str(env_dir),
           # SageMaker resolves algo-N; here the one host is this machine
           contract.MASTER_ADDR_ENV: "127.0.0.1", contract.MASTER_PORT_ENV: str(free_port())}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(["/bin/sh", str(code / "sagemaker_entry.sh")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "args ['--epochs', '2']" in output  # no --sagemaker_* or --dtrain_* arguments
    assert "dtrain-metrics step=1 loss=1.5" in output
    installed = subprocess.run([str(bin_dir / "python"), "-c",
                                "import dtrain; print(dtrain.__file__)"],
                               capture_output=True, text=True, env=env, cwd=tmp_path, check=True)
    assert str(env_dir) in installed.stdout and str(ROOT) not in installed.stdout
    shutil.rmtree(env_dir)
