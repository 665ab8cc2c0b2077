"""boto3 plumbing shared by the cloud backends: client construction and one-line errors.

boto3 is imported inside functions so ``import dtrain.launcher.*`` stays cheap.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import IO, Any

from dtrain.core.aws import region_of
from dtrain.core.errors import DtrainError

# Tags on everything dtrain creates, the same keys on every cloud target, so one tag query
# finds a job's resources wherever it ran.
TAG_JOB = "dtrain:job"
TAG_CREATED_BY = "dtrain:created-by"
CREATED_BY = "dtrain"

# Codes that mean "your request or account is wrong", shown as one line without a traceback.
USER_ERROR_CODES = {
    "ResourceLimitExceeded": "raise the quota in Service Quotas (SageMaker: '<type> for training "
                             "job usage'/'for spot training job usage') or use fewer instances",
    "ValidationException": "fix the setting named above and submit again",
    "AccessDeniedException": "check the IAM permissions of your AWS credentials",
    "AccessDenied": "check the IAM permissions of your AWS credentials",
    "UnauthorizedOperation": "check the IAM permissions of your AWS credentials",  # EC2's
    "NoSuchBucket": "create the bucket or fix output_path",
    "ResourceNotFound": "check the job name (dtrain list)",
    "ExpiredTokenException": "refresh your AWS credentials",
    "ThrottlingException": "wait a minute and retry",
    "NoCredentialsError": "configure AWS credentials (aws configure, AWS_PROFILE, or the "
                          "instance's role)",
}


_CLIENT_LOCK = threading.Lock()
_WRAPPED_CODE = re.compile(r"An error occurred \((\w+)\) when calling")
_HTML = re.compile(r"<\s*(!doctype|html|head|body)\b", re.IGNORECASE)
_TAG = re.compile(r"<[^>]*>")


def make_client(service: str, *, region: str | None = None) -> Any:
    """A boto3 client with adaptive retries; ``AWS_ENDPOINT_URL`` is honoured by boto3 itself."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError

    config = Config(retries={"mode": "adaptive", "max_attempts": 10},
                    user_agent_extra="dtrain")
    try:  # boto3's default session makes clients unsafely across threads (dtrain list's)
        with _CLIENT_LOCK:
            return boto3.client(service, region_name=region_of(region), config=config)
    except (BotoCoreError, ValueError) as exc:  # NoRegionError, ProfileNotFound, a bad endpoint
        raise DtrainError(f"cannot create the AWS {service} client: {exc}; set the region "
                          "(the spec's sagemaker.region or ec2.region, `dtrain ec2 gc --region`, "
                          "or AWS_REGION) and AWS credentials") from None


def error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return response.get("Error", {}).get("Code")
    # boto3's transfer manager wraps the ClientError into text (S3UploadFailedError)
    match = _WRAPPED_CODE.search(str(exc)) if type(exc).__name__.endswith("FailedError") else None
    return match.group(1) if match else None


def as_dtrain_error(exc: BaseException, action: str, *, fix: str | None = None) -> DtrainError:
    """A botocore ClientError as one line: what failed, AWS's message verbatim, the fix
    (``fix``, else the one :data:`USER_ERROR_CODES` has for the code)."""
    code = error_code(exc) or type(exc).__name__
    message = ""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        message = response.get("Error", {}).get("Message", "")
    message = " ".join((message or str(exc)).split())
    if not isinstance(response, dict) and ": " in message and _WRAPPED_CODE.search(message):
        message = message.rsplit(": ", 1)[1]  # the wrapped error's own words
    if _HTML.search(message):  # an error page from a proxy or an emulator: never shown raw
        status = (response or {}).get("ResponseMetadata", {}).get("HTTPStatusCode") \
            if isinstance(response, dict) else None
        text = " ".join(_TAG.sub(" ", message).split())[:200]
        message = f"the service answered with an HTML page (HTTP {status or '?'}): {text}"
    fix = fix or USER_ERROR_CODES.get(code)
    return DtrainError(f"{action} failed: {code}: {message}" + (f"; {fix}" if fix else ""))


class AwsBackend:
    """What the cloud backends share: boto3 clients (passed in by tests, else made on first use
    with adaptive retries), the region, where progress goes, and an injectable clock and sleep."""

    def __init__(self, clients: dict[str, Any], *, region: str | None = None,
                 stream: IO[str] | None = None,
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
                 sleep: Callable[[float], None] = time.sleep):
        self._clients = dict(clients)
        self.region = region
        self.stream = stream
        self.clock = clock
        self.sleep = sleep

    def client(self, service: str) -> Any:
        if self._clients.get(service) is None:
            self._clients[service] = make_client(service, region=self.region)
        return self._clients[service]

    @property
    def out(self) -> IO[str]:
        return self.stream if self.stream is not None else sys.stderr
