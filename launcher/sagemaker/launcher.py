"""The SageMaker backend: the same spec as a SageMaker training job, same container contract.

``build_request`` is pure and returns the exact ``CreateTrainingJob`` request and its uploads
(``dtrain submit --dry-run`` prints it; ``request`` shapes it). ``submit`` checks the bucket,
uploads the code, the runtime wheel and the entry script to ``{output_path}/{job}/source/``,
creates the job, and removes the uploads again when anything fails. ``status``/``logs``/``stop``
need only the training job's name and region, so a job submitted elsewhere works too.

Clients are passed in (tests hand moto-backed ones); by default they are built with adaptive
retries, and ``AWS_ENDPOINT_URL`` points them anywhere, as boto3 defines it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from typing import IO, TYPE_CHECKING, Any

from dtrain.core import aws_images, s3
from dtrain.core.aws import region_of
from dtrain.core.errors import DtrainError
from dtrain.core.states import FINAL_STATUSES, RUNNING, STARTING, STOPPED, STOPPING
from dtrain.launcher import aws, packaging
from dtrain.launcher.agents import STOP_REASON
from dtrain.launcher.base import (
    Handle,
    JobIdentity,
    Journal,
    Launcher,
    Request,
    TargetState,
    Update,
    follow_submitter,
)
from dtrain.launcher.sagemaker import request as req
from dtrain.launcher.sagemaker.cloudwatch import SAGEMAKER_LOG_GROUP, LogFilter, LogReader

if TYPE_CHECKING:
    from dtrain.planning.planner import Plan
    from dtrain.spec.model import JobSpec

LOG_POLL_S = 5.0
# How far SageMaker's clock may be behind this machine's when a job's CreationTime is compared
# with the submit's start.
CLOCK_SKEW_S = 300.0
# SecondaryStatus values before the training container runs.
_STARTING = {"Starting", "Pending", "LaunchingMLInstances", "PreparingTrainingStack",
             "Downloading", "DownloadingTrainingImage", "Restarting", "Interrupted"}


@dataclass(frozen=True)
class SageMakerState(TargetState):
    training_job_name: str | None = None
    region: str | None = None  # where the job is: status, logs and stop ask there
    arn: str | None = None
    console_url: str | None = None
    uploads: list[str] = field(default_factory=list)  # the code channel's objects
    transitions: list[dict[str, str]] = field(default_factory=list)  # SecondaryStatusTransitions
    model_data: str | None = None  # S3 URI of model.tar.gz, once SageMaker reports it
    billable_seconds: int | None = None


def resolve_image_uri(spec: JobSpec, plan: Plan, *, region: str | None) -> str:
    """``sagemaker.image_uri``, else the AWS PyTorch image of ``framework_version`` in
    ``region``: the SageMaker SDK's lookup when it is installed and knows the version (the
    authority), else dtrain's table (``dtrain.core.aws_images``)."""
    sm = spec.sagemaker
    if sm.image_uri:
        return sm.image_uri
    if not region:
        raise DtrainError("sagemaker.region: needed to pick the training image's registry; "
                          "set it, or AWS_REGION, or sagemaker.image_uri")
    retrieve, sdk_says = _sdk_image_retrieve(), None
    if retrieve is not None:
        try:
            return retrieve(framework="pytorch", region=region, version=sm.framework_version,
                            py_version=sm.py_version, instance_type=req.instance_type_name(plan),
                            image_scope="training")
        except ValueError as exc:  # a version newer than the SDK: the table may have it
            sdk_says = " ".join(str(exc).split())
    image = aws_images.training_image_uri(sm.framework_version, region)
    if image:
        return image
    raise _no_image(spec, region, sdk_says)


def _no_image(spec: JobSpec, region: str, sdk_says: str | None) -> DtrainError:
    sm, known = spec.sagemaker, ", ".join(aws_images.IMAGES)
    if sdk_says:
        return DtrainError(f"sagemaker.framework_version/py_version: {sm.framework_version!r}/"
                           f"{sm.py_version!r}: {sdk_says}; use one of {known} or set "
                           "sagemaker.image_uri")
    if region not in aws_images.REGISTRIES:
        return DtrainError(f"sagemaker.region: dtrain's image table has no registry for "
                           f"{region!r}; set sagemaker.image_uri")
    return DtrainError(f"sagemaker.framework_version: {sm.framework_version!r} has no AWS image "
                       f"in dtrain's table ({known}); use one of those, set sagemaker.image_uri, "
                       "or pip install 'dtrain[sagemaker]' for the SDK's lookup")


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


