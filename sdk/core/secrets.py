"""Secrets in a job's environment: references resolved on the node, plain values never shown.

An ``environment`` value may be a reference instead of the secret itself:

* ``secretsmanager:<name or ARN>`` — an AWS Secrets Manager secret's string;
* ``secretsmanager:<name or ARN>#<key>`` — one key of a JSON secret;
* ``ssm:<parameter name>`` — an SSM Parameter Store parameter, decrypted.

Requests and dry runs carry the reference only; the node agent resolves it with the node's own
credentials before it starts the workers. A plain value in a variable whose name looks like a
secret is sent as given (with a warning at validation) but never printed. Stdlib only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

_REFERENCE = re.compile(r"^(secretsmanager|ssm):(\S+)$")
_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE|API_?KEY|"
                          r"ACCESS_?KEY|AUTH)", re.IGNORECASE)
REDACTED = "<redacted>"


def reference(value: str) -> tuple[str, str] | None:
    """``(service, name)`` of a reference, or None for a plain value."""
    match = _REFERENCE.match(value)
    return (match.group(1), match.group(2)) if match else None


def looks_secret(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def plain_secrets(environment: Mapping[str, str]) -> list[str]:
    """The values of secret-looking variables given in plain text."""
    return [v for k, v in environment.items() if looks_secret(k) and v and reference(v) is None]


def redact(data: Any, secrets: Iterable[str]) -> Any:
    """``data`` (JSON-like) with every occurrence of each secret value replaced by REDACTED."""
    values = sorted({s for s in secrets if s}, key=len, reverse=True)
    if not values:
        return data

    def walk(item: Any) -> Any:
        if isinstance(item, str):
            for value in values:
                item = item.replace(value, REDACTED)
            return item
        if isinstance(item, dict):
            return {k: walk(v) for k, v in item.items()}
        if isinstance(item, (list, tuple)):
            return [walk(v) for v in item]
        return item
    return walk(data)
