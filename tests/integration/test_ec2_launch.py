"""The EC2 backend against moto: launch a 2-node p4d job, stop it, let it finish, fail half-way,
gc leftovers, read its logs, wait for a job until its groups are gone.

The backend is driven as the jobs layer drives it (``Ec2``: ``jobs.submit``, ``jobs.refresh``,
the backend's ``stop`` with the store's journal), so every store write the tests see went
through the journal or an ``Update``.

moto implements instances, security groups, subnets, IAM and S3 but not placement groups, and it
accepts EFA interface types and capacity reservations without modelling them. ``PlacementGroups``
below is the one standing test double: a botocore ``before-call`` handler that answers exactly
Create/Describe/DeletePlacementGroup. ``RunInstances`` still goes to moto; a
``before-parameter-build`` handler only records what was sent so the EFA, placement and capacity
parameters can be asserted. The SSM lookup of the Deep Learning AMI uses botocore's Stubber
(moto refuses the reserved ``/aws/`` parameter names). moto deletes a security group even while
network interfaces use it; the tests of that case answer ``DeleteSecurityGroup`` with EC2's
``DependencyViolation`` through a ``before-call`` handler (``security_group_in_use``).
"""

from __future__ import annotations

import base64
import io
import time
from datetime import datetime, timezone
from pathlib import Path

import boto3
import pytest
from botocore.awsrequest import AWSResponse
from botocore.stub import Stubber
from dtrain.core.errors import DtrainError, SpecError
from dtrain.jobs import api as jobs
from dtrain.jobs.store import JobRecord, JobStore, new_job_id
from dtrain.launcher import aws as aws_tags
from dtrain.launcher import packaging
from dtrain.launcher.base import Handle, JobIdentity
from dtrain.launcher.ec2 import requests as req
from dtrain.launcher.ec2 import resources as res
from dtrain.launcher.ec2 import tags
from dtrain.launcher.ec2.launcher import Ec2Launcher
from dtrain.launcher.ec2.node import bootstrap as boot
from dtrain.spec.model import JobSpec
from moto import mock_aws

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ec2-p4d.yaml"
REGION = "us-east-1"
BUCKET = "dtrain-example-bucket"
JOB = "pythia-1b-ec2-20250101-000000"


class PlacementGroups:
    """Create/Describe/DeletePlacementGroup answered in the test (moto has none).

    ``before-parameter-build`` sees the API-level parameters; ``before-call`` answers with them.
    """

    def __init__(self, events):
        self.groups: dict[str, dict] = {}
        self.calls: list[tuple[str, dict]] = []
        self._params: dict = {}
        for op in ("CreatePlacementGroup", "DescribePlacementGroups", "DeletePlacementGroup"):
            events.register(f"before-parameter-build.ec2.{op}", self._keep)
        events.register("before-call.ec2.CreatePlacementGroup", self._create)
        events.register("before-call.ec2.DescribePlacementGroups", self._describe)
        events.register("before-call.ec2.DeletePlacementGroup", self._delete)

    def _keep(self, params, **_):
        self._params = dict(params)

    @staticmethod
    def _ok(body: dict):
        return AWSResponse("https://ec2", 200, {}, None), {
            **body, "ResponseMetadata": {"HTTPStatusCode": 200}}

    def _create(self, **_):
        params = self._params
        self.calls.append(("create", params))
        tags = params.get("TagSpecifications", [{}])[0].get("Tags", [])
        self.groups[params["GroupName"]] = {"GroupName": params["GroupName"],
                                            "Strategy": params["Strategy"],
                                            "State": "available", "Tags": tags}
        return self._ok({"PlacementGroup": self.groups[params["GroupName"]]})

    def _describe(self, **_):
        wanted = {f["Name"][4:]: f["Values"] for f in self._params.get("Filters", [])
                  if f["Name"].startswith("tag:")}
        found = [g for g in self.groups.values()
                 if all(tags.tag_map(g).get(k) in v for k, v in wanted.items())]
        return self._ok({"PlacementGroups": found})

    def _delete(self, **_):
        self.calls.append(("delete", self._params))
        self.groups.pop(self._params["GroupName"], None)
        return self._ok({})


def record_run_instances(client) -> list[dict]:
    sent: list[dict] = []
    client.meta.events.register("before-parameter-build.ec2.RunInstances",
                                lambda params, **_: sent.append(dict(params)))
    return sent


def fail_run_instances_after(client, launched: int, code="InsufficientInstanceCapacity"):
    """RunInstances succeeds ``launched`` times, then EC2 says it has no capacity."""
    calls = {"n": 0}

    def handler(**_):
        calls["n"] += 1
        if calls["n"] > launched:
            return AWSResponse("https://ec2", 500, {}, None), {
                "Error": {"Code": code, "Message": "We currently do not have sufficient "
                          "p4d.24xlarge capacity in the Availability Zone you requested."},
                "ResponseMetadata": {"HTTPStatusCode": 500}}
        return None
    client.meta.events.register("before-call.ec2.RunInstances", handler)


