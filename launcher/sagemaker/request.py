"""Spec -> the exact SageMaker ``CreateTrainingJob`` request and its uploads (pure: no I/O, no clock).

How dtrain runs on a stock AWS PyTorch training image, with the same container contract as the
other targets:

* code arrives as an input channel ``dtrain_code`` (``{output_path}/{job}/source/``: the source
  archive, the runtime wheel and ``sagemaker_entry.sh``), so SageMaker downloads it with the job's
  role and network isolation keeps working;
* ``ContainerEntrypoint`` runs that entry script, which unpacks the code into ``/opt/ml/code``,
  installs the wheel and execs ``python -m dtrain.runtime`` (the node agent);
* dtrain's settings travel as ``dtrain_*`` hyperparameters (``dtrain.core.contract``), next to the
  ``sagemaker_*`` keys the SageMaker SDK sends, every value JSON-encoded as the SDK does;
* ``MetricDefinitions`` come from ``dtrain.core.metrics_format``, the one definition of the metric
  line.

The spec reaching here has passed validation (``dtrain.spec``), which owns every rule on user
input; nothing here rejects a valid spec.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from dtrain.core import metrics_format, s3, toolkit
from dtrain.launcher import aws, packaging
from dtrain.launcher.base import Upload, runtime_settings

if TYPE_CHECKING:
    from dtrain.planning.planner import Plan
    from dtrain.spec.model import JobSpec

CODE_CHANNEL = "dtrain_code"
SOURCE_CHANNEL = "dtrain_source"  # a source_dir given as an s3:// sourcedir.tar.gz
ENTRY_SCRIPT = "sagemaker_entry.sh"
CONTAINER_ROOT = "/opt/ml"
CHECKPOINT_LOCAL_PATH = "/opt/ml/checkpoints"


def instance_type_name(plan: Plan) -> str:
    return "ml." + plan.instance.name


def source_prefix(spec: JobSpec, job_name: str) -> str:
    """``{output_path}/{job_name}/source`` where the archive, wheel and entry script go."""
    return s3.join(spec.output_path, job_name, "source")


def entry_script_path() -> str:
    """Where the entry script lies in the container (the code channel's folder)."""
    return f"{CONTAINER_ROOT}/input/data/{CODE_CHANNEL}/{ENTRY_SCRIPT}"


def model_data_uri(output_path: str, job_name: str) -> str:
    """Where SageMaker puts ``model.tar.gz`` of a completed job."""
    return s3.join(output_path, job_name, "output", "model.tar.gz")


def checkpoint_s3_uri(spec: JobSpec, job_name: str) -> str:
    """The spec's checkpoint URI, else ``{output_path}/{job}/checkpoints``.

    Always set: spot interruptions resume only from checkpoints SageMaker synced to S3.
    """
    return spec.checkpoint.uri or s3.join(spec.output_path, job_name, "checkpoints")


def packs_source(spec: JobSpec) -> bool:
    """A local source folder is packed and uploaded; a recipe has none, an s3:// one is ready."""
    return bool(spec.source_dir) and not spec.is_recipe and not s3.is_s3_uri(spec.source_dir)


def uploads(spec: JobSpec, job_name: str) -> tuple[Upload, ...]:
    """What ``submit`` puts under the code channel's prefix before it creates the job."""
    prefix = source_prefix(spec, job_name)
    files = [Upload(packaging.WHEEL, s3.join(prefix, packaging.wheel_name())),
             Upload(packaging.SAGEMAKER_ENTRY_SCRIPT, s3.join(prefix, ENTRY_SCRIPT))]
    if packs_source(spec):
        files.insert(0, Upload(spec.source_dir, s3.join(prefix, packaging.SOURCE_ARCHIVE)))
    return tuple(files)


def create_training_job(spec: JobSpec, plan: Plan, *, job_name: str, image_uri: str,
                        region: str | None) -> dict[str, Any]:
    """The ``CreateTrainingJob`` kwargs (keys in the API's order)."""
    sm = spec.sagemaker
    request: dict[str, Any] = {
        "TrainingJobName": job_name,
        "HyperParameters": hyperparameters(spec, plan, job_name=job_name, region=region),
        "AlgorithmSpecification": {
            "TrainingImage": image_uri,
            "TrainingInputMode": sm.input_mode,
            "MetricDefinitions": metrics_format.metric_definitions(),
            "EnableSageMakerMetricsTimeSeries": True,
            "ContainerEntrypoint": ["/bin/sh", entry_script_path()],
        },
        "RoleArn": sm.role,
        "InputDataConfig": _input_channels(spec, job_name),
        "OutputDataConfig": _drop_none({"S3OutputPath": spec.output_path,
                                        "KmsKeyId": sm.output_kms_key_id}),
        "ResourceConfig": _drop_none({
            "InstanceType": instance_type_name(plan),
            "InstanceCount": plan.num_nodes,
            "VolumeSizeInGB": spec.compute.volume_size_gb,
            "VolumeKmsKeyId": sm.volume_kms_key_id,
            "KeepAlivePeriodInSeconds": sm.keep_alive_period,
        }),
        "StoppingCondition": _stopping_condition(spec),
        "Tags": _tags(spec, job_name),
        "EnableNetworkIsolation": sm.enable_network_isolation,
        **({"EnableInterContainerTrafficEncryption": True}
           if sm.encrypt_inter_container_traffic else {}),
        "EnableManagedSpotTraining": spec.compute.use_spot,
        "CheckpointConfig": {"S3Uri": checkpoint_s3_uri(spec, job_name),
                             "LocalPath": CHECKPOINT_LOCAL_PATH},
        "Environment": dict(sorted(spec.environment.items())),
    }
    if sm.subnets:
        request["VpcConfig"] = {"SecurityGroupIds": list(sm.security_group_ids),
                                "Subnets": list(sm.subnets)}
    if sm.retry_attempts:
        request["RetryStrategy"] = {"MaximumRetryAttempts": sm.retry_attempts}
    return request


def hyperparameters(spec: JobSpec, plan: Plan, *, job_name: str,
                    region: str | None) -> dict[str, str]:
    """User hyperparameters + ``sagemaker_*`` + ``dtrain_*`` keys, each JSON-encoded."""
    settings = runtime_settings(spec, plan, job_name=job_name,
                                instance_type=instance_type_name(plan),
                                processes_per_host=plan.processes_per_node)
    framework = {"sagemaker_program": spec.entry_point, "sagemaker_job_name": job_name,
                 "sagemaker_container_log_level": 20}
    if packs_source(spec):
        framework["sagemaker_submit_directory"] = s3.join(source_prefix(spec, job_name),
                                                          packaging.SOURCE_ARCHIVE)
    elif spec.source_dir and not spec.is_recipe:
        framework["sagemaker_submit_directory"] = spec.source_dir
    if region:
        framework["sagemaker_region"] = region
    values = {**spec.hyperparameters, **framework, **settings.to_hyperparameters()}
    return toolkit.encode_hyperparameters(dict(sorted(values.items())))


def region_of(payload: dict[str, Any]) -> str | None:
    """The region ``build_request`` chose, as it travels in the request: the SageMaker SDK's
    ``sagemaker_region`` hyperparameter (None: the client's default region)."""
    value = payload.get("HyperParameters", {}).get("sagemaker_region")
    return json.loads(value) if value else None


def _input_channels(spec: JobSpec, job_name: str) -> list[dict[str, Any]]:
    channels = [_s3_channel(name, uri) for name, uri in sorted(spec.inputs.items())]
    # The code channel is always File mode: the entry script reads it before anything runs.
    channels.append({**_s3_channel(CODE_CHANNEL, source_prefix(spec, job_name) + "/"),
                     "InputMode": "File"})
    if spec.source_dir and s3.is_s3_uri(spec.source_dir):
        channels.append({**_s3_channel(SOURCE_CHANNEL, spec.source_dir), "InputMode": "File"})
    return channels


def _s3_channel(name: str, uri: str) -> dict[str, Any]:
    return {"ChannelName": name, "DataSource": {"S3DataSource": {
        "S3DataType": "S3Prefix", "S3Uri": uri, "S3DataDistributionType": "FullyReplicated"}}}


def _stopping_condition(spec: JobSpec) -> dict[str, int]:
    compute = spec.compute
    condition = {"MaxRuntimeInSeconds": compute.max_run}
    if compute.use_spot:
        # SageMaker requires a wait limit for spot; max_run is the tightest valid one.
        condition["MaxWaitTimeInSeconds"] = compute.max_wait or compute.max_run
    return condition


def _tags(spec: JobSpec, job_name: str) -> list[dict[str, str]]:
    tags = {**spec.tags, aws.TAG_JOB: job_name, aws.TAG_CREATED_BY: aws.CREATED_BY}
    return [{"Key": key, "Value": value} for key, value in tags.items()]


def _drop_none(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}
