"""Rules of ``compute.target: sagemaker``."""

from __future__ import annotations

from dtrain.core import instances
from dtrain.spec.rules.common import Findings, cloud_paths


def offered_on_sagemaker(spec, ctx: Findings) -> None:
    inst = spec.compute.instance
    if not inst.is_local and not inst.on_sagemaker:
        offered = [t.name for t in instances.CATALOG.values() if t.on_sagemaker]
        ctx.problems.append(
            f"compute.instance_type: {inst.name!r} is not offered for SageMaker training; use "
            f"one of {', '.join(offered)}, or target 'ec2'"
        )


def sagemaker_settings(spec, ctx: Findings) -> None:
    sm = spec.sagemaker
    if sm.role is None:
        ctx.problems.append(
            "sagemaker.role: required for target sagemaker; give the IAM role ARN the job runs as"
        )
    if bool(sm.subnets) != bool(sm.security_group_ids):
        ctx.problems.append(
            "sagemaker.subnets / sagemaker.security_group_ids: give both for a VPC, or neither"
        )


RULES = (offered_on_sagemaker, sagemaker_settings, cloud_paths)