def moto_aws(tmp_path, monkeypatch):
    """The moto account every EC2 test runs in (the ``aws`` fixture; other test modules wrap it
    in theirs)."""
    monkeypatch.setenv("DTRAIN_HOME", str(tmp_path / "home"))
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with mock_aws():
        # on the default session, so clients the CLI builds get the double too
        boto3.setup_default_session()
        groups = PlacementGroups(boto3.DEFAULT_SESSION.events)
        ec2 = boto3.client("ec2", region_name=REGION)
        s3 = boto3.client("s3", region_name=REGION)
        s3.create_bucket(Bucket=BUCKET)
        iam = boto3.client("iam", region_name=REGION)
        iam.create_instance_profile(InstanceProfileName="dtrain-node")
        subnet = ec2.describe_subnets(
            Filters=[{"Name": "default-for-az", "Values": ["true"]}])["Subnets"][0]
        yield {"ec2": ec2, "s3": s3, "subnet": subnet, "pg": groups,
               "sent": record_run_instances(ec2)}


@pytest.fixture
def aws(tmp_path, monkeypatch):
    yield from moto_aws(tmp_path, monkeypatch)


class Ec2:
    """The EC2 target as `dtrain submit/status/stop` drive it, on this test's job store.

    ``clients`` are the backend's constructor arguments (the jobs layer builds a backend from
    them for each call, as the CLI does); ``launcher`` is one such backend; ``out`` collects
    what the backends say.
    """

    def __init__(self, *, ec2_client, s3_client, subnet_id: str | None = None,
                 ssm: Stubber | None = None, **options):
        self.out = io.StringIO()
        self.clients = {"ec2_client": ec2_client, "s3_client": s3_client, "region": REGION,
                        "stream": self.out, "sleep": lambda s: None, **options}
        if ssm is not None:
            self.clients["ssm_client"] = ssm.client
        self.launcher = Ec2Launcher(**self.clients)
        self.store = JobStore()
        self._ssm, self._subnet_id = ssm, subnet_id

    def spec(self, *overrides: str) -> JobSpec:
        subnet = [f"ec2.subnet_id={self._subnet_id}"] if self._subnet_id else []
        return JobSpec.from_file(EXAMPLE, overrides=[*subnet, *overrides])

    def submit(self, *overrides: str, job: str = JOB) -> JobRecord:
        """`dtrain submit --no-wait` with the job name ``job``."""
        if self._ssm is not None:  # the SSM lookup of the Deep Learning AMI, answered once more
            ami = self.clients["ec2_client"].describe_images()["Images"][0]["ImageId"]
            self._ssm.add_response(
                "get_parameter", {"Parameter": {"Name": req.DLAMI_SSM_PARAMETER, "Value": ami,
                                                "Type": "String"}},
                {"Name": req.DLAMI_SSM_PARAMETER})
        identity = JobIdentity(id=new_job_id(), name=job, submitted_at=time.time())
        return jobs.submit(self.spec(*overrides), wait=False, store=self.store,
                           clients=self.clients, job=identity)

    def handle(self, record: JobRecord) -> Handle:
        return jobs.handle_of(record, self.launcher)

    def status(self, record: JobRecord) -> JobRecord:
        """`dtrain status`: the backend's Update, written."""
        return jobs.refresh(record, self.launcher, self.store)

    def stop(self, job: JobRecord | str) -> JobRecord:
        """The backend's stop, recording through the store's journal (`dtrain stop` asks
        ``status`` first, which these tests do where they mean it)."""
        record = self.store.find(job) if isinstance(job, str) else job
        self.launcher.stop(self.handle(record),
                           jobs.StoreJournal(self.store, self.launcher, record.id))
        return self.store.get(record.id)


def ec2_target(aws, **options) -> Ec2:
    """The backend on the moto account, with the SSM lookup of the Deep Learning AMI stubbed."""
    ssm = Stubber(boto3.client("ssm", region_name=REGION))
    ssm.activate()
    return Ec2(ec2_client=aws["ec2"], s3_client=aws["s3"], ssm=ssm,
               subnet_id=aws["subnet"]["SubnetId"], **options)


def live_instances(ec2) -> list[dict]:
    return [i for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]
            if i["State"]["Name"] in ("pending", "running")]


def dtrain_groups(ec2) -> list[dict]:
    return [g for g in ec2.describe_security_groups()["SecurityGroups"]
            if g["GroupName"].startswith("dtrain-")]


