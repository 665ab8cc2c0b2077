"""EC2 request building: the exact calls a p4d or p5 job makes, checked against golden JSON.

Regenerate the golden files after an intended change with
``DTRAIN_UPDATE_GOLDEN=1 pytest tests/unit/test_ec2_requests.py`` and review the diff.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from dtrain.core.errors import SpecError
from dtrain.launcher import aws, packaging
from dtrain.launcher.base import JobIdentity, Request, Upload
from dtrain.launcher.ec2 import requests as req
from dtrain.launcher.ec2.launcher import Ec2Launcher
from dtrain.planning.planner import plan
from dtrain.spec.model import JobSpec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ec2-p4d.yaml"
GOLDEN = ROOT / "tests" / "golden"
JOB = "pythia-1b-ec2-20250101-000000"
IDENTITY = JobIdentity(id="0123456789ab", name=JOB, submitted_at=1735689600.0)
P5_OVERRIDES = [
    "compute.instance_type=p5.48xlarge", "compute.instance_count=2",
    "ec2.ami=ami-0123456789abcdef0", "ec2.subnet_id=subnet-0f1e2d3c4b5a69788",
    "ec2.ssh_cidr=203.0.113.7/32",
    "ec2.instance_profile=arn:aws:iam::111122223333:instance-profile/dtrain-node",
    "ec2.capacity_reservation_id=cr-0123456789abcdef0", "ec2.capacity_block=true",
    "ec2.placement_group=my-cluster-pg", "ec2.key_name=ops",
]


@pytest.fixture(autouse=True)
def _dtrain_home(tmp_path, monkeypatch):
    monkeypatch.setenv("DTRAIN_HOME", str(tmp_path / "home"))


def request(overrides=(), job=JOB) -> Request:
    spec = JobSpec.from_file(EXAMPLE, overrides=list(overrides))
    return Ec2Launcher().build_request(spec, plan(spec), dataclasses.replace(IDENTITY, name=job))


def build(overrides=(), job=JOB) -> dict:
    """The request's payload: every EC2 call."""
    return request(overrides, job).payload


def golden_text(built: Request) -> str:
    """The request as --dry-run prints it, with this checkout's path (the source folder to
    pack) written as <repo>."""
    return json.dumps(built.to_dict(), indent=2).replace(str(ROOT), "<repo>")


def job_config(user_data: str) -> dict:
    """The job JSON the user data writes to job.json (between the heredoc markers)."""
    body = user_data.split("<<'DTRAIN_JOB_JSON'\n", 1)[1].split("\nDTRAIN_JOB_JSON\n", 1)[0]
    return json.loads(body)


@pytest.mark.parametrize("name,overrides", [("p4d", []), ("p5", P5_OVERRIDES)])
def test_request_set_matches_golden(name, overrides):
    path = GOLDEN / f"ec2_{name}.json"
    if os.environ.get("DTRAIN_UPDATE_GOLDEN"):
        path.write_text(golden_text(request(overrides)) + "\n")
    assert json.loads(path.read_text()) == json.loads(golden_text(request(overrides)))


def test_uploads_are_the_source_archive_and_the_wheel_the_user_data_installs():
    built = request()
    prefix = built.payload["prefix"]
    assert built.uploads == (
        Upload(str(ROOT / "examples" / "sagemaker_src"),
                         f"{prefix}/source/{packaging.SOURCE_ARCHIVE}"),
        Upload(packaging.WHEEL, f"{prefix}/source/{packaging.wheel_name()}"))
    assert f"WHEEL_URI='{built.uploads[1].uri}'" in built.payload["run_instances"]["UserData"]
    recipe = request(["entry_point=recipe:causal_lm", "source_dir=null"])
    assert [u.source for u in recipe.uploads] == [packaging.WHEEL]
    assert job_config(recipe.payload["run_instances"]["UserData"])["source"] is None


def test_p4d_nodes_get_four_efa_interfaces_one_per_network_card():
    node = build()["run_instances"]
    cards = node["NetworkInterfaces"]
    assert [(c["NetworkCardIndex"], c["DeviceIndex"], c["InterfaceType"]) for c in cards] == [
        (0, 0, "efa"), (1, 1, "efa"), (2, 1, "efa"), (3, 1, "efa")]
    assert {c["SubnetId"] for c in cards} == {"{{subnet_id}}"}
    assert node["InstanceType"] == "p4d.24xlarge"
    assert node["Placement"] == {"GroupName": f"dtrain-{JOB}-{{{{launch_token}}}}"}