def console_url(name: str, region: str) -> str:
    return (f"https://{region}.console.aws.amazon.com/sagemaker/home?region={region}"
            f"#/jobs/{name}")


class SageMakerLauncher(Launcher, aws.AwsBackend):
    """``compute.target: sagemaker``; ``region`` and the boto3 clients are its configuration."""

    name = "sagemaker"
    state_type = SageMakerState
    poll_s = 10.0
    stamps_job_names = True
    follows_submitter = True

    def __init__(self, *, sagemaker_client: Any = None, s3_client: Any = None,
                 logs_client: Any = None, region: str | None = None,
                 stream: IO[str] | None = None, sleep: Callable[[float], None] = time.sleep):
        # The environment's region (found as boto3 finds it) is configuration, read once here:
        # build_request stays a function of its arguments and of this launcher's settings.
        aws.AwsBackend.__init__(
            self, {"sagemaker": sagemaker_client, "s3": s3_client, "logs": logs_client},
            region=region_of(region), stream=stream, sleep=sleep)
        self._given = {service for service, client in self._clients.items() if client is not None}

    def client_in(self, service: str, region: str | None) -> Any:
        """The ``service`` client for a job in ``region``: the one passed in (the caller chose
        it), else one made for that region, so a spec's region is where its job is created."""
        if region is None or region == self.region or service in self._given:
            return self.client(service)
        key = f"{service}@{region}"
        if key not in self._clients:
            self._clients[key] = aws.make_client(service, region=region)
        return self._clients[key]

    # ---------------------------------------------------------------- request

    def build_request(self, spec: JobSpec, plan: Plan, job: JobIdentity) -> Request:
        region = spec.sagemaker.region or self.region
        payload = req.create_training_job(
            spec, plan, job_name=job.name, image_uri=resolve_image_uri(spec, plan, region=region),
            region=region)
        return Request(target=self.name, job=job, payload=payload,
                       uploads=req.uploads(spec, job.name))

    # ---------------------------------------------------------------- submit

    def submit(self, request: Request, journal: Journal) -> Handle:
        payload = request.payload
        name = payload["TrainingJobName"]
        output_path = payload["OutputDataConfig"]["S3OutputPath"]
        sagemaker = self.client_in("sagemaker", req.region_of(payload))
        region = sagemaker.meta.region_name
        journal.record(Update(
            log_location=f"cloudwatch:{SAGEMAKER_LOG_GROUP}/{name}/",
            output_location=req.model_data_uri(output_path, name),
            state=SageMakerState.changes(training_job_name=name, region=region,
                                         console_url=console_url(name, region),
                                         checkpoints=payload["CheckpointConfig"]["S3Uri"])))
        s3_client = self.client_in("s3", region)
        self._check_bucket(s3_client, output_path)
        uploaded: list[str] = []
        action = f"uploading the code of {name}"
        try:
            packaging.upload_all(s3_client, request.uploads, stream=self.out, uploaded=uploaded,
                                 entry_script=entry_script_text())
            if journal.current().status == STOPPING:  # `dtrain stop` came while uploading
                packaging.delete_objects(s3_client, uploaded)
                return journal.record(Update(status=STOPPED, failure_reason=STOP_REASON))
            action = f"CreateTrainingJob {name}"
            response = self._create(sagemaker, payload, region, since=request.job.submitted_at)
        except BaseException as exc:
            if action.startswith("CreateTrainingJob") and self._created_anyway(name, region, exc):
                raise  # SageMaker has the job (a Ctrl-C in flight): its code stays; status adopts it
            packaging.delete_objects(s3_client, uploaded)  # nothing left behind, whatever went wrong
            error = _user_error(exc, action)
            if error is None:
                raise
            raise error from None
        # a Stopping record stays Stopping (the store): a stop that came during the call is
        # delivered here, one that comes later finds the arn
        handle = journal.record(Update(status=STARTING, state=SageMakerState.changes(
            arn=response["TrainingJobArn"], uploads=uploaded)))
        if handle.status == STOPPING:
            try:
                return self.stop(handle, journal)
            except DtrainError as exc:  # the job runs: the record must not say it failed
                self.out.write(f"{name}: `dtrain stop` came while SageMaker created the job, and "
                               f"stopping it failed ({exc}); run `dtrain stop` again\n")
        return handle

    def _create(self, sagemaker: Any, payload: dict[str, Any], region: str, *,
                since: float) -> dict[str, Any]:
        """CreateTrainingJob. botocore retries a call whose answer was lost, and SageMaker
        refuses the retry as a duplicate name (ResourceInUse) though the first try made the job:
        a job of that name with this request's hyperparameters, created since the submit began,
        is this one (answered as CreateTrainingJob would), not another job's name."""
        from botocore.exceptions import ClientError

        try:
            return sagemaker.create_training_job(**payload)
        except ClientError as exc:
            if aws.error_code(exc) != "ResourceInUse":
                raise
            try:
                job = self.describe(payload["TrainingJobName"], region=region, missing_ok=True)
            except DtrainError:
                raise exc from None
            if job is None or job.get("HyperParameters") != payload["HyperParameters"] or \
                    job["CreationTime"].timestamp() < since - CLOCK_SKEW_S:
                raise
            return {"TrainingJobArn": job["TrainingJobArn"]}

    def _created_anyway(self, name: str, region: str, exc: BaseException) -> bool:
        """Whether CreateTrainingJob, cut off by ``exc`` (not SageMaker's refusal), made the job."""
        from botocore.exceptions import ClientError

        if isinstance(exc, ClientError):
            return False
        try:
            return self.describe(name, region=region, missing_ok=True) is not None
        except (DtrainError, KeyboardInterrupt):
            return False

    def default_output_path(self) -> str:
        """``s3://sagemaker-<region>-<account>/``, created if missing, as the SageMaker SDK does."""
        from botocore.exceptions import BotoCoreError, ClientError

        sts = self.client("sts")
        try:
            account = sts.get_caller_identity()["Account"]
        except (ClientError, BotoCoreError) as exc:
            raise aws.as_dtrain_error(exc, "GetCallerIdentity") from None
        region = self.region or sts.meta.region_name
        bucket = f"sagemaker-{region}-{account}"
        s3_client = self.client("s3")
        try:
            s3_client.head_bucket(Bucket=bucket)
        except (ClientError, BotoCoreError) as exc:
            # only a missing bucket is created, as the SageMaker SDK does; a 403 is reported
            if aws.error_code(exc) not in ("404", "NoSuchBucket"):
                raise aws.as_dtrain_error(exc, f"checking bucket {bucket}") from None
            config = {} if region == "us-east-1" else {
                "CreateBucketConfiguration": {"LocationConstraint": region}}
            s3_client.create_bucket(Bucket=bucket, **config)
        return f"s3://{bucket}"

    @staticmethod
    def _check_bucket(client: Any, output_path: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, _ = s3.split(output_path)
        try:
            client.head_bucket(Bucket=bucket)
        except (ClientError, BotoCoreError) as exc:
            code = aws.error_code(exc)
            if code in ("404", "NoSuchBucket"):
                raise DtrainError(f"output_path: bucket {bucket!r} does not exist; create it "
                                  f"(aws s3 mb s3://{bucket}) or fix output_path") from None
            if code in ("403", "AccessDenied"):
                raise DtrainError(f"output_path: no access to bucket {bucket!r}; check your AWS "
                                  "credentials' S3 permissions") from None
            raise aws.as_dtrain_error(exc, f"checking bucket {bucket}") from None

    # ---------------------------------------------------------------- lifecycle

    def describe(self, training_job_name: str, *, region: str | None = None,
                 missing_ok: bool = False) -> dict[str, Any] | None:
        """DescribeTrainingJob, AWS errors as one line; with ``missing_ok``, None for a job
        SageMaker does not have."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self.client_in("sagemaker", region).describe_training_job(
                TrainingJobName=training_job_name)
        except (ClientError, BotoCoreError) as exc:
            if missing_ok and _is_missing(exc):
                return None
            raise aws.as_dtrain_error(exc, f"DescribeTrainingJob {training_job_name}") from None

    def status(self, handle: Handle) -> Update:
        """State, SecondaryStatus, FailureReason (verbatim) and model artifacts of the job."""
        if handle.is_final:
            return Update()
        state: SageMakerState = handle.state
        if state.arn is None and state.submitter is not None:  # uploading or creating
            waiting, described = follow_submitter(
                handle, lambda: self.describe(_job_name(handle), region=state.region,
                                              missing_ok=True),
                made="SageMaker created the job")
            if waiting is not None:
                return waiting
        else:
            described = self.describe(_job_name(handle), region=state.region)
        if handle.status == STOPPING and described.get("TrainingJobStatus") == "InProgress":
            # a stop recorded and not delivered: its submit died, or its StopTrainingJob failed
            # (or SageMaker has not moved to Stopping yet: it refuses a second stop, harmlessly)
            try:
                self._stop_training_job(_job_name(handle), state.region)
            except DtrainError:
                pass  # the record stays Stopping: the next status tries again
        update = update_from(described)
        if state.arn is None and described.get("TrainingJobArn"):
            # created by a submit that died before it recorded the job: adopted
            update = dataclasses.replace(update, state={
                **update.state, "arn": described["TrainingJobArn"], "submitter": None})
        return update

    def hosts(self, handle: Handle) -> list[str] | None:
        """Once the job ended, the hosts that wrote a log stream (None before: a host that has
        not written yet may still start)."""
        if not handle.is_final:
            return None
        reader = LogReader(self.client_in("logs", handle.state.region), _job_name(handle))
        return reader.hosts() or None

    def logs(self, handle: Handle, *, follow: bool, host: str | None, rank: int | None,
             ended: Callable[[], bool]) -> Iterator[str]:
        """Every host's CloudWatch stream merged by time, optionally one host's or rank's."""
        state: SageMakerState = handle.state
        reader = LogReader(self.client_in("logs", state.region), _job_name(handle),
                           filter=LogFilter(host, rank), poll_s=LOG_POLL_S, sleep=self.sleep)
        return reader.lines(follow=follow, done=ended)

    def stop(self, handle: Handle, journal: Journal) -> Handle:
        """StopTrainingJob; SageMaker sends SIGTERM, so the agent checkpoints and exits."""
        if handle.is_final:
            return handle
        if handle.state.arn is None and handle.state.submitter is not None:
            # the submit is still uploading or creating: it stops the job when it sees this (a
            # dead one's job was adopted or lost by the status before this call)
            handle = journal.record(Update(status=STOPPING, failure_reason=STOP_REASON))
            if handle.state.arn is None:
                return handle  # else CreateTrainingJob has answered meanwhile: stop it here too
        try:
            self._stop_training_job(_job_name(handle), handle.state.region)
        except DtrainError:
            # SageMaker refuses to stop a job that has just ended or is stopping already
            now = self.status(handle)
            if now.status in FINAL_STATUSES or now.status == STOPPING:
                return journal.record(now)
            raise
        return journal.record(Update(status=STOPPING))

    def _stop_training_job(self, name: str, region: str | None) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client_in("sagemaker", region).stop_training_job(TrainingJobName=name)
        except (ClientError, BotoCoreError) as exc:
            raise aws.as_dtrain_error(exc, f"StopTrainingJob {name}") from None


def update_from(described: dict[str, Any]) -> Update:
    """A DescribeTrainingJob answer as what the store records."""
    return Update(
        status=job_status(described.get("TrainingJobStatus"), described.get("SecondaryStatus")),
        failure_reason=described.get("FailureReason"),  # verbatim, as SageMaker says it
        started_at=_epoch(described.get("TrainingStartTime")),
        ended_at=_epoch(described.get("TrainingEndTime")),
        state=SageMakerState.changes(
            secondary_status=described.get("SecondaryStatus"),
            transitions=[{"status": t.get("Status"), "message": t.get("StatusMessage", "")}
                         for t in described.get("SecondaryStatusTransitions", [])],
            model_data=described.get("ModelArtifacts", {}).get("S3ModelArtifacts"),
            billable_seconds=described.get("BillableTimeInSeconds")))


def job_status(state: str | None, secondary: str | None) -> str | None:
    """SageMaker's TrainingJobStatus/SecondaryStatus -> the job store's status names."""
    if state == "InProgress":
        return STARTING if secondary in _STARTING else RUNNING
    return state  # Completed, Failed, Stopping, Stopped: same names


def _is_missing(exc: BaseException) -> bool:
    """DescribeTrainingJob's answer for a job SageMaker does not have (AWS: "Requested resource
    not found."; moto: "Could not find training job ...")."""
    message = str(exc)
    return aws.error_code(exc) in ("ValidationException", "ResourceNotFound") and (
        "not found" in message.lower() or "could not find" in message.lower())


def _job_name(handle: Handle) -> str:
    state: SageMakerState = handle.state
    return state.training_job_name or handle.job.name


def _user_error(exc: BaseException, action: str) -> DtrainError | None:
    """An AWS or file error as one line; None for anything else (a DtrainError is one line
    already; Ctrl-C and bugs keep their own)."""
    from boto3.exceptions import Boto3Error  # S3UploadFailedError wraps the ClientError
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(exc, (ClientError, BotoCoreError, Boto3Error)):
        return aws.as_dtrain_error(exc, action)
    if isinstance(exc, OSError):  # reading or packing the code, a full temp folder
        return DtrainError(f"{action} failed: {exc}")
    return None


def _epoch(value: Any) -> float | None:
    """botocore's datetime (or moto's epoch number) as epoch seconds."""
    if value is None:
        return None
    return value.timestamp() if hasattr(value, "timestamp") else float(value)
