"""How an EC2 job ends against moto: an interruption, a failed node whose peers still run, `dtrain
stop` of a job that has already ended, a launcher that died before its nodes were launched, and
`dtrain stop` while the launch is under way.

The moto account, the placement-group double and the helpers come from ``test_ec2_launch`` (see
its docstring for what each test double stands in for). Nodes are played by the test: it writes
their status objects with ``ec2_bootstrap.write_status``, as the bootstrap does, and powers them
off through its own client.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

import boto3
import pytest
import test_ec2_launch as ec2_test
from dtrain.core.errors import DtrainError
from dtrain.jobs.store import JobStore
from dtrain.launcher.ec2 import gc, tags
from dtrain.launcher.ec2.node import bootstrap as boot
from dtrain.launcher.ec2.nodes import FAILED_PEER_GRACE_S
from test_ec2_launch import (
    JOB,
    REGION,
    Ec2,
    dtrain_groups,
    ec2_target,
    live_instances,
)

LINE = ("interrupted: training stopped at step 1200 after a checkpoint because a host received "
        "SIGTERM; resubmit to resume from s3://dtrain-example-bucket/dtrain/{job}/checkpoints/"
        "step-001200")


@pytest.fixture
def aws(tmp_path, monkeypatch):
    yield from ec2_test.moto_aws(tmp_path, monkeypatch)


def report(aws, record, rank: int, state: str, reason: str = "", **extra) -> str:
    """Node ``rank`` writes its status object, as ``ec2_bootstrap.run_node`` does; its id.
    ``updated=`` backdates the report."""
    instance_id = record.target_data["instance_ids"][rank]
    instance = aws["ec2"].describe_instances(
        InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]
    node = boot.Node(rank=rank, private_ip=instance["PrivateIpAddress"], instance_id=instance_id,
                     root="/opt/ml", work_dir="/opt/dtrain")
    boot.write_status(aws["s3"], record.target_data, node, state, reason=reason, **extra)
    return instance_id


def failed_long_ago() -> float:
    """A failure report's time from before the peers' grace began."""
    return time.time() - FAILED_PEER_GRACE_S - 60


def power_off(*instance_ids: str) -> None:
    """A node's own shutdown (InstanceInitiatedShutdownBehavior=terminate), not dtrain's call."""
    boto3.client("ec2", region_name=REGION).terminate_instances(InstanceIds=list(instance_ids))


# ---------------------------------------------------------------- interruption

def test_an_interrupted_job_is_stopping_while_a_peer_runs_then_stopped_with_the_runtimes_line(
        aws):
    target = ec2_target(aws, assume_yes=True)
    record = target.submit()
    line = LINE.format(job=record.name)
    first = report(aws, record, 0, "stopped", line)  # the peer of the interrupted host...
    power_off(first)
    report(aws, record, 1, "running")  # ...while this one still checkpoints and uploads
    record = target.status(record)
    assert (record.status, record.target_data["secondary_status"]) == ("Stopping", "Interrupted")
    assert record.failure_reason == line
    assert len(live_instances(aws["ec2"])) == 1  # an interruption does not kill the peer
    power_off(record.target_data["instance_ids"][1])  # its bootstrap was killed with the node
    record = target.status(record)
    assert record.status == "Stopped" and record.failure_reason == line


def test_dtrain_stop_says_stopped_by_user(aws):
    target = ec2_target(aws, assume_yes=True)
    record = target.stop(target.submit())
    record = target.status(record)
    assert record.status == "Stopped" and record.failure_reason == "stopped by user (dtrain stop)"


# ---------------------------------------------------------------- nothing runs once a job ended

def test_a_failed_nodes_peer_that_has_not_reported_runs_until_the_grace_ends_then_goes(aws):
    now = {"t": time.time()}
    target = ec2_target(aws, assume_yes=True, clock=lambda: datetime.fromtimestamp(
        now["t"], timezone.utc))
    record = target.submit()
    failed = report(aws, record, 0, "failed", "rank 3 exited with code 1: CUDA error")
    now["t"] = time.time()
    power_off(failed)
    # waits in a collective for node 0 until it times out, then uploads its checkpoint shards
    peer = report(aws, record, 1, "running")
    record = target.status(record)
    assert record.status == "Failed"
    assert record.failure_reason == "rank 3 exited with code 1: CUDA error"
    assert [i["InstanceId"] for i in live_instances(aws["ec2"])] == [peer], \
        "the failed node's peer was terminated before it could upload its checkpoints"
    cleanup = record.target_data["cleanup"]
    assert cleanup["state"] == "pending" and cleanup["spared"] == [peer]
    assert f"leaving 1 node(s) that have not reported running ({peer})" in target.out.getvalue()
    # a waiting submit polls through more than one launcher: the line came twice
    again = ec2_target(aws, assume_yes=True, clock=target.launcher.clock)
    again.status(record)
    assert "leaving" not in again.out.getvalue()
    assert target.launcher.pending_cleanup(target.handle(record)).once.startswith(
        "the node still running after the failure has uploaded its checkpoints and terminated "
        "(dtrain terminates it at ")
    now["t"] += FAILED_PEER_GRACE_S - 60
    record = target.status(record)
    assert [i["InstanceId"] for i in live_instances(aws["ec2"])] == [peer]
    now["t"] += 61  # the grace has passed: its collectives would have timed out long ago
    record = target.status(record)
    assert live_instances(aws["ec2"]) == [] and record.target_data["cleanup"]["state"] == "pending"
    assert f"terminated 1 node(s) still running ({peer})" in target.out.getvalue()
    record = target.status(record)
    assert record.target_data["cleanup"]["state"] == "done" and dtrain_groups(aws["ec2"]) == []
    assert aws["pg"].groups == {} and record.status == "Failed"


def test_a_failed_nodes_peer_that_has_reported_is_terminated_at_once_the_others_are_left(aws):
    target = ec2_target(aws, assume_yes=True)
    record = target.submit("compute.instance_count=3")
    power_off(report(aws, record, 0, "failed", "rank 3 exited with code 1: CUDA error"))
    done = report(aws, record, 1, "failed", "rank 9: NCCL timeout")  # uploaded; powering off
    left = report(aws, record, 2, "running")
    asked = ec2_test.termination_takes_a_while(aws["ec2"])
    record = target.status(record)
    assert record.status == "Failed" and asked == [[done]]
    assert record.target_data["cleanup"]["spared"] == [left]


def ended_with_a_live_peer(aws, target, *, failed_at: float):
    """A Failed job whose peer still runs and has not reported, its groups left for gc."""
    record = target.submit()
    power_off(report(aws, record, 0, "failed", "rank 3 exited with code 1", updated=failed_at))
    store = JobStore()
    store.update(record.id, status="Failed", failure_reason="rank 3 exited with code 1")
    record = store.update(record.id, target_data={"cleanup": {
        "state": "left-for-gc", "removed": [], "left": [record.target_data["security_group_id"]],
        "reason": "1 node(s) not terminated yet", "nodes_left": 1}})
    assert len(live_instances(aws["ec2"])) == 1
    return record


def test_stop_of_a_job_that_already_failed_terminates_what_still_runs_and_keeps_the_status(aws):
    target = ec2_target(aws, assume_yes=True)
    record = ended_with_a_live_peer(aws, target, failed_at=time.time())
    stopped = target.stop(record.id)  # the user's call: no grace for the peer
    assert live_instances(aws["ec2"]) == [] and dtrain_groups(aws["ec2"]) == []
    assert aws["pg"].groups == {}
    assert stopped.status == "Failed" and stopped.failure_reason == "rank 3 exited with code 1"
    assert stopped.target_data["cleanup"]["state"] == "done"
    assert "(it had ended: Failed): terminated 1 node(s)" in target.out.getvalue()
    calls = ec2_test.count_ec2_calls(aws["ec2"])
    assert target.stop(stopped) == stopped and "TerminateInstances" not in calls


def test_gc_removes_the_live_peer_and_groups_of_a_job_its_record_says_failed(aws):
    from click.testing import CliRunner
    from dtrain.cli.ec2 import ec2 as ec2_group

    target = ec2_target(aws, assume_yes=True)
    record = ended_with_a_live_peer(aws, target, failed_at=failed_long_ago())
    peer = live_instances(aws["ec2"])[0]["InstanceId"]
    # a "no" (or no terminal to answer) removes nothing: an error, not a Ctrl-C's "aborted"
    for answer in ("n\n", ""):
        declined = CliRunner().invoke(ec2_group, ["gc"], input=answer)
        assert str(declined.exception) == ("nothing removed; answer y, or pass --yes to remove "
                                           "them without asking")
        assert [i["InstanceId"] for i in live_instances(aws["ec2"])] == [peer]
    done = CliRunner().invoke(ec2_group, ["gc", "--yes"])  # however young the launch
    assert done.exit_code == 0, done.output
    assert f"remove instance {peer}" in done.output
    assert f"remove security group {record.target_data['security_group_id']}" in done.output
    assert live_instances(aws["ec2"]) == [] and dtrain_groups(aws["ec2"]) == []
    assert aws["pg"].groups == {}


def test_gc_leaves_a_failed_jobs_unreported_peer_alone_while_it_may_upload(aws):
    from click.testing import CliRunner
    from dtrain.cli.ec2 import ec2 as ec2_group

    target = ec2_target(aws, assume_yes=True)
    record = ended_with_a_live_peer(aws, target, failed_at=time.time() - 60)
    peer = live_instances(aws["ec2"])[0]["InstanceId"]
    kept = CliRunner().invoke(ec2_group, ["gc", "--yes"])
    assert kept.exit_code == 0, kept.output
    assert kept.output.endswith("no dtrain leftovers found\n")
    assert ("keeping 3 resource(s) of failed jobs whose other nodes may still be stopping and "
            "uploading their logs, until ") in kept.output and peer in kept.output
    assert [i["InstanceId"] for i in live_instances(aws["ec2"])] == [peer]
    assert [g["GroupId"] for g in dtrain_groups(aws["ec2"])] == [
        record.target_data["security_group_id"]]


def test_gc_without_a_record_removes_a_cluster_whose_nodes_reported_a_failure(aws, monkeypatch,
                                                                            tmp_path):
    from click.testing import CliRunner
    from dtrain.cli.ec2 import ec2 as ec2_group

    target = ec2_target(aws, assume_yes=True)
    record = target.submit()
    power_off(report(aws, record, 0, "failed", "rank 3 exited with code 1",
                     updated=failed_long_ago()))  # the peer's grace has passed
    peer = report(aws, record, 1, "running")
    monkeypatch.setenv("DTRAIN_HOME", str(tmp_path / "another-machine"))  # no record there
    runner = CliRunner()
    young = runner.invoke(ec2_group, ["gc", "--dry-run"])
    assert young.exit_code == 0, young.output
    assert "no dtrain leftovers found" in young.output and "--min-age 0" in young.output
    done = runner.invoke(ec2_group, ["gc", "--yes", "--min-age", "0"])
    assert done.exit_code == 0, done.output
    assert f"remove instance {peer}" in done.output
    assert live_instances(aws["ec2"]) == [] and dtrain_groups(aws["ec2"]) == []


@pytest.mark.parametrize("home", ["this machine", "another machine"])
def test_gc_during_a_launch_leaves_its_groups_and_nodes_alone(aws, tmp_path, home):
    from click.testing import CliRunner
    from dtrain.cli.ec2 import ec2 as ec2_group

    target = ec2_target(aws, assume_yes=True)
    ran = []

    def gc_once_the_nodes_exist(**_):  # its groups and nodes exist, its record lists none yet
        if not ran:
            # this machine: the record says it is launching; another: no record, a young launch
            env = {} if home == "this machine" else {"DTRAIN_HOME": str(tmp_path / "other")}
            ran.append(CliRunner().invoke(ec2_group, ["gc", "--yes"], env=env))
    aws["ec2"].meta.events.register("after-call.ec2.RunInstances", gc_once_the_nodes_exist)
    record = target.submit()
    assert ran[0].exit_code == 0, ran[0].output
    assert ran[0].output.endswith("no dtrain leftovers found\n")
    assert ("younger than 30 min" in ran[0].output) == (home == "another machine")
    assert record.status == "Starting" and len(live_instances(aws["ec2"])) == 2
    assert [g["GroupId"] for g in dtrain_groups(aws["ec2"])] == [
        record.target_data["security_group_id"]]
    assert list(aws["pg"].groups) == [record.target_data["placement_group"]]


# ---------------------------------------------------------------- stop while launching

def test_stop_while_the_launch_is_under_way_ends_it_stopped_with_nothing_left(aws):
    target = ec2_target(aws, assume_yes=True)
    other = ec2_target(aws)  # `dtrain stop` from another shell, same job store
    stopped = []

    def stop_before_the_nodes(**_):  # the groups exist; the record was read just before
        if not stopped:
            stopped.append(other.stop(JOB))
    aws["ec2"].meta.events.register("before-call.ec2.RunInstances", stop_before_the_nodes)
    with pytest.raises(DtrainError) as caught:
        target.submit()
    assert str(caught.value).startswith("stopped by `dtrain stop` while launching (launched 2 "
                                        "of 2 nodes, all terminated)")
    assert stopped[0].status == "Stopping"  # the launch was still under way: it finishes it
    record = JobStore().find(JOB)
    assert record.status == "Stopped"
    assert live_instances(aws["ec2"]) == [] and dtrain_groups(aws["ec2"]) == []
    assert aws["pg"].groups == {}


def another_shell(aws) -> tuple[Ec2, object]:
    """`dtrain stop` from another shell: the same job store, its own launcher and EC2 client (so
    the test doubles below slow down its calls only)."""
    ec2 = boto3.client("ec2", region_name=REGION)
    return Ec2(ec2_client=ec2, s3_client=aws["s3"]), ec2


def a_slow_stopper(aws, until: threading.Event) -> tuple[Ec2, threading.Event]:
    """``another_shell`` whose TerminateInstances waits for ``until`` (a real node takes about a
    minute to terminate); the returned event is set once the stop has got to terminating."""
    stopper, stopper_ec2 = another_shell(aws)
    terminating = threading.Event()

    def termination_takes_a_while(**_):
        terminating.set()
        until.wait(60)
    stopper_ec2.meta.events.register("before-call.ec2.TerminateInstances",
                                     termination_takes_a_while)
    return stopper, terminating


def test_a_stop_that_runs_while_the_launch_goes_on_leaves_no_node_running(aws):
    # the stop runs in a thread once the nodes exist, before the launcher has recorded them; its
    # termination takes a while (a real node needs about a minute), and the launcher goes on
    # meanwhile
    target = ec2_target(aws, assume_yes=True)
    release = threading.Event()
    stopper, terminating = a_slow_stopper(aws, until=release)
    stops = []
    stop = threading.Thread(target=lambda: stops.append(stopper.stop(JOB)))

    def stop_once_the_nodes_exist(**_):
        if not stop.is_alive() and not stops:
            stop.start()
            assert terminating.wait(60), "the stop never got to terminating the nodes"
    aws["ec2"].meta.events.register("after-call.ec2.RunInstances", stop_once_the_nodes_exist)
    try:
        target.submit()
        outcome = "launched every node"
    except DtrainError as exc:
        outcome = str(exc)
    release.set()
    stop.join(60)
    record = target.status(JobStore().find(JOB))  # as a waiting client does
    assert live_instances(aws["ec2"]) == [], "a node of the stopped launch still runs"
    assert record.status == "Stopped"
    assert outcome.startswith("stopped by `dtrain stop` while launching (launched 2 of 2 nodes, "
                              "all terminated)")
    assert stops[0].status == "Stopped" and dtrain_groups(aws["ec2"]) == []
    assert aws["pg"].groups == {}


def test_stop_terminates_the_nodes_whose_run_instances_landed_after_it_listed_the_launch(aws):
    # the stop lists the launch's nodes (none yet), then the RunInstances lands, then the
    # launcher stalls (EC2 slow to answer, a suspended laptop): the stop alone must get them
    target = ec2_target(aws, assume_yes=True)
    stopper, stopper_ec2 = another_shell(aws)
    listed, landed = threading.Event(), threading.Event()
    stops, live_once_stopped = [], []
    stop = threading.Thread(target=lambda: stops.append(stopper.stop(JOB)))

    def nodes_land_after_the_first_list(**_):
        if not listed.is_set():
            listed.set()
            assert landed.wait(60), "the RunInstances never landed"

    def stop_during_run_instances(**_):
        stop.start()
        assert listed.wait(60), "the stop never listed the launch's nodes"

    def stall_once_landed(**_):
        landed.set()
        stop.join(60)  # the launcher is stalled until the stop has returned
        live_once_stopped.extend(i["InstanceId"] for i in live_instances(aws["ec2"]))
    stopper_ec2.meta.events.register("after-call.ec2.DescribeInstances",
                                     nodes_land_after_the_first_list)
    aws["ec2"].meta.events.register("before-call.ec2.RunInstances", stop_during_run_instances)
    aws["ec2"].meta.events.register("after-call.ec2.RunInstances", stall_once_landed)
    with pytest.raises(DtrainError, match="stopped by `dtrain stop` while launching"):
        target.submit()
    assert stops and live_once_stopped == [], "the stop returned with nodes running"
    assert "terminated 2 node(s)" in stopper.out.getvalue()
    record = JobStore().find(JOB)
    assert record.status == "Stopped" and live_instances(aws["ec2"]) == []
    assert dtrain_groups(aws["ec2"]) == [] and aws["pg"].groups == {}


def test_ctrl_c_during_stop_leaves_a_stopping_job_whose_nodes_the_next_status_terminates(aws):
    target = ec2_target(aws, assume_yes=True)
    record = target.submit()
    stopper, stopper_ec2 = another_shell(aws)

    def ctrl_c(**_):
        raise KeyboardInterrupt
    stopper_ec2.meta.events.register("before-call.ec2.TerminateInstances", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        stopper.stop(record.id)
    record = JobStore().get(record.id)
    assert record.status == "Stopping" and record.failure_reason == "stopped by user (dtrain stop)"
    assert len(live_instances(aws["ec2"])) == 2
    record = target.status(record)  # terminates what the interrupted stop left running
    assert live_instances(aws["ec2"]) == []
    record = target.status(record)
    assert record.status == "Stopped" and record.failure_reason == "stopped by user (dtrain stop)"
    assert dtrain_groups(aws["ec2"]) == [] and aws["pg"].groups == {}


def test_each_resource_of_a_launch_carries_its_launch_time(aws):
    from datetime import datetime, timezone

    at = datetime(2025, 3, 4, 5, 6, 7, tzinfo=timezone.utc)
    target = ec2_target(aws, assume_yes=True, clock=lambda: at)
    record = target.submit()
    launches = gc.find_launches(aws["ec2"])
    launch = launches[record.target_data["launch_token"]]
    assert launch.started() == at
    tagged = [*launch.instances, *launch.security_groups, *launch.placement_groups]
    assert len(tagged) == 4
    assert {tags.tag_map(r)[tags.TAG_LAUNCHED_AT] for r in tagged} == {"2025-03-04T05:06:07Z"}


# ---------------------------------------------------------------- a launcher that died

KILLED_LAUNCHER = """
import pathlib, sys, time
from dtrain.jobs import api
from dtrain.jobs.store import new_job_id
from dtrain.launcher import aws
from dtrain.launcher.base import JobIdentity
from dtrain.spec.model import JobSpec

