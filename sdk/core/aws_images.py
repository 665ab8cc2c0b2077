"""The AWS PyTorch training images (Deep Learning Containers) dtrain's runtime runs on.

A small, dated table, so that ``dtrain submit --target sagemaker`` needs no ``image_uri`` and
no SageMaker SDK: the SageMaker-flavoured GPU images of the torch versions in
:mod:`dtrain.core.torch_support`'s range, and the ECR registry account of each region (AWS's
own accounts, which publish these images). When the SageMaker SDK is installed its lookup is
the authority for the versions it knows (``pytest -m sagemaker_sdk`` checks the table against
it). Stdlib only: spec validation reads it too.
"""

from __future__ import annotations

from dtrain.core import torch_support

AS_OF = "2026-08"  # when the table was read from AWS's published image list
REPOSITORY = "pytorch-training"
# framework_version -> (py_version, image tag) of the SageMaker GPU training image
IMAGES = {
    "2.9": ("py312", "2.9.0-gpu-py312-cu130-ubuntu22.04-sagemaker"),
    "2.10": ("py313", "2.10.0-gpu-py313-cu130-ubuntu22.04-sagemaker"),
}
DEFAULT_FRAMEWORK_VERSION = "2.10"
_DLC = "763104351884"  # the registry account of most regions
REGISTRIES = {
    **dict.fromkeys(("ap-northeast-1", "ap-northeast-2", "ap-south-1", "ap-southeast-1",
                     "ap-southeast-2", "ca-central-1", "eu-central-1", "eu-north-1",
                     "eu-west-1", "eu-west-2", "eu-west-3", "sa-east-1", "us-east-1",
                     "us-east-2", "us-west-1", "us-west-2"), _DLC),
    "af-south-1": "626614931356", "ap-east-1": "871362719292", "ap-east-2": "975050140332",
    "ap-northeast-3": "364406365360", "ap-south-2": "772153158452",
    "ap-southeast-3": "907027046896", "ap-southeast-4": "457447274322",
    "ap-southeast-5": "550225433462", "ap-southeast-6": "633930458069",
    "ap-southeast-7": "590183813437", "ca-west-1": "204538143572",
    "cn-north-1": "727897471807", "cn-northwest-1": "727897471807",
    "eu-central-2": "380420809688", "eu-south-1": "692866216735",
    "eu-south-2": "503227376785", "il-central-1": "780543022126",
    "me-central-1": "914824155844", "me-south-1": "217643126080",
    "mx-central-1": "637423239942", "us-gov-east-1": "446045086412",
    "us-gov-west-1": "442386744353",
}


def short_version(version: str) -> str | None:
    parsed = torch_support.parse(version)
    return None if parsed is None else f"{parsed[0]}.{parsed[1]}"


def training_image_uri(framework_version: str, region: str) -> str | None:
    """The image for ``framework_version`` in ``region``; None when the table has none."""
    image = IMAGES.get(short_version(framework_version) or "")
    account = REGISTRIES.get(region)
    if image is None or account is None:
        return None
    domain = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
    return f"{account}.dkr.ecr.{region}.{domain}/{REPOSITORY}:{image[1]}"


def torch_version_of(image_uri: str) -> str | None:
    """The torch version a recognisable PyTorch image's tag names (``pytorch-training:2.5.1-gpu``
    -> ``2.5.1``); None for an image whose tag says nothing (a custom one)."""
    repository, _, tag = image_uri.rpartition("/")[2].partition(":")
    if "pytorch" not in repository or not tag:
        return None
    version = tag.split("-", 1)[0]
    return version if torch_support.parse(version) else None
