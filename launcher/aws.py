"""boto3 plumbing shared by the cloud backends: client construction and one-line errors.

boto3 is imported inside functions so ``import dtrain.launcher.*`` stays cheap.
"""

from __future__ import annotations

import os
from typing import Any

from dtrain.errors import DtrainError

# Codes that mean "your request or account is wrong", shown as one line without a traceback.
USER_ERROR_CODES = {
    "ResourceLimitExceeded": "raise the quota in Service Quotas (SageMaker: '<type> for training "
                             "job usage'/'for spot training job usage') or use fewer instances",
    "ValidationException": "fix the setting named above and submit again",
    "AccessDeniedException": "check the IAM permissions of your AWS credentials",
    "AccessDenied": "check the IAM permissions of your AWS credentials",
    "NoSuchBucket": "create the bucket or fix output_path",
    "ResourceNotFound": "check the job name (dtrain list)",
    "ExpiredTokenException": "refresh your AWS credentials",
    "ThrottlingException": "wait a minute and retry",
}


def resolve_region(region: str | None = None) -> str | None:
    """The region a spec asks for, else the environment's (boto3's own lookup order)."""
    return region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")


def make_client(service: str, *, region: str | None = None) -> Any:
    """A boto3 client with adaptive retries; ``AWS_ENDPOINT_URL`` is honoured by boto3 itself."""
    import boto3
    from botocore.config import Config

    config = Config(retries={"mode": "adaptive", "max_attempts": 10},
                    user_agent_extra="dtrain")
    try:
        return boto3.client(service, region_name=resolve_region(region), config=config)
    except Exception as exc:  # NoRegionError and friends: one line, with the fix
        raise DtrainError(f"cannot create the AWS {service} client: {exc}; set sagemaker.region "
                          "or AWS_REGION, and AWS credentials") from None


def error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return response.get("Error", {}).get("Code")
    return None


def as_dtrain_error(exc: BaseException, action: str) -> DtrainError:
    """A botocore ClientError as one line: what failed, AWS's message verbatim, the fix."""
    code = error_code(exc) or type(exc).__name__
    message = ""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        message = response.get("Error", {}).get("Message", "")
    message = " ".join((message or str(exc)).split())
    fix = USER_ERROR_CODES.get(code)
    return DtrainError(f"{action} failed: {code}: {message}" + (f"; {fix}" if fix else ""))
