"""The tags that mark what dtrain created on EC2, and the filters that find it again.

Every instance, volume, network interface, security group and placement group of a job carries
``aws.TAG_CREATED_BY`` and ``aws.TAG_JOB`` (shared with SageMaker) and the EC2-only keys below;
`dtrain ec2 gc` and every lookup by tag touch nothing without ``aws.TAG_CREATED_BY``.
"""

from __future__ import annotations

from typing import Any

from dtrain.launcher import aws

TAG_LAUNCH = "dtrain:launch"  # one submission's token: a job name may be used again later
TAG_NUM_NODES = "dtrain:num-nodes"  # lets gc see a cluster that never came up whole
TAG_PREFIX = "dtrain:prefix"  # where status and logs are, so a job name alone is enough
# When the launch began (UTC, LAUNCHED_AT_FORMAT): `dtrain ec2 gc` leaves young launches alone,
# and EC2 tells no creation time of a security or placement group.
TAG_LAUNCHED_AT = "dtrain:launched-at"
LAUNCHED_AT_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def tag_map(resource: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in resource.get("Tags", [])}


def filters(job: str | None, launch: str | None = None) -> list[dict[str, Any]]:
    """What dtrain created: of one job (all jobs when None), of one launch of it if given."""
    found = [{"Name": f"tag:{aws.TAG_CREATED_BY}", "Values": [aws.CREATED_BY]}]
    if job is not None:
        found.append({"Name": f"tag:{aws.TAG_JOB}", "Values": [job]})
    if launch is not None:
        found.append({"Name": f"tag:{TAG_LAUNCH}", "Values": [launch]})
    return found