def test_two_node_p4d_job_launches_tagged_in_one_subnet_with_its_user_data(aws):
    target = ec2_target(aws, assume_yes=True)
    record = target.submit()
    assert (record.name, record.target, record.status) == (JOB, "ec2", "Starting")
    assert JobStore().find(JOB) == record
    assert record.output_location == f"s3://{BUCKET}/dtrain/{JOB}/model/"
    facts = record.target_data
    ec2 = aws["ec2"]
    nodes = live_instances(ec2)
    assert sorted(i["InstanceId"] for i in nodes) == sorted(facts["instance_ids"])
    assert len(nodes) == 2 and {i["SubnetId"] for i in nodes} == {aws["subnet"]["SubnetId"]}
    for instance in nodes:
        found = tags.tag_map(instance)
        assert found[aws_tags.TAG_JOB] == JOB and found[aws_tags.TAG_CREATED_BY] == "dtrain"
        assert found[tags.TAG_LAUNCH] == facts["launch_token"]
        assert instance["MetadataOptions"]["HttpTokens"] == "required"
        raw = ec2.describe_instance_attribute(InstanceId=instance["InstanceId"],
                                              Attribute="userData")["UserData"]["Value"]
        text = base64.b64decode(raw).decode()
        assert "DTRAIN_NODE_RANK=$(imds ami-launch-index)" in text  # the same on every node
        assert f'"launch_token": "{facts["launch_token"]}"' in text and "{{" not in text
    # the whole cluster in one request; the record lists the nodes in rank (launch index) order
    assert [(s["MinCount"], s["MaxCount"]) for s in aws["sent"]] == [(2, 2)]
    ranks = {i["InstanceId"]: i["AmiLaunchIndex"] for i in nodes}
    assert [ranks[i] for i in facts["instance_ids"]] == [0, 1]
    # what moto cannot model, asserted on the requests sent
    group = facts["placement_group"]
    kind, created = aws["pg"].calls[0]
    assert (kind, created["GroupName"], created["Strategy"]) == ("create", group, "cluster")
    assert tags.tag_map(created["TagSpecifications"][0])[aws_tags.TAG_JOB] == JOB
    for sent in aws["sent"]:
        assert sent["Placement"] == {"GroupName": group}
        assert [n["InterfaceType"] for n in sent["NetworkInterfaces"]] == ["efa"] * 4
        assert {tuple(n["Groups"]) for n in sent["NetworkInterfaces"]} == {
            (facts["security_group_id"],)}
    # the self-only security group
    sg = ec2.describe_security_groups(GroupIds=[facts["security_group_id"]])["SecurityGroups"][0]
    assert [p["UserIdGroupPairs"][0]["GroupId"] for p in sg["IpPermissions"]] == [sg["GroupId"]]
    assert not any(r.get("CidrIp") for p in sg["IpPermissions"] for r in p["IpRanges"])
    # code and runtime wheel uploaded for the bootstrap
    keys = {o["Key"] for o in aws["s3"].list_objects_v2(Bucket=BUCKET)["Contents"]}
    assert {f"dtrain/{JOB}/source/sourcedir.tar.gz",
            f"dtrain/{JOB}/source/{packaging.wheel_name()}"} <= keys
    assert target.launcher.job_status(target.handle(record))["status"] == "Starting"
    assert target.status(record).status == "Starting"  # no node has reported running yet


def test_nodes_are_recorded_and_listed_by_launch_index_whatever_order_ec2_answers_in(aws):
    # a node's rank is its launch index; EC2 does not promise its lists in that order
    def reverse_instances(parsed, **_):
        parsed.get("Instances", []).reverse()
        for reservation in parsed.get("Reservations", []):
            reservation["Instances"].reverse()
        parsed.get("Reservations", []).reverse()
    aws["ec2"].meta.events.register("after-call.ec2.RunInstances", reverse_instances)
    aws["ec2"].meta.events.register("after-call.ec2.DescribeInstances", reverse_instances)
    record = ec2_target(aws, assume_yes=True).submit()
    index = {i["InstanceId"]: i["AmiLaunchIndex"] for i in live_instances(aws["ec2"])}
    assert [index[i] for i in record.target_data["instance_ids"]] == [0, 1]
    listed = res.job_instances(aws["ec2"], JOB)
    assert [i["AmiLaunchIndex"] for i in listed] == [0, 1]


def test_stop_leaves_no_running_instance_and_no_dtrain_security_group(aws):
    target = ec2_target(aws, assume_yes=True)
    record = target.stop(target.submit())
    assert record.status == "Stopped" and record.target_data["cleanup"]["state"] == "done"
    assert record.failure_reason.startswith("stopped by user")
    assert live_instances(aws["ec2"]) == []
    assert dtrain_groups(aws["ec2"]) == []
    assert aws["pg"].groups == {}
    assert target.status(record).status == "Stopped"


def test_a_call_the_credentials_may_not_make_is_named_with_the_fix(aws):
    # every refused call read "EC2 launch failed: UnauthorizedOperation: ..." with no fix
    target = ec2_target(aws, assume_yes=True)
    fail_run_instances_after(aws["ec2"], launched=0, code="UnauthorizedOperation")
    with pytest.raises(DtrainError, match=r"^EC2 launch \(RunInstances\) failed: "
                                          r"UnauthorizedOperation: .*; check the IAM permissions "
                                          r"of your AWS credentials \(no node was launched\)"):
        target.submit()
    assert live_instances(aws["ec2"]) == [] and dtrain_groups(aws["ec2"]) == []


def test_no_capacity_for_the_cluster_rolls_everything_back(aws):
    target = ec2_target(aws, assume_yes=True)
    fail_run_instances_after(aws["ec2"], launched=0)
    with pytest.raises(DtrainError) as caught:
        target.submit()
    message = str(caught.value)
    assert "\n" not in message and "InsufficientInstanceCapacity" in message
    assert "2 × p4d.24xlarge" in message and "no node was launched" in message
    assert "ec2.subnet_id" in message and "capacity_reservation_id" in message
    assert live_instances(aws["ec2"]) == []
    assert dtrain_groups(aws["ec2"]) == [] and aws["pg"].groups == {}
    assert "Contents" not in aws["s3"].list_objects_v2(Bucket=BUCKET)  # uploads removed too
    failed = JobStore().find(JOB)  # recorded with its reason, like a failed SageMaker job
    assert failed.status == "Failed" and failed.failure_reason == message
    assert failed.target_data["cleanup"]["state"] == "done"


