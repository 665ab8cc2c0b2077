"""The torch versions dtrain's runtime runs on: declared once, read by spec validation (an
image's ``framework_version`` or tag) and by the runtime at start (stdlib only)."""

from __future__ import annotations

import re

# 2.9 is the first torch with FSDP2's set_custom_all_gather (the MiCS hierarchical all-gather
# plugs in there) and set_force_sum_reduction_for_comms (gloo has no AVG reduction).
MINIMUM = (2, 9)
# The newest torch the test suite runs on (constraints.txt); the private names dtrain uses
# (dtrain.runtime.torch_private) were checked there.
TESTED = (2, 13)
_VERSION = re.compile(r"(\d+)\.(\d+)")


def parse(version: str) -> tuple[int, int] | None:
    """``"2.13.0+cpu"`` -> ``(2, 13)``; None when there is no ``major.minor``."""
    match = _VERSION.search(str(version))
    return (int(match.group(1)), int(match.group(2))) if match else None


def supported_range() -> str:
    return f"{MINIMUM[0]}.{MINIMUM[1]} to {TESTED[0]}.{TESTED[1]}"


def problem(version: str) -> str | None:
    """Why dtrain's runtime cannot run on torch ``version``; None when it can. A torch newer
    than tested passes (its private names are checked when the runtime starts)."""
    parsed = parse(version)
    if parsed is None:
        return f"{version!r} is not a torch version"
    if parsed < MINIMUM:
        return (f"torch {version} is older than dtrain's runtime supports "
                f"({supported_range()}; it needs FSDP2's custom all-gather)")
    return None
