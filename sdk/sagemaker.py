"""SageMaker Python SDK compatibility: ``from dtrain.sagemaker import PyTorch``.

Estimator code written for the SageMaker SDK v2 ``PyTorch`` class runs after changing only its
import line: the constructor arguments that matter become a ``JobSpec`` (SMP distribution dicts
are translated by ``dtrain.spec.smp``), and ``fit`` submits it through ``dtrain.jobs.api`` to the
SageMaker target, so the job is in dtrain's job store (``dtrain status``/``logs``/``stop`` see it)
and runs dtrain's node agent with the same container contract as every other target.
``attach`` also takes a training job dtrain has no record of (started elsewhere): that one is
asked of SageMaker by name, as the SageMaker SDK does.

``to_model_trainer(spec)`` goes the other way, to the official SDK's ``ModelTrainer`` (needs the
``sagemaker`` extra; imported only when called).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from dtrain.core import names
from dtrain.core.errors import DtrainError, SpecWarning
from dtrain.core.states import COMPLETED, FINAL_STATUSES, PENDING

# Arguments the SageMaker SDK accepts that change nothing a dtrain job does: accepted, and each
# one set is named in a warning (the session is dtrain's own: not even that).
_IGNORED = ("sagemaker_session", "debugger_hook_config", "disable_profiler", "profiler_config",
            "container_log_level", "code_location", "rules", "metric_definitions",
            "enable_sagemaker_metrics", "input_mode_channels")
_SILENT = ("sagemaker_session",)
# Arguments whose meaning dtrain cannot keep: refused with the way to get it (a job that ran
# without them would differ from the one asked for).
_REFUSED = {
    "checkpoint_local_path": "dtrain's jobs checkpoint in the contract's folder "
                             "(/opt/ml/checkpoints, ctx.checkpoint_dir); write checkpoints there",
    "dependencies": "copy those folders into source_dir",
    "git_config": "clone the repository and pass its folder as source_dir",
}
_CHECKPOINT_LOCAL_PATH = "/opt/ml/checkpoints"


class PyTorch:
    """A SageMaker SDK v2 ``sagemaker.pytorch.PyTorch`` look-alike that submits through dtrain."""

    # The SageMaker SDK v2's positional order (entry_point, framework_version, py_version,
    # source_dir, hyperparameters, image_uri, distribution); every other argument by name.
    def __init__(self, entry_point: str, framework_version: str | None = None,
                 py_version: str | None = None, source_dir: str | None = None,
                 hyperparameters: dict[str, Any] | None = None, image_uri: str | None = None,
                 distribution: dict[str, Any] | None = None, *, role: str | None = None,
                 instance_type: str | None = None, instance_count: int = 1,
                 output_path: str | None = None,
                 checkpoint_s3_uri: str | None = None, use_spot_instances: bool = False,
                 max_run: int = 86400, max_wait: int | None = None,
                 environment: dict[str, str] | None = None,
                 tags: list[dict[str, str]] | None = None, subnets: list[str] | None = None,
                 security_group_ids: list[str] | None = None,
                 base_job_name: str | None = None, volume_size: int = 30,
                 volume_kms_key: str | None = None, output_kms_key: str | None = None,
                 keep_alive_period_in_seconds: int | None = None,
                 enable_network_isolation: bool = False, max_retry_attempts: int | None = None,
                 input_mode: str = "File", encrypt_inter_container_traffic: bool = False,
                 clients: dict[str, Any] | None = None, **kwargs: Any):
        local_path = kwargs.get("checkpoint_local_path")
        if local_path is None or os.path.normpath(local_path) == _CHECKPOINT_LOCAL_PATH:
            kwargs.pop("checkpoint_local_path", None)  # SageMaker's default is dtrain's too
        for name, how in _REFUSED.items():
            if kwargs.get(name):
                raise DtrainError(f"PyTorch({name}=...): dtrain cannot keep its meaning; {how}")
        unknown = sorted(set(kwargs) - set(_IGNORED) - set(_REFUSED))
        if unknown:
            raise DtrainError(f"PyTorch({unknown[0]}=...): not supported by dtrain.sagemaker; "
                              "remove it (see the dtrain docs for supported arguments)")
        # a false value (disable_profiler=False, metric_definitions=[]) or the SDK's default
        # log level asks for nothing dtrain leaves out
        ignored = sorted(n for n, v in kwargs.items() if n not in _SILENT and v
                         and not (n == "container_log_level" and v == logging.INFO))
        if ignored:
            warnings.warn(f"PyTorch({', '.join(ignored)}): not used by dtrain (no SageMaker "
                          "debugger, profiler or metric definitions run; the code goes under "
                          "output_path); ignored", SpecWarning, stacklevel=2)
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
        self.encrypt_inter_container_traffic = encrypt_inter_container_traffic
        self.clients = clients  # boto3 clients for the SageMaker target (tests pass moto's)
        self._launcher: Any = None
        self._job: _RecordedJob | _DescribedJob | None = None
        self.latest_training_job: str | None = None
        self.latest_request: dict[str, Any] | None = None  # the CreateTrainingJob kwargs sent

    # ---------------------------------------------------------------- spec

    def to_spec_dict(self, inputs: Any = None) -> dict[str, Any]:
        """The JobSpec (as a dict) these constructor arguments and ``inputs`` mean."""
        if not self.instance_type:
            raise DtrainError("PyTorch(instance_type=...): required; e.g. 'ml.p4d.24xlarge'")
        if self.instance_type in ("local", "local_gpu"):  # the SageMaker SDK's local mode
            raise DtrainError(
                f"PyTorch(instance_type={self.instance_type!r}): this class runs SageMaker "
                "training jobs; to run the same script on this machine use "
                f"dtrain.Estimator(entry_point=..., instance_type={self.instance_type!r}, ...) "
                "with the arguments the two share (source_dir, hyperparameters, distribution, "
                "instance_count, environment; the SageMaker ones such as framework_version, "
                "image_uri and subnets go in sagemaker={...}), or `dtrain submit job.yaml "
                "--target local`")
        sm = {"role": self.role, "image_uri": self.image_uri, "subnets": self.subnets or [],
              "security_group_ids": self.security_group_ids or [],
              "enable_network_isolation": self.enable_network_isolation,
              "encrypt_inter_container_traffic": self.encrypt_inter_container_traffic,
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
            "inputs": _channels(inputs, mode=self.input_mode), "output_path": self.output_path,
            "checkpoint": {"uri": self.checkpoint_s3_uri}, "environment": self.environment,
            "tags": self.tags,
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
            from dtrain.jobs import api as jobs

            self._launcher = jobs.launcher_for("sagemaker", self.clients)
        return self._launcher

    # ---------------------------------------------------------------- run

    def fit(self, inputs: Any = None, wait: bool = True, logs: Any = "All",
            job_name: str | None = None) -> None:
        """Submit the job; with ``wait``, stream its logs (``logs``) until it ends."""
        from dtrain.jobs import api as jobs

        spec = self.to_spec(inputs)  # its notes (SMP keys dtrain ignores) reach the user
        job = jobs.identity(spec, self._launcher_obj())
        if job_name:  # the SDK uses a given name as it is, without a timestamp
            if len(job_name) > 63 or not re.fullmatch(r"[a-zA-Z0-9](-*[a-zA-Z0-9])*", job_name):
                raise DtrainError(
                    f"fit(job_name={job_name!r}): SageMaker training job names are 1-63 letters, "
                    f"digits and hyphens, starting and ending with a letter or digit; e.g. "
                    f"{names.sanitize(job_name, max_length=names.MAX_TARGET_LENGTH)!r}")
            job = dataclasses.replace(job, name=job_name)
        # build_request is pure: this is exactly what submit sends for the same identity
        self.latest_request = jobs.build_request(spec, clients=self.clients, job=job).payload
        record = jobs.submit(spec, wait=False, clients=self.clients, job=job)
        self.latest_training_job = record.name
        self._job = _RecordedJob(record.id, self.clients)
        if wait:
            self.wait(logs=bool(logs) and logs != "None")

    def wait(self, *, logs: bool = False) -> None:
        """Block until the latest job ends; raise with its FailureReason unless it completed."""
        job, name = self._latest("wait"), self.latest_training_job
        if logs:
            for line in job.logs():
                print(line, flush=True)
        status, reason = job.wait(_transition_printer(name))
        if status != COMPLETED:
            raise DtrainError(f"training job {name} {status.lower()}: "
                              f"{reason or 'no FailureReason given'}")
        print(f"{name}: {status}", file=sys.stderr)

    @classmethod
    def attach(cls, training_job_name: str, *,
               clients: dict[str, Any] | None = None) -> PyTorch:
        """An estimator for an existing job (as ``sagemaker.estimator.Estimator.attach``):
        through the job store when dtrain submitted it from here, else by name."""
        from dtrain.jobs import api as jobs

        recorded = [r for r in jobs.list_jobs(target="sagemaker", refresh_s=None)
                    if r.name == training_job_name]  # newest first
        launcher = jobs.launcher_for("sagemaker", clients)
        region = recorded[0].target_data.get("region") if recorded else None
        job = launcher.describe(training_job_name, region=region, missing_ok=True)
        if job is None:
            raise DtrainError(f"PyTorch.attach({training_job_name!r}): SageMaker has no training "
                              "job of that name in this region; check the name (dtrain list "
                              "--target sagemaker) and the region")
        hps = job.get("HyperParameters", {})
        program = hps.get("sagemaker_program", '"train.py"').strip('"')
        resources = job["ResourceConfig"]
        est = cls(program, role=job.get("RoleArn"), instance_type=resources["InstanceType"],
                  instance_count=resources["InstanceCount"],
                  output_path=job.get("OutputDataConfig", {}).get("S3OutputPath"),
                  image_uri=job.get("AlgorithmSpecification", {}).get("TrainingImage"),
                  clients=clients)
        est._launcher = launcher
        est.latest_training_job = training_job_name
        est._job = (_RecordedJob(recorded[0].id, clients) if recorded
                    else _DescribedJob(launcher, training_job_name))
        return est

    @property
    def model_data(self) -> str | None:
        """S3 URI of ``model.tar.gz`` once the job has completed."""
        return self._latest("model_data").state().get("model_data")

    def stop(self) -> None:
        """Stop the latest job (SageMaker sends SIGTERM: it checkpoints, then ends Stopped)."""
        self._latest("stop").stop()

    def _latest(self, what: str) -> _RecordedJob | _DescribedJob:
        if self._job is None:
            raise DtrainError(f"{what}: this estimator has no job yet; call fit() or attach()")
        return self._job


class _RecordedJob:
    """A job in dtrain's job store: every operation goes through the jobs layer."""

    def __init__(self, job_id: str, clients: dict[str, Any] | None):
        from dtrain.jobs import api

        self.jobs, self.job_id, self.clients = api, job_id, clients

    def wait(self, report: Callable[[dict[str, Any]], None]) -> tuple[str, str | None]:
        record = self.jobs.wait_for(self.job_id, clients=self.clients,
                                    on_status=lambda r: report(r.target_data))
        return record.status, record.failure_reason

    def logs(self) -> Iterator[str]:
        return self.jobs.logs(self.job_id, follow=True, clients=self.clients)

    def stop(self) -> None:
        self.jobs.stop(self.job_id, clients=self.clients)

    def state(self) -> dict[str, Any]:
        return self.jobs.get(self.job_id, clients=self.clients).target_data


