"""What an EC2 job's nodes say about it: their status objects, and the job status they make.

Each node's bootstrap (``dtrain.launcher.ec2.node.bootstrap``) writes
``{prefix}/status/<host>.json``: ``starting``, ``running``, then ``completed``, ``failed`` or
``stopped`` with the node agent's reason. ``job_state`` turns those reports and EC2's instance
states into the store's status; ``peer_grace`` says how long a failed job's other nodes are left
running to stop and report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtrain.core import s3 as s3_uri
from dtrain.core.states import COMPLETED, FAILED, RUNNING, STARTING, STOPPED, STOPPING
from dtrain.launcher.ec2 import layout
from dtrain.launcher.ec2.resources import RUNNING_STATES

NODE_FINAL_STATES = ("completed", "stopped", "failed")  # what the bootstrap writes at the end
# After a node reports a failure, its peers that have not reported yet are left running this
# long before dtrain terminates them. A peer sees the report within the bootstrap's
# PEER_POLL_S (10 s) and SIGTERMs its agent, whose workers get the grace period (30 s by
# default) before SIGKILL; its complete checkpoints are in S3 already (synced as they are
# written), so what is left is its logs and its report. Ten minutes covers that with room for
# a long grace period; it is a safety net for a peer that cannot reach S3.
FAILED_PEER_GRACE_S = 600.0


def read_status_objects(s3: Any, prefix: str) -> list[dict[str, Any]]:
    """Each node's ``{prefix}/status/<host>.json``, in rank order."""
    bucket, _ = s3_uri.split(prefix)
    nodes = [layout.read_json(s3, bucket, key)
             for key in layout.list_keys(s3, layout.status_folder(prefix)) if key.endswith(".json")]
    # a node that could not learn its rank reports none (null): it sorts last
    return sorted(nodes, key=lambda n: n["rank"] if isinstance(n.get("rank"), int)
                  else float("inf"))


def job_state(instances: dict[str, str], nodes: list[dict], num_nodes: int) -> dict[str, Any]:
    """The job's store status from EC2's instance states and each node's own report.

    ``status`` is one of the store's names (None: nothing is known yet), ``secondary_status``
    says more while it runs. A failed node fails the job at once; ``Ec2Launcher.status`` then
    terminates the nodes that reported too and still run, and the others once ``peer_grace``
    ends (they stop their workers on seeing the report, then upload and report). A stopped
    node (interrupted: it or a peer got SIGTERM and its workers stopped after a checkpoint) makes
    the job Stopping while other nodes still run, so they can checkpoint and upload too, then
    Stopped with the node's own reason (the runtime's interruption line) once none runs.
    """
    by_state: dict[str, list[dict]] = {}
    for node in nodes:
        by_state.setdefault(node.get("state"), []).append(node)
    if by_state.get("failed"):  # the first report is the root cause; peers fail after it
        first = min(by_state["failed"], key=lambda n: n.get("updated") or float("inf"))
        return _state(FAILED, first.get("reason") or f"node {first.get('host')} failed")
    if num_nodes and len(by_state.get("completed", [])) >= num_nodes:
        return _state(COMPLETED)
    reported = {n.get("instance_id") for n in nodes if n.get("state") in NODE_FINAL_STATES}
    # nodes that may still report: their instance runs and they have not said they ended
    still = [i for i, state in instances.items() if state in RUNNING_STATES and i not in reported]
    stopped = by_state.get("stopped", [])
    if stopped:
        reason = next((n["reason"] for n in stopped if n.get("reason")), None) or (
            f"node {stopped[0].get('host')} was interrupted (SIGTERM); resubmit to resume")
        return _state(STOPPING, reason, "Interrupted") if still else _state(STOPPED, reason)
    if still:
        running = any(n.get("state") == "running" for n in nodes)
        return _state(RUNNING, None, "Training") if running else _state(STARTING, None, "Starting")
    if not instances and not nodes:
        return _state(None)
    return _state(STOPPED, "nodes ended before every node reported completion (stopped, spot "
                           "interruption or max_run)")


def _state(status: str | None, reason: str | None = None,
           secondary: str | None = None) -> dict[str, Any]:
    return {"status": status, "secondary_status": secondary, "failure_reason": reason}


@dataclass(frozen=True)
class PeerGrace:
    """A failed job's nodes that have not reported yet are left running until ``until`` (epoch
    seconds) so they can stop, upload and report; ``reported``: nodes that wrote a final report."""

    until: float
    reported: frozenset[str]

    def spares(self, instance: dict[str, Any]) -> bool:
        return (instance["State"]["Name"] in RUNNING_STATES
                and instance["InstanceId"] not in self.reported)


def peer_grace(nodes: list[dict[str, Any]], *, now: float) -> PeerGrace | None:
    """The grace of a failed job's unreported peers, from the nodes' reports; None when no node
    reported a failure or ``FAILED_PEER_GRACE_S`` has passed since the first such report.

    It runs from the report's own time (``updated``, which every ``write_status`` sets), so
    `dtrain status` and `dtrain ec2 gc` on any machine agree on it.
    """
    failed_at = [n["updated"] for n in nodes if n.get("state") == "failed" and n.get("updated")]
    if not failed_at or now >= min(failed_at) + FAILED_PEER_GRACE_S:
        return None
    return PeerGrace(until=min(failed_at) + FAILED_PEER_GRACE_S,
                     reported=frozenset(n.get("instance_id") for n in nodes
                                        if n.get("state") in NODE_FINAL_STATES))
