"""Plan -> the exact SageMaker ``CreateTrainingJob`` request (pure: no I/O, no clock).

How dtrain runs on a stock AWS PyTorch training image, with the same container contract as the
other targets:

* code arrives as an input channel ``dtrain_code`` (``{output_path}/{job}/source/``: the source
  archive, the runtime wheel and ``sagemaker_entry.sh``), so SageMaker downloads it with the job's
  role and network isolation keeps working;
* ``ContainerEntrypoint`` runs that entry script, which unpacks the code into ``/opt/ml/code``,
  installs the wheel and execs ``python -m dtrain.runtime`` (the node agent);
* dtrain's settings travel as ``dtrain_*`` hyperparameters (``dtrain.core.contract``), next to the
  ``sagemaker_*`` keys the SageMaker SDK sends, every value JSON-encoded as the SDK does;
* ``MetricDefinitions`` come from ``dtrain.core.metrics_format``, the one definition of the metric line.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import TYPE_CHECKING, Any

from dtrain import __version__
from dtrain.core import contract, metrics_format
from dtrain.core.errors import DtrainError
from dtrain.launcher.base import runtime_settings
from dtrain.launcher.packaging import SOURCE_ARCHIVE, join_s3

if TYPE_CHECKING:
    from dtrain.planning.planner import Plan

CODE_CHANNEL = "dtrain_code"
SOURCE_CHANNEL = "dtrain_source"  # a source_dir given as an s3:// sourcedir.tar.gz
ENTRY_SCRIPT = "sagemaker_entry.sh"
CONTAINER_ROOT = "/opt/ml"
CHECKPOINT_LOCAL_PATH = "/opt/ml/checkpoints"
MAX_JOB_NAME = 63
MAX_HP_VALUE = 2500  # SageMaker's limit on one hyperparameter value
# Same tag keys as the EC2 target, so one tag query finds a job's resources on either.
TAG_JOB = "dtrain:job"
TAG_CREATED_BY = "dtrain:created-by"
_NAME_CHARS = re.compile(r"[^a-zA-Z0-9-]+")


def training_job_name(base: str, *, now: datetime) -> str:
    """``<base>-YYYYmmdd-HHMMSS`` like the SageMaker SDK's ``base_job_name`` (max 63 chars)."""
    stamp = now.strftime("%Y%m%d-%H%M%S")
    base = _NAME_CHARS.sub("-", base).strip("-")[: MAX_JOB_NAME - len(stamp) - 1] or "dtrain"
    return f"{base}-{stamp}"


def instance_type_name(plan: Plan) -> str:
    return "ml." + plan.instance.name


def source_prefix(plan: Plan, job_name: str) -> str:
    """``{output_path}/{job_name}/source`` where the archive, wheel and entry script go."""
    return join_s3(plan.spec.output_path, job_name, "source")


def wheel_name() -> str:
    return f"dtrain-{__version__}-py3-none-any.whl"


def entry_script_path() -> str:
    """Where the entry script lies in the container (the code channel's folder)."""
    return f"{CONTAINER_ROOT}/input/data/{CODE_CHANNEL}/{ENTRY_SCRIPT}"


def model_data_uri(plan: Plan, job_name: str) -> str:
    """Where SageMaker puts ``model.tar.gz`` of a completed job."""
    return join_s3(plan.spec.output_path, job_name, "output", "model.tar.gz")


def checkpoint_s3_uri(plan: Plan, job_name: str) -> str:
    """The spec's checkpoint URI, else ``{output_path}/{job}/checkpoints``.

    Always set: spot interruptions resume only from checkpoints SageMaker synced to S3.
    """
    return plan.spec.checkpoint.uri or join_s3(plan.spec.output_path, job_name, "checkpoints")


def build_create_training_job(plan: Plan, *, job_name: str, image_uri: str,
                              region: str | None = None) -> dict[str, Any]:
    """The ``CreateTrainingJob`` request for ``plan`` (keys in the API's order)."""
    spec = plan.spec
    _check_sagemaker_rules(plan)
    sm = spec.sagemaker
    request: dict[str, Any] = {
        "TrainingJobName": job_name,
        "HyperParameters": build_hyperparameters(plan, job_name=job_name, region=region),
        "AlgorithmSpecification": {
            "TrainingImage": image_uri,
            "TrainingInputMode": sm.input_mode,
            "MetricDefinitions": metrics_format.metric_definitions(),
            "EnableSageMakerMetricsTimeSeries": True,
            "ContainerEntrypoint": ["/bin/sh", entry_script_path()],
        },
        "RoleArn": sm.role,
        "InputDataConfig": _input_channels(plan, job_name),
        "OutputDataConfig": _drop_none({"S3OutputPath": spec.output_path,
                                        "KmsKeyId": sm.output_kms_key_id}),
        "ResourceConfig": _drop_none({
            "InstanceType": instance_type_name(plan),
            "InstanceCount": plan.num_nodes,
            "VolumeSizeInGB": spec.compute.volume_size_gb,
            "VolumeKmsKeyId": sm.volume_kms_key_id,
            "KeepAlivePeriodInSeconds": sm.keep_alive_period,
        }),
        "StoppingCondition": _stopping_condition(plan),
        "Tags": _tags(plan, job_name),
        "EnableNetworkIsolation": sm.enable_network_isolation,
        "EnableManagedSpotTraining": spec.compute.use_spot,
        "CheckpointConfig": {"S3Uri": checkpoint_s3_uri(plan, job_name),
                             "LocalPath": CHECKPOINT_LOCAL_PATH},
        "Environment": dict(sorted(spec.environment.items())),
    }
    if sm.subnets:
        request["VpcConfig"] = {"SecurityGroupIds": list(sm.security_group_ids),
                                "Subnets": list(sm.subnets)}
    if sm.retry_attempts:
        request["RetryStrategy"] = {"MaximumRetryAttempts": sm.retry_attempts}
    return request


