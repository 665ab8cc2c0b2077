"""Resolve the environment's secret references (``dtrain.core.secrets``) on the node, with the
node's own credentials, before the workers start: the secret never travels in a request."""

from __future__ import annotations

import json
import os
from collections.abc import MutableMapping

from dtrain.core import secrets
from dtrain.core.aws import region_of

# What to do about the errors that are not the secret's name or permission.
_FIXES = {
    "NoRegionError": "the node has no AWS region: set AWS_REGION in the job's environment",
    "NoCredentialsError": "the node has no AWS credentials: give it an instance role (EC2, "
                          "SageMaker) or a profile (Slurm nodes, local)",
}


def resolve_references(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Replace every reference value in ``environ`` by the secret; returns the names resolved.

    Raises ValueError naming the variable and the secret when one cannot be read."""
    resolved = []
    for name, value in list(environ.items()):
        ref = secrets.reference(value)
        if ref is None:
            continue
        service, where = ref
        try:
            environ[name] = _fetch(service, where)
        except Exception as exc:  # noqa: BLE001 - boto3's errors, named to the user
            fix = _FIXES.get(type(exc).__name__, "check the name and the node's permission to "
                                                 "read it")
            raise ValueError(f"environment {name}: cannot read {service} secret {where!r} "
                             f"({type(exc).__name__}: {exc}); {fix}") from None
        resolved.append(name)
    return resolved


def _fetch(service: str, where: str) -> str:
    import boto3

    region = region_of()  # AWS_REGION too, which botocore alone does not read
    if service == "ssm":
        answer = boto3.client("ssm", region_name=region).get_parameter(Name=where,
                                                                       WithDecryption=True)
        return answer["Parameter"]["Value"]
    secret_id, _, key = where.partition("#")
    text = boto3.client("secretsmanager", region_name=region).get_secret_value(
        SecretId=secret_id)["SecretString"]
    return str(json.loads(text)[key]) if key else text
