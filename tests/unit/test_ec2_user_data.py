"""The user-data shell script run locally with stand-ins for aws, python and shutdown.

It must schedule the max_run backstop, write the job config, install the wheel, start the Python
bootstrap with this node's rank (its launch index, from the instance metadata, which a ``curl``
stand-in answers), and power the node off at the end even when a step fails.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
from dtrain.launcher import packaging
from dtrain.launcher.ec2 import userdata
from dtrain.planning.planner import plan
from dtrain.spec.model import JobSpec

ROOT = Path(__file__).resolve().parents[2]


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


# IMDSv2 as the script asks it: a token, then the node's launch index (none: a 404)
CURL = """case "$*" in
  *api/token*) echo token ;;
  *meta-data/ami-launch-index*) echo "curl ami-launch-index" >> "$CALLS"
    [ -n "$LAUNCH_INDEX" ] && echo -n "$LAUNCH_INDEX" || exit 22 ;;
  *meta-data/local-ipv4*) echo -n 10.0.0.5 ;;
  *meta-data/instance-id*) echo -n i-0 ;;
  *) exit 22 ;;
esac
"""


def run_user_data(tmp_path, *, aws_exit=0, launch_index="1"):
    spec = JobSpec.from_file(ROOT / "examples" / "ec2-p4d.yaml", overrides=["ec2.subnet_id=s-1"])
    script = tmp_path / "user-data.sh"
    script.write_text(userdata.render(spec, plan(spec), job_name="job-1"))
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    _stub(bin_dir, "aws", f'echo "aws $*" >> {calls}\n'
          f'[ "$4" = - ] && cat > {tmp_path}/uploaded.json\nexit {aws_exit}\n')
    _stub(bin_dir, "shutdown", f'echo "shutdown $*" >> {calls}\n')
    _stub(bin_dir, "python-stub", f'echo "python $*" >> {calls}\n')
    _stub(bin_dir, "curl", CURL)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "DTRAIN_BOOTSTRAP_DIR": str(tmp_path / "w"),
           "DTRAIN_PYTHON": str(bin_dir / "python-stub"), "AWS_DEFAULT_REGION": "us-east-1",
           "DTRAIN_HOME": str(tmp_path / "home"), "LAUNCH_INDEX": launch_index,
           "CALLS": str(calls)}
    subprocess.run(["bash", str(script)], env=env, timeout=60, check=False)
    return calls.read_text().splitlines(), tmp_path / "w"


def test_user_data_installs_runs_the_bootstrap_and_powers_off(tmp_path):
    calls, work = run_user_data(tmp_path)
    assert calls[0] == 'shutdown -h +735 dtrain: max_run reached'
    assert calls[1] == "curl ami-launch-index"  # the rank, 1 here, as the node's launch index
    wheel = packaging.wheel_name()
    assert calls[2].startswith("aws s3 cp --only-show-errors s3://dtrain-example-bucket/dtrain/"
                               f"job-1/source/{wheel} ")
    assert calls[3] == f"python -m pip install --quiet {work}/{wheel}"
    assert calls[4] == (f"python -m dtrain.launcher.ec2.node.bootstrap --config {work}/job.json "
                        f"--rank 1 --work-dir {work}")
    assert calls[-1] == "shutdown -h now dtrain: node finished"
    config = json.loads((work / "job.json").read_text())
    assert config["job"] == "job-1" and config["num_nodes"] == 2


@pytest.mark.parametrize("aws_exit", [1])
def test_user_data_powers_off_when_the_wheel_cannot_be_fetched(tmp_path, aws_exit):
    calls, _ = run_user_data(tmp_path, aws_exit=aws_exit)
    assert not any(c.startswith("python") for c in calls)
    assert calls[-1] == "shutdown -h now dtrain: node finished"


def test_a_node_that_cannot_read_its_launch_index_reports_it_and_powers_off(tmp_path):
    calls, _ = run_user_data(tmp_path, launch_index="")
    assert calls.count("curl ami-launch-index") == 5  # asked again, 2 s apart, before giving up
    assert not any(c.startswith(("python", "aws s3 cp --only-show-errors s3://")) for c in calls)
    status = [c for c in calls if c.startswith("aws s3 cp --only-show-errors - ")]
    assert status and status[0].endswith("/status/10.0.0.5.json")
    report = json.loads((tmp_path / "uploaded.json").read_text())
    assert (report["state"], report["rank"]) == ("failed", None)
    assert "could not read this node's launch index (ami-launch-index)" in report["reason"]
    assert calls[-1] == "shutdown -h now dtrain: node finished"
