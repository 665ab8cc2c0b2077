"""EC2 I/O for the ec2 backend: lookups, finding a job's resources by tag, teardown, leftovers.

Every function takes its boto3 client(s) as arguments. Teardown is ordered the way EC2 needs it:
terminate instances, wait until they are gone (a security group stays "in use" while their
network interfaces exist), then delete the security group and the placement group.
``remove_groups`` is the non-blocking variant for a job that ended on its own: one try per call,
and whatever is still in use is reported for the next call instead of waited for.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from dtrain.core import s3 as s3_uri
from dtrain.core.errors import DtrainError
from dtrain.jobs.store import (
    COMPLETED,
    FAILED,
    FINAL_STATUSES,
    RUNNING,
    STARTING,
    STOPPED,
    STOPPING,
)
from dtrain.launcher import aws
from dtrain.launcher.ec2 import layout
from dtrain.launcher.ec2 import requests as req

LIVE_STATES = ("pending", "running", "stopping", "stopped", "shutting-down")
RUNNING_STATES = ("pending", "running")  # a node in these can still do work and report it
NODE_FINAL_STATES = ("completed", "stopped", "failed")  # what ec2_bootstrap writes at the end
# After a node reports a failure, its peers that have not reported yet are left running this
# long before dtrain terminates them. A node uploads its checkpoints only when its own job ends:
# a peer's agent exits once its collectives with the failed node time out (the runtime's process
# group timeout, dtrain.runtime.distributed.context.DEFAULT_TIMEOUT_S: 30 min), then its bootstrap uploads
# its checkpoint shards (15 min here for a large sharded checkpoint), reports and powers off.
FAILED_PEER_GRACE_S = 2700.0
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


def job_instance_ids(ec2: Any, job: str, *, launch: str | None = None) -> list[str]:
    """The job's (launch's) nodes not terminated yet, shutting-down ones included."""
    return [i["InstanceId"] for i in job_instances(ec2, job, launch=launch)
            if i["State"]["Name"] != "terminated"]


def job_resources(ec2: Any, job: str, *, launch: str | None = None) -> Created:
    """What dtrain created and tagged for a job (one launch of it when ``launch`` is given):
    its nodes still not terminated, its security group, its placement group. A placement group
    the user named in ``ec2.placement_group`` carries no dtrain tag, so it is never listed."""
    found = Created(job=job)
    found.instances = job_instance_ids(ec2, job, launch=launch)
    found.security_groups = [g["GroupId"] for g in job_security_groups(ec2, job, launch=launch)]
    found.placement_groups = [g["GroupName"]
                              for g in job_placement_groups(ec2, job, launch=launch)]
    return found


# ---------------------------------------------------------------- teardown

def rollback(ec2: Any, s3: Any, created: Created, *, sleep: Callable[[float], None],
             keep_uploads: bool = False,
             relist: Callable[[], list[str]] | None = None) -> list[str]:
    """Remove everything in ``created``; returns what could not be removed (for the message).

    ``relist`` (the launch's nodes not terminated, listed again) is for a stop that races a
    launch still under way: a node whose RunInstances landed after ``created`` was listed is
    terminated too, before the groups it would hold. Such nodes are added to ``created``.
    """
    left = _terminate_and_wait(ec2, created.instances)
    seen = set(created.instances)
    while relist is not None:  # the launcher checks the record before each node: few rounds
        late = [i for i in relist() if i not in seen]
        if not late:
            break
        seen.update(late)
        created.instances += late
        left += _terminate_and_wait(ec2, late)
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


def _terminate_and_wait(ec2: Any, instance_ids: list[str]) -> list[str]:
    """Terminate the nodes and wait until they are gone; returns those that may not be."""
    if not instance_ids:
        return []
    going = _terminate(ec2, instance_ids)
    left = [i for i in instance_ids if i not in going]
    try:
        if going:
            ec2.get_waiter("instance_terminated").wait(
                InstanceIds=going, WaiterConfig={"Delay": 15, "MaxAttempts": 40})
    except Exception:  # noqa: BLE001 - reported by the caller, the rest still gets a try
        left += going
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
    spared: list[str] = field(default_factory=list)  # a failed job's peers left to upload
    spared_until: float | None = None  # when those are terminated (epoch seconds)


@dataclass(frozen=True)
class PeerGrace:
    """A failed job's nodes that have not reported yet are left running until ``until`` (epoch
    seconds) so they can upload their checkpoints; ``reported``: nodes that wrote a final report."""

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


def utc_time(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def clear_ended_job(ec2: Any, job: str, *, launch: str | None,
                    grace: PeerGrace | None = None) -> Removal:
    """Terminate what still runs of a job that has ended, and delete its groups; one try.

    A job ends while nodes may still run: a failed node ends it while its peers hang in a
    collective, and a node can be stopped rather than terminated. Those are terminated (a node
    already shutting down is left to finish), except the peers ``grace`` spares: they may still
    upload their checkpoints. While a node of the launch is not yet terminated its network
    interfaces hold the security group (and the node the placement group), so no group is tried
    then. No waiting, no sleeping: the caller records what is left and tries again on its next
    call.
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
        result.spared = [i["InstanceId"] for i in instances if grace and grace.spares(i)]
        if result.spared:
            result.spared_until = grace.until
            result.reason += (f"; {len(result.spared)} left running after a peer failed, to "
                              f"upload their checkpoints, until {utc_time(grace.until)}")
        running = [i["InstanceId"] for i in instances if i["State"]["Name"] != "shutting-down"
                   and i["InstanceId"] not in result.spared]
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
    bucket, _ = s3_uri.split(prefix)
    nodes = [layout.read_json(s3, bucket, key)
             for key in layout.list_keys(s3, layout.status_folder(prefix)) if key.endswith(".json")]
    return sorted(nodes, key=lambda n: n.get("rank", 0))