def build_hyperparameters(plan: Plan, *, job_name: str,
                          region: str | None = None) -> dict[str, str]:
    """User hyperparameters + ``sagemaker_*`` + ``dtrain_*`` keys, each JSON-encoded."""
    spec = plan.spec
    settings = runtime_settings(plan, job_name=job_name, instance_type=instance_type_name(plan),
                                processes_per_host=plan.processes_per_node)
    framework = {"sagemaker_program": spec.entry_point, "sagemaker_job_name": job_name,
                 "sagemaker_container_log_level": 20}
    if spec.source_dir and not spec.is_recipe:
        framework["sagemaker_submit_directory"] = (
            spec.source_dir if spec.source_dir.startswith("s3://")
            else join_s3(source_prefix(plan, job_name), SOURCE_ARCHIVE))
    if region:
        framework["sagemaker_region"] = region
    values = {**spec.hyperparameters, **framework, **settings.to_hyperparameters()}
    encoded = contract.encode_hyperparameters(dict(sorted(values.items())))
    for key, value in encoded.items():
        if len(value) > MAX_HP_VALUE:
            raise DtrainError(
                f"hyperparameters.{key}: {len(value)} characters when JSON-encoded, above "
                f"SageMaker's {MAX_HP_VALUE}; pass large settings through a file in source_dir"
            )
    return encoded


def _input_channels(plan: Plan, job_name: str) -> list[dict[str, Any]]:
    spec = plan.spec
    reserved = {CODE_CHANNEL, SOURCE_CHANNEL} & set(spec.inputs)
    if reserved:
        raise DtrainError(f"inputs.{min(reserved)}: this channel name is reserved by dtrain "
                          "for the job's code; rename the channel")
    channels = [_s3_channel(name, uri) for name, uri in sorted(spec.inputs.items())]
    # The code channel is always File mode: the entry script reads it before anything runs.
    channels.append({**_s3_channel(CODE_CHANNEL, source_prefix(plan, job_name) + "/"),
                     "InputMode": "File"})
    if spec.source_dir and spec.source_dir.startswith("s3://"):
        channels.append({**_s3_channel(SOURCE_CHANNEL, spec.source_dir), "InputMode": "File"})
    return channels


def _s3_channel(name: str, uri: str) -> dict[str, Any]:
    return {"ChannelName": name, "DataSource": {"S3DataSource": {
        "S3DataType": "S3Prefix", "S3Uri": uri, "S3DataDistributionType": "FullyReplicated"}}}


def _stopping_condition(plan: Plan) -> dict[str, int]:
    compute = plan.spec.compute
    condition = {"MaxRuntimeInSeconds": compute.max_run}
    if compute.use_spot:
        # SageMaker requires a wait limit for spot; max_run is the tightest valid one.
        condition["MaxWaitTimeInSeconds"] = compute.max_wait or compute.max_run
    return condition


def _tags(plan: Plan, job_name: str) -> list[dict[str, str]]:
    tags = dict(plan.spec.tags)
    tags.update({TAG_JOB: job_name, TAG_CREATED_BY: "dtrain"})
    return [{"Key": key, "Value": value} for key, value in tags.items()]


def _check_sagemaker_rules(plan: Plan) -> None:
    """What SageMaker would reject and the spec cannot know about on its own."""
    spec = plan.spec
    if spec.compute.target != "sagemaker":
        raise DtrainError(f"compute.target: {spec.compute.target!r}; the SageMaker launcher "
                          "builds requests only for target 'sagemaker'")
    if not plan.instance.on_sagemaker:
        raise DtrainError(f"compute.instance_type: {plan.instance.name!r} is not offered for "
                          "SageMaker training; pick another type (dtrain instances)")
    if spec.sagemaker.role is None:
        raise DtrainError("sagemaker.role: required for target sagemaker; give the IAM role ARN "
                          "the job runs as")
    if not spec.output_path or not spec.output_path.startswith("s3://"):
        raise DtrainError(f"output_path: {spec.output_path!r}; SageMaker needs an s3:// URI")
    if spec.compute.use_spot and spec.sagemaker.keep_alive_period:
        raise DtrainError("sagemaker.keep_alive_period: warm pools do not work with managed spot "
                          "training; remove it or set compute.use_spot: false")


def _drop_none(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}