def test_ctrl_c_inside_run_instances_terminates_the_nodes_ec2_made_meanwhile(aws):
    node = 1  # the one RunInstances call
    target = ec2_target(aws, assume_yes=True)
    calls = {"run": 0, "lists": 0}

    def interrupt(**_):  # the nodes exist, the answer never reaches the launch
        calls["run"] += 1
        if calls["run"] == node:
            raise KeyboardInterrupt

    def not_listed_yet(params, **_):
        # EC2 lists new nodes only after a while (moto at once): the first two lists of the
        # launch's nodes (by tag, not the waiter's by id) after the interrupt come back empty
        if calls["run"] != node or not any(key.startswith("Filter") for key in params["body"]):
            return None
        calls["lists"] += 1
        if calls["lists"] <= 2:
            return AWSResponse("https://ec2", 200, {}, None), {
                "Reservations": [], "ResponseMetadata": {"HTTPStatusCode": 200}}
        return None
    aws["ec2"].meta.events.register("after-call.ec2.RunInstances", interrupt)
    aws["ec2"].meta.events.register("before-call.ec2.DescribeInstances", not_listed_yet)
    with pytest.raises(KeyboardInterrupt):
        target.submit()
    assert calls["run"] == node
    assert live_instances(aws["ec2"]) == []  # every node, though the launch knew of none
    assert dtrain_groups(aws["ec2"]) == [] and aws["pg"].groups == {}
    assert JobStore().find(JOB).status == "Failed"
    assert "looking again for nodes the cut-off RunInstances may have made" in \
        target.out.getvalue()


def test_an_upload_refused_by_s3_is_one_line_and_leaves_nothing(aws):
    target = ec2_target(aws, assume_yes=True)
    with pytest.raises(DtrainError) as caught:
        target.submit("output_path=s3://no-such-bucket-7/dtrain")
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    assert "failed: NoSuchBucket: The specified bucket does not exist; create the bucket or fix "\
        "output_path" in message
    assert live_instances(aws["ec2"]) == [] and dtrain_groups(aws["ec2"]) == []
    assert JobStore().find(JOB).status == "Failed"


def test_cost_above_threshold_is_refused_without_yes_and_nothing_is_created(aws):
    target = ec2_target(aws)  # as from Python: no one to ask, and no --yes to pass
    with pytest.raises(DtrainError, match=r"above ec2.confirm_above_usd=\$100.00; raise "
                                          r"ec2.confirm_above_usd, or lower compute.max_run$"):
        target.submit()
    assert live_instances(aws["ec2"]) == [] and dtrain_groups(aws["ec2"]) == []
    assert "Contents" not in aws["s3"].list_objects_v2(Bucket=BUCKET)  # nothing uploaded
    asked = []
    target = ec2_target(aws, confirm=lambda q: asked.append(q) or False)
    with pytest.raises(DtrainError):
        target.submit()
    assert asked == ["that is above ec2.confirm_above_usd ($100.00). Launch?"]
    assert "; pass --yes, raise ec2.confirm_above_usd" in target.store.find(JOB).failure_reason
    assert target.out.getvalue().count("up to $786.54") == 1  # the cost line, once
    refused = target.store.find(JOB)  # the record says why; nothing of it is left to remove
    assert refused.status == "Failed" and refused.failure_reason.startswith("not launched: ")
    assert target.launcher.pending_cleanup(target.handle(refused)) is None
    calls = count_ec2_calls(aws["ec2"])
    assert target.status(refused) == refused and target.stop(refused) == refused and calls == []
    with pytest.raises(DtrainError, match="no logs: it was never launched"):
        list(jobs.logs(refused.id, store=target.store, clients=target.clients))


def answer_capacity_reservation(client, **fields) -> None:
    """moto has no DescribeCapacityReservations: this double answers it with one reservation
    (an active one for 2 p4d.24xlarge in the test subnet's zone, changed by ``fields``)."""
    def describe(params, **_):
        reservation = {"CapacityReservationId": "cr-0abc", "InstanceType": "p4d.24xlarge",
                       "State": "active", "AvailableInstanceCount": 2,
                       **fields}
        return AWSResponse("https://ec2", 200, {}, None), {
            "CapacityReservations": [reservation], "ResponseMetadata": {"HTTPStatusCode": 200}}
    client.meta.events.register("before-call.ec2.DescribeCapacityReservations", describe)


def test_capacity_reservation_is_sent_as_given(aws):
    target = ec2_target(aws, assume_yes=True)
    answer_capacity_reservation(aws["ec2"], AvailabilityZone=aws["subnet"]["AvailabilityZone"])
    target.submit("ec2.capacity_reservation_id=cr-0abc", "ec2.capacity_block=true")
    for sent in aws["sent"]:
        assert sent["CapacityReservationSpecification"] == {
            "CapacityReservationTarget": {"CapacityReservationId": "cr-0abc"}}
        assert sent["InstanceMarketOptions"] == {"MarketType": "capacity-block"}


@pytest.mark.parametrize("fields,said", [
    ({"AvailabilityZone": "us-east-1f"}, ("it is in us-east-1f, and the subnet in {zone}; "
                                          "give a subnet in us-east-1f (ec2.subnet_id)")),
    ({"InstanceType": "p5.48xlarge"}, "it holds p5.48xlarge, and the job asks for p4d.24xlarge"),
    ({"PlacementGroupArn": "arn:aws:ec2:us-east-1:123456789012:placement-group/reserved-pg"},
     "it was made for placement group reserved-pg; set ec2.placement_group: reserved-pg"),
    ({"State": "scheduled"}, ("it is scheduled, not active (a capacity block can be used "
                              "from its start time)")),
    ({"AvailableInstanceCount": 1}, "1 of its instances are free, and the job needs 2"),
], ids=["zone", "instance-type", "placement-group", "not-started", "too-few-free"])
def test_a_reservation_the_nodes_cannot_launch_into_is_refused_before_anything_is_made(
        aws, fields, said):
    target = ec2_target(aws, assume_yes=True)
    zone = aws["subnet"]["AvailabilityZone"]
    answer_capacity_reservation(aws["ec2"], **{"AvailabilityZone": zone, **fields})
    with pytest.raises(DtrainError) as caught:
        target.submit("ec2.capacity_reservation_id=cr-0abc")
    assert str(caught.value).startswith("ec2.capacity_reservation_id: cr-0abc cannot take these "
                                        "nodes: " + said.format(zone=zone))
    assert aws["sent"] == [] and live_instances(aws["ec2"]) == []  # nothing launched or made
    assert dtrain_groups(aws["ec2"]) == [] and aws["pg"].groups == {}
    assert "Contents" not in aws["s3"].list_objects_v2(Bucket=BUCKET)
    assert JobStore().find(JOB).status == "Failed"