example, marker, job, *overrides = sys.argv[1:]
ec2 = aws.make_client("ec2", region="us-east-1")
calls = []

def stall_once_launched(**_):  # the nodes exist, not yet recorded; the launcher is killed now
    pathlib.Path(marker).write_text("nodes launched")
    time.sleep(600)

ec2.meta.events.register("after-call.ec2.RunInstances", stall_once_launched)
spec = JobSpec.from_file(example, overrides=overrides)
api.submit(spec, wait=False, job=JobIdentity(new_job_id(), job, time.time()),
           clients={"ec2_client": ec2, "region": "us-east-1", "assume_yes": True})
"""


@pytest.fixture
def moto_server(monkeypatch):
    """A moto server the launcher's process and the test share (two processes, one account)."""
    import urllib.request

    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"))
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_ENDPOINT_URL", url)
    yield url
    server.stop()


@pytest.mark.parametrize("then", ["status", "stop"])
def test_a_launcher_killed_before_it_recorded_its_nodes_leaves_a_record_that_ends(
        moto_server, tmp_path, then):
    import os
    import signal
    import subprocess
    import sys
    import time

    ec2 = boto3.client("ec2", region_name=REGION)
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket=ec2_test.BUCKET)
    boto3.client("iam", region_name=REGION).create_instance_profile(
        InstanceProfileName="dtrain-node")
    subnet = ec2.describe_subnets(Filters=[{"Name": "default-for-az", "Values": ["true"]}])
    ami = ec2.describe_images()["Images"][0]["ImageId"]
    marker = tmp_path / "marker"
    # the user's own placement group: the moto server has no CreatePlacementGroup
    launch = subprocess.Popen([
        sys.executable, "-c", KILLED_LAUNCHER, str(ec2_test.EXAMPLE), str(marker), ec2_test.JOB,
        f"ec2.subnet_id={subnet['Subnets'][0]['SubnetId']}", f"ec2.ami={ami}",
        "ec2.placement_group=my-cluster-pg"], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert launch.poll() is None, launch.stderr.read().decode()
        assert time.monotonic() < deadline, "the launcher never launched the nodes"
        time.sleep(0.2)
    os.kill(launch.pid, signal.SIGKILL)  # no except clause runs: nothing is rolled back
    launch.wait()
    record = JobStore().find(ec2_test.JOB)
    assert record.status == "Pending" and len(live_instances(ec2)) == 2
    ec2_test.PlacementGroups(ec2.meta.events)  # answers DescribePlacementGroups (none tagged)
    target = Ec2(ec2_client=ec2, s3_client=s3)
    if then == "status":
        record = target.status(record)
        assert record.status == "Failed"
        assert record.failure_reason.startswith(
            f"launch interrupted: the process that launched it (pid {launch.pid} on ")
        assert live_instances(ec2) == []
        record = target.status(record)  # the node has terminated: now the group goes
    else:
        record = target.stop(record)
        assert record.status == "Stopped" and record.failure_reason.startswith("stopped by user")
    assert live_instances(ec2) == [] and dtrain_groups(ec2) == []
    assert record.target_data["cleanup"]["state"] == "done"
    assert target.status(record) == record  # it stays ended
