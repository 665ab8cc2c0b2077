"""Pure request building for the EC2 target: every AWS call a job needs, as plain dicts, no I/O.

``payload(spec, plan, job_name)`` is the request set that ``dtrain submit --target ec2
--dry-run`` prints and that ``Ec2Launcher.submit`` sends, in order: an optional
``CreatePlacementGroup`` (strategy ``cluster``), a security group that allows all traffic only
from itself (EFA's requirement) plus SSH from ``ec2.ssh_cidr`` when given, and one
``RunInstances`` for every node. Values only known after an I/O step appear as ``{{name}}``
placeholders (``ami_id`` from the Deep Learning AMI SSM parameter, ``vpc_id`` and ``subnet_id``
when no subnet is given, ``security_group_id`` once the group exists, ``launch_token`` and
``launched_at`` drawn at submit); ``placeholders.fill`` substitutes them.

One ``RunInstances`` for all nodes (``MinCount=MaxCount=`` the node count), as AWS advises for
a cluster placement group: EC2 places the whole cluster in one go or launches none of it
(``InsufficientInstanceCapacity``), where requests one node at a time could get a cluster's
first nodes and then no room for the rest beside them. Every node gets the same user data; a
node's rank is its AMI launch index in the request (0 to N-1, read from the instance metadata
at boot, ``ami-launch-index``), and the launcher lists a launch's nodes in that order too.

EFA layout follows the AWS guide "Maximize network bandwidth ... with multiple network cards":
network card 0 device 0 is an ``efa`` interface (EFA plus the ENA that carries IP traffic); every
further card gets device index 1, as ``efa`` on p4d/p4de and as ``efa-only`` on the p5 family,
where 31 extra IP addresses per node would be wasted (``efa-only`` has no IP address).

The spec reaching here has passed validation (``dtrain.spec``), which owns the rules on user
input; the one check left here is the size of the rendered user data (``userdata.render``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dtrain.launcher import aws, packaging
from dtrain.launcher.base import Upload
from dtrain.launcher.ec2 import layout, userdata
from dtrain.launcher.ec2.placeholders import placeholder
from dtrain.launcher.ec2.tags import (
    TAG_LAUNCH,
    TAG_LAUNCHED_AT,
    TAG_NUM_NODES,
    TAG_PREFIX,
)

if TYPE_CHECKING:
    from dtrain.planning.planner import Plan
    from dtrain.spec.model import JobSpec

# The documented public SSM parameter of the AWS Deep Learning OSS Nvidia Driver AMI (PyTorch,
# Ubuntu 24.04, P4/P5 among its instance types; torch in /opt/pytorch); see the DLAMI developer
# guide, "Finding the AMI ID with SSM". The node agent runs on this AMI's torch, so its version
# must be one dtrain's runtime supports (dtrain.core.torch_support; a unit test holds it there).
DLAMI_PYTORCH_VERSION = "2.10"
DLAMI_SSM_PARAMETER = (
    "/aws/service/deeplearning/ami/x86_64/"
    f"oss-nvidia-driver-gpu-pytorch-{DLAMI_PYTORCH_VERSION}-ubuntu-24.04/latest/ami-id"
)
DLAMI_ROOT_DEVICE = "/dev/sda1"  # Ubuntu AMIs; a user AMI's is looked up at submit
# p5-family cards beyond 0 carry EFA only: no IP address per card (AWS EFA guide, P5 section).
EFA_ONLY_FAMILIES = ("p5.", "p5e.", "p5en.")


def resource_name(job_name: str) -> str:
    """Security and placement group name; unique per submission through the launch token."""
    return f"dtrain-{job_name}-{placeholder('launch_token')}"


def payload(spec: JobSpec, plan: Plan, job_name: str) -> dict[str, Any]:
    """Every call an EC2 job makes, in order, as JSON-compatible data (pure: no I/O)."""
    placement = _placement_group(job_name, spec.ec2.placement_group, spec.tags)
    return {
        "region": spec.ec2.region,
        "prefix": userdata.job_prefix(spec, job_name),
        "checkpoints": layout.checkpoint_uri(userdata.job_prefix(spec, job_name),
                                             spec.checkpoint.uri),
        "cost": cost_summary(spec, plan),
        "lookups": _lookups(spec),
        "placement_group": placement,
        "security_group": _security_group(job_name, spec.ec2.ssh_cidr, spec.tags),
        "run_instances": _run_instances(spec, plan, job_name, placement["GroupName"]),
    }


def uploads(spec: JobSpec, job_name: str) -> tuple[Upload, ...]:
    """What ``submit`` puts under ``{prefix}/source/`` for the nodes: the packed source folder
    (none for a recipe or an s3:// archive) and the runtime wheel."""
    prefix = userdata.job_prefix(spec, job_name)
    files = [Upload(packaging.WHEEL, layout.source_uri(prefix, packaging.wheel_name()))]
    if userdata.packs_source(spec):
        files.insert(0, Upload(spec.source_dir,
                               layout.source_uri(prefix, packaging.SOURCE_ARCHIVE)))
    return tuple(files)


def cost_summary(spec: JobSpec, plan: Plan) -> dict[str, Any]:
    """Nodes × $/hour × max_run, from the plan; the launcher shows it before anything starts."""
    return {
        "nodes": plan.num_nodes,
        "instance_type": plan.instance.name,
        "price_per_hour": plan.price_per_hour,
        "max_run_hours": round(spec.compute.max_run / 3600, 4),
        "max_run_cost": None if plan.max_run_cost is None else round(plan.max_run_cost, 2),
        "confirm_above_usd": spec.ec2.confirm_above_usd,
        "spot": spec.compute.use_spot,
    }


def cost_line(cost: dict[str, Any]) -> str:
    if cost["max_run_cost"] is None:
        return (f"cost: {cost['nodes']} × {cost['instance_type']} (no price known; set "
                f"compute.price_per_hour) up to {cost['max_run_hours']:g} h")
    spot = " on-demand price; spot is usually less" if cost["spot"] else ""
    return (f"cost: {cost['nodes']} × {cost['instance_type']} × ${cost['price_per_hour']:,.2f}/h"
            f" × {cost['max_run_hours']:g} h max_run = up to ${cost['max_run_cost']:,.2f}{spot}")


def needs_confirmation(cost: dict[str, Any]) -> bool:
    """True when the job's max_run cost is above ``ec2.confirm_above_usd`` (or unknown)."""
    return cost["max_run_cost"] is None or cost["max_run_cost"] > cost["confirm_above_usd"]


def _lookups(spec: JobSpec) -> dict[str, Any]:
    """The I/O steps submit runs before the calls below, and what each fills in."""
    ec2 = spec.ec2
    reservation = ({"capacity_reservation": {
        "describe_capacity_reservations": ec2.capacity_reservation_id,
        "check": "its instance type, zone, placement group, state and free instances"}}
        if ec2.capacity_reservation_id else {})
    return {
        **reservation,
        "ami_id": ({"ssm_parameter": DLAMI_SSM_PARAMETER} if ec2.ami == "auto"
                   else {"value": ec2.ami}),
        "root_device": ({"value": DLAMI_ROOT_DEVICE} if ec2.ami == "auto"
                        else {"describe_images": ec2.ami}),
        "subnet_id": ({"value": ec2.subnet_id} if ec2.subnet_id
                      else {"default_subnet": "first default subnet of the default VPC"}),
        "vpc_id": {"describe_subnets": ec2.subnet_id or placeholder("subnet_id")},
    }


def _tags(job: str, user_tags: dict[str, str], *, name: str, **extra: str) -> list[dict]:
    tags = {**user_tags, "Name": name, aws.TAG_JOB: job, aws.TAG_CREATED_BY: aws.CREATED_BY,
            TAG_LAUNCH: placeholder("launch_token"), TAG_LAUNCHED_AT: placeholder("launched_at"),
            **extra}
    return [{"Key": k, "Value": v} for k, v in tags.items()]


def _placement_group(job: str, existing: str | None, user_tags: dict) -> dict[str, Any]:
    if existing:
        return {"create": False, "GroupName": existing}
    name = resource_name(job)
    return {
        "create": True,
        "GroupName": name,
        "CreatePlacementGroup": {
            "GroupName": name, "Strategy": "cluster",
            "TagSpecifications": [{"ResourceType": "placement-group",
                                   "Tags": _tags(job, user_tags, name=name)}],
        },
    }


def _security_group(job: str, ssh_cidr: str | None, user_tags: dict) -> dict[str, Any]:
    """All traffic from/to the group itself (EFA needs both directions), SSH only if asked."""
    name = resource_name(job)
    self_pair = [{"GroupId": placeholder("security_group_id"),
                  "Description": "EFA and NCCL traffic between the job's nodes"}]
    ingress = [{"IpProtocol": "-1", "UserIdGroupPairs": self_pair}]
    if ssh_cidr:
        ingress.append({"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22,
                        "IpRanges": [{"CidrIp": ssh_cidr, "Description": "SSH (ec2.ssh_cidr)"}]})
    group_id = placeholder("security_group_id")
    return {
        "CreateSecurityGroup": {
            "GroupName": name, "VpcId": placeholder("vpc_id"),
            "Description": f"dtrain job {job}: all traffic between its nodes (EFA)",
            "TagSpecifications": [{"ResourceType": "security-group",
                                   "Tags": _tags(job, user_tags, name=name)}],
        },
        # The group keeps EC2's default allow-all egress, so nodes reach S3.
        "AuthorizeSecurityGroupIngress": {"GroupId": group_id, "IpPermissions": ingress},
        "AuthorizeSecurityGroupEgress": {
            "GroupId": group_id,
            "IpPermissions": [{"IpProtocol": "-1", "UserIdGroupPairs": self_pair}],
        },
    }


def network_interfaces(instance_type: str, efa_count: int) -> list[dict[str, Any]]:
    """One interface per EFA-capable network card; a plain ENA interface without EFA."""
    common = {"SubnetId": placeholder("subnet_id"), "Groups": [placeholder("security_group_id")],
              "DeleteOnTermination": True}
    if efa_count == 0:
        return [{"NetworkCardIndex": 0, "DeviceIndex": 0, **common}]
    extra_type = "efa-only" if instance_type.startswith(EFA_ONLY_FAMILIES) else "efa"
    cards = [{"NetworkCardIndex": 0, "DeviceIndex": 0, "InterfaceType": "efa", **common}]
    cards += [{"NetworkCardIndex": card, "DeviceIndex": 1, "InterfaceType": extra_type, **common}
              for card in range(1, efa_count)]
    return cards


def _run_instances(spec: JobSpec, plan: Plan, job: str, placement_group: str) -> dict[str, Any]:
    request: dict[str, Any] = {
        "ImageId": placeholder("ami_id"),
        "InstanceType": plan.instance.name,
        # all or none (see the module doc): a cluster with a node missing cannot train
        "MinCount": plan.num_nodes,
        "MaxCount": plan.num_nodes,
        # Idempotent under boto3's retries: a retried call never launches a second cluster.
        # The token is drawn at submit, so a job name used again later launches afresh.
        "ClientToken": f"dtrain-{placeholder('launch_token')}",
        "Placement": {"GroupName": placement_group},
        "NetworkInterfaces": network_interfaces(plan.instance.name, plan.instance.efa_interfaces),
        "BlockDeviceMappings": [{
            "DeviceName": placeholder("root_device"),
            "Ebs": {"VolumeSize": spec.compute.volume_size_gb, "VolumeType": "gp3",
                    "DeleteOnTermination": True, "Encrypted": True},
        }],
        # IMDSv2 only; hop limit 2 so a container on the node (ec2.image_uri) reaches it too.
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled",
                            "HttpPutResponseHopLimit": 2},
        # The bootstrap's final `shutdown` then terminates: a finished node stops billing.
        "InstanceInitiatedShutdownBehavior": "terminate",
        "UserData": userdata.render(spec, plan, job_name=job),
        "TagSpecifications": [
            {"ResourceType": kind,
             "Tags": _tags(job, spec.tags, name=f"dtrain-{job}",
                           **{TAG_NUM_NODES: str(plan.num_nodes),
                              TAG_PREFIX: userdata.job_prefix(spec, job)})}
            for kind in ("instance", "volume", "network-interface")
        ],
    }
    profile = spec.ec2.instance_profile
    if profile:
        request["IamInstanceProfile"] = {"Arn" if profile.startswith("arn:") else "Name": profile}
    if spec.ec2.key_name:
        request["KeyName"] = spec.ec2.key_name
    request.update(_market_options(spec))
    return request


def _market_options(spec: JobSpec) -> dict[str, Any]:
    ec2 = spec.ec2
    options: dict[str, Any] = {}
    if ec2.capacity_reservation_id:
        options["CapacityReservationSpecification"] = {
            "CapacityReservationTarget": {"CapacityReservationId": ec2.capacity_reservation_id}
        }
    if ec2.capacity_block:
        options["InstanceMarketOptions"] = {"MarketType": "capacity-block"}
    elif spec.compute.use_spot:
        options["InstanceMarketOptions"] = {
            "MarketType": "spot",
            "SpotOptions": {"SpotInstanceType": "one-time",
                            "InstanceInterruptionBehavior": "terminate"},
        }
    return options
