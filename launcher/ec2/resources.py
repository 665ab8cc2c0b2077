"""EC2 I/O for the ec2 backend: lookups, finding a job's resources by tag, blocking teardown.

Every function takes its boto3 client(s) as arguments. Teardown is ordered the way EC2 needs it:
terminate instances, wait until they are gone (a security group stays "in use" while their
network interfaces exist), then delete the security group and the placement group. The
non-blocking removal for a job that ended on its own is ``cleanup.clear_ended_job``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dtrain.core.errors import DtrainError
from dtrain.launcher import aws, packaging
from dtrain.launcher.ec2 import requests as req
from dtrain.launcher.ec2 import tags

LIVE_STATES = ("pending", "running", "stopping", "stopped", "shutting-down")
RUNNING_STATES = ("pending", "running")  # a node in these can still do work and report it
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


def resolve_subnet(ec2: Any, lookup: dict[str, str]) -> tuple[str, str, str]:
    """(subnet id, its VPC id, its availability zone): the given subnet, else the default VPC's
    first default subnet."""
    if "value" in lookup:
        subnets = ec2.describe_subnets(SubnetIds=[lookup["value"]])["Subnets"]
    else:
        subnets = ec2.describe_subnets(
            Filters=[{"Name": "default-for-az", "Values": ["true"]}])["Subnets"]
        subnets.sort(key=lambda s: s["AvailabilityZone"])
    if not subnets:
        raise DtrainError("ec2.subnet_id: not set and this region has no default subnet; give "
                          "a subnet id (one AZ, with a route to S3)")
    return subnets[0]["SubnetId"], subnets[0]["VpcId"], subnets[0]["AvailabilityZone"]


def check_reservation(ec2: Any, reservation_id: str, *, zone: str, instance_type: str,
                      nodes: int, placement_group: str) -> None:
    """Refuse, before anything is created, a capacity reservation the nodes could not launch
    into: another instance type or zone than the job's, a placement group it was not made for,
    not active yet (a capacity block before its start), or too few instances free."""
    try:
        found = ec2.describe_capacity_reservations(
            CapacityReservationIds=[reservation_id])["CapacityReservations"]
    except Exception as exc:  # noqa: BLE001 - one line: a wrong id, or no permission
        raise aws.as_dtrain_error(exc, f"DescribeCapacityReservations {reservation_id}") from None
    if not found:
        raise DtrainError(f"ec2.capacity_reservation_id: EC2 has no reservation {reservation_id} "
                          "in this region")
    cr = found[0]
    problems = []
    if cr.get("InstanceType") != instance_type:
        problems.append(f"it holds {cr.get('InstanceType')}, and the job asks for {instance_type}"
                        " (compute.instance_type)")
    if cr.get("AvailabilityZone") != zone:
        problems.append(f"it is in {cr.get('AvailabilityZone')}, and the subnet in {zone}; give "
                        f"a subnet in {cr.get('AvailabilityZone')} (ec2.subnet_id)")
    group = (cr.get("PlacementGroupArn") or "").rpartition("/")[2]
    if group and group != placement_group:
        problems.append(f"it was made for placement group {group}; set ec2.placement_group: "
                        f"{group}")
    if cr.get("State", "active") != "active":
        problems.append(f"it is {cr['State']}, not active (a capacity block can be used from "
                        "its start time)")
    free = cr.get("AvailableInstanceCount")
    if free is not None and free < nodes and not problems:
        problems.append(f"{free} of its instances are free, and the job needs {nodes}")
    if problems:
        raise DtrainError(f"ec2.capacity_reservation_id: {reservation_id} cannot take these "
                          f"nodes: {'; '.join(problems)}")


# ---------------------------------------------------------------- a job's resources by tag

def job_instances(ec2: Any, job: str | None, *, launch: str | None = None) -> list[dict[str, Any]]:
    """dtrain's instances (of one job, or all; of one launch of it), in rank order."""
    found = []
    for page in ec2.get_paginator("describe_instances").paginate(
            Filters=tags.filters(job, launch)):
        for reservation in page["Reservations"]:
            found += reservation["Instances"]
    return in_rank_order(found)


def in_rank_order(instances: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A launch's nodes by rank: a node's rank is its launch index in the launch's one
    RunInstances request (what its bootstrap reads from the instance metadata)."""
    return sorted(instances, key=lambda i: i.get("AmiLaunchIndex", 0))


def job_security_groups(ec2: Any, job: str | None, *,
                        launch: str | None = None) -> list[dict[str, Any]]:
    return ec2.describe_security_groups(Filters=tags.filters(job, launch))["SecurityGroups"]


def job_placement_groups(ec2: Any, job: str | None, *,
                         launch: str | None = None) -> list[dict[str, Any]]:
    return ec2.describe_placement_groups(Filters=tags.filters(job, launch))["PlacementGroups"]


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
    launch still under way, and for a launch cut off inside RunInstances: a node whose
    RunInstances landed after ``created`` was listed is terminated too, before the groups it
    would hold. Such nodes are added to ``created``. A list that fails is reported as left.
    """
    left = _terminate_and_wait(ec2, created.instances)
    seen = set(created.instances)
    while relist is not None:  # one RunInstances per launch: few rounds
        try:
            late = [i for i in relist() if i not in seen]
        except Exception:  # noqa: BLE001 - the caller reports what is left
            left.append(f"any node of {created.job} not listed (DescribeInstances failed)")
            break
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
        error = delete_once(delete)
        if error is None:
            return True
        if aws.error_code(error) not in IN_USE_CODES or attempt == DELETE_ATTEMPTS - 1:
            return False
        sleep(DELETE_RETRY_S)
    return False


def delete_once(delete: Callable[[], Any]) -> BaseException | None:
    """None once the resource is gone (deleted now or before), else EC2's error."""
    try:
        delete()
    except Exception as exc:  # noqa: BLE001 - the caller decides what each code means
        return None if aws.error_code(exc) in GONE_CODES else exc
    return None
