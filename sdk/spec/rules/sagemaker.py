"""Rules of ``compute.target: sagemaker``: everything SageMaker would refuse after the upload,
and everything the request needs (an image, a region) that can be known before it."""

from __future__ import annotations

import importlib.util
import json

from dtrain.core import aws, aws_images, instances, secrets, torch_support
from dtrain.spec.rules.common import Findings, cloud_paths

MAX_HYPERPARAMETER_CHARS = 2500  # SageMaker's limit on one hyperparameter value
MAX_HYPERPARAMETERS = 100  # SageMaker's limit on keys, dtrain's own and the toolkit's included
MAX_HYPERPARAMETER_KEY_CHARS = 256
# the most keys a job adds (sagemaker_* for the toolkit, dtrain_* for the runtime); a unit test
# holds it to what launcher.sagemaker.request builds
RESERVED_HYPERPARAMETERS = 15
MAX_TAGS = 50  # SageMaker's limit on a training job's tags
RESERVED_TAGS = 2  # dtrain:job, dtrain:created-by


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
    if sm.keep_alive_period and spec.compute.use_spot:
        ctx.problems.append(
            "sagemaker.keep_alive_period: warm pools do not work with managed spot training; "
            "remove it or set compute.use_spot: false"
        )


def settings_the_job_can_run_with(spec, ctx: Findings) -> None:
    """Settings SageMaker accepts that the job itself cannot work with, found before it is
    paid for."""
    sm = spec.sagemaker
    if sm.enable_network_isolation:
        refs = [name for name, value in spec.environment.items() if secrets.reference(value)]
        if refs:
            ctx.problems.append(
                f"sagemaker.enable_network_isolation: the node resolves environment "
                f"{', '.join(refs)} from Secrets Manager / SSM, which network isolation blocks; "
                "give the values another way, or turn isolation off")
    if sm.input_mode == "Pipe" and spec.is_recipe:
        ctx.problems.append(
            f"sagemaker.input_mode: Pipe streams each channel through a FIFO, but "
            f"{spec.entry_point} reads its data as files; use File or FastFile")
    image = aws_images.IMAGES.get(aws_images.short_version(sm.framework_version) or "")
    if sm.py_version and not sm.image_uri and image and sm.py_version != image[0]:
        ctx.problems.append(
            f"sagemaker.py_version: {sm.py_version!r}, but the AWS image of torch "
            f"{sm.framework_version} has {image[0]}; remove py_version, or set "
            "sagemaker.image_uri")


def hyperparameters_fit(spec, ctx: Findings) -> None:
    room = MAX_HYPERPARAMETERS - RESERVED_HYPERPARAMETERS
    if len(spec.hyperparameters) > room:
        ctx.problems.append(
            f"hyperparameters: {len(spec.hyperparameters)} keys, above the {room} SageMaker has "
            f"room for ({MAX_HYPERPARAMETERS} with dtrain's own {RESERVED_HYPERPARAMETERS}); "
            "group settings under one key as a mapping")
    for key in spec.hyperparameters:
        if len(key) > MAX_HYPERPARAMETER_KEY_CHARS:
            ctx.problems.append(
                f"hyperparameters.{key[:40]}...: a key of {len(key)} characters, above "
                f"SageMaker's {MAX_HYPERPARAMETER_KEY_CHARS}; shorten it")
    room = MAX_TAGS - RESERVED_TAGS
    if len(spec.tags) > room:
        ctx.problems.append(f"tags: {len(spec.tags)} tags, above the {room} SageMaker has room "
                            f"for ({MAX_TAGS} with dtrain's {RESERVED_TAGS}); drop some")
    for key, value in spec.hyperparameters.items():
        size = len(json.dumps(value))
        if size > MAX_HYPERPARAMETER_CHARS:
            ctx.problems.append(
                f"hyperparameters.{key}: {size} characters when JSON-encoded, above SageMaker's "
                f"{MAX_HYPERPARAMETER_CHARS}; pass large settings through a file in source_dir"
            )


def image_runs_the_runtime(spec, ctx: Findings) -> None:
    """The image's torch is in the runtime's range, and without ``image_uri`` there is an AWS
    image to pick for ``framework_version`` in the job's region (decided here, not at submit)."""
    sm = spec.sagemaker
    if sm.image_uri:
        image_torch(ctx, "sagemaker.image_uri", sm.image_uri)
        return
    problem = torch_support.problem(sm.framework_version)
    if problem:
        ctx.problems.append(f"sagemaker.framework_version: {problem}; use one of "
                            f"{', '.join(aws_images.IMAGES)} or set sagemaker.image_uri")
        return
    region = aws.region_of(sm.region)
    if region is None:
        ctx.problems.append("sagemaker.region: needed to pick the training image's registry; "
                            "set it, or AWS_REGION, or sagemaker.image_uri")
    elif importlib.util.find_spec("sagemaker") is not None:
        return  # the SageMaker SDK's lookup is the authority for what it knows
    elif aws_images.short_version(sm.framework_version) not in aws_images.IMAGES:
        ctx.problems.append(
            f"sagemaker.framework_version: {sm.framework_version!r} has no AWS image in dtrain's "
            f"table (as of {aws_images.AS_OF}: {', '.join(aws_images.IMAGES)}); use one of those, "
            "set sagemaker.image_uri, or pip install 'dtrain[sagemaker]' for the SDK's lookup")
    elif region not in aws_images.REGISTRIES:
        ctx.problems.append(f"sagemaker.region: dtrain's image table has no registry for "
                            f"{region!r}; set sagemaker.image_uri")


def image_torch(ctx: Findings, field: str, image_uri: str) -> None:
    """An image whose tag names its torch (``pytorch-training:2.5.1-...``) must be in range."""
    version = aws_images.torch_version_of(image_uri)
    problem = version and torch_support.problem(version)
    if problem:
        ctx.problems.append(f"{field}: {problem}; use an image with torch "
                            f"{torch_support.supported_range()}")


RULES = (offered_on_sagemaker, sagemaker_settings, settings_the_job_can_run_with,
         hyperparameters_fit, image_runs_the_runtime, cloud_paths)
