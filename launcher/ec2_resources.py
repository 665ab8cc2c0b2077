"""EC2 I/O for the ec2 backend: lookups, finding a job's resources by tag, teardown, leftovers.

Every function takes its boto3 client(s) as arguments. Teardown is ordered the way EC2 needs it:
terminate instances, wait until they are gone (a security group stays "in use" while their
network interfaces exist), then delete the security group and the placement group.
``remove_groups`` is the non-blocking variant for a job that ended on its own: one try per call,
and whatever is still in use is reported for the next call instead of waited for.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dtrain.errors import DtrainError
from dtrain.launcher import aws
from dtrain.launcher import ec2_requests as req
from dtrain.store import COMPLETED, FAILED, RUNNING, STARTING, STOPPED, STOPPING

LIVE_STATES = ("pending", "running", "stopping", "stopped", "shutting-down")
RUNNING_STATES = ("pending", "running")  # a node in these can still do work and report it
NODE_FINAL_STATES = ("completed", "stopped", "failed")  # what ec2_bootstrap writes at the end
DELETE_ATTEMPTS = 20
DELETE_RETRY_S = 15.0
# EC2's answers while terminated nodes' network interfaces are still detaching: try again later.
IN_USE_CODES = ("DependencyViolation", "InvalidPlacementGroup.InUse")
GONE_CODES = ("InvalidGroup.NotFound", "InvalidPlacementGroup.Unknown")


@dataclass
class Created:
    """What one submission created so far: exactly what a rollback removes."""

    job: str
    instances: list[str] = field(default_factory=list)
    security_groups: list[str] = field(default_factory=list)
    placement_groups: list[str] = field(default_factory=list)
    uploads: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- lookups

def resolve_ami(ssm: Any, lookup: dict[str, str]) -> str:
    if "value" in lookup:
        return lookup["value"]
    name = lookup["ssm_parameter"]
    try:
        return ssm.get_parameter(Name=name)["Parameter"]["Value"]
    except Exception as exc:
        if aws.error_code(exc) is None:
            raise
        raise DtrainError(f"ec2.ami: auto: cannot read the Deep Learning AMI id from SSM "
                          f"parameter {name} ({aws.error_code(exc)}); set ec2.ami to an AMI id"
                          ) from None


def resolve_root_device(ec2: Any, lookup: dict[str, str], ami_id: str) -> str:
    if "value" in lookup:
        return lookup["value"]
    images = ec2.describe_images(ImageIds=[ami_id]).get("Images", [])
    if not images:
        raise DtrainError(f"ec2.ami: {ami_id!r} not found in this region; give an AMI id from "
                          "the job's region or use ami: auto")
    return images[0].get("RootDeviceName") or req.DLAMI_ROOT_DEVICE


def resolve_subnet(ec2: Any, lookup: dict[str, str]) -> tuple[str, str]:
    """(subnet id, its VPC id): the given subnet, else the default VPC's first default subnet."""
    if "value" in lookup:
        subnets = ec2.describe_subnets(SubnetIds=[lookup["value"]])["Subnets"]
    else:
        subnets = ec2.describe_subnets(
            Filters=[{"Name": "default-for-az", "Values": ["true"]}])["Subnets"]
        subnets.sort(key=lambda s: s["AvailabilityZone"])
    if not subnets:
        raise DtrainError("ec2.subnet_id: not set and this region has no default subnet; give "
                          "a subnet id (one AZ, with a route to S3)")
    return subnets[0]["SubnetId"], subnets[0]["VpcId"]


# ---------------------------------------------------------------- a job's resources by tag

def tag_map(resource: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in resource.get("Tags", [])}


def _tag_filters(job: str | None, launch: str | None = None) -> list[dict[str, Any]]:
    filters = [{"Name": f"tag:{req.TAG_CREATED_BY}", "Values": [req.CREATED_BY]}]
    if job is not None:
        filters.append({"Name": f"tag:{req.TAG_JOB}", "Values": [job]})
    if launch is not None:
        filters.append({"Name": f"tag:{req.TAG_LAUNCH}", "Values": [launch]})
    return filters


def job_instances(ec2: Any, job: str | None, *, launch: str | None = None) -> list[dict[str, Any]]:
    """dtrain's instances (of one job, or all; of one launch of it), in node-rank order."""
    found = []
    for page in ec2.get_paginator("describe_instances").paginate(
            Filters=_tag_filters(job, launch)):
        for reservation in page["Reservations"]:
            found += reservation["Instances"]
    return sorted(found, key=lambda i: int(tag_map(i).get(req.TAG_NODE_RANK, 0)))


def job_security_groups(ec2: Any, job: str | None, *,
                        launch: str | None = None) -> list[dict[str, Any]]:
    return ec2.describe_security_groups(Filters=_tag_filters(job, launch))["SecurityGroups"]


def job_placement_groups(ec2: Any, job: str | None, *,
                         launch: str | None = None) -> list[dict[str, Any]]:
    return ec2.describe_placement_groups(Filters=_tag_filters(job, launch))["PlacementGroups"]


