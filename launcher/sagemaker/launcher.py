"""The SageMaker backend: the same spec as a SageMaker training job, same container contract.

``build_request(plan)`` is pure and returns the exact ``CreateTrainingJob`` request
(``dtrain submit --dry-run`` prints it; see ``sagemaker_request`` for how it is shaped).
``submit`` uploads the code, the runtime wheel and the entry script to
``{output_path}/{job}/source/``, creates the job, and removes the uploads again when creation
fails. ``status``/``wait``/``logs``/``stop`` work from the job name alone, so ``dtrain status``
and ``Estimator.attach`` need nothing but the job store or the name.

Clients are passed in (tests hand moto-backed ones); by default they are built with adaptive
retries, and ``AWS_ENDPOINT_URL`` points them anywhere, as boto3 defines it.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from dtrain.core.errors import DtrainError
from dtrain.launcher import aws, packaging
from dtrain.launcher.base import Launcher
from dtrain.launcher.sagemaker import request as req
from dtrain.launcher.sagemaker.cloudwatch import SAGEMAKER_LOG_GROUP, LogFilter, LogReader

if TYPE_CHECKING:
    from dtrain.planning.planner import Plan

TERMINAL_STATES = ("Completed", "Failed", "Stopped")
DEFAULT_POLL_S = 15.0


def resolve_image_uri(plan: Plan, *, region: str | None) -> str:
    """``sagemaker.image_uri``, else the SageMaker SDK's lookup of the AWS PyTorch image."""
    sm = plan.spec.sagemaker
    if sm.image_uri:
        return sm.image_uri
    retrieve = _sdk_image_retrieve()
    if retrieve is None:
        raise DtrainError("sagemaker.image_uri: not set and the SageMaker SDK is not installed to "
                          "look up the AWS PyTorch image; set sagemaker.image_uri or "
                          "pip install 'dtrain[sagemaker]'")
    if not region:
        raise DtrainError("sagemaker.region: needed to look up the training image; set it or "
                          "AWS_REGION")
    try:
        return retrieve(framework="pytorch", region=region, version=sm.framework_version,
                        py_version=sm.py_version, instance_type=req.instance_type_name(plan),
                        image_scope="training")
    except ValueError as exc:
        raise DtrainError(f"sagemaker.framework_version/py_version: {sm.framework_version!r}/"
                          f"{sm.py_version!r}: {exc}; or set sagemaker.image_uri") from None


def _sdk_image_retrieve() -> Callable[..., str] | None:
    """``image_uris.retrieve`` from SageMaker SDK v3 or v2, imported only when needed."""
    for module in ("sagemaker.core.image_uris", "sagemaker.image_uris"):
        try:
            return __import__(module, fromlist=["retrieve"]).retrieve
        except (ImportError, AttributeError):
            continue
    return None


def entry_script_text() -> str:
    return resources.files("dtrain.launcher.sagemaker").joinpath(req.ENTRY_SCRIPT).read_text()


def job_name_of(job: Any) -> str:
    """The training job name of a store record (H3's JobRecord) or of a plain name."""
    if isinstance(job, str):
        return job
    return (getattr(job, "target_data", None) or {}).get("training_job_name") or job.name


