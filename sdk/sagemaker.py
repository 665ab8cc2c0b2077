"""SageMaker Python SDK compatibility: ``from dtrain.sagemaker import PyTorch``.

Estimator code written for the SageMaker SDK v2 ``PyTorch`` class runs after changing only its
import line: the constructor arguments that matter become a ``JobSpec`` (SMP distribution dicts
are translated by ``dtrain.spec.smp``), and ``fit`` submits it with dtrain's SageMaker launcher,
so the job runs dtrain's node agent with the same container contract as every other target.

``to_model_trainer(spec)`` goes the other way, to the official SDK's ``ModelTrainer`` (needs the
``sagemaker`` extra; imported only when called).
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

from dtrain.core import names
from dtrain.core.errors import DtrainError

# Arguments the SageMaker SDK accepts that have no meaning for dtrain; accepted and ignored.
_IGNORED = ("sagemaker_session", "checkpoint_local_path", "debugger_hook_config",
            "disable_profiler", "profiler_config", "container_log_level", "code_location",
            "dependencies", "git_config", "rules", "metric_definitions",
            "encrypt_inter_container_traffic",
            "enable_sagemaker_metrics", "input_mode_channels")


class PyTorch:
    """A SageMaker SDK v2 ``sagemaker.pytorch.PyTorch`` look-alike that submits through dtrain."""

    def __init__(self, entry_point: str, source_dir: str | None = None, *, role: str | None = None,
                 instance_type: str | None = None, instance_count: int = 1,
                 hyperparameters: dict[str, Any] | None = None,
                 distribution: dict[str, Any] | None = None, output_path: str | None = None,
                 checkpoint_s3_uri: str | None = None, use_spot_instances: bool = False,
                 max_run: int = 86400, max_wait: int | None = None,
                 environment: dict[str, str] | None = None,
                 tags: list[dict[str, str]] | None = None, subnets: list[str] | None = None,
                 security_group_ids: list[str] | None = None, image_uri: str | None = None,
                 framework_version: str | None = None, py_version: str | None = None,
                 base_job_name: str | None = None, volume_size: int = 30,
                 volume_kms_key: str | None = None, output_kms_key: str | None = None,
                 keep_alive_period_in_seconds: int | None = None,
                 enable_network_isolation: bool = False, max_retry_attempts: int | None = None,
                 input_mode: str = "File", launcher: Any = None, **kwargs: Any):
        unknown = sorted(set(kwargs) - set(_IGNORED))
        if unknown:
            raise DtrainError(f"PyTorch({unknown[0]}=...): not supported by dtrain.sagemaker; "
                              "remove it (see the dtrain docs for supported arguments)")
        self.entry_point, self.source_dir = entry_point, source_dir
        self.role, self.instance_type, self.instance_count = role, instance_type, instance_count
        self.hyperparameters = dict(hyperparameters or {})
        self.distribution = distribution
        self.output_path, self.checkpoint_s3_uri = output_path, checkpoint_s3_uri
        self.use_spot_instances, self.max_run, self.max_wait = use_spot_instances, max_run, max_wait
        self.environment = dict(environment or {})
        self.tags = list(tags or [])
        self.subnets, self.security_group_ids = subnets, security_group_ids
        self.image_uri, self.framework_version, self.py_version = (image_uri, framework_version,
                                                                   py_version)
        self.base_job_name = base_job_name
        self.volume_size, self.volume_kms_key, self.output_kms_key = (volume_size, volume_kms_key,
                                                                      output_kms_key)
        self.keep_alive_period_in_seconds = keep_alive_period_in_seconds
        self.enable_network_isolation = enable_network_isolation
        self.max_retry_attempts = max_retry_attempts
        self.input_mode = input_mode
        self._launcher = launcher
        self.latest_training_job: str | None = None
        self.latest_request: dict[str, Any] | None = None

    # ---------------------------------------------------------------- spec

    def to_spec_dict(self, inputs: Any = None) -> dict[str, Any]:
        """The JobSpec (as a dict) these constructor arguments and ``inputs`` mean."""
        if not self.instance_type:
            raise DtrainError("PyTorch(instance_type=...): required; e.g. 'ml.p4d.24xlarge'")
        sm = {"role": self.role, "image_uri": self.image_uri, "subnets": self.subnets or [],
              "security_group_ids": self.security_group_ids or [],
              "enable_network_isolation": self.enable_network_isolation,
              "input_mode": self.input_mode, "volume_kms_key_id": self.volume_kms_key,
              "output_kms_key_id": self.output_kms_key,
              "keep_alive_period": self.keep_alive_period_in_seconds,
              "retry_attempts": self.max_retry_attempts or 0}
        if self.framework_version:
            sm["framework_version"] = self.framework_version
        if self.py_version:
            sm["py_version"] = self.py_version
        data: dict[str, Any] = {
            "name": names.from_entry_point(self.base_job_name or self.entry_point),
            "entry_point": self.entry_point, "source_dir": self.source_dir,
            "hyperparameters": self.hyperparameters,
            "compute": {"target": "sagemaker", "instance_type": self.instance_type,
                        "instance_count": self.instance_count, "volume_size_gb": self.volume_size,
                        "use_spot": self.use_spot_instances, "max_run": self.max_run,
                        "max_wait": self.max_wait},
            "inputs": _channels(inputs), "output_path": self.output_path,
            "checkpoint": {"uri": self.checkpoint_s3_uri}, "environment": self.environment,
            "tags": {t["Key"]: t["Value"] for t in self.tags},
            "sagemaker": {k: v for k, v in sm.items() if v is not None},
        }
        if self.distribution:
            data["distribution"] = self.distribution
            per_host = (self.distribution.get("mpi") or {}).get("processes_per_host")
            if per_host:
                data["compute"]["processes_per_instance"] = per_host
        return data

    def to_spec(self, inputs: Any = None):
        from dtrain.spec.model import JobSpec

        data = self.to_spec_dict(inputs)
        if data["output_path"] is None:
            data["output_path"] = self._launcher_obj().default_output_path()
        return JobSpec.from_dict(data)

    def _launcher_obj(self):
        if self._launcher is None:
            from dtrain.launcher.sagemaker.launcher import SageMakerLauncher

            self._launcher = SageMakerLauncher()
        return self._launcher

    # ---------------------------------------------------------------- run

    def fit(self, inputs: Any = None, wait: bool = True, logs: Any = "All",
            job_name: str | None = None) -> None:
        """Submit the job; with ``wait``, stream its logs (``logs``) until it ends."""
        from dtrain.jobs.store import JobStore
        from dtrain.planning.planner import plan

        launcher = self._launcher_obj()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # notes on ignored SMP keys: same as the SDK's
            spec = self.to_spec(inputs)
        request = launcher.build_request(plan(spec), job_name=job_name)
        self.latest_request = request
        record = launcher.submit(request, store=JobStore())
        self.latest_training_job = record.name
        if wait:
            self.wait(logs=bool(logs) and logs != "None")

    def wait(self, *, logs: bool = False) -> None:
        """Block until the latest job ends; raise with its FailureReason unless it completed."""
        show_logs = logs
        launcher = self._launcher_obj()
        name = self.latest_training_job
        if show_logs:
            for line in launcher.logs(name, follow=True):
                print(line, flush=True)
        status = launcher.wait(name, poll_s=15)
        if status["state"] != "Completed":
            raise DtrainError(f"training job {name} {status['state'].lower()}: "
                              f"{status.get('failure_reason') or 'no FailureReason given'}")
        print(f"{name}: {status['state']}", file=sys.stderr)

    @classmethod
    def attach(cls, training_job_name: str, *, launcher: Any = None) -> PyTorch:
        """An estimator for an existing job (as ``sagemaker.estimator.Estimator.attach``)."""
        from dtrain.launcher.sagemaker.launcher import SageMakerLauncher

        launcher = launcher or SageMakerLauncher()
        job = launcher.describe(training_job_name)
        hps = job.get("HyperParameters", {})
        program = hps.get("sagemaker_program", '"train.py"').strip('"')
        resources = job["ResourceConfig"]
        est = cls(program, role=job.get("RoleArn"), instance_type=resources["InstanceType"],
                  instance_count=resources["InstanceCount"],
                  output_path=job.get("OutputDataConfig", {}).get("S3OutputPath"),
                  image_uri=job.get("AlgorithmSpecification", {}).get("TrainingImage"),
                  launcher=launcher)
        est.latest_training_job = training_job_name
        return est

    @property
    def model_data(self) -> str | None:
        """S3 URI of ``model.tar.gz`` once the job has completed."""
        if not self.latest_training_job:
            raise DtrainError("model_data: this estimator has no job yet; call fit() or attach()")
        return self._launcher_obj().job_status(self.latest_training_job)["model_data"]

    def stop(self) -> None:
        self._launcher_obj().stop(self.latest_training_job)


def _channels(inputs: Any) -> dict[str, str]:
    """``fit`` inputs (str, dict of str/TrainingInput, or one TrainingInput) -> channel URIs."""
    if inputs is None:
        return {}
    if isinstance(inputs, str):
        return {"training": inputs}
    if isinstance(inputs, dict):
        return {name: _uri(value) for name, value in inputs.items()}
    return {"training": _uri(inputs)}


def _uri(value: Any) -> str:
    if isinstance(value, str):
        return value
    config = getattr(value, "config", None)  # sagemaker.inputs.TrainingInput
    try:
        return config["DataSource"]["S3DataSource"]["S3Uri"]
    except (TypeError, KeyError):
        raise DtrainError(f"fit inputs: {value!r} is not an s3:// URI or TrainingInput; "
                          "give 's3://bucket/prefix'") from None


def to_model_trainer(spec: Any) -> Any:
    """An equivalent ``sagemaker.train.ModelTrainer`` (SageMaker SDK v3) for a JobSpec.

    Same image, role, compute, stopping condition, data, output, checkpoints, network, tags,
    environment, metric definitions, retry strategy and hyperparameters (``dtrain_*`` included,
    so dtrain's runtime reads the same settings). One difference: the SDK starts ``entry_point``
    with its own torchrun driver rather than dtrain's entry script and node agent.
    """
    try:
        from sagemaker.train import ModelTrainer, configs
        from sagemaker.train.distributed import Torchrun
    except ImportError:
        raise DtrainError("to_model_trainer needs the SageMaker SDK v3; "
                          "pip install 'dtrain[sagemaker]'") from None
    from dtrain.launcher.sagemaker.launcher import SageMakerLauncher
    from dtrain.planning.planner import plan

    p = plan(spec)
    request = SageMakerLauncher().build_request(p)
    resource, stop = request["ResourceConfig"], request["StoppingCondition"]
    vpc, output = request.get("VpcConfig", {}), request["OutputDataConfig"]
    trainer = ModelTrainer(**_kw(
        training_image=request["AlgorithmSpecification"]["TrainingImage"],
        training_input_mode=request["AlgorithmSpecification"]["TrainingInputMode"],
        role=request["RoleArn"], base_job_name=spec.name,
        source_code=configs.SourceCode(source_dir=spec.source_dir,
                                       entry_script=spec.entry_point),
        distributed=Torchrun(process_count_per_node=p.processes_per_node),
        compute=configs.Compute(**_kw(
            instance_type=resource["InstanceType"], instance_count=resource["InstanceCount"],
            volume_size_in_gb=resource["VolumeSizeInGB"],
            volume_kms_key_id=resource.get("VolumeKmsKeyId"),
            keep_alive_period_in_seconds=resource.get("KeepAlivePeriodInSeconds"),
            enable_managed_spot_training=request["EnableManagedSpotTraining"])),
        stopping_condition=configs.StoppingCondition(**_kw(
            max_runtime_in_seconds=stop["MaxRuntimeInSeconds"],
            max_wait_time_in_seconds=stop.get("MaxWaitTimeInSeconds"))),
        output_data_config=configs.OutputDataConfig(**_kw(
            s3_output_path=output["S3OutputPath"], kms_key_id=output.get("KmsKeyId"))),
        checkpoint_config=configs.CheckpointConfig(
            s3_uri=request["CheckpointConfig"]["S3Uri"],
            local_path=request["CheckpointConfig"]["LocalPath"]),
        networking=configs.Networking(**_kw(
            subnets=vpc.get("Subnets"), security_group_ids=vpc.get("SecurityGroupIds"),
            enable_network_isolation=request["EnableNetworkIsolation"])),
        input_data_config=[configs.InputData(channel_name=name, data_source=uri)
                           for name, uri in sorted(spec.inputs.items())] or None,
        hyperparameters={k: json.loads(v) for k, v in request["HyperParameters"].items()
                         if not k.startswith("sagemaker_")},
        environment=request["Environment"],
        tags=[configs.Tag(key=t["Key"], value=t["Value"]) for t in request["Tags"]],
    ))
    trainer = trainer.with_metric_definitions([
        configs.MetricDefinition(name=m["Name"], regex=m["Regex"])
        for m in request["AlgorithmSpecification"]["MetricDefinitions"]])
    if "RetryStrategy" in request:
        trainer = trainer.with_retry_strategy(configs.RetryStrategy(
            maximum_retry_attempts=request["RetryStrategy"]["MaximumRetryAttempts"]))
    return trainer


def _kw(**values: Any) -> dict[str, Any]:
    """Keyword arguments without the unset ones (the SDK's models default them themselves)."""
    return {k: v for k, v in values.items() if v is not None}


__all__ = ["PyTorch", "to_model_trainer"]