def test_the_whole_cluster_is_one_all_or_nothing_request():
    # AWS's advice for a cluster placement group: one request, so EC2 places every node or none
    node = build()["run_instances"]
    assert node["MinCount"] == node["MaxCount"] == 2
    assert node["ClientToken"] == "dtrain-{{launch_token}}"


def test_p5_nodes_get_32_interfaces_efa_only_beyond_card_0():
    node = build(P5_OVERRIDES)["run_instances"]
    cards = node["NetworkInterfaces"]
    assert len(cards) == 32
    assert (cards[0]["DeviceIndex"], cards[0]["InterfaceType"]) == (0, "efa")
    assert {(c["DeviceIndex"], c["InterfaceType"]) for c in cards[1:]} == {(1, "efa-only")}
    assert [c["NetworkCardIndex"] for c in cards] == list(range(32))


def test_security_group_admits_only_itself_and_no_ssh_by_default():
    sg = build()["security_group"]
    ingress = sg["AuthorizeSecurityGroupIngress"]["IpPermissions"]
    assert ingress == [{"IpProtocol": "-1", "UserIdGroupPairs": [
        {"GroupId": "{{security_group_id}}", "Description": ingress[0]["UserIdGroupPairs"][0][
            "Description"]}]}]
    assert "0.0.0.0/0" not in json.dumps(sg)
    egress = sg["AuthorizeSecurityGroupEgress"]["IpPermissions"]
    assert egress[0]["UserIdGroupPairs"][0]["GroupId"] == "{{security_group_id}}"


def test_ssh_rule_only_from_the_given_cidr():
    ingress = build(P5_OVERRIDES)["security_group"]["AuthorizeSecurityGroupIngress"]
    ssh = [p for p in ingress["IpPermissions"] if p["IpProtocol"] == "tcp"]
    assert ssh == [{"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "IpRanges": [
        {"CidrIp": "203.0.113.7/32", "Description": "SSH (ec2.ssh_cidr)"}]}]


def test_every_node_requires_imdsv2_terminates_on_shutdown_and_is_tagged():
    node = build()["run_instances"]
    assert node["MetadataOptions"]["HttpTokens"] == "required"
    assert node["InstanceInitiatedShutdownBehavior"] == "terminate"
    assert node["IamInstanceProfile"] == {"Name": "dtrain-node"}
    assert node["BlockDeviceMappings"][0]["Ebs"]["VolumeSize"] == 500
    for spec in node["TagSpecifications"]:
        tags = {t["Key"]: t["Value"] for t in spec["Tags"]}
        assert tags[aws.TAG_JOB] == JOB and tags[aws.TAG_CREATED_BY] == "dtrain"
        assert tags["team"] == "ml-platform" and tags["Name"] == f"dtrain-{JOB}"
    assert "InstanceMarketOptions" not in node


def test_user_data_reads_the_rank_and_carries_the_wheel_and_the_job_config():
    request = build()
    text = request["run_instances"]["UserData"]
    assert text.startswith("#!/bin/bash\n")
    # one script for every node: the rank is the node's launch index in the one request
    assert "DTRAIN_NODE_RANK=$(imds ami-launch-index)" in text
    assert f"{request['prefix']}/source/{packaging.wheel_name()}" in text
    assert "shutdown -h +735 " in text  # 12 h max_run + 15 min margin, in minutes
    config = job_config(text)
    assert config["num_nodes"] == 2 and config["settings"]["processes_per_host"] == 8
    assert config["settings"]["distribution"]["sharding_degree"] == 8
    assert config["channels"] == {"train": "s3://dtrain-example-bucket/datasets/pile/train"}
    assert config["source"] == f"{request['prefix']}/source/sourcedir.tar.gz"


def test_capacity_block_and_reservation_targeting():
    node = build(P5_OVERRIDES)["run_instances"]
    assert node["InstanceMarketOptions"] == {"MarketType": "capacity-block"}
    assert node["CapacityReservationSpecification"] == {
        "CapacityReservationTarget": {"CapacityReservationId": "cr-0123456789abcdef0"}}


def test_existing_placement_group_is_used_not_created():
    request = build(P5_OVERRIDES)
    assert request["placement_group"] == {"create": False, "GroupName": "my-cluster-pg"}
    assert request["run_instances"]["Placement"] == {"GroupName": "my-cluster-pg"}


