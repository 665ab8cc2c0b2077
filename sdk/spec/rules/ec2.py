"""Rules of ``compute.target: ec2``."""

from __future__ import annotations

import ipaddress
import json

from dtrain.spec.rules.common import Findings, cloud_paths
from dtrain.spec.rules.sagemaker import image_torch

# An SSH rule for a range wider than this prefix counts as open to the world.
OPEN_PREFIX = 8
# The node bootstrap carries the job's settings in EC2 user data (16 KiB raw); its fixed part
# and dtrain's own settings take under 6 KiB, so the user's values get the rest.
USER_VALUES_BUDGET = 10 * 1024


def ec2_settings(spec, ctx: Findings) -> None:
    ec2 = spec.ec2
    if not ec2.instance_profile:
        ctx.problems.append(
            "ec2.instance_profile: needed; the nodes fetch dtrain and the job's code from S3 and "
            "write status, logs and checkpoints there with its credentials (an instance profile "
            "whose role may read and write the output_path bucket)")
    if ec2.capacity_block and not ec2.capacity_reservation_id:
        ctx.problems.append(
            "ec2.capacity_block: needs ec2.capacity_reservation_id (the capacity block's id)"
        )
    if ec2.capacity_reservation_id and spec.compute.use_spot:
        kind, fields = (("capacity block", "ec2.capacity_block and ec2.capacity_reservation_id")
                        if ec2.capacity_block else
                        ("capacity reservation", "ec2.capacity_reservation_id"))
        ctx.problems.append(
            f"compute.use_spot: spot instances cannot run in a {kind} (it is reserved "
            f"on-demand capacity, already paid for); set use_spot: false or drop {fields}"
        )
    if spec.compute.instance.efa_interfaces > 1 and not ec2.subnet_id:
        ctx.problems.append(
            f"ec2.subnet_id: needed for {spec.compute.instance.name}; a node with "
            f"{spec.compute.instance.efa_interfaces} network interfaces (one per EFA card) gets "
            "no public IP address, so in the default subnet it cannot reach S3; give a subnet "
            "with a NAT gateway or an S3 gateway endpoint, in the zone that has the capacity")
    if not spec.compute.instance.is_local and not spec.compute.instance.on_ec2:
        ctx.problems.append(
            f"compute.instance_type: {spec.compute.instance.name!r} has no EC2 offering; pick "
            "an EC2 instance type such as p4d.24xlarge"
        )
    if ec2.ssh_cidr is not None and ipaddress.ip_network(ec2.ssh_cidr, strict=False).prefixlen \
            < OPEN_PREFIX and not ec2.allow_open_ssh:
        ctx.problems.append(
            f"ec2.ssh_cidr: {ec2.ssh_cidr} opens SSH to a large part of the internet; give your "
            "own address range (e.g. 203.0.113.7/32), or set ec2.allow_open_ssh: true if you "
            "mean it")


def user_values_fit_the_bootstrap(spec, ctx: Findings) -> None:
    size = len(json.dumps({"hyperparameters": spec.hyperparameters,
                           "environment": spec.environment, "inputs": spec.inputs}, indent=1))
    if size > USER_VALUES_BUDGET:
        ctx.problems.append(
            f"hyperparameters / environment / inputs: {size} bytes as JSON, over the "
            f"{USER_VALUES_BUDGET} the EC2 node bootstrap's user data has room for; move large "
            "values into an input channel"
        )


def image_runs_the_runtime(spec, ctx: Findings) -> None:
    if spec.ec2.image_uri:
        image_torch(ctx, "ec2.image_uri", spec.ec2.image_uri)


RULES = (ec2_settings, user_values_fit_the_bootstrap, image_runs_the_runtime, cloud_paths)
