"""The SageMaker CreateTrainingJob request built from a spec: golden file and field coverage.

Regenerate the golden file after an intended change with
``DTRAIN_UPDATE_GOLDEN=1 pytest tests/unit/test_sagemaker_request.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from dtrain.core.errors import DtrainError
from dtrain.launcher.sagemaker.launcher import SageMakerLauncher
from dtrain.planning.planner import plan
from dtrain.spec.model import JobSpec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sagemaker-p4d.yaml"
GOLDEN = ROOT / "tests" / "golden" / "sagemaker_p4d_request.json"
JOB = "pythia-1b-p4d-20250101-000000"


@pytest.fixture(autouse=True)
def _dtrain_home(tmp_path, monkeypatch):
    monkeypatch.setenv("DTRAIN_HOME", str(tmp_path / "home"))


def build(spec: JobSpec, **kwargs) -> dict:
    return SageMakerLauncher(region="us-east-1").build_request(plan(spec), job_name=JOB, **kwargs)


def example_spec(*overrides: str) -> JobSpec:
    return JobSpec.from_file(EXAMPLE, overrides=list(overrides))


def test_example_request_matches_golden_file():
    request = build(example_spec())
    if os.environ.get("DTRAIN_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(request, indent=2) + "\n")
    assert request == json.loads(GOLDEN.read_text())


def hps(request: dict) -> dict:
    return {k: json.loads(v) for k, v in request["HyperParameters"].items()}


# Where each spec field shows up in the request: field path -> value found there.
FIELD_IN_REQUEST = {
    "name": lambda r: r["TrainingJobName"].rsplit("-", 2)[0],
    "entry_point": lambda r: hps(r)["sagemaker_program"],
    "source_dir": lambda r: hps(r)["sagemaker_submit_directory"],
    "hyperparameters": lambda r: {k: v for k, v in hps(r).items()
                                  if not k.startswith(("dtrain_", "sagemaker_"))},
    "compute.instance_type": lambda r: r["ResourceConfig"]["InstanceType"],
    "compute.instance_count": lambda r: r["ResourceConfig"]["InstanceCount"],
    "compute.processes_per_instance": lambda r: hps(r)["dtrain_processes_per_host"],
    "compute.volume_size_gb": lambda r: r["ResourceConfig"]["VolumeSizeInGB"],
    "compute.use_spot": lambda r: r["EnableManagedSpotTraining"],
    "compute.max_run": lambda r: r["StoppingCondition"]["MaxRuntimeInSeconds"],
    "compute.max_wait": lambda r: r["StoppingCondition"]["MaxWaitTimeInSeconds"],
    "compute.max_restarts": lambda r: hps(r)["dtrain_max_restarts"],
    "distribution.sharding_degree": lambda r: hps(r)["dtrain_distribution"]["sharding_degree"],
    "distribution.backend": lambda r: hps(r)["dtrain_distribution"]["backend"],
    "distribution.gradient_accumulation_steps":
        lambda r: hps(r)["dtrain_distribution"]["gradient_accumulation_steps"],
    "distribution.mixed_precision": lambda r: hps(r)["dtrain_distribution"]["mixed_precision"],
    "distribution.activation_checkpointing":
        lambda r: hps(r)["dtrain_distribution"]["activation_checkpointing"],
    "distribution.hierarchical_allgather":
        lambda r: hps(r)["dtrain_distribution"]["hierarchical_allgather"],
    "distribution.attention": lambda r: hps(r)["dtrain_distribution"]["attention"],
    "inputs": lambda r: {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"]
                         for c in r["InputDataConfig"]
                         if not c["ChannelName"].startswith("dtrain_")},
    "output_path": lambda r: r["OutputDataConfig"]["S3OutputPath"],
    "checkpoint.uri": lambda r: r["CheckpointConfig"]["S3Uri"],
    "checkpoint.interval_steps": lambda r: hps(r)["dtrain_checkpoint_interval_steps"],
    "checkpoint.keep_last": lambda r: hps(r)["dtrain_checkpoint_keep_last"],
    "environment": lambda r: r["Environment"],
    "tags": lambda r: {t["Key"]: t["Value"] for t in r["Tags"]
                       if not t["Key"].startswith("dtrain:")},
    "sagemaker.role": lambda r: r["RoleArn"],
    "sagemaker.region": lambda r: hps(r)["sagemaker_region"],
    "sagemaker.image_uri": lambda r: r["AlgorithmSpecification"]["TrainingImage"],
    "sagemaker.input_mode": lambda r: r["AlgorithmSpecification"]["TrainingInputMode"],
    "sagemaker.keep_alive_period": lambda r: r["ResourceConfig"]["KeepAlivePeriodInSeconds"],
    "sagemaker.subnets": lambda r: r["VpcConfig"]["Subnets"],
    "sagemaker.security_group_ids": lambda r: r["VpcConfig"]["SecurityGroupIds"],
    "sagemaker.retry_attempts": lambda r: r["RetryStrategy"]["MaximumRetryAttempts"],
    "sagemaker.enable_network_isolation": lambda r: r["EnableNetworkIsolation"],
    "sagemaker.volume_kms_key_id": lambda r: r["ResourceConfig"]["VolumeKmsKeyId"],
    "sagemaker.output_kms_key_id": lambda r: r["OutputDataConfig"]["KmsKeyId"],
}
# Spec fields that deliberately do not reach a SageMaker request, and why.
NOT_IN_REQUEST = {
    "compute.target": "selects this launcher",
    "compute.price_per_hour": "cost estimates only (dtrain plan)",
    "sagemaker.framework_version": "image lookup only, when image_uri is unset",
    "sagemaker.py_version": "image lookup only, when image_uri is unset",
    "ec2": "EC2 target only",
}
# How the request spells a value the spec writes another way.
EXPECTED = {
    "compute.instance_type": lambda v: "ml." + v,
    "source_dir": lambda v: f"s3://dtrain-example-bucket/dtrain/{JOB}/source/sourcedir.tar.gz",
}


def leaf_fields(model_cls, prefix="") -> list[str]:
    """Dotted paths of every field, descending into nested spec sections."""
    from pydantic import BaseModel

    out = []
    for name, info in model_cls.model_fields.items():
        path = prefix + name
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(leaf_fields(ann, path + "."))
        else:
            out.append(path)
    return out


def _accounted(path: str) -> bool:
    section = path.split(".")[0]
    return path in FIELD_IN_REQUEST or path in NOT_IN_REQUEST or section in NOT_IN_REQUEST


def test_every_spec_field_is_mapped_or_declared_not_applicable():
    missing = [p for p in leaf_fields(JobSpec) if not _accounted(p)]
    assert not missing, f"spec fields with no place in the SageMaker request: {missing}"


def _set_paths(spec: JobSpec) -> list[str]:
    paths = []
    for name in spec.model_fields_set:
        value = getattr(spec, name)
        if hasattr(value, "model_fields_set") and name in {"compute", "distribution",
                                                           "checkpoint", "sagemaker", "ec2"}:
            paths += [f"{name}.{sub}" for sub in value.model_fields_set]
        else:
            paths.append(name)
    return sorted(paths)


def _spec_value(spec: JobSpec, path: str):
    value = spec
    for part in path.split("."):
        value = getattr(value, part)
    return value


def test_no_field_set_in_the_example_is_silently_dropped():
    spec = example_spec("sagemaker.keep_alive_period=0", "compute.processes_per_instance=8")
    request = build(spec.model_copy(update={}), )
    for path in _set_paths(spec):
        if path in NOT_IN_REQUEST or path.split(".")[0] in NOT_IN_REQUEST:
            continue
        value = _spec_value(spec, path)
        expected = EXPECTED.get(path, lambda v: v)(value)
        assert FIELD_IN_REQUEST[path](request) == expected, path


def test_keep_alive_and_network_isolation_reach_the_request():
    request = build(example_spec("compute.use_spot=false", "compute.max_wait=null",
                                 "sagemaker.keep_alive_period=600",
                                 "sagemaker.enable_network_isolation=true"))
    assert request["ResourceConfig"]["KeepAlivePeriodInSeconds"] == 600
    assert request["EnableNetworkIsolation"] is True
    assert "MaxWaitTimeInSeconds" not in request["StoppingCondition"]


def test_spot_without_max_wait_waits_as_long_as_it_runs():
    request = build(example_spec("compute.max_wait=null"))
    assert request["StoppingCondition"] == {"MaxRuntimeInSeconds": 172800,
                                            "MaxWaitTimeInSeconds": 172800}


def test_code_arrives_as_a_file_mode_channel_and_the_entry_script_starts_the_agent():
    request = build(example_spec("sagemaker.input_mode=FastFile"))
    code = request["InputDataConfig"][-1]
    assert code["ChannelName"] == "dtrain_code" and code["InputMode"] == "File"
    assert code["DataSource"]["S3DataSource"]["S3Uri"].endswith(f"/dtrain/{JOB}/source/")
    entry = request["AlgorithmSpecification"]["ContainerEntrypoint"]
    assert entry[-1] == "/opt/ml/input/data/dtrain_code/sagemaker_entry.sh"
    from dtrain.launcher.sagemaker.launcher import entry_script_text
    assert "exec \"$PYTHON\" -m dtrain.runtime" in entry_script_text()


def test_dtrain_settings_decode_with_the_container_contract():
    from dtrain.core import contract

    decoded = contract.decode_hyperparameters(build(example_spec())["HyperParameters"])
    settings = contract.Settings.from_hyperparameters(
        {k: v for k, v in decoded.items() if k.startswith("dtrain_")})
    assert settings.entry_point == "train.py"
    assert settings.processes_per_host == 8
    assert settings.distribution["sharding_degree"] == 8
    assert settings.job_name == JOB


def test_metric_definitions_match_the_trainer_line():
    import re

    from dtrain.core.metrics_format import format_metrics

    line = "2025-01-01 [algo-1 0]: " + format_metrics(12, loss=2.345, eval_loss=9.0, lr=3e-4,
                                                         mfu=0.48)
    found = {}
    for item in build(example_spec())["AlgorithmSpecification"]["MetricDefinitions"]:
        match = re.search(item["Regex"], line)
        if match:
            found[item["Name"]] = float(match.group(1))
    assert found == {"step": 12, "loss": 2.345, "eval_loss": 9.0, "lr": 3e-4, "mfu": 0.48}


def test_missing_image_without_the_sagemaker_sdk_is_one_line_error(monkeypatch):
    from dtrain.launcher.sagemaker import launcher as sagemaker

    monkeypatch.setattr(sagemaker, "_sdk_image_retrieve", lambda: None)
    with pytest.raises(DtrainError, match=r"set sagemaker.image_uri or pip install 'dtrain\[sage"):
        build(example_spec("sagemaker.image_uri=null"))


def test_reserved_channel_name_is_rejected():
    with pytest.raises(DtrainError, match="inputs.dtrain_code: .*reserved"):
        build(example_spec("inputs.dtrain_code=s3://b-ucket/x"))


def test_spot_with_warm_pool_is_rejected_before_any_call():
    with pytest.raises(DtrainError, match="warm pools do not work with managed spot"):
        build(example_spec("sagemaker.keep_alive_period=300"))


def test_sagemaker_framework_keys_never_reach_the_user_script(tmp_path):
    from dtrain.core import contract

    config = tmp_path / "input" / "config"
    config.mkdir(parents=True)
    (config / "resourceconfig.json").write_text(json.dumps(
        {"current_host": "algo-1", "hosts": ["algo-1", "algo-2"]}))
    hyperparameters = build(example_spec())["HyperParameters"]
    (config / "hyperparameters.json").write_text(json.dumps(hyperparameters))
    read = contract.read_contract(str(tmp_path), num_gpus=8)
    assert not [a for a in read.user_args() if a.startswith(("--sagemaker_", "--dtrain_"))]
    assert "--lr" in read.user_args() and read.settings.processes_per_host == 8