def plant_leftovers(aws, *, launched_at: str = "2020-01-01T00:00:00Z"):
    """A half-launched dtrain job (launched at ``launched_at``, with no record in this machine's
    job store), a dtrain security group, and look-alikes without tags."""
    ec2 = aws["ec2"]
    ami = ec2.describe_images()["Images"][0]["ImageId"]
    planted = [{"Key": aws_tags.TAG_CREATED_BY, "Value": "dtrain"},
               {"Key": aws_tags.TAG_JOB, "Value": "old"}, {"Key": tags.TAG_LAUNCH, "Value": "t1"},
               {"Key": tags.TAG_NUM_NODES, "Value": "2"},
               {"Key": tags.TAG_LAUNCHED_AT, "Value": launched_at}]
    orphan = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, TagSpecifications=[
        {"ResourceType": "instance", "Tags": planted}])["Instances"][0]["InstanceId"]
    vpc = aws["subnet"]["VpcId"]
    group = ec2.create_security_group(GroupName="dtrain-old-t1", Description="x", VpcId=vpc,
                                      TagSpecifications=[{"ResourceType": "security-group",
                                                          "Tags": planted}])["GroupId"]
    ec2.create_placement_group(GroupName="dtrain-old-t1", Strategy="cluster", TagSpecifications=[
        {"ResourceType": "placement-group", "Tags": planted}])
    mine = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    my_group = ec2.create_security_group(GroupName="dtrain-lookalike", Description="untagged",
                                         VpcId=vpc)["GroupId"]
    return {"orphan": orphan, "group": group, "mine": mine, "my_group": my_group}


