"""S3 URIs: the one parser and checker every layer uses (stdlib only)."""

from __future__ import annotations

import re

SCHEME = "s3://"
_URI = re.compile(r"^s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(/.*)?$")
_UNSAFE = re.compile(r"[\"'`\\\x00-\x1f\x7f]")


def is_s3_uri(value: object) -> bool:
    """True for anything meant as an S3 location (well-formed or not: ``check`` says)."""
    return isinstance(value, str) and value[:3].lower() == "s3:"


def check(value: str, field: str) -> str:
    """Return ``value`` if it is a well-formed ``s3://bucket/key`` URI, else raise ValueError
    naming ``field``."""
    if not _URI.match(value) or "//" in value[5:] or ".." in value[5:].split("/")[0]:
        raise ValueError(
            f"{field}: {value!r} is not a valid S3 URI; write it as s3://bucket-name/prefix "
            "(bucket names are 3-63 lowercase letters, digits, dots or hyphens)"
        )
    if _UNSAFE.search(value):
        # S3 allows them, but the URI travels in shell scripts and JSON (an EC2 node's bootstrap)
        raise ValueError(f"{field}: {value!r} holds a quote, a backslash or a control character; "
                         "dtrain does not take those in S3 locations")
    return value


def split(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> ``("bucket", "a/b")``; ValueError for anything but s3://."""
    if not uri.startswith(SCHEME):
        raise ValueError(f"{uri!r} is not an s3:// URI; write it as s3://bucket/prefix")
    bucket, _, key = uri[len(SCHEME):].partition("/")
    return bucket, key.strip("/")


def join(uri: str, *parts: str) -> str:
    """``join("s3://b/p/", "a", "/c")`` -> ``s3://b/p/a/c``."""
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts)])
