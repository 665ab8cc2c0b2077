"""AWS facts every layer reads the same way (stdlib only; boto3 lives in the launchers)."""

from __future__ import annotations

import configparser
import os


def region_of(region: str | None = None) -> str | None:
    """The region a spec asks for, else the one boto3 would use: ``AWS_REGION``,
    ``AWS_DEFAULT_REGION``, then the profile's ``region`` in the AWS config file."""
    found = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    return found or _configured_region()


def _configured_region() -> str | None:
    path = os.environ.get("AWS_CONFIG_FILE") or os.path.expanduser("~/.aws/config")
    profile = os.environ.get("AWS_PROFILE") or "default"
    parser = configparser.ConfigParser()
    try:
        parser.read(path)
    except (configparser.Error, OSError):
        return None
    section = profile if profile == "default" else f"profile {profile}"
    return parser.get(section, "region", fallback=None) or None
