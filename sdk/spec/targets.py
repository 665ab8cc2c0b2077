"""The spec's per-target sections: `sagemaker`, `ec2` and `slurm`, each read only by its target
(its rules are in :mod:`dtrain.spec.rules`); `JobSpec` holds one of each."""

from __future__ import annotations

import re
from typing import Literal

from dtrain.core import aws_images, torch_support
from dtrain.spec.base import _Model, duration
from pydantic import Field, field_validator

_ROLE_ARN = re.compile(r"^arn:aws[a-z\-]*:iam::\d{12}:role/[\w+=,.@\-/]{1,512}$")
_CIDR = re.compile(r"^(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})/(\d{1,2})$")


class SageMakerOptions(_Model):
    """Settings used only with `compute.target: sagemaker`."""

    role: str | None = Field(
        None, description="IAM role ARN the training job runs as (required for SageMaker)."
    )
    region: str | None = Field(None, description="AWS region; default: the boto3 default.")
    image_uri: str | None = Field(
        None, description="Training image; default: the AWS PyTorch training image for "
        "framework_version and the job's region.",
    )
    framework_version: str = Field(
        aws_images.DEFAULT_FRAMEWORK_VERSION,
        description="PyTorch version of the AWS image; dtrain's runtime supports torch "
        f"{torch_support.supported_range()}.",
    )
    py_version: str | None = Field(
        None, description="Python version tag of the AWS image; default: the image's own."
    )
    input_mode: Literal["File", "FastFile", "Pipe"] = Field(
        "File", description="How SageMaker delivers input channels."
    )
    keep_alive_period: duration(0, 3600) | None = Field(  # type: ignore[valid-type]
        None, description="Warm-pool keep-alive after the job, seconds or e.g. '10m'."
    )
    subnets: list[str] = Field(default_factory=list, description="VPC subnet ids.")
    security_group_ids: list[str] = Field(default_factory=list, description="VPC security groups.")
    retry_attempts: int = Field(
        0, ge=0, le=30, description="SageMaker RetryStrategy: retries on internal errors."
    )
    enable_network_isolation: bool = Field(False, description="Block outbound network access.")
    encrypt_inter_container_traffic: bool = Field(
        False, description="Encrypt the traffic between the job's instances (slower collectives)."
    )
    volume_kms_key_id: str | None = Field(None, description="KMS key for the storage volume.")
    output_kms_key_id: str | None = Field(None, description="KMS key for the output artifacts.")

    @field_validator("role")
    @classmethod
    def _role_arn(cls, value: str | None) -> str | None:
        if value is not None and not _ROLE_ARN.match(value):
            raise ValueError(
                f"{value!r} is not an IAM role ARN; expected "
                "arn:aws:iam::<12-digit account>:role/<name>"
            )
        return value


class Ec2Options(_Model):
    """Settings used only with `compute.target: ec2`."""

    region: str | None = Field(None, description="AWS region; default: the boto3 default.")
    ami: str = Field(
        "auto", description="AMI id, or `auto` for the AWS Deep Learning AMI (PyTorch) via SSM."
    )
    subnet_id: str | None = Field(
        None, description="Subnet for every node (one AZ). Needed for instance types with several "
        "EFA cards (p4d, p5): those nodes get no public IP, so the subnet must reach S3 through a "
        "NAT gateway or an S3 gateway endpoint. Unset: the default VPC's first default subnet.")
    key_name: str | None = Field(None, description="EC2 key pair for SSH, if any.")
    ssh_cidr: str | None = Field(
        None, description="CIDR allowed to SSH in; default: no SSH rule at all. A range wider "
        "than /8 is refused unless allow_open_ssh.",
    )
    allow_open_ssh: bool = Field(
        False, description="Allow an ssh_cidr open to the world (0.0.0.0/0 or wider than /8).",
    )
    instance_profile: str | None = Field(
        None, description="Required: IAM instance profile (name or ARN) whose role lets the "
        "nodes read and write the output_path bucket."
    )
    placement_group: str | None = Field(
        None, description="Existing cluster placement group; default: dtrain creates one."
    )
    capacity_reservation_id: str | None = Field(
        None, description="Capacity reservation (or capacity block) to launch into."
    )
    capacity_block: bool = Field(
        False, description="The reservation is an EC2 Capacity Block for ML."
    )
    image_uri: str | None = Field(
        None, description="Run the runtime in this container image instead of on the AMI."
    )
    confirm_above_usd: float = Field(
        100.0, ge=0, description="Ask before launching when max_run would cost more than this."
    )

    @field_validator("ssh_cidr")
    @classmethod
    def _cidr(cls, value: str | None) -> str | None:
        if value is None:
            return value
        match = _CIDR.match(value)
        if not match or any(int(p) > 255 for p in match.groups()[:4]) or int(match[5]) > 32:
            raise ValueError(f"{value!r} is not an IPv4 CIDR; write e.g. 203.0.113.7/32")
        return value


class SlurmOptions(_Model):
    """Settings used only with `compute.target: slurm` (HyperPod, ParallelCluster, any Slurm)."""

    shared_dir: str | None = Field(
        None, description="Folder on the cluster's shared file system (e.g. /fsx/dtrain) that "
        "the login node and every compute node see at the same path; each job gets "
        "`<shared_dir>/<job id>/` for its contract, logs, checkpoints and model. Required.",
    )
    partition: str | None = Field(
        None, description="Partition (`--partition`); default: the cluster's default one."
    )
    account: str | None = Field(None, description="Account to charge (`--account`).")
    qos: str | None = Field(None, description="Quality of service (`--qos`).")
    exclusive: bool = Field(
        True, description="Whole nodes (`--exclusive`): no other job shares their GPUs and "
        "network cards.",
    )
    gpus_per_node: int | None = Field(
        None, ge=0, le=64, description="GPUs per node (`--gpus-per-node`); default: the "
        "instance type's, from the catalog; 0: request none (a cluster without GPU GRES).",
    )
    python: str | None = Field(
        None, description="Python on the compute nodes that has `dtrain[runtime]`; default: "
        "the one running dtrain (its environment must be on the shared file system), or "
        "`python` in `container_image`.",
    )
    container_image: str | None = Field(
        None, description="Run each node's agent in this image with Pyxis/enroot "
        "(`srun --container-image`); it needs torch, dtrain is installed into it from the "
        "job's wheel.",
    )
    container_mounts: list[str] = Field(
        default_factory=list, description="More `--container-mounts` as `SRC:DST`; the job's "
        "folder, local input folders and `checkpoint.uri` are mounted at their own paths "
        "already.",
    )
    extra_sbatch: list[str] = Field(
        default_factory=list, description="More `#SBATCH` options, e.g. `--constraint=p4d` or "
        "`--mail-type=END`; not those dtrain sets from the spec (nodes, tasks, time, GPUs, "
        "partition, account, qos, job name, output; memory on exclusive nodes).",
    )
