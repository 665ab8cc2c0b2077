"""Pure request building for the EC2 target: every AWS call a job needs, as plain dicts, no I/O.

``build_request(plan)`` returns the whole request set that ``dtrain submit --target ec2
--dry-run`` prints and that ``Ec2Launcher.submit`` sends, in order: an optional
``CreatePlacementGroup`` (strategy ``cluster``), a security group that allows all traffic only
from itself (EFA's requirement) plus SSH from ``ec2.ssh_cidr`` when given, and one
``RunInstances`` per node. Values only known after an I/O step appear as ``{{name}}``
placeholders (``ami_id`` from the Deep Learning AMI SSM parameter, ``vpc_id`` and ``subnet_id``
when no subnet is given, ``security_group_id`` once the group exists, ``launch_token`` and
``launched_at`` drawn at submit); ``fill_placeholders`` substitutes them.

One ``RunInstances`` per node (``MinCount=MaxCount=1``) rather than one for all: each node's
user data carries its own rank, so the cluster order is the launch order without relying on
``AmiLaunchIndex``, and a capacity failure is noticed at the exact node it hit.

EFA layout follows the AWS guide "Maximize network bandwidth ... with multiple network cards":
network card 0 device 0 is an ``efa`` interface (EFA plus the ENA that carries IP traffic); every
further card gets device index 1, as ``efa`` on p4d/p4de and as ``efa-only`` on the p5 family,
where 31 extra IP addresses per node would be wasted (``efa-only`` has no IP address).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from importlib import resources
from typing import TYPE_CHECKING, Any

from dtrain import __version__
from dtrain.core.errors import SpecError
from dtrain.launcher.base import runtime_settings
from dtrain.launcher.ec2 import layout

if TYPE_CHECKING:
    from dtrain.planning.planner import Plan

# Tag keys that identify what dtrain created; `dtrain ec2 gc` touches nothing without them.
TAG_JOB = "dtrain:job"
TAG_CREATED_BY = "dtrain:created-by"
TAG_NODE_RANK = "dtrain:node-rank"
TAG_LAUNCH = "dtrain:launch"  # one submission's token: a job name may be used again later
TAG_NUM_NODES = "dtrain:num-nodes"  # lets gc see a cluster that never came up whole
TAG_PREFIX = "dtrain:prefix"  # where status and logs are, so a job name alone is enough
# When the launch began (UTC, LAUNCHED_AT_FORMAT): `dtrain ec2 gc` leaves young launches alone,
# and EC2 tells no creation time of a security or placement group.
TAG_LAUNCHED_AT = "dtrain:launched-at"
LAUNCHED_AT_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
CREATED_BY = "dtrain"
# The documented public SSM parameter of the AWS Deep Learning OSS Nvidia Driver AMI (PyTorch,
# Ubuntu 22.04); see the DLAMI developer guide, "Finding the AMI ID with SSM".
DLAMI_PYTORCH_VERSION = "2.6"
DLAMI_SSM_PARAMETER = (
    "/aws/service/deeplearning/ami/x86_64/"
    f"oss-nvidia-driver-gpu-pytorch-{DLAMI_PYTORCH_VERSION}-ubuntu-22.04/latest/ami-id"
)
DLAMI_ROOT_DEVICE = "/dev/sda1"  # Ubuntu AMIs; a user AMI's is looked up at submit
# p5-family cards beyond 0 carry EFA only: no IP address per card (AWS EFA guide, P5 section).
EFA_ONLY_FAMILIES = ("p5.", "p5e.", "p5en.")
USER_DATA_LIMIT = 16 * 1024  # EC2's limit on raw user data
# The shutdown backstop fires this long after max_run, so the agent's own max_run handling and
# the artifact upload come first.
SHUTDOWN_MARGIN_S = 900
BOOTSTRAP_TEMPLATE = "ec2_bootstrap.sh"
WHEEL_NAME = f"dtrain-{__version__}-py3-none-any.whl"
SOURCE_ARCHIVE = "sourcedir.tar.gz"


def placeholder(name: str) -> str:
    return "{{" + name + "}}"


def job_prefix(plan: Plan, job_name: str) -> str:
    """``{output_path}/{job}``: where source, status, logs and outputs of the job live."""
    return f"{plan.spec.output_path.rstrip('/')}/{job_name}"


def resource_name(job_name: str) -> str:
    """Security and placement group name; unique per submission through the launch token."""
    return f"dtrain-{job_name}-{placeholder('launch_token')}"


def build_request(plan: Plan, *, job_name: str | None = None) -> dict[str, Any]:
    """Every call an EC2 job makes, in order, as JSON-compatible data (pure: no I/O)."""
    spec = plan.spec
    job = job_name or spec.name
    _check_supported(plan)
    ec2 = spec.ec2
    placement = _placement_group(job, ec2.placement_group, spec.tags)
    request = {
        "target": "ec2",
        "job": job,
        "region": ec2.region,
        "prefix": job_prefix(plan, job),
        "cost": cost_summary(plan),
        "lookups": _lookups(spec),
        "placement_group": placement,
        "security_group": _security_group(job, ec2.ssh_cidr, spec.tags),
        "run_instances": [
            _run_instances(plan, job, rank, placement["GroupName"])
            for rank in range(plan.num_nodes)
        ],
    }
    return request


def _check_supported(plan: Plan) -> None:
    spec = plan.spec
    if spec.compute.use_spot and spec.ec2.capacity_block:
        raise SpecError(
            "compute.use_spot: a capacity block is already reserved capacity; set use_spot: "
            "false or drop ec2.capacity_block"
        )
    if not plan.instance.on_ec2:
        raise SpecError(
            f"compute.instance_type: {plan.instance.name!r} has no EC2 offering; pick an EC2 "
            "instance type such as p4d.24xlarge"
        )


def cost_summary(plan: Plan) -> dict[str, Any]:
    """Nodes × $/hour × max_run, from the plan; the launcher shows it before anything starts."""
    return {
        "nodes": plan.num_nodes,
        "instance_type": plan.instance.name,
        "price_per_hour": plan.price_per_hour,
        "max_run_hours": round(plan.spec.compute.max_run / 3600, 4),
        "max_run_cost": None if plan.max_run_cost is None else round(plan.max_run_cost, 2),
        "confirm_above_usd": plan.spec.ec2.confirm_above_usd,
        "spot": plan.spec.compute.use_spot,
    }


def cost_line(cost: dict[str, Any]) -> str:
    if cost["max_run_cost"] is None:
        return (f"cost: {cost['nodes']} × {cost['instance_type']} (no price known; set "
                f"compute.price_per_hour) up to {cost['max_run_hours']:g} h")
    spot = " on-demand price; spot is usually less" if cost["spot"] else ""
    return (f"cost: {cost['nodes']} × {cost['instance_type']} × ${cost['price_per_hour']:,.2f}/h"
            f" × {cost['max_run_hours']:g} h max_run = up to ${cost['max_run_cost']:,.2f}{spot}")


def _lookups(spec) -> dict[str, Any]:
    """The I/O steps submit runs before the calls below, and what each fills in."""
    ec2 = spec.ec2
    return {
        "ami_id": ({"ssm_parameter": DLAMI_SSM_PARAMETER} if ec2.ami == "auto"
                   else {"value": ec2.ami}),
        "root_device": ({"value": DLAMI_ROOT_DEVICE} if ec2.ami == "auto"
                        else {"describe_images": ec2.ami}),
        "subnet_id": ({"value": ec2.subnet_id} if ec2.subnet_id
                      else {"default_subnet": "first default subnet of the default VPC"}),
        "vpc_id": {"describe_subnets": ec2.subnet_id or placeholder("subnet_id")},
    }


def _tags(job: str, user_tags: dict[str, str], *, name: str, **extra: str) -> list[dict]:
    tags = {**user_tags, "Name": name, TAG_JOB: job, TAG_CREATED_BY: CREATED_BY,
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


def _run_instances(plan: Plan, job: str, rank: int, placement_group: str) -> dict[str, Any]:
    spec, ec2 = plan.spec, plan.spec.ec2
    name = f"dtrain-{job}-{rank}"
    request: dict[str, Any] = {
        "ImageId": placeholder("ami_id"),
        "InstanceType": plan.instance.name,
        "MinCount": 1,
        "MaxCount": 1,
        # Idempotent under boto3's retries: a retried call never launches a second node. The
        # token is drawn at submit, so a job name used again later launches afresh.
        "ClientToken": f"dtrain-{placeholder('launch_token')}-{rank}",
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
        "UserData": render_user_data(plan, job, rank),
        "TagSpecifications": [
            {"ResourceType": kind,
             "Tags": _tags(job, spec.tags, name=name, **{TAG_NODE_RANK: str(rank),
                                                          TAG_NUM_NODES: str(plan.num_nodes),
                                                          TAG_PREFIX: job_prefix(plan, job)})}
            for kind in ("instance", "volume", "network-interface")
        ],
    }
    if ec2.instance_profile:
        key = "Arn" if ec2.instance_profile.startswith("arn:") else "Name"
        request["IamInstanceProfile"] = {key: ec2.instance_profile}
    if ec2.key_name:
        request["KeyName"] = ec2.key_name
    request.update(_market_options(spec))
    return request


def _market_options(spec) -> dict[str, Any]:
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


def node_config(plan: Plan, job: str) -> dict[str, Any]:
    """What the bootstrap needs to know about the job (embedded in the user data as JSON)."""
    spec = plan.spec
    prefix = job_prefix(plan, job)
    return {
        "job": job,
        "prefix": prefix,
        "num_nodes": plan.num_nodes,
        # Drawn at submit: keeps a re-used job name from meeting an earlier run's rendezvous.
        "launch_token": placeholder("launch_token"),
        "region": spec.ec2.region,
        "max_run": spec.compute.max_run,
        "source": None if spec.is_recipe else layout.source_uri(prefix, SOURCE_ARCHIVE),
        "settings": asdict(runtime_settings(plan, job_name=job, instance_type=plan.instance.name,
                                            processes_per_host=plan.processes_per_node)),
        "hyperparameters": spec.hyperparameters,
        "channels": dict(spec.inputs),
        "checkpoint_uri": layout.checkpoint_uri(prefix, spec.checkpoint.uri),
        "environment": dict(spec.environment),
        "image_uri": spec.ec2.image_uri,
    }


def render_user_data(plan: Plan, job: str, rank: int) -> str:
    """The node's bootstrap script: the shipped template with this job's values filled in."""
    template = resources.files("dtrain.launcher.ec2.node").joinpath(BOOTSTRAP_TEMPLATE).read_text()
    config = json.dumps(node_config(plan, job), indent=1, sort_keys=True)
    prefix = job_prefix(plan, job)
    values = {
        "NODE_RANK": str(rank),
        "WHEEL_URI": layout.source_uri(prefix, WHEEL_NAME),
        "SHUTDOWN_AFTER_MIN": str((plan.spec.compute.max_run + SHUTDOWN_MARGIN_S + 59) // 60),
        "JOB_CONFIG": config,
    }
    text = template
    for key, value in values.items():
        text = text.replace(f"@@{key}@@", value)
    if len(text.encode()) > USER_DATA_LIMIT:
        raise SpecError(
            f"hyperparameters: the node bootstrap is {len(text.encode())} bytes, over EC2's "
            f"{USER_DATA_LIMIT}-byte user-data limit; move large values into an input channel"
        )
    return text


def fill_placeholders(value: Any, values: dict[str, str]) -> Any:
    """``value`` with every ``{{name}}`` in its strings replaced; unknown names stay."""
    if isinstance(value, dict):
        return {k: fill_placeholders(v, values) for k, v in value.items()}
    if isinstance(value, list):
        return [fill_placeholders(v, values) for v in value]
    if isinstance(value, str) and "{{" in value:
        for key, replacement in values.items():
            value = value.replace(placeholder(key), replacement)
    return value