class _DescribedJob:
    """A training job dtrain has no record of (``attach`` to one started elsewhere): asked of
    SageMaker by name each time, as the SageMaker SDK does; nothing goes into the job store.

    It is also the ``Journal`` its ``stop`` records in: with nothing to write, the handle stays
    as made, not known to have ended, so every ``status`` asks SageMaker."""

    def __init__(self, launcher: Any, name: str):
        from dtrain.launcher.base import Handle, JobIdentity
        from dtrain.launcher.sagemaker.launcher import SageMakerState

        self.launcher = launcher
        self.handle = Handle(job=JobIdentity(id=name, name=name, submitted_at=0.0),
                             status=PENDING, state=SageMakerState(training_job_name=name))

    def record(self, update: Any) -> Any:
        return self.handle

    def current(self) -> Any:
        return self.handle

    def _ended(self) -> bool:
        return self.launcher.status(self.handle).status in FINAL_STATUSES

    def wait(self, report: Callable[[dict[str, Any]], None]) -> tuple[str, str | None]:
        while True:
            update = self.launcher.status(self.handle)
            report(update.state)
            if update.status in FINAL_STATUSES:
                return update.status, update.failure_reason
            time.sleep(self.launcher.poll_s)

    def logs(self) -> Iterator[str]:
        return self.launcher.logs(self.handle, follow=True, host=None, rank=None,
                                  ended=self._ended)

    def stop(self) -> None:
        self.launcher.stop(self.handle, self)

    def state(self) -> dict[str, Any]:
        return self.launcher.status(self.handle).state