def test_gc_removes_planted_leftovers_and_nothing_untagged(aws):
    from click.testing import CliRunner
    from dtrain.cli.ec2 import ec2 as ec2_group

    planted = plant_leftovers(aws)
    target = ec2_target(aws, assume_yes=True)
    record = target.submit()  # a healthy job: gc leaves it alone
    runner = CliRunner()
    dry = runner.invoke(ec2_group, ["gc", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert planted["orphan"] in dry.output and planted["group"] in dry.output
    assert len(live_instances(aws["ec2"])) == 4  # dry run removed nothing
    done = runner.invoke(ec2_group, ["gc", "--yes"])
    assert done.exit_code == 0, done.output
    live = {i["InstanceId"] for i in live_instances(aws["ec2"])}
    assert planted["orphan"] not in live and planted["mine"] in live and len(live) == 3
    groups = {g["GroupId"] for g in aws["ec2"].describe_security_groups()["SecurityGroups"]}
    assert planted["group"] not in groups and planted["my_group"] in groups
    assert "dtrain-old-t1" not in aws["pg"].groups and len(aws["pg"].groups) == 1
    assert target.launcher.job_status(target.handle(record))["status"] == "Starting"


# ---------------------------------------------------------------- a job that ends on its own

def finish_nodes(aws, record, *, power_off: bool = True, state: str = "completed") -> None:
    """What every node does at the end of a job: write its final status object, then power off
    (InstanceInitiatedShutdownBehavior=terminate makes that a termination)."""
    ids = record.target_data["instance_ids"]
    nodes = [i for r in aws["ec2"].describe_instances(InstanceIds=ids)["Reservations"]
             for i in r["Instances"]]
    for instance in nodes:
        node = boot.Node(rank=instance["AmiLaunchIndex"],
                         private_ip=instance["PrivateIpAddress"],
                         instance_id=instance["InstanceId"], root="/opt/ml", work_dir="/opt/dtrain")
        boot.write_status(aws["s3"], record.target_data, node, state,
                          exit_code=0 if state == "completed" else 1)
    if power_off:
        aws["ec2"].terminate_instances(InstanceIds=ids)


def security_group_in_use(client, *, times: int | None = None) -> list[str]:
    """DeleteSecurityGroup answered with EC2's DependencyViolation (the terminated nodes'
    network interfaces are still detaching) ``times`` times, or always; moto would delete."""
    calls: list[str] = []

    def keep(params, **_):
        calls.append(params["GroupId"])

    def answer(**_):
        if times is not None and len(calls) > times:
            return None
        return AWSResponse("https://ec2", 400, {}, None), {
            "Error": {"Code": "DependencyViolation",
                      "Message": f"resource {calls[-1]} has a dependent object"},
            "ResponseMetadata": {"HTTPStatusCode": 400}}
    client.meta.events.register("before-parameter-build.ec2.DeleteSecurityGroup", keep)
    client.meta.events.register("before-call.ec2.DeleteSecurityGroup", answer)
    return calls


def termination_takes_a_while(client) -> list[list[str]]:
    """TerminateInstances answered as EC2 answers it (the nodes are "shutting-down") while
    moto's nodes keep running: a real node takes about a minute to terminate, moto's none. The
    tests power the nodes off later through another client. Returns the ids of each call."""
    asked: list[list[str]] = []

    def keep(params, **_):
        asked.append(list(params["InstanceIds"]))

    def answer(**_):
        return AWSResponse("https://ec2", 200, {}, None), {
            "TerminatingInstances": [{"InstanceId": i,
                                      "CurrentState": {"Code": 32, "Name": "shutting-down"},
                                      "PreviousState": {"Code": 16, "Name": "running"}}
                                     for i in asked[-1]],
            "ResponseMetadata": {"HTTPStatusCode": 200}}
    client.meta.events.register("before-parameter-build.ec2.TerminateInstances", keep)
    client.meta.events.register("before-call.ec2.TerminateInstances", answer)
    return asked


def count_ec2_calls(client) -> list[str]:
    calls: list[str] = []
    client.meta.events.register("before-parameter-build.ec2",
                                lambda model, **_: calls.append(model.name))
    return calls


def test_a_job_that_completes_on_its_own_leaves_no_group_once_status_sees_it_end(aws):
    target = ec2_target(aws, assume_yes=True)
    record = target.submit()
    group = record.target_data["security_group_id"]
    # nodes report completion a moment before they power off: the groups are still in use
    finish_nodes(aws, record, power_off=False)
    asked = termination_takes_a_while(aws["ec2"])
    record = target.status(record)
    assert record.status == "Completed"
    # what still runs of an ended job is terminated, not trusted to power itself off
    assert asked == [record.target_data["instance_ids"]]
    cleanup = record.target_data["cleanup"]
    assert cleanup["state"] == "pending" and "2 node(s) not terminated yet" in cleanup["reason"]
    assert [g["GroupId"] for g in dtrain_groups(aws["ec2"])] == [group]
    boto3.client("ec2", region_name=REGION).terminate_instances(  # EC2 finishes shutting down
        InstanceIds=record.target_data["instance_ids"])
    record = target.status(record)
    assert record.status == "Completed" and record.target_data["cleanup"]["state"] == "done"
    assert dtrain_groups(aws["ec2"]) == [] and aws["pg"].groups == {}
    assert set(record.target_data["cleanup"]["removed"]) == {
        group, record.target_data["placement_group"]}
    assert f"removed {group}" in target.out.getvalue()
    calls = count_ec2_calls(aws["ec2"])
    assert target.status(record) == JobStore().get(record.id) and calls == []  # done: no retry


def test_a_placement_group_and_security_groups_the_user_made_are_never_removed(aws):
    aws["ec2"].create_placement_group(GroupName="my-cluster-pg", Strategy="cluster")
    vpc = aws["subnet"]["VpcId"]
    # the user's own groups, one even tagged with the job's name (but not created by dtrain)
    mine = [aws["ec2"].create_security_group(GroupName="my-efa-sg", Description="mine",
                                             VpcId=vpc)["GroupId"],
            aws["ec2"].create_security_group(
                GroupName=f"dtrain-{JOB}-mine", Description="mine", VpcId=vpc,
                TagSpecifications=[{"ResourceType": "security-group",
                                    "Tags": [{"Key": aws_tags.TAG_JOB, "Value": JOB}]}])["GroupId"]]
    target = ec2_target(aws, assume_yes=True)
    record = target.submit("ec2.placement_group=my-cluster-pg")
    finish_nodes(aws, record)
    record = target.status(record)
    assert record.status == "Completed" and record.target_data["cleanup"]["removed"] == [
        record.target_data["security_group_id"]]
    assert list(aws["pg"].groups) == ["my-cluster-pg"]
    left = {g["GroupId"] for g in aws["ec2"].describe_security_groups()["SecurityGroups"]}
    assert set(mine) <= left and record.target_data["security_group_id"] not in left


def test_a_security_group_still_in_use_is_removed_by_the_next_status_call(aws):
    target = ec2_target(aws, assume_yes=True)
    record = target.submit()
    group = record.target_data["security_group_id"]
    tried = security_group_in_use(aws["ec2"], times=1)
    finish_nodes(aws, record)
    record = target.status(record)  # no exception: the job did complete
    assert record.status == "Completed" and tried == [group]
    cleanup = record.target_data["cleanup"]
    assert cleanup["state"] == "pending" and cleanup["left"] == [group]
    assert cleanup["removed"] == [record.target_data["placement_group"]]
    assert "DependencyViolation" in cleanup["reason"]
    assert f"{group} not removed yet" in target.out.getvalue()
    assert "dtrain ec2 gc" in target.out.getvalue()
    assert [g["GroupId"] for g in dtrain_groups(aws["ec2"])] == [group]
    record = target.status(JobStore().get(record.id))
    assert tried == [group, group] and dtrain_groups(aws["ec2"]) == []
    assert record.status == "Completed" and record.target_data["cleanup"]["state"] == "done"


def test_a_group_in_use_for_an_hour_is_left_to_gc_which_removes_it_by_default(aws):
    from click.testing import CliRunner
    from dtrain.cli.ec2 import ec2 as ec2_group
    from dtrain.launcher.ec2.cleanup import CLEANUP_RETRY_S

    now = {"t": 1_700_000_000.0}
    target = ec2_target(aws, assume_yes=True, clock=lambda: datetime.fromtimestamp(
        now["t"], timezone.utc))
    record = target.submit()
    group = record.target_data["security_group_id"]
    tried = security_group_in_use(aws["ec2"])  # the launcher's client only, not gc's
    finish_nodes(aws, record, state="failed")
    assert target.status(record).target_data["cleanup"]["state"] == "pending"
    now["t"] += CLEANUP_RETRY_S
    record = target.status(JobStore().get(record.id))
    assert record.status == "Failed" and record.target_data["cleanup"]["state"] == "left-for-gc"
    assert record.target_data["cleanup"]["tries"] == 2 and len(tried) == 2
    assert target.status(record) == record and len(tried) == 2  # not retried forever
    done = CliRunner().invoke(ec2_group, ["gc", "--yes"])  # no --all needed
    assert done.exit_code == 0, done.output
    assert f"remove security group {group}" in done.output and dtrain_groups(aws["ec2"]) == []


def test_gc_keeps_a_finishing_cluster_whose_other_node_already_terminated(aws):
    from click.testing import CliRunner
    from dtrain.cli.ec2 import ec2 as ec2_group

    target = ec2_target(aws, assume_yes=True)
    record = target.submit()
    first, second = record.target_data["instance_ids"]
    aws["ec2"].terminate_instances(InstanceIds=[first])  # node 0 is done, node 1 still uploads
    dry = CliRunner().invoke(ec2_group, ["gc", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert dry.output == "no dtrain leftovers found\n"
    assert [i["InstanceId"] for i in live_instances(aws["ec2"])] == [second]


def test_dtrain_status_of_a_job_that_ended_removes_its_groups_and_says_so(aws):
    from click.testing import CliRunner
    from dtrain.cli.main import cli

    target = ec2_target(aws, assume_yes=True)
    record = target.submit()
    finish_nodes(aws, record)
    shown = CliRunner().invoke(cli, ["status", record.id])  # the CLI builds its own clients
    assert shown.exit_code == 0, shown.output
    assert "status    Completed" in shown.stdout
    assert f"removed {record.target_data['security_group_id']}" in shown.stderr
    assert dtrain_groups(aws["ec2"]) == [] and aws["pg"].groups == {}


# ---------------------------------------------------------------- logs

def put_log(aws, record, rel: str, body: bytes) -> None:
    """A log object as a node's bootstrap uploads it, under ``{prefix}/logs/<host>/``."""
    key = record.target_data["prefix"].split(f"s3://{BUCKET}/", 1)[1]
    aws["s3"].put_object(Bucket=BUCKET, Key=f"{key}/logs/{rel}", Body=body)


def test_logs_merge_the_nodes_own_logs_in_time_order_in_the_format_of_every_target(aws):
    target = ec2_target(aws, assume_yes=True)
    record = target.submit()
    # each node's own log: the bootstrap's lines (no stamp) and the agent's, stamped, with the
    # worker lines it echoes; the ranks' raw log objects are not read again
    put_log(aws, record, "10.0.0.1/bootstrap.log",
            b"dtrain: node 0 installing\n@10.000 [10.0.0.1 0]:step 1\n"
            b"@12.000 [10.0.0.1 1]:warning: slow\n@14.000 agent: workers exited\n")
    put_log(aws, record, "10.0.0.2/bootstrap.log",
            b"dtrain: node 1 installing\n@11.000 [10.0.0.2 2]:step 1\n"
            b"@13.000 [10.0.0.2 2]:restarted\n")
    put_log(aws, record, "10.0.0.1/rank-0.stdout.log", b"step 1\n")
    put_log(aws, record, "10.0.0.1/rank-0.error.json", b"{}")

    def logs(**only):
        return list(jobs.logs(record.id, store=target.store, clients=target.clients, **only))
    assert logs() == ["[10.0.0.1] dtrain: node 0 installing", "[10.0.0.2] dtrain: node 1 installing",
                      "[10.0.0.1 0]:step 1", "[10.0.0.2 2]:step 1", "[10.0.0.1 1]:warning: slow",
                      "[10.0.0.2 2]:restarted", "[10.0.0.1] agent: workers exited"]
    assert logs(rank=2) == ["[10.0.0.2 2]:step 1", "[10.0.0.2 2]:restarted"]
    assert logs(host="10.0.0.1", rank=0) == ["[10.0.0.1 0]:step 1"]
    # while it runs, a node may not have uploaded its first log yet: no lines, no refusal
    assert logs(host="10.0.0.3") == []
    # once it ended, a host of no node (the other targets' algo-2) is refused, not answered
    # with no lines
    target.stop(record)
    with pytest.raises(SpecError, match=rf"--host 'algo-1': job {record.id} runs on 10.0.0.1, "
                                        r"10.0.0.2$"):
        logs(host="algo-1")


def test_following_logs_gives_each_line_once_and_whole(aws):
    target = ec2_target(aws, assume_yes=True)
    record = target.submit()
    put_log(aws, record, "10.0.0.1/bootstrap.log", b"@1.000 [10.0.0.1 0]:step 1\n@2.000 [10.0")
    syncs = iter([b"@1.000 [10.0.0.1 0]:step 1\n@2.000 [10.0.0.1 0]:step 2\n@3.0",  # mid-line
                  (b"@1.000 [10.0.0.1 0]:step 1\n@2.000 [10.0.0.1 0]:step 2\n"
                   b"@3.000 [10.0.0.1 0]:step 3\n@4.000 [10.0.0.1 0]:last words")])

    def next_sync(_seconds):  # the node uploads its log again between two looks
        put_log(aws, record, "10.0.0.1/bootstrap.log", next(syncs))
    looks = iter([False, False, True])
    launcher = Ec2Launcher(**{**target.clients, "sleep": next_sync})
    lines = list(launcher.logs(target.handle(record), follow=True, host=None, rank=None,
                               ended=lambda: next(looks)))
    assert lines == ["[10.0.0.1 0]:step 1", "[10.0.0.1 0]:step 2", "[10.0.0.1 0]:step 3",
                     "[10.0.0.1 0]:last words"]  # the job ended: its last line is complete


# ---------------------------------------------------------------- waiting for a job to end

def wait_clients(aws, out) -> dict:
    """What ``dtrain.jobs.api`` passes to the EC2 launcher it builds: the test's moto clients."""
    return {"ec2_client": aws["ec2"], "s3_client": aws["s3"], "region": REGION, "stream": out}


def on_describe_instances(client, *, at: int, do) -> list[int]:
    """Call ``do()`` right after the ``at``-th DescribeInstances answer (how the test lets nodes
    power off, or the user press Ctrl-C, between two of the waiter's polls)."""
    seen: list[int] = []

    def handler(**_):
        seen.append(len(seen) + 1)
        if len(seen) == at:
            do()
    client.meta.events.register("after-call.ec2.DescribeInstances", handler)
    return seen


def test_waiting_goes_on_after_completed_until_the_nodes_terminated_and_the_groups_are_gone(aws):
    from dtrain.jobs import api as jobs

    target = ec2_target(aws, assume_yes=True)
    record = target.submit()
    group, pg = record.target_data["security_group_id"], record.target_data["placement_group"]
    finish_nodes(aws, record, power_off=False)  # "completed" is written, the nodes shut down
    termination_takes_a_while(aws["ec2"])
    other = boto3.client("ec2", region_name=REGION)  # the nodes' own power-off, not the waiter's
    # looks 1-2: the status call that sees Completed; 3-4: two more polls while nodes still run
    looks = on_describe_instances(aws["ec2"], at=4, do=lambda: other.terminate_instances(
        InstanceIds=record.target_data["instance_ids"]))
    notes, out = [], io.StringIO()
    final = jobs.wait_for(record.id, clients=wait_clients(aws, out), poll_s=0.01,
                          on_note=notes.append)
    assert final.status == "Completed" and final.target_data["cleanup"]["state"] == "done"
    assert len(looks) >= 5  # it did not return at Completed, but once the nodes were gone
    assert dtrain_groups(aws["ec2"]) == [] and aws["pg"].groups == {}
    assert notes == [(f"Completed; removing security group {group} and placement group {pg} "
                      "once the 2 nodes have terminated…")]
    said = out.getvalue()
    assert said.count("not removed yet") == 1  # said once, not on every poll
    assert f"removed {group}, {pg}" in said


def test_waiting_for_the_groups_is_bounded_and_a_completed_job_stays_completed(aws):
    from dtrain.jobs import api as jobs

    target = ec2_target(aws, assume_yes=True)
    record = target.submit()
    group = record.target_data["security_group_id"]
    finish_nodes(aws, record, power_off=False)  # and the nodes never terminate
    termination_takes_a_while(aws["ec2"])
    notes, out = [], io.StringIO()
    started = time.monotonic()
    final = jobs.wait_for(record.id, clients=wait_clients(aws, out), poll_s=0.01, settle_s=0.5,
                          on_note=notes.append)
    assert time.monotonic() - started < 30
    assert final.status == "Completed" and final.failure_reason is None
    assert final.target_data["cleanup"]["state"] == "pending"  # the next status call retries
    assert len(notes) == 2 and notes[1] == (
        f"warning: security group {group} and placement group "
        f"{record.target_data['placement_group']} still not removed after 0.5 s (waiting until "
        f"the 2 nodes have terminated); `dtrain status {record.id}` tries again, or run "
        "`dtrain ec2 gc`")
    assert [g["GroupId"] for g in dtrain_groups(aws["ec2"])] == [group]


def test_ctrl_c_while_waiting_for_the_groups_returns_the_ended_job_and_says_who_retries(aws):
    from dtrain.jobs import api as jobs

    target = ec2_target(aws, assume_yes=True)
    record = target.submit()
    finish_nodes(aws, record, state="failed", power_off=False)
    termination_takes_a_while(aws["ec2"])

    def ctrl_c():
        raise KeyboardInterrupt

    on_describe_instances(aws["ec2"], at=4, do=ctrl_c)  # during the second poll after Failed
    notes = []
    final = jobs.wait_for(record.id, clients=wait_clients(aws, io.StringIO()), poll_s=0.01,
                          on_note=notes.append)
    assert final.status == "Failed" and final.target_data["cleanup"]["state"] == "pending"
    assert notes[-1].startswith("stopped waiting: security group ")
    assert notes[-1].endswith(f"not removed yet; `dtrain status {record.id}` tries again, "
                              "or run `dtrain ec2 gc`")


def test_waiting_for_a_local_job_ends_with_the_job_there_is_nothing_to_remove(tmp_path):
    from dtrain.jobs import api as jobs

    (tmp_path / "train.py").write_text("print('done')\n")
    spec = JobSpec.from_dict({"name": "local-wait", "entry_point": "train.py",
                              "source_dir": str(tmp_path),
                              "compute": {"instance_type": "local", "max_run": 60}})
    notes = []
    record = jobs.wait_for(jobs.submit(spec, wait=False).id, poll_s=0.05, on_note=notes.append)
    assert record.status == "Completed", record.failure_reason
    started = time.monotonic()  # a poll after the end would sleep poll_s first
    again = jobs.wait_for(record.id, poll_s=60, settle_s=60, on_note=notes.append)
    assert time.monotonic() - started < 10 and again.status == "Completed"
    assert notes == []
