"""Job names: the one rule for what a name may be and how one is made from other text.

A spec's ``name`` is 1-40 letters, digits and hyphens (room for the ``-YYYYmmdd-HHMMSS-mmm`` stamp
the cloud targets add, within SageMaker's 63-character limit). Stdlib only.
"""

from __future__ import annotations

import re
from datetime import datetime

MAX_LENGTH = 40
MAX_TARGET_LENGTH = 63  # SageMaker's TrainingJobName limit; EC2 tags and groups take it too
DEFAULT = "dtrain-job"
_VALID = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,39}$")
_OTHER_CHARS = re.compile(r"[^A-Za-z0-9]+")


def is_valid(name: str) -> bool:
    return bool(_VALID.match(name))


def check(name: str) -> str:
    """``name`` if valid, else ValueError saying the rule."""
    if not is_valid(name):
        raise ValueError(
            f"{name!r} is not a valid job name; use 1-{MAX_LENGTH} letters, digits and hyphens, "
            "starting and ending with a letter or digit"
        )
    return name


def sanitize(text: str, *, max_length: int = MAX_LENGTH, default: str = DEFAULT) -> str:
    """A valid name from any text: other characters become hyphens, then it is cut to size."""
    return _OTHER_CHARS.sub("-", text).strip("-")[:max_length].strip("-") or default


def from_entry_point(entry_point: str) -> str:
    """``train.py`` -> ``train``, ``recipe:causal_lm`` -> ``causal-lm``, ``a/b.py`` -> ``b``."""
    stem = entry_point.split(":", 1)[-1].rsplit("/", 1)[-1].removesuffix(".py")
    return sanitize(stem)


def timestamped(base: str, *, now: datetime) -> str:
    """``<base>-YYYYmmdd-HHMMSS-mmm`` (milliseconds last, as the SageMaker SDK's
    ``base_job_name`` stamps; max 63 chars): the name a cloud target's job gets, unique per
    submission, also for two submits in the same second (their code would share an S3 prefix)."""
    stamp = f"{now.strftime('%Y%m%d-%H%M%S')}-{now.microsecond // 1000:03d}"
    return f"{sanitize(base, max_length=MAX_TARGET_LENGTH - len(stamp) - 1)}-{stamp}"
