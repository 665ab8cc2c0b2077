"""The CLI as a user runs it: exit codes, one-line errors, JSON output."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import _cli
import pytest

EXAMPLE = "entry_point: recipe:causal_lm\nhyperparameters: {model: pythia-70m}\n"

# check=False: the exit code is what these tests assert on
dtrain = partial(_cli.dtrain, check=False, timeout=60)


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(EXAMPLE)
    return path


def test_version_and_help():
    assert dtrain("--version").stdout.strip() == "dtrain, version 0.1.0"
    for command in ("validate", "plan", "schema", "instances"):
        result = dtrain(command, "--help")
        assert result.returncode == 0 and "Usage: dtrain" in result.stdout


def test_validate_ok_prints_a_summary(spec_file):
    result = dtrain("validate", str(spec_file))
    assert result.returncode == 0
    assert result.stdout.startswith("ok: causal-lm · target local")


def test_validate_shows_the_plan_s_notes():
    # a model that cannot fit its devices: validate said only "ok" while plan warned
    example = Path(__file__).resolve().parents[2] / "examples" / "sagemaker-p4d.yaml"
    result = dtrain("validate", str(example), "--set", "hyperparameters.model=gpt-neox-20b",
                    "--set", "distribution.sharding_degree=1")
    assert result.returncode == 0 and result.stdout.startswith("ok: pythia-1b-p4d")
    assert "note: estimated 315.5 GiB per device exceeds its 40 GiB" in result.stderr


def test_invalid_spec_exits_2_with_one_line_and_no_traceback(spec_file):
    result = dtrain("validate", str(spec_file), "--set", "compute.instance_count=0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: compute.instance_count: input should be greater than or equal to 1 (got 0)"]
    assert "Traceback" not in result.stderr


def test_debug_shows_the_traceback(spec_file):
    result = dtrain("--debug", "validate", str(spec_file), "--set", "compute.instance_count=0")
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_missing_file_and_bad_option_exit_2(tmp_path):
    assert dtrain("validate", str(tmp_path / "nope.yaml")).returncode == 2
    assert dtrain("plan", "--no-such-option").returncode == 2


def test_an_aws_call_without_credentials_and_an_unwritable_file_are_one_line(tmp_path,
                                                                               monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    result = dtrain("ec2", "gc", "--dry-run", "--region", "us-east-1",
                    env={"AWS_EC2_METADATA_DISABLED": "true"})  # no instance role either
    assert result.returncode == 1 and result.stderr.splitlines() == [(
        "error: an AWS call failed: NoCredentialsError: Unable to locate credentials; configure "
        "AWS credentials (aws configure, AWS_PROFILE, or the instance's role)")]
    # status still shows what was recorded of a job its target cannot be asked about
    from dtrain.jobs.store import JobStore

    job = JobStore().create(name="sm-job", target="sagemaker", spec={}, status="Running",
                            target_data={"training_job_name": "sm-job-1", "region": "us-east-1"})
    shown = dtrain("status", job.id, env={"AWS_EC2_METADATA_DISABLED": "true"})
    assert shown.returncode == 0 and "status    Running" in shown.stdout
    assert shown.stderr.startswith(f"warning: could not ask sagemaker about job {job.id} (")
    assert shown.stderr.rstrip().endswith("showing what was last recorded")
    result = dtrain("schema", "--file", str(tmp_path / "no-such-folder" / "schema.json"))
    assert result.returncode == 1 and result.stderr.splitlines() == [
        f"error: cannot write {tmp_path}/no-such-folder/schema.json: No such file or directory"]


def test_plan_json_resolves_the_mesh(spec_file):
    result = dtrain("plan", str(spec_file), "-o", "json", "--set", "compute.target=ec2",
                    "--set", "compute.instance_type=p4d.24xlarge", "--set",
                    "compute.instance_count=2", "--set", "output_path=s3://dtrain-bucket/o",
                    "--set", "ec2.instance_profile=dtrain-node", "--set", "ec2.subnet_id=subnet-1")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["world_size"] == 16
    plan = data["parallelism"]
    assert plan["mesh_axis_names"] == ["pp", "dp_replicate", "dp_shard", "tp"]
    assert plan["mesh_shape"] == [1, 16, 1, 1] and plan["strategy"] == "DDP"
    assert data["max_run_cost"] == pytest.approx(2 * 32.7726 * 24)


def test_plan_text_shows_a_strategy_table(spec_file):
    result = dtrain("plan", str(spec_file))
    assert result.returncode == 0
    assert "mesh                         sharding degree resolved at run time" in result.stdout
    assert "world size                   1 (1 node × 1 process)" in result.stdout
    assert "tokens/s" in result.stdout
    result = dtrain("plan", str(spec_file), "--set", "distribution.sharding_degree=1",
                    "--set", "compute.max_run=600")
    assert "pp 1 × dp_replicate 1 × dp_shard 1 × tp 1 (DDP)" in result.stdout
    assert "$ for max_run (10 min)" in result.stdout


def test_schema_is_json_schema_of_the_jobspec():
    schema = json.loads(dtrain("schema").stdout)
    assert schema["title"] == "JobSpec" and "compute" in schema["properties"]


def test_instances_lists_the_catalog_with_price_date():
    out = dtrain("instances").stdout
    assert "p4d.24xlarge" in out and "as of" in out


def test_submit_dry_run_prints_the_plan_then_the_request(spec_file):
    result = dtrain("submit", str(spec_file), "--dry-run")
    assert result.returncode == 0, result.stderr
    plan_at = result.stdout.index("\nmesh ")
    request_at = result.stdout.index("request (local):")
    assert plan_at < request_at
    data = json.loads(dtrain("submit", str(spec_file), "--dry-run", "-o", "json").stdout)
    assert set(data) == {"plan", "request", "packed"} and data["plan"]["world_size"] == 1


def test_expensive_ec2_launch_needs_yes_and_launches_nothing_without_it(tmp_path):
    spec = str(Path(__file__).parents[2] / "examples" / "ec2-p4d.yaml")
    # no AWS call may happen before the answer: the endpoint is a closed local port
    env = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    result = dtrain("submit", spec, input="", env=env)
    assert result.returncode == 1, result.stderr
    assert "not launched" in result.stderr and "pass --yes" in result.stderr
    assert "Traceback" not in result.stderr
