"""The SageMaker launcher against a moto server: uploads, the created job, logs, cleanup.

moto completes training jobs at once and has no StopTrainingJob; the stop test answers that one
operation with a botocore ``before-call`` handler (a test double for exactly that call).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from botocore.exceptions import ClientError
from dtrain.core.errors import DtrainError
from dtrain.jobs.store import JobStore
from dtrain.launcher.sagemaker.launcher import SageMakerLauncher
from dtrain.planning.planner import plan
from dtrain.spec.model import JobSpec
from dtrain.testing import moto_aws  # noqa: F401  (the fixture under test)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sagemaker-p4d.yaml"

BUCKET = "dtrain-test-bucket"
SECRETS = (".env", "id_rsa", "deploy.pem", ".aws/credentials", "credentials")


def make_source(root):
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("print('hi')\n")
    (root / "pkg" / "util.py").write_text("X = 1\n")
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(b"0" * 10)
    (root / "notes.log").write_text("x")
    (root / ".dtrainignore").write_text("data/\n*.log\n")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core]\n")
    (root / ".aws").mkdir()
    for name in SECRETS:
        (root / name).write_text("secret\n")
    return root


def spec_for(source, *overrides):
    return JobSpec.from_file(EXAMPLE, overrides=[
        f"source_dir={source}", f"output_path=s3://{BUCKET}/dtrain",
        f"inputs.train=s3://{BUCKET}/data/train", f"inputs.validation=s3://{BUCKET}/data/val",
        f"checkpoint.uri=s3://{BUCKET}/ckpt", *overrides])


def objects(s3, prefix=""):
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
                  .get("Contents", []))


@pytest.fixture
def submitted(moto_aws, tmp_path):  # noqa: F811
    moto_aws.s3.create_bucket(Bucket=BUCKET)
    spec = spec_for(make_source(tmp_path / "src"))
    err = io.StringIO()
    sent = []
    client = moto_aws.client("sagemaker")
    client.meta.events.register("provide-client-params.sagemaker.CreateTrainingJob",
                                lambda params, **_: sent.append(dict(params)))
    # s3 and logs clients come from AWS_ENDPOINT_URL, as in the CLI
    launcher = SageMakerLauncher(sagemaker_client=client, stream=err)
    request = launcher.build_request(plan(spec))
    record = launcher.submit(request, store=JobStore())
    facts = {"job_name": record.name, "record": record, "sent": sent[0]}
    return moto_aws, launcher, facts, err.getvalue()


def test_submit_uploads_code_without_secrets_and_creates_the_job(submitted):
    aws, _, facts, err = submitted
    name = facts["job_name"]
    keys = objects(aws.s3, "dtrain/")
    prefix = f"dtrain/{name}/source/"
    assert keys == [prefix + "dtrain-0.1.0-py3-none-any.whl", prefix + "sagemaker_entry.sh",
                    prefix + "sourcedir.tar.gz"]
    body = aws.s3.get_object(Bucket=BUCKET, Key=prefix + "sourcedir.tar.gz")["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as tar:
        assert sorted(tar.getnames()) == [".dtrainignore", "pkg/util.py", "train.py"]
    for secret in (".env", "id_rsa", "deploy.pem", ".aws/", "credentials"):
        assert f"not packing {secret}" in err


def test_submitted_job_is_in_the_store_with_arn_and_uploads(submitted):
    _, _, facts, _ = submitted
    record = JobStore().find(facts["job_name"])
    assert record.target == "sagemaker" and record.status == "Starting"
    assert record.target_data["arn"].endswith(f"training-job/{facts['job_name']}")
    assert len(record.target_data["uploads"]) == 3
    assert record.output_location.endswith(f"/{facts['job_name']}/output/model.tar.gz")


def test_created_job_carries_instances_spot_checkpoint_hyperparameters_and_metrics(submitted):
    aws, _, facts, _ = submitted
    job = aws.sagemaker.describe_training_job(TrainingJobName=facts["job_name"])
    assert job["ResourceConfig"]["InstanceType"] == "ml.p4d.24xlarge"
    assert job["ResourceConfig"]["InstanceCount"] == 2
    assert job["EnableManagedSpotTraining"] is True
    assert job["CheckpointConfig"]["S3Uri"] == f"s3://{BUCKET}/ckpt"
    assert json.loads(job["HyperParameters"]["dtrain_distribution"])["sharding_degree"] == 8
    assert job["HyperParameters"]["lr"] == "0.0003"
    # moto replaces MetricDefinitions with its own fixed list, so check what went over the wire
    names = [m["Name"] for m in facts["sent"]["AlgorithmSpecification"]["MetricDefinitions"]]
    assert {"loss", "tokens_per_s", "mfu"} <= set(names)


def test_status_wait_and_model_data_of_a_finished_job(submitted):
    _, launcher, facts, _ = submitted
    lines = []
    status = launcher.wait(facts["job_name"], poll_s=0, on_transition=lines.append)
    assert status["state"] == "Completed"
    assert status["model_data"].startswith("s3://")
    assert lines and lines[0].startswith(facts["job_name"] + ": Starting")


def test_status_refreshes_the_store_record(submitted):
    _, launcher, facts, _ = submitted
    record = launcher.status(facts["record"], store=JobStore())
    assert record.status == "Completed" and record.ended_at >= record.started_at > 0
    assert record.target_data["model_data"].endswith("/output/model.tar.gz")
    assert record.target_data["secondary_status"] == "Completed"


def test_logs_merge_every_host_and_filter_by_host_and_rank(submitted):
    aws, launcher, facts, _ = submitted
    name, group = facts["job_name"], "/aws/sagemaker/TrainingJobs"
    aws.logs.create_log_group(logGroupName=group)
    now = int(time.time() * 1000)  # CloudWatch rejects events older than 14 days
    for host, ts, msg in (("algo-1", 1000, "[algo-1 0]: dtrain-metrics step=1 loss=2.0"),
                          ("algo-2", 1001, "[algo-2 8]: dtrain-metrics step=1 loss=2.1"),
                          ("algo-1", 1002, "[algo-1 1]: done"),
                          ("algo-2", 1003, "dtrain-agent INFO all workers exited")):
        stream = f"{name}/{host}-1700000000"
        try:
            aws.logs.create_log_stream(logGroupName=group, logStreamName=stream)
        except ClientError:
            pass
        aws.logs.put_log_events(logGroupName=group, logStreamName=stream,
                                logEvents=[{"timestamp": now + ts, "message": msg}])
    everything = list(launcher.logs(name))
    assert everything == ["[algo-1 0]: dtrain-metrics step=1 loss=2.0",
                          "[algo-2 8]: dtrain-metrics step=1 loss=2.1",
                          "[algo-1 1]: done",
                          "[algo-2] dtrain-agent INFO all workers exited"]
    assert list(launcher.logs(name, host="algo-2")) == [everything[1], everything[3]]
    assert list(launcher.logs(name, rank=1)) == [everything[2]]
    assert list(launcher.logs(name, follow=True, poll_s=0)) == everything  # job already ended


def test_stop_calls_stop_training_job(submitted):
    aws, _, facts, _ = submitted
    client = aws.client("sagemaker")
    calls = []

    def answer_stop(params, **_):  # moto has no StopTrainingJob: answer it here, in the test
        calls.append(json.loads(params["body"])["TrainingJobName"])
        return SimpleNamespace(status_code=200, headers={}), {}

    client.meta.events.register("before-call.sagemaker.StopTrainingJob", answer_stop)
    store = JobStore()
    running = store.update(facts["record"].id, status="Running")
    record = SageMakerLauncher(sagemaker_client=client).stop(running, store=store)
    assert calls == [facts["job_name"]]
    assert record.status == "Stopping"


def test_missing_bucket_fails_before_any_upload(moto_aws, tmp_path):  # noqa: F811
    launcher = SageMakerLauncher(stream=io.StringIO())
    request = launcher.build_request(plan(spec_for(make_source(tmp_path / "src"))))
    with pytest.raises(DtrainError, match=f"bucket '{BUCKET}' does not exist; create it"):
        launcher.submit(request, store=JobStore())
    assert moto_aws.sagemaker.list_training_jobs()["TrainingJobSummaries"] == []


def test_forbidden_default_bucket_is_one_line_and_never_created(moto_aws):  # noqa: F811
    # 403: another account owns the name, or s3:ListBucket is missing; only a 404 creates it
    s3, created = moto_aws.s3, []

    def forbidden(**_):
        raise ClientError({"Error": {"Code": "403", "Message": "Forbidden"}}, "HeadBucket")

    s3.meta.events.register("before-call.s3.HeadBucket", forbidden)
    s3.meta.events.register("before-call.s3.CreateBucket", lambda **_: created.append(True))
    with pytest.raises(DtrainError, match="checking bucket sagemaker-us-east-1-123456789012 "
                                          "failed: 403: Forbidden"):
        SageMakerLauncher(s3_client=s3).default_output_path()
    assert created == []


@pytest.mark.parametrize("code", ["ResourceLimitExceeded", "ValidationException"])
def test_rejected_job_is_one_line_and_leaves_no_upload_behind(moto_aws, tmp_path, code):  # noqa: F811
    moto_aws.s3.create_bucket(Bucket=BUCKET)
    client = moto_aws.client("sagemaker")

    def reject(**_):
        raise ClientError({"Error": {"Code": code, "Message": "ml.p4d.24xlarge: limit is 0"}},
                          "CreateTrainingJob")

    client.meta.events.register("before-call.sagemaker.CreateTrainingJob", reject)
    launcher = SageMakerLauncher(sagemaker_client=client, stream=io.StringIO())
    request = launcher.build_request(plan(spec_for(make_source(tmp_path / "src"))))
    with pytest.raises(DtrainError) as info:
        launcher.submit(request, store=JobStore())
    assert f"{code}: ml.p4d.24xlarge: limit is 0" in str(info.value)
    assert "\n" not in str(info.value)
    assert objects(moto_aws.s3) == []
    failed = JobStore().find(request["TrainingJobName"])
    assert failed.status == "Failed" and code in failed.failure_reason


def test_runtime_wheel_installs_and_imports_the_contract(tmp_path):
    from dtrain.launcher.packaging import build_runtime_wheel

    wheel = build_runtime_wheel(tmp_path / "w")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"dtrain/core/contract.py", "dtrain/runtime/__main__.py",
            "dtrain/launcher/sagemaker/sagemaker_entry.sh"} <= set(names)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                    "--target", str(target), str(wheel)], check=True)
    out = subprocess.run([sys.executable, "-c", "import dtrain.core.contract as c; print(c.__file__)"],
                         env={"PYTHONPATH": str(target)}, capture_output=True, text=True,
                         check=True, cwd=tmp_path)
    assert out.stdout.startswith(str(target))


REASON = "AlgorithmError: rank 3 on algo-1 exited with code 1: CUDA out of memory"


def answer_describe_as_failed(client, name):
    """moto completes every job at once: answer DescribeTrainingJob with a failed job instead."""
    def failed(**_):
        return SimpleNamespace(status_code=200, headers={}), {
            "TrainingJobName": name, "TrainingJobStatus": "Failed", "SecondaryStatus": "Failed",
            "FailureReason": REASON, "ResourceConfig": {"InstanceType": "ml.p4d.24xlarge",
                                                        "InstanceCount": 2},
            "SecondaryStatusTransitions": [{"Status": "Starting", "StatusMessage": "Starting"},
                                           {"Status": "Failed", "StatusMessage": REASON}]}

    client.meta.events.register("before-call.sagemaker.DescribeTrainingJob", failed)


def test_failure_reason_reaches_the_store_verbatim(submitted):
    aws, _, facts, _ = submitted
    client = aws.client("sagemaker")
    answer_describe_as_failed(client, facts["job_name"])
    launcher = SageMakerLauncher(sagemaker_client=client)
    record = launcher.status(facts["record"], store=JobStore())
    assert (record.status, record.failure_reason) == ("Failed", REASON)
    shown = []
    launcher.wait(facts["job_name"], poll_s=0, on_transition=shown.append)
    assert shown[-1] == f"{facts['job_name']}: Failed - {REASON}"


def test_estimator_fit_raises_the_failure_reason_and_attach_finds_the_job(submitted):
    from dtrain.sagemaker import PyTorch

    aws, _, facts, _ = submitted
    attached = PyTorch.attach(facts["job_name"], launcher=SageMakerLauncher(
        sagemaker_client=aws.client("sagemaker"), stream=io.StringIO()))
    assert attached.instance_count == 2 and attached.entry_point == "train.py"
    assert attached.model_data.endswith(f"{facts['job_name']}/output/model.tar.gz")
    answer_describe_as_failed(aws.client("sagemaker"), facts["job_name"])
    with pytest.raises(DtrainError, match="CUDA out of memory"):
        attached.wait()