def job_state(instances: dict[str, str], nodes: list[dict], num_nodes: int) -> dict[str, Any]:
    """The job's store status from EC2's instance states and each node's own report.

    ``status`` is one of the store's names (None: nothing is known yet), ``secondary_status``
    says more while it runs. A failed node fails the job at once; ``Ec2Launcher.status`` then
    terminates the nodes that reported too and still run, and the others once ``peer_grace``
    ends (they upload their checkpoints when their own job ends). A stopped
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
    folder = layout.logs_folder(prefix)
    bucket, root = s3_uri.split(folder)
    for key in sorted(layout.list_keys(s3, folder)):
        node, _, name = key[len(root):].lstrip("/").partition("/")
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

@dataclass
class Launch:
    """One submission's dtrain-tagged resources, grouped by their ``dtrain:launch`` tag."""

    token: str
    instances: list[dict[str, Any]] = field(default_factory=list)
    security_groups: list[dict[str, Any]] = field(default_factory=list)
    placement_groups: list[dict[str, Any]] = field(default_factory=list)

    @property
    def live(self) -> list[dict[str, Any]]:
        return [i for i in self.instances if i["State"]["Name"] in LIVE_STATES]

    @property
    def num_nodes(self) -> int:
        tags = tag_map(self.instances[0]) if self.instances else {}
        return int(tags.get(req.TAG_NUM_NODES, len(self.instances)))

    def started(self) -> datetime | None:
        """Its ``dtrain:launched-at`` tag, else its first node's launch time (older dtrain)."""
        for resource in (*self.instances, *self.security_groups, *self.placement_groups):
            value = tag_map(resource).get(req.TAG_LAUNCHED_AT)
            if value:
                return datetime.strptime(value, req.LAUNCHED_AT_FORMAT).replace(
                    tzinfo=timezone.utc)
        times = [i["LaunchTime"] for i in self.instances if i.get("LaunchTime")]
        return min(times) if times else None

    def everything(self) -> Created:
        return Created(job=self.token, instances=[i["InstanceId"] for i in self.live],
                       security_groups=[g["GroupId"] for g in self.security_groups],
                       placement_groups=[g["GroupName"] for g in self.placement_groups])