def _transition_printer(name: str | None) -> Callable[[dict[str, Any]], None]:
    """Prints each new SecondaryStatus transition of the job once, as the SageMaker SDK does."""
    shown = 0

    def report(state: dict[str, Any]) -> None:
        nonlocal shown
        transitions = state.get("transitions") or []
        for item in transitions[shown:]:
            message = f" - {item['message']}" if item.get("message") else ""
            print(f"{name}: {item['status']}{message}", file=sys.stderr, flush=True)
        shown = max(shown, len(transitions))

    return report


def _channels(inputs: Any, *, mode: str) -> dict[str, str]:
    """``fit`` inputs (str, dict of str/TrainingInput, or one TrainingInput) -> channel URIs."""
    if inputs is None:
        return {}
    if isinstance(inputs, str):
        return {"training": inputs}
    if isinstance(inputs, dict):
        return {name: _uri(value, mode=mode) for name, value in inputs.items()}
    return {"training": _uri(inputs, mode=mode)}


# A TrainingInput's settings a dtrain channel has (an S3 prefix every host gets whole; the job's
# one input mode, sagemaker.input_mode): any other value is refused, not dropped.
_CHANNEL_AS_DTRAIN = {"S3DataType": "S3Prefix", "S3DataDistributionType": "FullyReplicated"}