class SageMakerLauncher(Launcher, aws.AwsBackend):
    """``build_request`` / ``submit`` / ``status`` / ``wait`` / ``logs`` / ``stop``.

    Lifecycle methods take a store record (``dtrain.jobs.store.JobRecord``) or a training job name.
    """

    name = "sagemaker"
    poll_s = 10.0

    def __init__(self, *, sagemaker_client: Any = None, s3_client: Any = None,
                 logs_client: Any = None, region: str | None = None,
                 stream: IO[str] | None = None,
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
                 sleep: Callable[[float], None] = time.sleep):
        aws.AwsBackend.__init__(
            self, {"sagemaker": sagemaker_client, "s3": s3_client, "logs": logs_client},
            region=region, stream=stream, clock=clock, sleep=sleep)

    # ---------------------------------------------------------------- request

    def build_request(self, plan: Plan, *, job_name: str | None = None) -> dict[str, Any]:
        """The exact ``CreateTrainingJob`` request (no AWS call)."""
        region = aws.resolve_region(plan.spec.sagemaker.region or self.region)
        name = job_name or req.training_job_name(plan.spec.name, now=self.clock())
        request = req.build_create_training_job(
            plan, job_name=name, image_uri=resolve_image_uri(plan, region=region), region=region)
        self._plans[name] = plan
        return request

    # ---------------------------------------------------------------- submit

    def submit(self, request: dict[str, Any], *, store: Any = None,
               plan: Plan | None = None) -> Any:
        """Upload code and runtime, create the job; on failure remove what was uploaded.

        The job is in ``store`` (default: the user's job store) from the first upload on, so a
        failed submission is recorded with its reason too. Returns the store's JobRecord.
        """
        from dtrain.jobs.store import FAILED, STARTING, JobStore

        name = request["TrainingJobName"]
        plan = plan or self._plans.get(name)
        if plan is None:
            raise DtrainError(f"job {name!r}: no plan for this request; build it with "
                              "build_request(plan) on this launcher or pass plan=")
        self._check_bucket(plan.spec.output_path)
        store = store if store is not None else JobStore()
        record = store.create(name=name, target=self.name, spec=plan.spec.to_dict(),
                              log_location=f"cloudwatch:{SAGEMAKER_LOG_GROUP}/{name}/",
                              output_location=req.model_data_uri(plan, name),
                              target_data={"training_job_name": name,
                                           "region": self.region_of(plan),
                                           "console_url": self.console_url(name, plan)})
        uploaded: list[str] = []
        try:
            self._upload_code(plan, name, uploaded)
            response = self.client("sagemaker").create_training_job(**request)
        except BaseException as exc:
            packaging.delete_objects(self.client("s3"), uploaded)
            error = exc if isinstance(exc, DtrainError) or not hasattr(exc, "response") \
                else aws.as_dtrain_error(exc, f"CreateTrainingJob {name}")
            store.update(record.id, status=FAILED, failure_reason=str(error) or repr(exc))
            if error is exc:
                raise
            raise error from None
        return store.update(record.id, status=STARTING, target_data={
            "arn": response["TrainingJobArn"], "uploads": uploaded})

    def region_of(self, plan: Plan) -> str | None:
        return aws.resolve_region(plan.spec.sagemaker.region or self.region) or getattr(
            getattr(self.client("sagemaker"), "meta", None), "region_name", None)

    def console_url(self, name: str, plan: Plan) -> str:
        region = self.region_of(plan) or "us-east-1"
        return (f"https://{region}.console.aws.amazon.com/sagemaker/home?region={region}"
                f"#/jobs/{name}")

    def default_output_path(self) -> str:
        """``s3://sagemaker-<region>-<account>/``, created if missing, as the SageMaker SDK does."""
        from botocore.exceptions import BotoCoreError, ClientError

        sts = self.client("sts")
        try:
            account = sts.get_caller_identity()["Account"]
        except (ClientError, BotoCoreError) as exc:
            raise aws.as_dtrain_error(exc, "GetCallerIdentity") from None
        region = aws.resolve_region(self.region) or sts.meta.region_name
        bucket = f"sagemaker-{region}-{account}"
        s3 = self.client("s3")
        try:
            s3.head_bucket(Bucket=bucket)
        except (ClientError, BotoCoreError) as exc:
            # only a missing bucket is created, as the SageMaker SDK does; a 403 is reported
            if aws.error_code(exc) not in ("404", "NoSuchBucket"):
                raise aws.as_dtrain_error(exc, f"checking bucket {bucket}") from None
            config = {} if region == "us-east-1" else {
                "CreateBucketConfiguration": {"LocationConstraint": region}}
            s3.create_bucket(Bucket=bucket, **config)
        return f"s3://{bucket}"

    def _check_bucket(self, output_path: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, _ = packaging.parse_s3_uri(output_path)
        try:
            self.client("s3").head_bucket(Bucket=bucket)
        except (ClientError, BotoCoreError) as exc:
            code = aws.error_code(exc)
            if code in ("404", "NoSuchBucket"):
                raise DtrainError(f"output_path: bucket {bucket!r} does not exist; create it "
                                  f"(aws s3 mb s3://{bucket}) or fix output_path") from None
            if code in ("403", "AccessDenied"):
                raise DtrainError(f"output_path: no access to bucket {bucket!r}; check your AWS "
                                  "credentials' S3 permissions") from None
            raise aws.as_dtrain_error(exc, f"checking bucket {bucket}") from None

    def _upload_code(self, plan: Plan, name: str, uploaded: list[str]) -> None:
        prefix = req.source_prefix(plan, name)
        s3 = self.client("s3")
        with tempfile.TemporaryDirectory(prefix="dtrain-sm-") as tmp:
            files = [packaging.build_runtime_wheel(tmp)]
            entry = Path(tmp) / req.ENTRY_SCRIPT
            entry.write_text(entry_script_text())
            files.append(entry)
            source = plan.spec.source_dir
            if source and not plan.spec.is_recipe and not source.startswith("s3://"):
                packed = packaging.pack_source(source, tmp)
                for secret in packed.skipped_secrets:
                    self.out.write(f"warning: not packing {secret} (looks like a secret)\n")
                files.insert(0, packed.path)
            for path in files:
                uri = packaging.join_s3(prefix, path.name)
                uploaded.append(uri)  # before the call: a partial upload is removed too
                packaging.upload_file(s3, path, uri, stream=self.out)

    # ---------------------------------------------------------------- lifecycle

    def describe(self, job: Any) -> dict[str, Any]:
        job_name = job_name_of(job)
        try:
            return self.client("sagemaker").describe_training_job(TrainingJobName=job_name)
        except Exception as exc:
            if not hasattr(exc, "response"):
                raise
            raise aws.as_dtrain_error(exc, f"DescribeTrainingJob {job_name}") from None

    def job_status(self, job: Any) -> dict[str, Any]:
        """State, secondary status, FailureReason (verbatim) and model artifacts of a job."""
        job_name = job_name_of(job)
        described = self.describe(job_name)
        return {
            "job_name": job_name,
            "state": described["TrainingJobStatus"],
            "secondary_status": described.get("SecondaryStatus"),
            "failure_reason": described.get("FailureReason"),
            "model_data": described.get("ModelArtifacts", {}).get("S3ModelArtifacts"),
            "transitions": [
                {"status": t.get("Status"), "message": t.get("StatusMessage", "")}
                for t in described.get("SecondaryStatusTransitions", [])
            ],
            "billable_seconds": described.get("BillableTimeInSeconds"),
            "started_at": _epoch(described.get("TrainingStartTime")),
            "ended_at": _epoch(described.get("TrainingEndTime")),
        }

    def wait(self, job: Any, *, poll_s: float = DEFAULT_POLL_S,
             on_transition: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Poll until the job ends, reporting each new ``SecondaryStatus`` transition."""
        job_name = job_name_of(job)
        shown = 0
        report = on_transition or (lambda line: self.out.write(line + "\n"))
        while True:
            status = self.job_status(job_name)
            transitions = status["transitions"] or [
                {"status": status["secondary_status"], "message": ""}]
            for item in transitions[shown:]:
                report(f"{job_name}: {item['status']}" +
                       (f" - {item['message']}" if item["message"] else ""))
            shown = max(shown, len(transitions))
            if status["state"] in TERMINAL_STATES:
                return status
            self.sleep(poll_s)

    def logs(self, job: Any, *, follow: bool = False, host: str | None = None,
             rank: int | None = None, poll_s: float = 5.0) -> Iterator[str]:
        """Lines from every host's CloudWatch stream (``host: message``), optionally followed."""
        job_name = job_name_of(job)
        reader = LogReader(self.client("logs"), job_name, filter=LogFilter(host, rank),
                           poll_s=poll_s, sleep=self.sleep)
        yield from reader.lines(
            follow=follow, done=lambda: self.job_status(job_name)["state"] in TERMINAL_STATES)

    def status(self, record: Any, *, store: Any = None) -> Any:
        """Refresh a store record from DescribeTrainingJob (state, SecondaryStatus, reason)."""
        from dtrain.jobs.store import JobStore

        store = store if store is not None else JobStore()
        record = store.find(record) if isinstance(record, str) else record
        if record.is_final:
            return record
        current = self.job_status(record)
        fields: dict[str, Any] = {}
        if current["failure_reason"]:
            fields["failure_reason"] = current["failure_reason"]  # verbatim, as SageMaker says
        if current["started_at"] and not record.started_at:
            fields["started_at"] = current["started_at"]
        if current["state"] in TERMINAL_STATES:
            fields["ended_at"] = current["ended_at"] or time.time()
        return store.update(record.id, status=store_status(current), **fields, target_data={
            "secondary_status": current["secondary_status"],
            "transitions": current["transitions"], "model_data": current["model_data"]})

    def stop(self, record: Any, *, store: Any = None) -> Any:
        """StopTrainingJob; SageMaker sends SIGTERM, so the agent checkpoints and exits."""
        from dtrain.jobs.store import STOPPING, JobStore

        job_name = job_name_of(record)
        try:
            self.client("sagemaker").stop_training_job(TrainingJobName=job_name)
        except Exception as exc:
            if not hasattr(exc, "response"):
                raise
            raise aws.as_dtrain_error(exc, f"StopTrainingJob {job_name}") from None
        if isinstance(record, str):
            return None
        store = store if store is not None else JobStore()
        return record if record.is_final else store.update(record.id, status=STOPPING)


def _epoch(value: Any) -> float | None:
    """botocore's datetime (or moto's epoch number) as epoch seconds."""
    if value is None:
        return None
    return value.timestamp() if hasattr(value, "timestamp") else float(value)


# SecondaryStatus values before the training container runs.
_STARTING = {"Starting", "Pending", "LaunchingMLInstances", "PreparingTrainingStack",
             "Downloading", "DownloadingTrainingImage", "Restarting", "Interrupted"}


def store_status(current: dict[str, Any]) -> str:
    """SageMaker's TrainingJobStatus/SecondaryStatus -> the job store's status names."""
    state = current["state"]
    if state == "InProgress":
        return "Starting" if current["secondary_status"] in _STARTING else "Running"
    return state  # Completed, Failed, Stopping, Stopped: same names