def test_spot_uses_one_time_spot_market_options():
    node = build(["compute.use_spot=true"])["run_instances"]
    assert node["InstanceMarketOptions"]["MarketType"] == "spot"
    assert node["InstanceMarketOptions"]["SpotOptions"]["InstanceInterruptionBehavior"] == \
        "terminate"


@pytest.mark.parametrize("instance_type", ["p4d.24xlarge", "p5.48xlarge", "g6e.48xlarge"])
def test_a_node_of_several_network_interfaces_needs_a_subnet(instance_type):
    # several interfaces: no public IP, so the default subnet would leave the node without S3
    with pytest.raises(SpecError, match=r"ec2.subnet_id: needed .* no public IP .* NAT"):
        JobSpec.from_file(EXAMPLE, overrides=[f"compute.instance_type={instance_type}",
                                              "ec2.subnet_id=null"])


def test_a_node_of_one_interface_may_use_the_default_subnet():
    payload = build(["compute.instance_type=g5.48xlarge", "ec2.subnet_id=null"])
    assert payload["lookups"]["subnet_id"] == {
        "default_subnet": "first default subnet of the default VPC"}
    assert len(payload["run_instances"]["NetworkInterfaces"]) == 1


def test_spot_with_capacity_block_is_refused_by_validation_with_the_fix():
    # validation owns the rule (dtrain submit --dry-run says it too): no request is built
    with pytest.raises(SpecError, match="use_spot") as caught:
        JobSpec.from_file(EXAMPLE, overrides=["compute.use_spot=true",
                                              "ec2.capacity_reservation_id=cr-1",
                                              "ec2.capacity_block=true"])
    assert "capacity_block" in str(caught.value)


def test_ami_auto_is_a_documented_ssm_lookup_not_a_call():
    lookups = build()["lookups"]
    assert lookups["ami_id"] == {"ssm_parameter": req.DLAMI_SSM_PARAMETER}
    assert req.DLAMI_SSM_PARAMETER.startswith("/aws/service/deeplearning/ami/x86_64/")


def test_the_default_ami_carries_a_torch_the_runtime_runs_on():
    # the node agent runs on the AMI's own torch; one older than dtrain's minimum fails every
    # node at start, after the instances are paid for
    from dtrain.core import torch_support

    assert torch_support.problem(req.DLAMI_PYTORCH_VERSION) is None
    assert f"pytorch-{req.DLAMI_PYTORCH_VERSION}-" in req.DLAMI_SSM_PARAMETER
    assert torch_support.problem("2.6") is not None  # the AMI this once named


def test_cost_line_and_confirmation_threshold():
    request = build()
    assert req.cost_line(request["cost"]) == (
        "cost: 2 × p4d.24xlarge × $32.77/h × 12 h max_run = up to $786.54")
    assert req.needs_confirmation(request["cost"])
    assert not req.needs_confirmation(build(["ec2.confirm_above_usd=1000"])["cost"])


def test_values_too_large_for_the_user_data_are_refused_by_validation_and_at_the_budget_fit():
    with pytest.raises(SpecError, match=r"^hyperparameters / environment / inputs: 20307 bytes "
                                        r"as JSON, over the 10240 .* input channel$"):
        build(["hyperparameters.blob=" + "x" * 20000])
    from dtrain.spec.rules.ec2 import USER_VALUES_BUDGET

    base = len(json.dumps({"hyperparameters": JobSpec.from_file(EXAMPLE).hyperparameters,
                           "environment": {"NCCL_DEBUG": "WARN"}, "inputs": {}}, indent=1))
    longest = "n" * 63  # the longest job name a target makes
    at_budget = request(["hyperparameters.blob=" + "x" * (USER_VALUES_BUDGET - base - 400)],
                        job=longest).payload
    assert len(at_budget["run_instances"]["UserData"].encode()) <= 16 * 1024


def test_build_request_is_pure(monkeypatch):
    import boto3

    monkeypatch.setattr(boto3, "client", lambda *a, **k: pytest.fail("no AWS client"))
    launcher = Ec2Launcher()
    before = dict(vars(launcher))
    spec = JobSpec.from_file(EXAMPLE)
    built = launcher.build_request(spec, plan(spec), IDENTITY)
    assert built == launcher.build_request(spec, plan(spec), IDENTITY) == request()
    assert vars(launcher) == before  # nothing kept for submit: the request is all it gets
    assert built.job == IDENTITY and JOB in built.payload["prefix"]
