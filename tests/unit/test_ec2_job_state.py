"""One status for an EC2 job from EC2's instance states and each node's own status object.

The nodes' reports are what ``ec2_bootstrap.run_node`` writes to ``{prefix}/status/<host>.json``:
``starting``, ``running``, then ``completed``, ``failed`` or ``stopped`` (exit code 143: the node
or a peer got SIGTERM and the workers stopped after a checkpoint), with the node agent's reason.
"""

from __future__ import annotations

from dtrain.launcher.ec2.nodes import FAILED_PEER_GRACE_S, job_state, peer_grace

LINE = ("interrupted: training stopped at step 1200 after a checkpoint because a host received "
        "SIGTERM; resubmit to resume from s3://b/dtrain/job/checkpoints/step-001200")


def node(rank: int, state: str, reason: str = "", updated: float = 0.0) -> dict:
    return {"host": f"10.0.0.{rank + 1}", "rank": rank, "instance_id": f"i-{rank}",
            "state": state, "reason": reason, "updated": updated}


def instance(rank: int, state: str = "running") -> dict:
    return {"InstanceId": f"i-{rank}", "State": {"Name": state}}


def test_stopped_nodes_still_powering_off_make_the_job_stopped_not_starting():
    # a node writes its last status after its uploads: both are done, only the power-off is left
    state = job_state({"i-0": "running", "i-1": "running"},
                      [node(0, "stopped", LINE), node(1, "stopped", LINE)], 2)
    assert state == {"status": "Stopped", "secondary_status": None, "failure_reason": LINE}


def test_an_interrupted_node_with_a_peer_still_training_is_stopping_until_the_peer_ends():
    nodes = [node(0, "stopped", LINE), node(1, "running")]
    # the peer checkpoints and uploads too before it stops: not final, and not "Starting"
    assert job_state({"i-0": "terminated", "i-1": "running"}, nodes, 2) == {
        "status": "Stopping", "secondary_status": "Interrupted", "failure_reason": LINE}
    # the peer's instance is gone without a last report (its bootstrap was killed): ended
    ended = job_state({"i-0": "terminated", "i-1": "terminated"}, nodes, 2)
    assert ended == {"status": "Stopped", "secondary_status": None, "failure_reason": LINE}


def test_all_nodes_done_some_interrupted_is_stopped_with_the_runtimes_line_not_a_generic_one():
    nodes = [node(0, "completed"), node(1, "stopped", LINE)]
    state = job_state({"i-0": "running", "i-1": "running"}, nodes, 2)
    assert state["status"] == "Stopped" and state["failure_reason"] == LINE
    # a stopped node without a reason still says it was interrupted
    bare = job_state({}, [node(0, "stopped"), node(1, "stopped")], 2)
    assert bare["status"] == "Stopped" and "10.0.0.1 was interrupted" in bare["failure_reason"]


def test_a_failed_node_fails_the_job_even_while_peers_run_or_were_interrupted():
    nodes = [node(0, "failed", "rank 3 exited with code 1: CUDA error"), node(1, "stopped", LINE),
             node(2, "running")]
    state = job_state({"i-0": "terminated", "i-1": "running", "i-2": "running"}, nodes, 3)
    assert state["status"] == "Failed"
    assert state["failure_reason"] == "rank 3 exited with code 1: CUDA error"


def test_starting_running_completed_and_unknown():
    live = {"i-0": "running", "i-1": "pending"}
    assert job_state(live, [node(0, "starting")], 2)["status"] == "Starting"
    assert job_state(live, [node(0, "running"), node(1, "starting")], 2) == {
        "status": "Running", "secondary_status": "Training", "failure_reason": None}
    assert job_state(live, [node(0, "completed"), node(1, "completed")], 2)["status"] == \
        "Completed"
    assert job_state({}, [], 2)["status"] is None


def test_nodes_gone_without_any_final_report_is_stopped_with_the_generic_reason():
    state = job_state({"i-0": "terminated", "i-1": "stopped"}, [node(0, "running")], 2)
    assert state["status"] == "Stopped" and "before every node reported" in state["failure_reason"]


# ---------------------------------------------------------------- a failed job's peers

def test_a_failed_jobs_unreported_peers_are_spared_until_the_grace_after_the_first_failure():
    failed_at = 1_700_000_000.0
    nodes = [node(0, "failed", "rank 3 exited with code 1", updated=failed_at),
             node(1, "running", updated=failed_at - 600), node(2, "stopped", LINE),
             node(3, "failed", "NCCL timeout", updated=failed_at + 1800)]
    grace = peer_grace(nodes, now=failed_at + 60)
    assert grace.until == failed_at + FAILED_PEER_GRACE_S  # from the first failure report
    # still training or hung in a collective: its checkpoint shards are only on its disk
    assert grace.spares(instance(1)) and grace.spares(instance(4, "pending"))
    # a node that wrote its last report has uploaded: nothing to wait for
    assert not grace.spares(instance(2)) and not grace.spares(instance(3))
    assert not grace.spares(instance(1, "shutting-down"))
    assert peer_grace(nodes, now=failed_at + FAILED_PEER_GRACE_S) is None


def test_without_a_failure_report_nothing_is_spared():
    assert peer_grace([node(0, "running", updated=1.0), node(1, "stopped", LINE)], now=2.0) is None
    assert peer_grace([node(0, "failed", "x", updated=0.0)], now=1.0) is None  # no report time


def test_the_grace_outlasts_a_peers_reaction_its_workers_grace_and_its_last_uploads():
    """A peer sees the failure report within PEER_POLL_S and SIGTERMs its agent; the workers get
    the grace period; its checkpoints are in S3 already, its logs and report take minutes."""
    from dtrain.core.contract import DEFAULT_GRACE_PERIOD_S
    from dtrain.launcher.ec2.node.bootstrap import PEER_POLL_S

    assert FAILED_PEER_GRACE_S >= PEER_POLL_S + DEFAULT_GRACE_PERIOD_S + 300


def test_the_first_failure_report_is_the_reason_whatever_the_nodes_rank():
    # node 1 failed first; node 0 failed after it, its collectives broken by node 1's death
    nodes = [node(0, "failed", "rank 0 on 10.0.0.1: connection reset by peer", updated=20.0),
             node(1, "failed", "rank 5 on 10.0.0.2 exited with code 1: KeyError: 'x'",
                  updated=10.0)]
    state = job_state({"i-0": "running", "i-1": "running"}, nodes, 2)
    assert state["status"] == "Failed"
    assert state["failure_reason"] == "rank 5 on 10.0.0.2 exited with code 1: KeyError: 'x'"



def test_a_report_without_a_rank_sorts_last_instead_of_breaking_status():
    import json

    import boto3
    from dtrain.launcher.ec2 import nodes
    from moto import mock_aws

    # a node that could not read its launch index reports "rank": null (the bootstrap's shell)
    reports = {"10.0.0.9": None, "10.0.0.7": 1, "10.0.0.5": 0}
    with mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="dtrain-test")
        for host, rank in reports.items():
            s3.put_object(Bucket="dtrain-test", Key=f"j/status/{host}.json",
                          Body=json.dumps({"rank": rank, "host": host}))
        ordered = nodes.read_status_objects(s3, "s3://dtrain-test/j")
    assert [n["rank"] for n in ordered] == [0, 1, None]
