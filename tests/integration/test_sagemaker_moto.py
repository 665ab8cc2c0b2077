"""The SageMaker target through the jobs layer against a moto server: uploads, the created job,
status, logs, stop, cleanup after a failed submission, and the SDK shim's fit and attach.

moto completes training jobs at once and has no StopTrainingJob; tests that need a running job
or a stop answer those operations with a botocore ``before-call`` handler (a test double for
exactly that call).
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
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ClientError
from dtrain.core.errors import DtrainError
from dtrain.jobs import api as jobs
from dtrain.jobs.store import JobStore
from dtrain.launcher.sagemaker.launcher import SageMakerLauncher
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


def capture_create(client) -> list[dict]:
    """What goes over the wire to CreateTrainingJob (moto rewrites some of it in its answers)."""
    sent: list[dict] = []
    client.meta.events.register("provide-client-params.sagemaker.CreateTrainingJob",
                                lambda params, **_: sent.append(dict(params)))
    return sent


@pytest.fixture
def submitted(moto_aws, tmp_path):  # noqa: F811
    moto_aws.s3.create_bucket(Bucket=BUCKET)
    spec = spec_for(make_source(tmp_path / "src"))
    err = io.StringIO()
    client = moto_aws.client("sagemaker")
    sent = capture_create(client)
    # s3 and logs clients come from AWS_ENDPOINT_URL, as in the CLI
    clients = {"sagemaker_client": client, "stream": err}
    record = jobs.submit(spec, wait=False, clients=clients)
    facts = {"job_name": record.name, "record": record, "sent": sent[0], "clients": clients}
    return moto_aws, facts, err.getvalue()


def test_submit_uploads_code_without_secrets_and_creates_the_job(submitted):
    aws, facts, err = submitted
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


def test_submitted_job_is_in_the_store_with_its_sagemaker_state(submitted):
    _, facts, _ = submitted
    name = facts["job_name"]
    record = JobStore().get(facts["record"].id)
    assert record.target == "sagemaker" and record.status == "Starting"
    assert name.startswith("pythia-1b-p4d-") and len(name) == len("pythia-1b-p4d-") + len("YYYYmmdd-HHMMSS-mmm")
    state = record.target_data
    assert (state["training_job_name"], state["region"]) == (name, "us-east-1")
    assert state["arn"].endswith(f"training-job/{name}")
    assert state["console_url"] == ("https://us-east-1.console.aws.amazon.com/sagemaker/home"
                                    f"?region=us-east-1#/jobs/{name}")
    prefix = f"s3://{BUCKET}/dtrain/{name}/source/"
    assert state["uploads"] == [prefix + "sourcedir.tar.gz",
                                prefix + "dtrain-0.1.0-py3-none-any.whl",
                                prefix + "sagemaker_entry.sh"]
    assert record.output_location == f"s3://{BUCKET}/dtrain/{name}/output/model.tar.gz"
    assert record.log_location == f"cloudwatch:/aws/sagemaker/TrainingJobs/{name}/"


def test_dry_run_request_is_exactly_what_submit_sends(moto_aws, tmp_path):  # noqa: F811
    moto_aws.s3.create_bucket(Bucket=BUCKET)
    spec = spec_for(make_source(tmp_path / "src"))
    client = moto_aws.client("sagemaker")
    sent = capture_create(client)
    clients = {"sagemaker_client": client, "stream": io.StringIO()}
    request = jobs.submit(spec, dry_run=True, clients=clients)
    assert moto_aws.sagemaker.list_training_jobs()["TrainingJobSummaries"] == []
    record = jobs.submit(spec, wait=False, clients=clients, job=request.job)
    assert sent == [request.payload]
    assert (record.id, record.name) == (request.job.id, request.job.name)
    assert record.target_data["uploads"] == [upload.uri for upload in request.uploads]


def test_created_job_carries_instances_spot_checkpoint_hyperparameters_and_metrics(submitted):
    aws, facts, _ = submitted
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


def test_status_and_wait_record_the_end_model_data_and_transitions(submitted):
    _, facts, _ = submitted
    record = jobs.get(facts["record"].id, clients=facts["clients"])
    assert record.status == "Completed" and record.ended_at >= record.started_at > 0
    assert record.target_data["model_data"].endswith("/output/model.tar.gz")
    assert record.target_data["secondary_status"] == "Completed"
    assert record.target_data["transitions"][0]["status"] == "Starting"
    assert jobs.wait_for(record.id, clients=facts["clients"], poll_s=0) == JobStore().get(record.id)


def test_logs_merge_every_host_and_filter_by_host_and_rank(submitted):
    aws, facts, _ = submitted
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
    job_id, clients = facts["record"].id, facts["clients"]
    everything = list(jobs.logs(job_id, clients=clients))
    assert everything == ["[algo-1 0]: dtrain-metrics step=1 loss=2.0",
                          "[algo-2 8]: dtrain-metrics step=1 loss=2.1",
                          "[algo-1 1]: done",
                          "[algo-2] dtrain-agent INFO all workers exited"]
    assert list(jobs.logs(job_id, host="algo-2", clients=clients)) == [everything[1],
                                                                       everything[3]]
    assert list(jobs.logs(job_id, rank=1, clients=clients)) == [everything[2]]
    # the job has already ended: following reads everything once more, then stops
    assert list(jobs.logs(job_id, follow=True, clients=clients)) == everything


def answer_describe(client, name, *answers):
    """moto completes every job at once: answer DescribeTrainingJob with ``answers`` instead,
    ``(status, secondary status, failure reason)``, one per call, the last one from then on."""
    pending = list(answers)

    def describe(**_):
        status, secondary, reason = pending.pop(0) if len(pending) > 1 else pending[0]
        return SimpleNamespace(status_code=200, headers={}), {
            "TrainingJobName": name, "TrainingJobStatus": status, "SecondaryStatus": secondary,
            "TrainingJobArn": f"arn:aws:sagemaker:us-east-1:123456789012:training-job/{name}",
            **({"FailureReason": reason} if reason else {}),
            "ResourceConfig": {"InstanceType": "ml.p4d.24xlarge", "InstanceCount": 2},
            "SecondaryStatusTransitions": [{"Status": "Starting", "StatusMessage": "Starting"},
                                           {"Status": secondary,
                                            "StatusMessage": reason or secondary}]}

    client.meta.events.register("before-call.sagemaker.DescribeTrainingJob", describe)


def answer_stop(client, error: str | None = None) -> list[str]:
    """moto has no StopTrainingJob: answer it here (or refuse it with ``error``)."""
    calls: list[str] = []

    def stop(params, **_):
        calls.append(json.loads(params["body"])["TrainingJobName"])
        if error:
            raise ClientError({"Error": {"Code": "ValidationException", "Message": error}},
                              "StopTrainingJob")
        return SimpleNamespace(status_code=200, headers={}), {}

    client.meta.events.register("before-call.sagemaker.StopTrainingJob", stop)
    return calls


def test_stop_calls_stop_training_job_on_a_running_job(submitted):
    aws, facts, _ = submitted
    client = aws.client("sagemaker")
    answer_describe(client, facts["job_name"], ("InProgress", "Training", None))
    calls = answer_stop(client)
    record = jobs.stop(facts["record"].id, clients=facts["clients"])
    assert calls == [facts["job_name"]]
    assert record.status == "Stopping"
    # SageMaker still says InProgress for a moment: the job stays Stopping, not Running again
    assert jobs.get(record.id, clients=facts["clients"]).status == "Stopping"


@pytest.mark.parametrize("now", ["Completed", "Stopping"])
def test_stop_refused_for_a_job_that_ended_or_is_stopping_meanwhile_records_that(submitted,
                                                                                 now):
    aws, facts, _ = submitted
    client = aws.client("sagemaker")
    answer_describe(client, facts["job_name"], ("InProgress", "Training", None),
                    (now, now, None))
    calls = answer_stop(client, error=f"The training job is in status {now}")
    record = jobs.stop(facts["record"].id, clients=facts["clients"])
    assert calls == [facts["job_name"]]
    assert record.status == now and record.failure_reason is None


def test_stop_refused_for_a_running_job_is_one_line(submitted):
    aws, facts, _ = submitted
    client = aws.client("sagemaker")
    answer_describe(client, facts["job_name"], ("InProgress", "Training", None))
    answer_stop(client, error="User is not authorized")
    with pytest.raises(DtrainError, match=f"^StopTrainingJob {facts['job_name']} failed: "
                                          "ValidationException: User is not authorized"):
        jobs.stop(facts["record"].id, clients=facts["clients"])
    assert JobStore().get(facts["record"].id).status == "Running"


@pytest.mark.parametrize("during", ["the upload", "CreateTrainingJob"])
def test_a_stop_while_submitting_is_delivered_and_never_leaves_a_job_running(
        moto_aws, tmp_path, during):  # noqa: F811
    moto_aws.s3.create_bucket(Bucket=BUCKET)
    client, s3 = moto_aws.client("sagemaker"), moto_aws.client("s3")
    clients = {"sagemaker_client": client, "s3_client": s3, "stream": io.StringIO()}
    stopped = []

    def stop_now(**_):  # `dtrain stop` from another terminal, once per submit
        if not stopped:
            [record] = JobStore().list()
            stopped.append(jobs.stop(record.id, clients=clients))

    if during == "the upload":  # as the last file (the entry script) goes up
        s3.meta.events.register("provide-client-params.s3.PutObject", lambda params, **_: stop_now()
                                if params["Key"].endswith("/sagemaker_entry.sh") else None)
    else:  # the stop finds no job yet; SageMaker creates it after
        client.meta.events.register("before-call.sagemaker.CreateTrainingJob", stop_now)
    calls = answer_stop(client)
    record = jobs.submit(spec_for(make_source(tmp_path / "src")), wait=False, clients=clients)
    assert stopped[0].status == "Stopping"  # recorded; the submit under way delivers it
    if during == "the upload":  # no job, and the code it uploaded is gone
        assert (record.status, record.failure_reason) == ("Stopped", "stopped by user")
        assert moto_aws.sagemaker.list_training_jobs()["TrainingJobSummaries"] == []
        assert objects(moto_aws.s3) == [] and calls == []
    else:  # created meanwhile: the submit stops it, the record stays Stopping till it ends
        assert calls == [record.name]
        assert record.status == "Stopping" and record.target_data["arn"]
        assert record.failure_reason == "stopped by user"


@pytest.mark.parametrize("whose", ["this submit's", "another job's"])
def test_a_retried_create_refused_as_a_duplicate_adopts_the_job_its_first_try_made(
        moto_aws, tmp_path, whose):  # noqa: F811
    import boto3

    moto_aws.s3.create_bucket(Bucket=BUCKET)
    client = boto3.client("sagemaker", region_name=moto_aws.region,
                          endpoint_url=moto_aws.endpoint)  # hooked; moto_aws.sagemaker is not
    sent = capture_create(client)

    def first_try_made_it(**_):
        # botocore retried a call whose answer was lost: SageMaker made the job on the first
        # try and refuses the retry (moto has no retries; this double plays exactly that)
        made = dict(sent[0])
        if whose == "another job's":  # a job of the same name, from another request
            made["HyperParameters"] = {**made["HyperParameters"], "lr": "0.5"}
        moto_aws.sagemaker.create_training_job(**made)
        raise ClientError({"Error": {"Code": "ResourceInUse", "Message": "Training job names "
                                     "must be unique within an AWS account and region"}},
                          "CreateTrainingJob")

    client.meta.events.register("before-call.sagemaker.CreateTrainingJob", first_try_made_it)
    spec = spec_for(make_source(tmp_path / "src"))
    clients = {"sagemaker_client": client, "stream": io.StringIO()}
    if whose == "another job's":
        with pytest.raises(DtrainError, match="ResourceInUse: Training job names must be unique"):
            jobs.submit(spec, wait=False, clients=clients)
        assert JobStore().list()[0].status == "Failed"
        return
    record = jobs.submit(spec, wait=False, clients=clients)
    assert record.status == "Starting" and record.target_data["arn"].endswith(record.name)
    assert any(key.endswith("/sagemaker_entry.sh") for key in objects(moto_aws.s3))  # code kept


def test_a_stop_the_submit_could_not_deliver_is_delivered_by_the_next_status(
        moto_aws, tmp_path):  # noqa: F811
    moto_aws.s3.create_bucket(Bucket=BUCKET)
    client = moto_aws.client("sagemaker")
    clients = {"sagemaker_client": client, "stream": io.StringIO()}

    def stop_now(**_):  # `dtrain stop` from another terminal while SageMaker creates the job
        [record] = JobStore().list()
        jobs.stop(record.id, clients=clients)

    def in_progress(params, **_):  # moto completes a job at once; this one trains on
        name = json.loads(params["body"])["TrainingJobName"]
        return SimpleNamespace(status_code=200, headers={}), {
            "TrainingJobName": name, "TrainingJobStatus": "InProgress",
            "SecondaryStatus": "Training",
            "TrainingJobArn": f"arn:aws:sagemaker:us-east-1:123456789012:training-job/{name}"}

    client.meta.events.register("before-call.sagemaker.CreateTrainingJob", stop_now)
    client.meta.events.register("before-call.sagemaker.DescribeTrainingJob", in_progress)
    stops: list[str] = []

    def stop_training_job(params, **_):  # moto has none: refused while the submit runs
        stops.append(json.loads(params["body"])["TrainingJobName"])
        if refusing:
            raise ClientError({"Error": {"Code": "ThrottlingException",
                                         "Message": "Rate exceeded"}}, "StopTrainingJob")
        return SimpleNamespace(status_code=200, headers={}), {}

    refusing = True
    client.meta.events.register("before-call.sagemaker.StopTrainingJob", stop_training_job)
    record = jobs.submit(spec_for(make_source(tmp_path / "src")), wait=False, clients=clients)
    assert set(stops) == {record.name} and record.status == "Stopping"
    assert "stopping it failed" in clients["stream"].getvalue()
    refusing, stops[:] = False, []
    assert jobs.get(record.id, clients=clients).status == "Stopping"
    assert stops == [record.name]  # the status delivered it


def test_missing_bucket_fails_before_any_upload(moto_aws, tmp_path):  # noqa: F811
    spec = spec_for(make_source(tmp_path / "src"))
    with pytest.raises(DtrainError, match=f"bucket '{BUCKET}' does not exist; create it"):
        jobs.submit(spec, wait=False, clients={"stream": io.StringIO()})
    assert moto_aws.sagemaker.list_training_jobs()["TrainingJobSummaries"] == []
    [failed] = JobStore().list()
    assert failed.status == "Failed" and f"bucket '{BUCKET}' does not exist" in \
        failed.failure_reason


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
    spec = spec_for(make_source(tmp_path / "src"))
    with pytest.raises(DtrainError) as info:
        jobs.submit(spec, wait=False, clients={"sagemaker_client": client,
                                               "stream": io.StringIO()})
    assert f"{code}: ml.p4d.24xlarge: limit is 0" in str(info.value)
    assert "\n" not in str(info.value)
    assert objects(moto_aws.s3) == []
    [failed] = JobStore().list()
    assert failed.status == "Failed" and code in failed.failure_reason


def test_a_failed_upload_is_one_line_and_removes_what_was_uploaded(moto_aws, tmp_path):  # noqa: F811
    moto_aws.s3.create_bucket(Bucket=BUCKET)
    s3 = moto_aws.client("s3")

    def deny_entry_script(params, **_):
        if params["Key"].endswith("/sagemaker_entry.sh"):
            raise ClientError({"Error": {"Code": "AccessDenied", "Message": "denied"}},
                              "PutObject")

    s3.meta.events.register("provide-client-params.s3.PutObject", deny_entry_script)
    spec = spec_for(make_source(tmp_path / "src"))
    with pytest.raises(DtrainError) as info:
        jobs.submit(spec, wait=False, clients={"s3_client": s3, "stream": io.StringIO()})
    message = str(info.value)
    assert message.startswith("uploading sagemaker_entry.sh to s3://") and message.endswith(
        "failed: AccessDenied: denied; check the IAM permissions of your AWS credentials")
    assert "\n" not in message
    assert objects(moto_aws.s3) == []  # the archive and the wheel went up first: removed again
    assert moto_aws.sagemaker.list_training_jobs()["TrainingJobSummaries"] == []
    [failed] = JobStore().list()
    assert failed.status == "Failed" and failed.failure_reason == message


def test_a_local_error_while_packing_is_one_line_and_removes_the_uploads(moto_aws, tmp_path,  # noqa: F811
                                                                         monkeypatch):
    from dtrain.launcher import packaging

    moto_aws.s3.create_bucket(Bucket=BUCKET)

    def disk_full(dest_dir):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(packaging, "build_runtime_wheel", disk_full)  # after the source archive
    spec = spec_for(make_source(tmp_path / "src"))
    with pytest.raises(DtrainError, match=r"^uploading the code of pythia-1b-p4d-\S+ failed: "
                                          r"\[Errno 28\] No space left on device$"):
        jobs.submit(spec, wait=False, clients={"stream": io.StringIO()})
    assert objects(moto_aws.s3) == []


def test_a_job_in_the_specs_region_is_created_and_asked_about_there(moto_aws, tmp_path):  # noqa: F811
    import boto3

    moto_aws.s3.create_bucket(Bucket=BUCKET)
    spec = spec_for(make_source(tmp_path / "src"), "sagemaker.region=eu-west-1")
    record = jobs.submit(spec, wait=False, clients={"stream": io.StringIO()})  # env: us-east-1
    assert record.target_data["region"] == "eu-west-1"
    assert "region=eu-west-1" in record.target_data["console_url"]
    there = boto3.client("sagemaker", region_name="eu-west-1", endpoint_url=moto_aws.endpoint)
    assert [j["TrainingJobName"] for j in there.list_training_jobs()["TrainingJobSummaries"]] \
        == [record.name]
    assert moto_aws.sagemaker.list_training_jobs()["TrainingJobSummaries"] == []
    assert jobs.get(record.id).status == "Completed"


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


def test_failure_reason_reaches_the_store_verbatim(submitted):
    aws, facts, _ = submitted
    answer_describe(aws.client("sagemaker"), facts["job_name"], ("Failed", "Failed", REASON))
    record = jobs.get(facts["record"].id, clients=facts["clients"])
    assert (record.status, record.failure_reason) == ("Failed", REASON)


def test_estimator_fit_goes_through_the_job_store_with_the_name_it_is_given(moto_aws, tmp_path,  # noqa: F811
                                                                           capsys):
    from dtrain.sagemaker import PyTorch

    moto_aws.s3.create_bucket(Bucket=BUCKET)
    client = moto_aws.client("sagemaker")
    sent = capture_create(client)
    estimator = PyTorch("train.py",
                        source_dir=str(make_source(tmp_path / "src")),
                        role=moto_aws.role_arn, instance_type="ml.p4d.24xlarge",
                        instance_count=2, output_path=f"s3://{BUCKET}/dtrain", image_uri="img:1",
                        clients={"sagemaker_client": client, "stream": io.StringIO()})
    estimator.fit(f"s3://{BUCKET}/data/train", job_name="exactly-this-name")
    assert estimator.latest_training_job == "exactly-this-name"
    assert sent == [estimator.latest_request]
    [record] = JobStore().list()
    assert (record.name, record.status) == ("exactly-this-name", "Completed")
    assert estimator.model_data == record.target_data["model_data"]
    assert "exactly-this-name: Completed" in capsys.readouterr().err
    # a name SageMaker would refuse is refused before anything is uploaded
    with pytest.raises(DtrainError, match=r"fit\(job_name='bad_name!'\): SageMaker training "
                                          r"job names are .*; e.g. 'bad-name'"):
        estimator.fit(f"s3://{BUCKET}/data/train", job_name="bad_name!")
    assert len(JobStore().list()) == 1


def test_estimator_attach_to_a_job_dtrain_submitted_uses_its_record(submitted):
    from dtrain.sagemaker import PyTorch

    _, facts, _ = submitted
    attached = PyTorch.attach(facts["job_name"], clients=facts["clients"])
    assert attached.instance_count == 2 and attached.entry_point == "train.py"
    assert JobStore().get(facts["record"].id).status == "Starting"
    assert attached.model_data.endswith(f"{facts['job_name']}/output/model.tar.gz")
    # model_data went through the jobs layer, which recorded what SageMaker said
    assert JobStore().get(facts["record"].id).status == "Completed"
    with pytest.raises(DtrainError, match="no job yet"):
        _ = PyTorch("train.py", instance_type="ml.p4d.24xlarge").model_data


def test_estimator_attach_to_a_failed_job_raises_its_failure_reason(submitted, capsys):
    from dtrain.sagemaker import PyTorch

    aws, facts, _ = submitted
    answer_describe(aws.client("sagemaker"), facts["job_name"], ("Failed", "Failed", REASON))
    attached = PyTorch.attach(facts["job_name"], clients=facts["clients"])
    with pytest.raises(DtrainError, match=f"training job {facts['job_name']} failed: {REASON}"):
        attached.wait()
    assert f"{facts['job_name']}: Failed - {REASON}" in capsys.readouterr().err
    record = JobStore().get(facts["record"].id)
    assert (record.status, record.failure_reason) == ("Failed", REASON)


def test_estimator_attach_by_name_to_a_job_started_elsewhere(submitted, capsys):
    from dtrain.sagemaker import PyTorch

    aws, facts, _ = submitted
    # a training job dtrain has no record of, as if the SageMaker SDK had started it
    aws.sagemaker.create_training_job(**{**facts["sent"], "TrainingJobName": "from-elsewhere"})
    attached = PyTorch.attach("from-elsewhere", clients=facts["clients"])
    # a name SageMaker does not have: said so (it suggested 'fix the setting named above')
    with pytest.raises(DtrainError, match=r"PyTorch.attach\('no-such-job'\): SageMaker has no "
                                          r"training job of that name"):
        PyTorch.attach("no-such-job", clients=facts["clients"])
    assert (attached.instance_type, attached.instance_count) == ("ml.p4d.24xlarge", 2)
    assert attached.model_data.endswith("from-elsewhere/output/model.tar.gz")
    attached.wait(logs=True)  # moto completed it
    assert "from-elsewhere: Completed" in capsys.readouterr().err
    client = aws.client("sagemaker")
    answer_describe(client, "from-elsewhere", ("InProgress", "Training", None))
    calls = answer_stop(client)
    attached.stop()
    assert calls == ["from-elsewhere"]
    assert [r.name for r in JobStore().list()] == [facts["job_name"]]  # nothing recorded


def test_estimator_fit_tells_which_smp_keys_dtrain_ignores(moto_aws, tmp_path):  # noqa: F811
    from dtrain.core.errors import SpecWarning
    from dtrain.sagemaker import PyTorch

    moto_aws.s3.create_bucket(Bucket=BUCKET)
    estimator = PyTorch("train.py",
                        source_dir=str(make_source(tmp_path / "src")),
                        role=moto_aws.role_arn, instance_type="ml.p4d.24xlarge",
                        instance_count=2, output_path=f"s3://{BUCKET}/dtrain", image_uri="img:1",
                        distribution={"smdistributed": {"modelparallel": {
                            "enabled": True, "parameters": {"sharded_data_parallel_degree": 8,
                                                            "placement_strategy": "cluster"}}}},
                        clients={"sagemaker_client": moto_aws.client("sagemaker"),
                                 "stream": io.StringIO()})
    with pytest.warns(SpecWarning, match="placement_strategy is not used by dtrain"):
        estimator.fit(f"s3://{BUCKET}/data/train", wait=False)


def _dead_submitter() -> dict:
    """process.describe() of a `dtrain submit` that has since been killed."""
    from dtrain.launcher import process

    proc = subprocess.Popen(["sleep", "30"])
    described = process.describe(proc.pid)
    proc.kill()
    proc.wait()
    return described


def test_a_job_whose_submit_died_is_adopted_if_sagemaker_has_it_and_lost_if_not(submitted):
    _, facts, _ = submitted
    store, clients = JobStore(), facts["clients"]
    record = facts["record"]  # SageMaker created it; the submit "died" before recording that
    store.update(record.id, target_data={"arn": None, "submitter": _dead_submitter()})
    adopted = jobs.get(record.id, clients=clients)
    assert adopted.status in ("Starting", "Running", "Completed")
    assert adopted.target_data["arn"].endswith(f"training-job/{record.name}")
    assert adopted.target_data["submitter"] is None

    never = store.create(name="pythia-1b-p4d-20261125-000000-000", target="sagemaker",
                         spec=record.spec, target_data={
                             "training_job_name": "pythia-1b-p4d-20261125-000000-000",
                             "region": "us-east-1", "submitter": _dead_submitter()})
    lost = jobs.get(never.id, clients=clients)
    assert lost.status == "Failed" and lost.failure_reason.startswith(
        "lost: `dtrain submit` ended before SageMaker created the job")

    alive = store.create(name="pythia-1b-p4d-20261125-000001-000", target="sagemaker",
                         spec=record.spec, target_data={
                             "training_job_name": "pythia-1b-p4d-20261125-000001-000",
                             "region": "us-east-1", "submitter": _this_process()})
    assert jobs.get(alive.id, clients=clients).status == "Pending"  # still submitting: no call


def test_a_job_whose_submit_ran_on_another_host_waits_an_hour_then_is_lost(submitted):
    # this machine cannot see that submit's process: it is given an hour to create the job
    _, facts, _ = submitted
    store, clients, record = JobStore(), facts["clients"], facts["record"]
    elsewhere = {**_this_process(), "host": "another-host"}
    for hours, expected in ((0.5, "Pending"), (2, "Failed")):
        name = f"pythia-1b-p4d-20261125-00000{int(hours * 2)}-000"
        job = store.create(name=name, target="sagemaker", spec=record.spec,
                           created_at=time.time() - hours * 3600, target_data={
                               "training_job_name": name, "region": "us-east-1",
                               "submitter": elsewhere})
        seen = jobs.get(job.id, clients=clients)
        assert seen.status == expected
    assert seen.failure_reason.startswith("lost: `dtrain submit` ended before SageMaker created "
                                          "the job (it ran on another-host, more than 1 h ago)")


def test_a_stop_its_dead_submit_never_delivered_is_delivered_by_status(submitted):
    aws, facts, _ = submitted
    store, clients, record = JobStore(), facts["clients"], facts["record"]
    never = store.create(name="pythia-1b-p4d-20261125-000002-000", target="sagemaker",
                         spec=record.spec, status="Stopping",
                         target_data={"training_job_name": "pythia-1b-p4d-20261125-000002-000",
                                      "region": "us-east-1", "submitter": _dead_submitter()})
    store.update(never.id, failure_reason="stopped by user")
    ended = jobs.get(never.id, clients=clients)  # it died before SageMaker had the job
    assert (ended.status, ended.failure_reason) == ("Stopped", "stopped by user")

    # `dtrain stop` came during CreateTrainingJob, then the submit died before it recorded the
    # job or delivered the stop
    store.update(record.id, status="Stopping", failure_reason="stopped by user",
                 target_data={"arn": None, "submitter": _dead_submitter()})
    client = aws.client("sagemaker")
    answer_describe(client, record.name, ("InProgress", "Training", None))
    calls = answer_stop(client)
    adopted = jobs.get(record.id, clients=clients)
    assert calls == [record.name]  # the job does not train on to its end
    assert adopted.status == "Stopping" and adopted.target_data["arn"].endswith(record.name)


def _this_process() -> dict:
    from dtrain.launcher import process

    return process.this_process()


def test_sagemaker_s_answer_for_a_job_it_does_not_have_is_told_from_other_errors():
    from dtrain.launcher.sagemaker.launcher import _is_missing

    def error(code, message):
        return ClientError({"Error": {"Code": code, "Message": message}}, "DescribeTrainingJob")

    assert _is_missing(error("ValidationException", "Requested resource not found."))  # AWS
    assert _is_missing(error("ValidationException", "Could not find training job 'x'"))  # moto
    assert not _is_missing(error("ValidationException", "1 validation error detected"))
    assert not _is_missing(error("AccessDeniedException", "not authorized"))


def test_empty_pages_of_log_events_before_the_end_do_not_end_the_read(moto_aws):  # noqa: F811
    from dtrain.launcher.sagemaker.cloudwatch import MAX_EMPTY_PAGES, LogReader

    group, stream = "/aws/sagemaker/TrainingJobs", "job-1/algo-1-1700000000"
    logs = moto_aws.client("logs")
    logs.create_log_group(logGroupName=group)
    logs.create_log_stream(logGroupName=group, logStreamName=stream)
    now = int(time.time() * 1000)
    logs.put_log_events(logGroupName=group, logStreamName=stream, logEvents=[
        {"timestamp": now + i, "message": f"[algo-1 0]: line {i}"} for i in range(3)])
    # CloudWatch may answer empty pages with new tokens while events follow; moto never does,
    # so this double answers the first calls so (exactly that behaviour, nothing else)
    empty = MAX_EMPTY_PAGES + 5
    tokens = []

    def note_token(params, **_):
        tokens.append(params.get("nextToken"))
        if params.get("nextToken") == f"f/empty-{empty}":
            del params["nextToken"]  # moto's own first page follows the empty ones

    def empty_pages(**_):
        if len(tokens) <= empty:
            return AWSResponse("https://logs", 200, {}, None), {
                "events": [], "nextForwardToken": f"f/empty-{len(tokens)}",
                "nextBackwardToken": "b/empty", "ResponseMetadata": {"HTTPStatusCode": 200}}
        return None
    logs.meta.events.register("before-parameter-build.logs.GetLogEvents", note_token)
    logs.meta.events.register("before-call.logs.GetLogEvents", empty_pages)
    lines = [f"[algo-1 0]: line {i}" for i in range(3)]
    # `dtrain logs` without --follow reads once: to the end, however many empty pages come
    assert list(LogReader(client=logs, job_name="job-1").lines()) == lines
    tokens.clear()  # following: a long run of empty pages waits for the next poll
    follower = LogReader(client=logs, job_name="job-1")
    assert follower.poll(to_the_end=False) == []
    assert len(tokens) == MAX_EMPTY_PAGES
    assert follower.poll(to_the_end=False) == lines
    assert follower.poll() == []  # read to the end: nothing twice