def job_resources(ec2: Any, job: str, *, launch: str | None = None) -> Created:
    """What dtrain created and tagged for a job (one launch of it when ``launch`` is given):
    its nodes still not terminated, its security group, its placement group. A placement group
    the user named in ``ec2.placement_group`` carries no dtrain tag, so it is never listed."""
    found = Created(job=job)
    found.instances = [i["InstanceId"] for i in job_instances(ec2, job, launch=launch)
                       if i["State"]["Name"] != "terminated"]
    found.security_groups = [g["GroupId"] for g in job_security_groups(ec2, job, launch=launch)]
    found.placement_groups = [g["GroupName"]
                              for g in job_placement_groups(ec2, job, launch=launch)]
    return found


# ---------------------------------------------------------------- teardown

def rollback(ec2: Any, s3: Any, created: Created, *, sleep: Callable[[float], None],
             keep_uploads: bool = False) -> list[str]:
    """Remove everything in ``created``; returns what could not be removed (for the message)."""
    left: list[str] = []
    if created.instances:
        going = _terminate(ec2, created.instances)
        left += [i for i in created.instances if i not in going]
        try:
            if going:
                ec2.get_waiter("instance_terminated").wait(
                    InstanceIds=going, WaiterConfig={"Delay": 15, "MaxAttempts": 40})
        except Exception:  # noqa: BLE001 - reported below, the rest still gets a try
            left += going
    for group_id in created.security_groups:
        if not _delete_with_retry(lambda g=group_id: ec2.delete_security_group(GroupId=g), sleep):
            left.append(group_id)
    for name in created.placement_groups:
        if not _delete_with_retry(lambda n=name: ec2.delete_placement_group(GroupName=n), sleep):
            left.append(name)
    if s3 is not None and not keep_uploads:
        from dtrain.launcher import packaging

        packaging.delete_objects(s3, created.uploads)
    return left


def _terminate(ec2: Any, instance_ids: list[str]) -> list[str]:
    """Ask EC2 to terminate the nodes; returns those it accepted. EC2 refuses a whole call for
    one id it will not take, so then each node gets its own call."""
    if _terminate_once(ec2, instance_ids):
        return list(instance_ids)
    return [i for i in instance_ids if len(instance_ids) > 1 and _terminate_once(ec2, [i])]


def _terminate_once(ec2: Any, instance_ids: list[str]) -> bool:
    try:
        ec2.terminate_instances(InstanceIds=instance_ids)
    except Exception:  # noqa: BLE001 - the caller reports what is left
        return False
    return True


def _delete_with_retry(delete: Callable[[], Any], sleep: Callable[[float], None]) -> bool:
    """Network interfaces of terminated nodes linger a little: DependencyViolation is retried."""
    for attempt in range(DELETE_ATTEMPTS):
        error = _delete_once(delete)
        if error is None:
            return True
        if aws.error_code(error) not in IN_USE_CODES or attempt == DELETE_ATTEMPTS - 1:
            return False
        sleep(DELETE_RETRY_S)
    return False


def _delete_once(delete: Callable[[], Any]) -> BaseException | None:
    """None once the resource is gone (deleted now or before), else EC2's error."""
    try:
        delete()
    except Exception as exc:  # noqa: BLE001 - the caller decides what each code means
        return None if aws.error_code(exc) in GONE_CODES else exc
    return None


@dataclass
class Removal:
    """One try at clearing an ended job: what went, what is left and why."""

    removed: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    reason: str | None = None
    retry: bool = True  # False: EC2 refused for a reason waiting will not fix
    nodes_left: int = 0  # nodes of the launch not terminated yet: no group was tried
    terminated: list[str] = field(default_factory=list)  # nodes this try asked EC2 to terminate


def clear_ended_job(ec2: Any, job: str, *, launch: str | None) -> Removal:
    """Terminate what still runs of a job that has ended, and delete its groups; one try.

    A job ends while nodes may still run: a failed node ends it while its peers hang in a
    collective, and a node can be stopped rather than terminated. Those are terminated (a node
    already shutting down is left to finish). While a node of the launch is not yet terminated
    its network interfaces hold the security group (and the node the placement group), so no
    group is tried then. No waiting, no sleeping: the caller records what is left and tries
    again on its next call.
    """
    instances = [i for i in job_instances(ec2, job, launch=launch)
                 if i["State"]["Name"] != "terminated"]
    result = Removal()
    groups = ([(g["GroupId"], lambda g=g["GroupId"]: ec2.delete_security_group(GroupId=g))
               for g in job_security_groups(ec2, job, launch=launch)]
              + [(g["GroupName"], lambda n=g["GroupName"]: ec2.delete_placement_group(GroupName=n))
                 for g in job_placement_groups(ec2, job, launch=launch)])
    if instances:
        result.left = [name for name, _ in groups]
        result.nodes_left = len(instances)
        result.reason = f"{result.nodes_left} node(s) not terminated yet"
        running = [i["InstanceId"] for i in instances if i["State"]["Name"] != "shutting-down"]
        if running:
            try:
                ec2.terminate_instances(InstanceIds=running)
                result.terminated = running
            except Exception as exc:  # noqa: BLE001 - reported; the next call tries again
                code = aws.error_code(exc)
                result.reason += f"; {aws.as_dtrain_error(exc, 'terminating ' + ', '.join(running))}"
                result.retry = code is None or code.startswith(("RequestLimit", "Throttl"))
        return result
    for name, delete in groups:
        error = _delete_once(delete)
        if error is None:
            result.removed.append(name)
            continue
        result.left.append(name)
        code = aws.error_code(error)
        result.reason = (f"{name} still in use: {code}" if code in IN_USE_CODES
                         else str(aws.as_dtrain_error(error, f"deleting {name}")))
        # waiting fixes "in use" and a lost connection, not e.g. a missing permission
        result.retry = result.retry and (code in IN_USE_CODES or code is None)
    return result


