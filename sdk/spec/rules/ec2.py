"""Rules of ``compute.target: ec2``."""

from __future__ import annotations

from dtrain.spec.rules.common import Findings, cloud_paths
from dtrain.spec.rules.sagemaker import image_torch


def ec2_settings(spec, ctx: Findings) -> None:
    ec2 = spec.ec2
    if ec2.capacity_block and not ec2.capacity_reservation_id:
        ctx.problems.append(
            "ec2.capacity_block: needs ec2.capacity_reservation_id (the capacity block's id)"
        )
    if ec2.ssh_cidr is not None and ec2.ssh_cidr.endswith("/0"):
        ctx.notes.append(f"ec2.ssh_cidr: {ec2.ssh_cidr} opens SSH to the whole internet")


def image_runs_the_runtime(spec, ctx: Findings) -> None:
    if spec.ec2.image_uri:
        image_torch(ctx, "ec2.image_uri", spec.ec2.image_uri)


RULES = (ec2_settings, image_runs_the_runtime, cloud_paths)
