"""`dtrain` as a user runs it, against a moto server: submit, status, logs, dry run, bad input.

Every command is a real ``python -m dtrain.cli.main`` subprocess that reaches moto only through
``AWS_ENDPOINT_URL`` (set by the ``moto_aws`` fixture), as a CI job would.
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
import time
from functools import partial
from pathlib import Path

import _cli
import pytest
from dtrain.testing import moto_aws  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sagemaker-p4d.yaml"
BUCKET = "dtrain-e2e"

dtrain = partial(_cli.dtrain, timeout=120)


def source_with_secrets(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(ROOT / "examples" / "sagemaker_src", src)
    (src / ".env").write_text("AWS_SECRET_ACCESS_KEY=nope\n")
    (src / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    return src


def overrides(src: Path, role: str) -> list[str]:
    sets = [f"source_dir={src}", f"output_path=s3://{BUCKET}/dtrain",
            f"inputs.train=s3://{BUCKET}/data/train", f"inputs.validation=s3://{BUCKET}/data/val",
            f"checkpoint.uri=s3://{BUCKET}/ckpt", f"sagemaker.role={role}"]
    return [arg for item in sets for arg in ("--set", item)]


@pytest.fixture
def submitted(moto_aws, tmp_path):  # noqa: F811
    moto_aws.s3.create_bucket(Bucket=BUCKET)
    src = source_with_secrets(tmp_path)
    done = dtrain("submit", "--target", "sagemaker", str(EXAMPLE),
                  *overrides(src, moto_aws.role_arn), "--no-wait", "-o", "json")
    return moto_aws, json.loads(done.stdout), done.stderr


def test_submit_uploads_code_without_secrets_and_creates_the_job(submitted):
    aws, record, stderr = submitted
    name = record["name"]
    key = f"dtrain/{name}/source/sourcedir.tar.gz"
    body = aws.s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as tar:
        assert tar.getnames() == ["train.py"]
    assert "not packing .env" in stderr and "not packing id_rsa" in stderr
    job = aws.sagemaker.describe_training_job(TrainingJobName=name)
    assert (job["ResourceConfig"]["InstanceType"], job["ResourceConfig"]["InstanceCount"]) == \
        ("ml.p4d.24xlarge", 2)
    assert job["EnableManagedSpotTraining"] is True
    assert job["StoppingCondition"]["MaxWaitTimeInSeconds"] == 3 * 86400
    assert job["CheckpointConfig"] == {"S3Uri": f"s3://{BUCKET}/ckpt",
                                       "LocalPath": "/opt/ml/checkpoints"}
    assert job["HyperParameters"]["model"] == '"pythia-1b"'
    assert json.loads(job["HyperParameters"]["dtrain_distribution"])["sharding_degree"] == 8
    # moto answers MetricDefinitions with its own fixed list; the dry run shows what is sent
    assert job["AlgorithmSpecification"]["MetricDefinitions"]


def test_status_and_logs_come_from_the_store_and_cloudwatch(submitted):
    aws, record, _ = submitted
    group, now = "/aws/sagemaker/TrainingJobs", int(time.time() * 1000)
    aws.logs.create_log_group(logGroupName=group)
    for i, host in enumerate(("algo-1", "algo-2")):
        stream = f"{record['name']}/{host}-1700000000"
        aws.logs.create_log_stream(logGroupName=group, logStreamName=stream)
        aws.logs.put_log_events(logGroupName=group, logStreamName=stream, logEvents=[
            {"timestamp": now + i, "message": f"[{host} {8 * i}]: dtrain-metrics step=1 loss=2"}])
    status = json.loads(dtrain("status", record["id"], "-o", "json").stdout)
    assert status["status"] == "Completed"
    assert status["target_data"]["model_data"].endswith("/output/model.tar.gz")
    lines = dtrain("logs", record["id"]).stdout.splitlines()
    assert lines == ["[algo-1 0]: dtrain-metrics step=1 loss=2",
                     "[algo-2 8]: dtrain-metrics step=1 loss=2"]
    assert dtrain("logs", record["id"], "--host", "algo-2").stdout.splitlines() == lines[1:]
    other = dtrain("logs", record["id"], "--host", "algo-3", check=False)
    assert other.returncode == 2
    assert other.stderr == (f"error: --host 'algo-3': job {record['id']} runs on algo-1, "
                            "algo-2\n")
    listed = json.loads(dtrain("list", "-o", "json").stdout)
    assert [r["id"] for r in listed] == [record["id"]]


def test_logs_of_a_job_that_wrote_none_say_so_without_an_error(submitted):
    # a job that ended before its container started has no log streams: "cloudwatch:/aws/..."
    # was taken for a deleted local folder ("... which held its logs, no longer exists"), exit 1
    _, record, _ = submitted
    empty = dtrain("logs", record["id"], check=False)
    assert (empty.returncode, empty.stdout) == (0, "")
    assert empty.stderr == f"no log lines (it ended Completed) in job {record['id']}\n"


def test_dry_run_prints_the_create_training_job_request(moto_aws):  # noqa: F811
    done = dtrain("submit", "--dry-run", "--target", "sagemaker", str(EXAMPLE), "-o", "json")
    request = json.loads(done.stdout)["request"]
    golden = json.loads((ROOT / "tests" / "golden" / "sagemaker_p4d_request.json").read_text())
    name = request["job"]["name"]
    assert name.startswith("pythia-1b-p4d-") and request["target"] == "sagemaker"
    payload = request["payload"]  # the CreateTrainingJob kwargs
    assert payload["TrainingJobName"] == name
    assert payload["ResourceConfig"] == golden["ResourceConfig"]
    assert payload["AlgorithmSpecification"] == golden["AlgorithmSpecification"]
    prefix = f"s3://dtrain-example-bucket/dtrain/{name}/source/"
    assert [u["uri"] for u in request["uploads"]] == [
        prefix + "sourcedir.tar.gz", prefix + "dtrain-0.1.0-py3-none-any.whl",
        prefix + "sagemaker_entry.sh"]
    assert moto_aws.sagemaker.list_training_jobs()["TrainingJobSummaries"] == []


@pytest.mark.parametrize("setting, message", [
    ("sagemaker.role=null", "sagemaker.role: required for target sagemaker"),
    ("sagemaker.role=my-role", "sagemaker.role: 'my-role' is not an IAM role ARN"),
    ("compute.instance_type=p5e.48xlarge", "is not offered for SageMaker training"),
])
def test_bad_spec_is_one_line_before_any_call(moto_aws, setting, message):  # noqa: F811
    done = dtrain("submit", "--target", "sagemaker", str(EXAMPLE), "--set", setting, check=False)
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_missing_bucket_is_one_line_and_creates_nothing(moto_aws, tmp_path):  # noqa: F811
    src = source_with_secrets(tmp_path)
    done = dtrain("submit", "--target", "sagemaker", str(EXAMPLE),
                  *overrides(src, moto_aws.role_arn), check=False)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"error: output_path: bucket '{BUCKET}' does not exist; "
                                   f"create it (aws s3 mb s3://{BUCKET}) or fix output_path")
    assert moto_aws.sagemaker.list_training_jobs()["TrainingJobSummaries"] == []
    assert [b["Name"] for b in moto_aws.s3.list_buckets()["Buckets"]] == []
