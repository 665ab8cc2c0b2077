"""SageMaker SDK compatibility: SMP estimator code runs with only its import changed.

The SageMaker SDK is not a test dependency, so the SMP example runs with a two-function stand-in
``sagemaker`` package written into a temp folder (``get_execution_role`` and
``image_uris.retrieve``, the two SDK calls the example and the image lookup make).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from dtrain.core.errors import DtrainError, SpecWarning
from dtrain.sagemaker import PyTorch, to_model_trainer
from dtrain.testing import moto_aws  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]

FAKE_SDK = {
    "__init__.py": "import os\n\ndef get_execution_role():\n"
                   "    return os.environ['FAKE_SAGEMAKER_ROLE']\n",
    "image_uris.py": "def retrieve(framework, region, version, py_version, instance_type,\n"
                     "             image_scope):\n"
                     "    return (f'763104351884.dkr.ecr.{region}.amazonaws.com/{framework}-'\n"
                     "            f'{image_scope}:{version}-gpu-{py_version}')\n",
}


def run_example(script: str, moto_aws, tmp_path) -> subprocess.CompletedProcess:  # noqa: F811
    """Run ``examples/<script>`` as a user would, with the stand-in SDK, against moto."""
    sdk = tmp_path / "fake_sdk" / "sagemaker"
    sdk.mkdir(parents=True)
    for name, text in FAKE_SDK.items():
        (sdk / name).write_text(text)
    env = {**os.environ, "PYTHONPATH": str(sdk.parent), "FAKE_SAGEMAKER_ROLE": moto_aws.role_arn}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done


def test_smp_example_runs_against_moto_with_sharding_degree_and_backend(moto_aws, tmp_path):  # noqa: F811
    done = run_example("smp_port.py", moto_aws, tmp_path)
    [summary] = moto_aws.sagemaker.list_training_jobs()["TrainingJobSummaries"]
    name = summary["TrainingJobName"]
    assert name.startswith("sharded-data-parallel-demo-")
    job = moto_aws.sagemaker.describe_training_job(TrainingJobName=name)
    dist = json.loads(job["HyperParameters"]["dtrain_distribution"])
    assert dist["sharding_degree"] == 8
    assert dist["backend"] == "auto"  # ddp_dist_backend auto: NCCL plus dtrain's collectives
    assert dist["mixed_precision"] == "bf16"
    assert job["HyperParameters"]["dtrain_processes_per_host"] == "8"
    assert job["ResourceConfig"] == {**job["ResourceConfig"], "InstanceCount": 2,
                                     "InstanceType": "ml.p4d.24xlarge"}
    image = job["AlgorithmSpecification"]["TrainingImage"]
    assert image.endswith("pytorch-training:2.10-gpu-py313")  # the (fake) SDK's lookup
    bucket = "sagemaker-us-east-1-123456789012"  # the SDK's default bucket, created on demand
    assert job["OutputDataConfig"]["S3OutputPath"] == f"s3://{bucket}"
    assert done.stdout.strip().endswith("model.tar.gz")


def test_smp_v2_tensor_parallel_example_runs_against_moto_as_tp_and_mics(moto_aws, tmp_path):  # noqa: F811
    done = run_example("smp_tensor_parallel_port.py", moto_aws, tmp_path)
    [summary] = moto_aws.sagemaker.list_training_jobs()["TrainingJobSummaries"]
    job = moto_aws.sagemaker.describe_training_job(TrainingJobName=summary["TrainingJobName"])
    dist = json.loads(job["HyperParameters"]["dtrain_distribution"])
    assert (dist["tensor_parallel_degree"], dist["sharding_degree"]) == (8, 2)
    plan = dist["parallelism"]  # what every host builds: tp 8 inside each node, MiCS over both
    assert (plan["tp"], plan["dp_shard"], plan["dp_replicate"]) == (8, 2, 1)
    assert (plan["tp_mode"], plan["sequence_parallel"]) == ("1d", True)
    assert job["ResourceConfig"] == {**job["ResourceConfig"], "InstanceCount": 2,
                                     "InstanceType": "ml.p4d.24xlarge"}
    assert done.stdout.strip().endswith("model.tar.gz")


def estimator(**kwargs) -> PyTorch:
    args = {"entry_point": "train.py", "source_dir": str(ROOT / "examples" / "sagemaker_src"),
            "role": "arn:aws:iam::123456789012:role/R", "instance_type": "ml.p4d.24xlarge",
            "instance_count": 2, "output_path": "s3://b-ucket/out", "image_uri": "img:1"}
    return PyTorch(**{**args, **kwargs})


def test_estimator_arguments_become_the_spec():
    spec = estimator(
        hyperparameters={"epochs": 2}, use_spot_instances=True, max_run=3600, max_wait=7200,
        checkpoint_s3_uri="s3://b-ucket/ckpt", environment={"A": "1"},
        tags=[{"Key": "team", "Value": "ml"}], subnets=["subnet-1"], security_group_ids=["sg-1"],
        distribution={"torch_distributed": {"enabled": True}}, base_job_name="my-job",
    ).to_spec({"train": "s3://b-ucket/train", "test": "s3://b-ucket/test"})
    assert spec.name == "my-job" and spec.compute.instance_count == 2
    assert spec.compute.use_spot and spec.compute.max_wait == 7200
    assert spec.checkpoint.uri == "s3://b-ucket/ckpt" and spec.tags == {"team": "ml"}
    assert spec.inputs == {"train": "s3://b-ucket/train", "test": "s3://b-ucket/test"}
    assert spec.sagemaker.subnets == ["subnet-1"] and spec.hyperparameters == {"epochs": 2}


def test_positional_arguments_are_in_the_sagemaker_sdk_s_order():
    # PyTorch(entry_point, framework_version, py_version, source_dir, ...) in SDK v2
    job = PyTorch("train.py", "2.10", "py312", str(ROOT / "examples" / "sagemaker_src"),
                  role="arn:aws:iam::123456789012:role/R", instance_type="ml.p4d.24xlarge",
                  output_path="s3://b-ucket/out", sagemaker_session=None)
    assert (job.framework_version, job.py_version) == ("2.10", "py312")
    assert job.source_dir.endswith("sagemaker_src")


def test_a_single_s3_input_is_the_training_channel():
    assert estimator().to_spec("s3://b-ucket/data").inputs == {"training": "s3://b-ucket/data"}


def test_sagemaker_s_local_mode_points_at_dtrain_s_local_target():
    with pytest.raises(DtrainError, match=r"PyTorch\(instance_type='local'\): this class runs "
                                          r"SageMaker training jobs; .*dtrain.Estimator"):
        estimator(instance_type="local").to_spec()


def test_unsupported_argument_is_a_one_line_error():
    with pytest.raises(DtrainError, match=r"PyTorch\(warm_start_config=...\): not supported"):
        estimator(warm_start_config=object())


@pytest.mark.parametrize("argument,value,fix", [
    ("checkpoint_local_path", "/opt/ml/ckpt", "write checkpoints there"),
    ("dependencies", ["lib/"], "copy those folders into source_dir"),
    ("git_config", {"repo": "https://example.com/r.git"}, "clone the repository")])
def test_an_argument_whose_meaning_dtrain_cannot_keep_is_refused_not_dropped(argument, value,
                                                                              fix):
    with pytest.raises(DtrainError, match=rf"PyTorch\({argument}=...\): dtrain cannot keep its "
                                          rf"meaning; .*{fix}"):
        estimator(**{argument: value})
    estimator(checkpoint_local_path="/opt/ml/checkpoints")  # SageMaker's default is dtrain's


def test_an_argument_that_changes_nothing_is_named_in_a_warning_and_encryption_is_kept():
    with pytest.warns(SpecWarning, match=r"PyTorch\(disable_profiler, metric_definitions\): "
                                         "not used by dtrain"):
        job = estimator(disable_profiler=True, sagemaker_session=object(),
                        metric_definitions=[{"Name": "loss", "Regex": "loss=(.*)"}],
                        encrypt_inter_container_traffic=True)
    assert job.to_spec().sagemaker.encrypt_inter_container_traffic is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # values that ask for nothing: no warning
        estimator(disable_profiler=False, metric_definitions=[], container_log_level=20,
                  debugger_hook_config=False, checkpoint_local_path="/opt/ml/checkpoints/")


def test_a_training_input_dtrain_cannot_carry_is_refused():
    from types import SimpleNamespace

    def training_input(**source):
        return SimpleNamespace(config={"DataSource": {"S3DataSource": {
            "S3DataType": "S3Prefix", "S3Uri": "s3://b-ucket/train",
            "S3DataDistributionType": "FullyReplicated", **source}}})

    assert estimator().to_spec(training_input()).inputs == {"training": "s3://b-ucket/train"}
    same_mode = training_input()
    same_mode.config["InputMode"] = "File"  # the job's own mode: nothing to refuse
    assert estimator().to_spec(same_mode).inputs == {"training": "s3://b-ucket/train"}
    other_mode = training_input()
    other_mode.config["InputMode"] = "Pipe"
    with pytest.raises(DtrainError, match="one input mode for the job"):
        estimator().to_spec(other_mode)
    with pytest.raises(DtrainError, match="asks for S3DataDistributionType 'ShardedByS3Key'"):
        estimator().to_spec(training_input(S3DataDistributionType="ShardedByS3Key"))
    with pytest.raises(DtrainError, match="asks for S3DataType 'ManifestFile'"):
        estimator().to_spec(training_input(S3DataType="ManifestFile"))
    # what changes the bytes a host gets (they were dropped: a gzip channel arrived compressed)
    gzip = training_input(AttributeNames=["label"])
    gzip.config.update(CompressionType="Gzip", RecordWrapperType="None", ContentType=None)
    with pytest.raises(DtrainError, match=r"sets AttributeNames, CompressionType, which a dtrain "
                                          r"channel does not carry .*; drop them"):
        estimator().to_spec(gzip)
    shuffled = training_input()
    shuffled.config["ShuffleConfig"] = {"Seed": 3}
    with pytest.raises(DtrainError, match=r"sets ShuffleConfig, .*; drop it, and decompress"):
        estimator().to_spec(shuffled)


def test_to_model_trainer_without_the_sdk_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "sagemaker", None)  # as if the extra were not installed
    spec = estimator().to_spec()
    with pytest.raises(DtrainError, match=r"pip install 'dtrain\[sagemaker\]'"):
        to_model_trainer(spec)


@pytest.mark.sagemaker_sdk
def test_to_model_trainer_with_the_sdk_matches_the_request(moto_aws, monkeypatch):  # noqa: F811
    """Opt-in (``pytest -m sagemaker_sdk``): needs the `sagemaker` extra, which the dev install
    leaves out (SageMaker SDK v3 needs a newer boto3 than moto's pin and a large dependency set)."""
    monkeypatch.setenv("SAGEMAKER_VALIDATE_ROLE", "false")  # moto cannot simulate IAM policies
    from dtrain.spec.model import JobSpec

    spec = JobSpec.from_file(ROOT / "examples" / "sagemaker-p4d.yaml")
    trainer = to_model_trainer(spec)
    assert (trainer.compute.instance_type, trainer.compute.instance_count) == ("ml.p4d.24xlarge", 2)
    assert trainer.compute.enable_managed_spot_training is True
    assert trainer.stopping_condition.max_wait_time_in_seconds == 3 * 86400
    assert trainer.distributed.process_count_per_node == 8
    assert trainer.hyperparameters["dtrain_distribution"]["sharding_degree"] == 8


@pytest.mark.sagemaker_sdk
def test_the_image_table_agrees_with_the_sdk_lookup_for_every_version_and_region_it_knows():
    """Opt-in, as above: ``dtrain.core.aws_images`` is a dated copy of what the SDK's
    ``image_uris.retrieve`` knows; each version and region in it must give the same registry,
    repository and Python version as the SDK (the SDK's tag is the short alias of ours)."""
    from dtrain.core import aws_images
    from sagemaker.core import image_uris

    for version, (py_version, tag) in aws_images.IMAGES.items():
        for region in aws_images.REGISTRIES:
            sdk = image_uris.retrieve("pytorch", region=region, version=version,
                                      instance_type="ml.p4d.24xlarge", image_scope="training")
            ours = aws_images.training_image_uri(version, region)
            assert ours.split(":")[0] == sdk.split(":")[0], (version, region)
            assert sdk.split(":")[1] == f"{version}-gpu-{py_version}", (version, region)
            assert aws_images.short_version(tag.split("-")[0]) == version
