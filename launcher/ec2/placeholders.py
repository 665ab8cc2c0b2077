"""``{{name}}`` placeholders: values of an EC2 request that only ``submit`` learns.

``build_request`` is pure, so the values that need a call or must be drawn per launch appear in
the request as ``{{name}}`` (the AMI id from SSM, the subnet and VPC, the security group id once
the group exists, the launch token and time); ``submit`` fills them in step by step.
"""

from __future__ import annotations

from typing import Any


def placeholder(name: str) -> str:
    return "{{" + name + "}}"


def fill(value: Any, values: dict[str, str]) -> Any:
    """``value`` with every ``{{name}}`` in its strings replaced; unknown names stay."""
    if isinstance(value, dict):
        return {k: fill(v, values) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, values) for v in value]
    if isinstance(value, str) and "{{" in value:
        for key, replacement in values.items():
            value = value.replace(placeholder(key), replacement)
    return value