# ---------------------------------------------------------------- status and logs

def read_status_objects(s3: Any, prefix: str) -> list[dict[str, Any]]:
    """Each node's ``{prefix}/status/<host>.json``, in rank order."""
    from dtrain.launcher.ec2_bootstrap import list_keys, split_s3

    bucket, _ = split_s3(prefix)
    nodes = []
    for key in list_keys(s3, f"{prefix}/status/"):
        if key.endswith(".json"):
            nodes.append(json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read()))
    return sorted(nodes, key=lambda n: n.get("rank", 0))


def job_state(instances: dict[str, str], nodes: list[dict], num_nodes: int) -> dict[str, Any]:
    """The job's store status from EC2's instance states and each node's own report.

    ``status`` is one of the store's names (None: nothing is known yet), ``secondary_status``
    says more while it runs. A failed node fails the job at once; ``Ec2Launcher.status`` then
    terminates the nodes still running, as SageMaker stops a failed job's other hosts. A stopped
    node (interrupted: it or a peer got SIGTERM and its workers stopped after a checkpoint) makes
    the job Stopping while other nodes still run, so they can checkpoint and upload too, then
    Stopped with the node's own reason (the runtime's interruption line) once none runs.
    """
    by_state: dict[str, list[dict]] = {}
    for node in nodes:
        by_state.setdefault(node.get("state"), []).append(node)
    if by_state.get("failed"):
        first = by_state["failed"][0]
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


def new_log_lines(s3: Any, prefix: str, seen: dict[str, int], *, host: str | None,
                  rank: int | None) -> Iterator[str]:
    """Lines added since the last call to each log object (``seen`` holds the offsets)."""
    from dtrain.launcher.ec2_bootstrap import list_keys, split_s3

    bucket, _ = split_s3(prefix)
    root = f"{split_s3(prefix)[1]}/logs/"
    for key in sorted(list_keys(s3, f"{prefix}/logs/")):
        node, _, name = key[len(root):].partition("/")
        if host is not None and node != host:
            continue
        if rank is not None and name.split(".")[0] != f"rank-{rank}":
            continue
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        start = seen.get(key, 0)
        seen[key] = len(body)
        for line in body[start:].decode(errors="replace").splitlines():
            yield f"{node}: {line}"


# ---------------------------------------------------------------- leftovers (`dtrain ec2 gc`)

def find_leftovers(ec2: Any, *, include_running: bool = False) -> Created:
    """dtrain-tagged resources no running cluster uses; nothing untagged is ever listed.

    Groups are leftovers once no live node of their launch remains: a job that ended on its own,
    failed or was stopped, whose groups ``status`` could not remove yet. Nodes are leftovers when
    their launch never came up whole: fewer nodes than its ``dtrain:num-nodes`` were ever
    launched (the launcher died mid-way). Nodes that already finished count as launched (EC2
    lists terminated instances for about an hour), so the last node of a finishing job still
    uploading its results is not mistaken for one. ``include_running`` lists every live node.
    """
    launches: dict[str, list[dict]] = {}
    for instance in job_instances(ec2, None):
        launches.setdefault(tag_map(instance).get(req.TAG_LAUNCH, ""), []).append(instance)
    found = Created(job="*")
    kept: set[str] = set()
    for launch, nodes in launches.items():
        live = [i for i in nodes if i["State"]["Name"] in LIVE_STATES]
        if not live:
            continue
        want = int(tag_map(nodes[0]).get(req.TAG_NUM_NODES, len(nodes)))
        if include_running or len(nodes) < want:
            found.instances += [i["InstanceId"] for i in live]
        else:
            kept.add(launch)
    found.security_groups = [g["GroupId"] for g in job_security_groups(ec2, None)
                             if tag_map(g).get(req.TAG_LAUNCH) not in kept]
    found.placement_groups = [g["GroupName"] for g in job_placement_groups(ec2, None)
                              if tag_map(g).get(req.TAG_LAUNCH) not in kept]
    return found