def _uri(value: Any, *, mode: str) -> str:
    if isinstance(value, str):
        return value
    config = getattr(value, "config", None)  # sagemaker.inputs.TrainingInput
    try:
        source = config["DataSource"]["S3DataSource"]
        uri = source["S3Uri"]
    except (TypeError, KeyError):
        raise DtrainError(f"fit inputs: {value!r} is not an s3:// URI or TrainingInput; "
                          "give 's3://bucket/prefix'") from None
    for key, ours in _CHANNEL_AS_DTRAIN.items():
        if source.get(key, ours) != ours:
            raise DtrainError(
                f"fit inputs: TrainingInput({uri!r}) asks for {key} {source[key]!r}; a dtrain "
                f"channel is {ours} (an S3 prefix every host gets whole; the script or "
                "dtrain's data loader splits it by rank): give the prefix")
    kept = {"DataSource", "InputMode", *_CHANNEL_AS_DTRAIN, "S3Uri"}
    other = sorted(key for key, setting in {**config, **source}.items()
                   if key not in kept and setting not in (None, "None"))
    if other:  # compression, record wrapping, shuffling, attributes, content type
        raise DtrainError(
            f"fit inputs: TrainingInput({uri!r}) sets {', '.join(other)}, which a dtrain channel "
            "does not carry (every host gets the prefix's files as they are); drop "
            f"{'it' if len(other) == 1 else 'them'}, and decompress or shuffle in the script")
    own = config.get("InputMode")
    if own not in (None, mode):
        raise DtrainError(f"fit inputs: TrainingInput({uri!r}, input_mode={own!r}): dtrain has "
                          f"one input mode for the job ({mode}); pass PyTorch(input_mode=...) "
                          "instead")
    return uri


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
    from dtrain.jobs import api as jobs
    from dtrain.planning.planner import plan

    p = plan(spec)
    request = jobs.build_request(spec).payload
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
