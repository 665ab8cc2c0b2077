"""The SageMaker request built from a spec: the CreateTrainingJob payload (golden file, field
coverage), its uploads, and that building it is a pure function of spec, plan and job identity.

Regenerate the golden file after an intended change with
``DTRAIN_UPDATE_GOLDEN=1 pytest tests/unit/test_sagemaker_request.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from dtrain.core.errors import DtrainError, SpecError
from dtrain.launcher import packaging
from dtrain.launcher.base import JobIdentity, Request, Upload
from dtrain.launcher.sagemaker.launcher import SageMakerLauncher
from dtrain.planning.planner import plan
from dtrain.spec.model import JobSpec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sagemaker-p4d.yaml"
GOLDEN = ROOT / "tests" / "golden" / "sagemaker_p4d_request.json"
JOB = "pythia-1b-p4d-20250101-000000"
IDENTITY = JobIdentity(id="3f2a9c1d", name=JOB, submitted_at=1735689600.0)
PREFIX = f"s3://dtrain-example-bucket/dtrain/{JOB}/source"


@pytest.fixture(autouse=True)
def _dtrain_home(tmp_path, monkeypatch):
    monkeypatch.setenv("DTRAIN_HOME", str(tmp_path / "home"))


def build_request(spec: JobSpec, *, region: str | None = "us-east-1") -> Request:
    return SageMakerLauncher(region=region).build_request(spec, plan(spec), IDENTITY)


def build(spec: JobSpec) -> dict:
    """The CreateTrainingJob kwargs."""
    return build_request(spec).payload


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
    "distribution.gradient_sync": lambda r: hps(r)["dtrain_distribution"]["gradient_sync"],
    "distribution.mixed_precision": lambda r: hps(r)["dtrain_distribution"]["mixed_precision"],
    "distribution.activation_checkpointing":
        lambda r: hps(r)["dtrain_distribution"]["activation_checkpointing"],
    "distribution.hierarchical_allgather":
        lambda r: hps(r)["dtrain_distribution"]["hierarchical_allgather"],
    "distribution.attention": lambda r: hps(r)["dtrain_distribution"]["attention"],
    "distribution.tensor_parallel_degree":
        lambda r: hps(r)["dtrain_distribution"]["tensor_parallel_degree"],
    "distribution.tensor_parallel_mode":
        lambda r: hps(r)["dtrain_distribution"]["tensor_parallel_mode"],
    "distribution.sequence_parallel": lambda r: hps(r)["dtrain_distribution"]["sequence_parallel"],
    **{f"distribution.{key}": (lambda r, key=key: hps(r)["dtrain_distribution"][key])
       for key in ("pipeline_parallel_degree", "microbatches", "pipeline_schedule",
                   "stages_per_rank", "partition")},
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
    "sagemaker.encrypt_inter_container_traffic":
        lambda r: r.get("EnableInterContainerTrafficEncryption", False),
    "sagemaker.volume_kms_key_id": lambda r: r["ResourceConfig"]["VolumeKmsKeyId"],
    "sagemaker.output_kms_key_id": lambda r: r["OutputDataConfig"]["KmsKeyId"],
}
# Spec fields that deliberately do not reach a SageMaker request, and why.
NOT_IN_REQUEST = {
    "compute.target": "selects this launcher",
    "compute.price_per_hour": "cost estimates only (dtrain plan)",
    "compute.oversubscribe": "local target only",
    "sagemaker.framework_version": "image lookup only, when image_uri is unset",
    "sagemaker.py_version": "image lookup only, when image_uri is unset",
    "ec2": "EC2 target only",
    "slurm": "Slurm target only",
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


def test_keep_alive_network_isolation_and_traffic_encryption_reach_the_request():
    request = build(example_spec("compute.use_spot=false", "compute.max_wait=null",
                                 "sagemaker.keep_alive_period=600",
                                 "sagemaker.enable_network_isolation=true",
                                 "sagemaker.encrypt_inter_container_traffic=true"))
    assert request["ResourceConfig"]["KeepAlivePeriodInSeconds"] == 600
    assert request["EnableNetworkIsolation"] is True
    assert request["EnableInterContainerTrafficEncryption"] is True
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
    from dtrain.core import contract, toolkit

    decoded = toolkit.decode_hyperparameters(build(example_spec())["HyperParameters"])
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


def test_without_image_uri_or_the_sdk_the_image_comes_from_dtrains_table(monkeypatch):
    from dtrain.launcher.sagemaker import launcher as sagemaker

    monkeypatch.setattr(sagemaker, "_sdk_image_retrieve", lambda: None)
    request = build(example_spec("sagemaker.image_uri=null", "sagemaker.framework_version='2.10'",
                                 "sagemaker.region=eu-west-1"))
    assert request["AlgorithmSpecification"]["TrainingImage"] == (
        "763104351884.dkr.ecr.eu-west-1.amazonaws.com/pytorch-training:"
        "2.10.0-gpu-py313-cu130-ubuntu22.04-sagemaker")


def test_a_version_neither_the_table_nor_an_sdk_knows_is_one_line_error(monkeypatch):
    from dtrain.launcher.sagemaker import launcher as sagemaker

    monkeypatch.setattr(sagemaker, "_sdk_image_retrieve", lambda: None)
    with pytest.raises(DtrainError, match=r"^sagemaker.framework_version: '2.12' has no AWS image "
                                          r".*pip install 'dtrain\[sagemaker\]'"):
        build(example_spec("sagemaker.image_uri=null", "sagemaker.framework_version='2.12'"))
    with pytest.raises(DtrainError, match=r"^sagemaker.framework_version: torch 2.7 is older"):
        build(example_spec("sagemaker.image_uri=null", "sagemaker.framework_version='2.7'"))

    def sdk_lookup(**kwargs):
        if kwargs["version"] == "2.10":
            raise ValueError("Unsupported pytorch version: 2.10.\nSupported: 2.5, 2.6")
        return f"sdk-image:{kwargs['version']}-{kwargs['py_version']}-{kwargs['region']}"

    monkeypatch.setattr(sagemaker, "_sdk_image_retrieve", lambda: sdk_lookup)
    image = build(example_spec("sagemaker.image_uri=null", "sagemaker.framework_version='2.9'",
                               "sagemaker.py_version=py312"))["AlgorithmSpecification"][
        "TrainingImage"]
    assert image == "sdk-image:2.9-py312-us-east-1"  # the SDK is the authority for what it knows
    newer = build(example_spec("sagemaker.image_uri=null", "sagemaker.framework_version='2.10'"))
    assert newer["AlgorithmSpecification"]["TrainingImage"].endswith(
        "us-east-1.amazonaws.com/pytorch-training:2.10.0-gpu-py313-cu130-ubuntu22.04-sagemaker")


# Rules on user input that SageMaker would refuse only after the upload: validation owns them,
# so a spec it accepts always builds.
@pytest.mark.parametrize("override, message", [
    ("sagemaker.keep_alive_period=300",
     "sagemaker.keep_alive_period: warm pools do not work with managed spot training"),
    ("inputs.dtrain_code=s3://b-ucket/x", "inputs.dtrain_code: this channel name is reserved"),
    ("inputs.dtrain_source=s3://b-ucket/x", "inputs.dtrain_source: this channel name is reserved"),
    (f"hyperparameters.notes={'x' * 2500}",
     "hyperparameters.notes: 2502 characters when JSON-encoded, above SageMaker's 2500"),
], ids=["spot-warm-pool", "dtrain_code", "dtrain_source", "long-hyperparameter"])
def test_what_sagemaker_would_reject_is_a_validation_rule(override, message):
    with pytest.raises(SpecError, match=message):
        example_spec(override)


def test_sagemaker_s_key_and_tag_limits_are_validation_rules_with_room_for_dtrain_s_own():
    from dtrain.spec.rules import sagemaker as rules

    spec = example_spec()
    reserved = set(build(spec)["HyperParameters"]) - set(spec.hyperparameters)
    assert len(reserved) <= rules.RESERVED_HYPERPARAMETERS  # what the rule leaves room for
    assert len(build(spec)["Tags"]) - len(spec.tags) == rules.RESERVED_TAGS
    data = spec.model_dump(mode="json")
    room = rules.MAX_HYPERPARAMETERS - rules.RESERVED_HYPERPARAMETERS
    for hps, tags, message in (
            ({f"k{i}": i for i in range(room + 1)}, {}, rf"hyperparameters: {room + 1} keys"),
            ({"k" * 257: 1}, {}, "a key of 257 characters, above SageMaker's 256"),
            ({}, {f"t{i}": "v" for i in range(49)}, "tags: 49 tags, above the 48")):
        with pytest.raises(SpecError, match=message):
            JobSpec.from_dict({**data, "hyperparameters": hps, "tags": tags})
    JobSpec.from_dict({**data, "hyperparameters": {f"k{i}": i for i in range(room)}})


def test_uploads_are_the_source_archive_wheel_and_entry_script_under_the_code_channel():
    spec = example_spec()
    request = build_request(spec)
    assert request.uploads == (
        Upload(spec.source_dir, f"{PREFIX}/sourcedir.tar.gz"),
        Upload(packaging.WHEEL, f"{PREFIX}/dtrain-0.1.0-py3-none-any.whl"),
        Upload(packaging.SAGEMAKER_ENTRY_SCRIPT, f"{PREFIX}/sagemaker_entry.sh"))
    assert os.path.isdir(spec.source_dir)
    [code] = [c for c in request.payload["InputDataConfig"] if c["ChannelName"] == "dtrain_code"]
    assert code["DataSource"]["S3DataSource"]["S3Uri"] == PREFIX + "/"
    assert hps(request.payload)["sagemaker_submit_directory"] == f"{PREFIX}/sourcedir.tar.gz"


def test_a_recipe_or_an_s3_source_archive_is_not_packed():
    recipe = build_request(example_spec("entry_point=recipe:causal_lm", "source_dir=null"))
    assert [u.source for u in recipe.uploads] == [packaging.WHEEL, packaging.SAGEMAKER_ENTRY_SCRIPT]
    assert "sagemaker_submit_directory" not in hps(recipe.payload)
    packed = "s3://dtrain-example-bucket/code/sourcedir.tar.gz"
    from_s3 = build_request(example_spec(f"source_dir={packed}"))
    assert [u.source for u in from_s3.uploads] == [packaging.WHEEL, packaging.SAGEMAKER_ENTRY_SCRIPT]
    assert hps(from_s3.payload)["sagemaker_submit_directory"] == packed
    [source] = [c for c in from_s3.payload["InputDataConfig"] if c["ChannelName"] == "dtrain_source"]
    assert source["DataSource"]["S3DataSource"]["S3Uri"] == packed


def test_the_request_is_a_function_of_spec_plan_and_job_identity(monkeypatch):
    import time

    spec = example_spec()
    first = build_request(spec)
    monkeypatch.setattr(time, "time", lambda: 4102444800.0)  # a clock read would show
    assert build_request(spec) == first
    assert first.job == IDENTITY and first.target == "sagemaker"
    assert first.payload["TrainingJobName"] == JOB  # the name the jobs layer chose, as it is
    assert json.loads(json.dumps(first.to_dict()))["payload"] == first.payload  # --dry-run's


def test_region_comes_from_the_spec_else_from_the_launchers_configuration(monkeypatch):
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    launcher = SageMakerLauncher()  # reads the environment's region once, as configuration
    monkeypatch.setenv("AWS_REGION", "ap-south-1")
    no_region = example_spec("sagemaker.region=null")
    assert hps(launcher.build_request(no_region, plan(no_region), IDENTITY).payload)[
        "sagemaker_region"] == "eu-west-1"
    assert hps(build(example_spec("sagemaker.region=us-west-2")))["sagemaker_region"] == \
        "us-west-2"
    monkeypatch.delenv("AWS_REGION")
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    with_image = example_spec("sagemaker.region=null", "sagemaker.image_uri="
                              "123.dkr.ecr.eu-west-1.amazonaws.com/my-torch:latest")
    assert "sagemaker_region" not in hps(build_request(with_image, region=None).payload)
    with pytest.raises(DtrainError, match=r"^sagemaker.region: needed to pick the training"):
        example_spec("sagemaker.region=null")  # no image to pick without a region


def test_tags_name_the_job_with_the_keys_every_cloud_target_uses():
    from dtrain.launcher import aws

    tags = {t["Key"]: t["Value"] for t in build(example_spec())["Tags"]}
    assert tags == {"team": "ml-platform", "project": "pythia",
                    aws.TAG_JOB: JOB, aws.TAG_CREATED_BY: aws.CREATED_BY}
    assert (aws.TAG_JOB, aws.TAG_CREATED_BY, aws.CREATED_BY) == \
        ("dtrain:job", "dtrain:created-by", "dtrain")


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


def test_two_submits_in_one_second_get_different_names_and_code_prefixes():
    from datetime import datetime, timezone

    from dtrain.core import names

    first = datetime(2026, 11, 25, 1, 21, 42, 1000, tzinfo=timezone.utc)
    second = first.replace(microsecond=2000)
    a, b = (names.timestamped("pythia-1b-p4d", now=t) for t in (first, second))
    assert a == "pythia-1b-p4d-20261125-012142-001" and a != b
    longest = names.timestamped("n" * names.MAX_LENGTH, now=first)
    assert len(longest) <= names.MAX_TARGET_LENGTH and longest.startswith("n" * names.MAX_LENGTH)
