"""Secrets in a job's environment: references resolved on the node, plain ones warned about and
never printed; SSH is not opened to the world by accident."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import boto3
import pytest
from dtrain.core.errors import SpecError, SpecWarning
from dtrain.runtime.agent.secrets import resolve_references
from dtrain.spec.model import JobSpec
from moto import mock_aws

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TOKEN = "hf_abcdefghijklmnopqrstuvwxyz0123456789"


def test_a_secret_looking_variable_in_plain_text_is_warned_about_and_a_reference_is_not():
    spec = {"entry_point": "recipe:causal_lm", "hyperparameters": {"data": "/data/corpus"},
            "environment": {"HF_TOKEN": TOKEN}}
    with pytest.warns(SpecWarning, match=r"environment.HF_TOKEN: looks like a secret given in "
                                         r"plain text.*secretsmanager:<secret name>"):
        JobSpec.from_dict(spec)
    spec["environment"] = {"HF_TOKEN": "secretsmanager:prod/hf#token", "LOG_LEVEL": "info"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        JobSpec.from_dict(spec)
    assert not [w for w in caught if issubclass(w.category, SpecWarning)]


@pytest.mark.parametrize("example, target", [("ec2-p4d.yaml", "ec2"),
                                             ("sagemaker-p4d.yaml", "sagemaker")])
def test_dry_runs_never_print_a_plain_secret(example, target):
    for fmt in ("text", "json"):
        done = subprocess.run(
            [sys.executable, "-m", "dtrain.cli.main", "submit", str(EXAMPLES / example),
             "--dry-run", "-o", fmt, "--set", f"environment.HF_TOKEN={TOKEN}"],
            capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert TOKEN not in done.stdout and "<redacted>" in done.stdout
        assert "environment.HF_TOKEN: looks like a secret" in done.stderr


@mock_aws
def test_the_node_resolves_references_with_its_own_credentials():
    boto3.client("secretsmanager").create_secret(Name="prod/hf",
                                                 SecretString=json.dumps({"token": TOKEN}))
    boto3.client("secretsmanager").create_secret(Name="prod/wandb", SecretString="w-123")
    boto3.client("ssm").put_parameter(Name="/ml/db-password", Value="pw-9", Type="SecureString")
    env = {"HF_TOKEN": "secretsmanager:prod/hf#token", "WANDB_API_KEY": "secretsmanager:prod/wandb",
           "DB_PASSWORD": "ssm:/ml/db-password", "PLAIN": "value"}
    assert sorted(resolve_references(env)) == ["DB_PASSWORD", "HF_TOKEN", "WANDB_API_KEY"]
    assert env == {"HF_TOKEN": TOKEN, "WANDB_API_KEY": "w-123", "DB_PASSWORD": "pw-9",
                   "PLAIN": "value"}
    with pytest.raises(ValueError, match=r"^environment MISSING: cannot read secretsmanager "
                                         r"secret 'nope'"):
        resolve_references({"MISSING": "secretsmanager:nope"})


def test_ssh_open_to_the_world_is_refused_unless_allowed():
    base = {"entry_point": "recipe:causal_lm", "output_path": "s3://out-bkt/d",
            "compute": {"target": "ec2", "instance_type": "p4d.24xlarge"}}
    profile = {"instance_profile": "dtrain-node", "subnet_id": "subnet-0123"}
    with pytest.raises(SpecError, match=r"^ec2.ssh_cidr: 0.0.0.0/0 opens SSH to a large part of "
                                        r"the internet.*allow_open_ssh"):
        JobSpec.from_dict({**base, "ec2": {"ssh_cidr": "0.0.0.0/0", **profile}})
    assert JobSpec.from_dict({**base, "ec2": {"ssh_cidr": "0.0.0.0/0", "allow_open_ssh": True,
                                              **profile}})
    assert JobSpec.from_dict({**base, "ec2": {"ssh_cidr": "203.0.113.0/24", **profile}})



def test_aws_region_alone_is_the_node_s_region(monkeypatch):
    # botocore reads AWS_DEFAULT_REGION only; AWS_REGION alone failed with NoRegionError
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    with mock_aws():
        boto3.client("ssm", region_name="eu-west-1").put_parameter(
            Name="/ml/token", Value="t-1", Type="SecureString")
        env = {"TOKEN": "ssm:/ml/token"}
        assert resolve_references(env) == ["TOKEN"] and env["TOKEN"] == "t-1"


def test_a_node_without_a_region_is_told_to_set_one(monkeypatch):
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    with pytest.raises(ValueError, match=r"\(NoRegionError: .*\); the node has no AWS region: "
                                         r"set AWS_REGION in the job's environment"):
        resolve_references({"HF_TOKEN": "secretsmanager:prod/hf"})