def find_launches(ec2: Any) -> dict[str, Launch]:
    """Every launch that has a dtrain-tagged instance (EC2 lists terminated ones for about an
    hour), security group or placement group; nothing untagged is ever listed."""
    launches: dict[str, Launch] = {}

    def launch(resource: dict[str, Any]) -> Launch:
        token = tag_map(resource).get(req.TAG_LAUNCH, "")
        return launches.setdefault(token, Launch(token=token))

    for instance in job_instances(ec2, None):
        launch(instance).instances.append(instance)
    for group in job_security_groups(ec2, None):
        launch(group).security_groups.append(group)
    for group in job_placement_groups(ec2, None):
        launch(group).placement_groups.append(group)
    return launches


@dataclass
class Leftovers:
    """What `dtrain ec2 gc` removes, and what it keeps only because it is too recent."""

    remove: Created = field(default_factory=lambda: Created(job="*"))
    too_recent: list[str] = field(default_factory=list)
    # of failed jobs whose unreported peers may still upload checkpoints; kept until then
    finishing: list[str] = field(default_factory=list)
    finishing_until: float | None = None

    def add(self, found: Created) -> None:
        self.remove.instances += found.instances
        self.remove.security_groups += found.security_groups
        self.remove.placement_groups += found.placement_groups


def find_leftovers(launches: dict[str, Launch], *, now: datetime, s3: Any = None,
                   ended: Collection[str] = (), running: Collection[str] = (),
                   min_age_s: float = 0.0, include_running: bool = False) -> Leftovers:
    """The launches' resources that no running job uses, launch by launch.

    ``ended``/``running``: launch tokens whose job record says the job ended / still runs. An
    ended job's live nodes and groups all go; a running job's stay. A launch without a record
    is left alone while younger than ``min_age_s`` (it may still be launching: its groups exist
    before its nodes); after that its groups go once no node of it is live, and its nodes too
    when fewer than its ``dtrain:num-nodes`` were ever launched (a launcher killed mid-way) or
    its nodes' status objects (read with ``s3``) say the job ended. Either way, while a node
    reported a failure and a peer that has not reported still runs (``peer_grace``), the launch
    is kept whole in ``finishing``: that peer may still upload its checkpoints, and its groups
    are in use. ``include_running``: all.
    """
    found = Leftovers()
    for token, launch in launches.items():
        started = launch.started()
        everything = launch.everything()
        names = [*everything.instances, *everything.security_groups, *everything.placement_groups]
        if include_running:
            found.add(everything)
        elif token in running:
            continue
        elif (token not in ended and started is not None
              and (now - started).total_seconds() < min_age_s):
            found.too_recent += names
        elif token in ended or not launch.live or len(launch.instances) < launch.num_nodes or (
                s3 is not None and _reported_ended(s3, launch)):
            until = _peers_finishing(s3, launch, now=now)
            if until is None:
                found.add(everything)
            else:
                found.finishing += names
                found.finishing_until = max(found.finishing_until or until, until)
    return found


def _reports(s3: Any, launch: Launch) -> list[dict[str, Any]]:
    """The status objects of the launch's own nodes; [] when they cannot be read."""
    ids = {i["InstanceId"] for i in launch.instances}
    prefix = tag_map(launch.instances[0]).get(req.TAG_PREFIX)
    try:
        return [n for n in read_status_objects(s3, prefix) if n.get("instance_id") in ids]
    except Exception:  # noqa: BLE001 - unreadable reports: judge by the instance states alone
        return []


def _reported_ended(s3: Any, launch: Launch) -> bool:
    """True when the launch's nodes' own reports and EC2's states say its job ended."""
    states = {i["InstanceId"]: i["State"]["Name"] for i in launch.instances}
    return job_state(states, _reports(s3, launch), launch.num_nodes)["status"] in FINAL_STATUSES


def _peers_finishing(s3: Any, launch: Launch, *, now: datetime) -> float | None:
    """Until when a failed job's unreported peers of this launch are left running; None if none."""
    if s3 is None or not launch.live:
        return None
    grace = peer_grace(_reports(s3, launch), now=now.timestamp())
    if grace is None or not any(grace.spares(i) for i in launch.live):
        return None
    return grace.until
