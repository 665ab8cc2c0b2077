"""Input channels for the targets whose hosts share the submitting machine's files (local, Slurm).

Each channel becomes one folder that every host's contract links to: a local path is used in
place (a single file gets a folder of its own), an S3 prefix is downloaded once, at submit, into
the job's folder. So hosts never download anything, and a channel is read where it lies.
"""

from __future__ import annotations

import os
from typing import Any

from dtrain.core import contract, s3
from dtrain.core.errors import DtrainError


def stage_inputs(inputs: dict[str, str], job_dir: str, *, s3_client: Any = None
                 ) -> dict[str, str]:
    """channel -> a folder holding its data; an S3 client is made only for S3 inputs."""
    staged = {}
    for channel, uri in inputs.items():
        folder = os.path.join(job_dir, "inputs", channel)
        if s3.is_s3_uri(uri):
            if s3_client is None:
                import boto3

                s3_client = boto3.client("s3")
            staged[channel] = download_prefix(s3_client, uri, folder)
            continue
        source = os.path.abspath(os.path.expanduser(uri))
        if not os.path.exists(source):
            raise DtrainError(f"inputs.{channel}: {uri!r} does not exist; fix the path")
        if os.path.isfile(source):
            os.makedirs(folder, exist_ok=True)
            os.symlink(source, os.path.join(folder, os.path.basename(source)))
            source = folder
        staged[channel] = source
    return staged


def download_prefix(client: Any, uri: str, folder: str) -> str:
    """Every object under ``uri`` into ``folder`` (keys relative to the prefix); returns it.
    An AWS error (no such bucket, no credentials, access denied) is a one-line DtrainError."""
    from botocore.exceptions import BotoCoreError, ClientError
    from dtrain.launcher import aws

    try:
        return _download_prefix(client, uri, folder)
    except (ClientError, BotoCoreError) as exc:
        raise aws.as_dtrain_error(exc, f"downloading input {uri}", fix=(
            "fix the input's URI under inputs, or check that your AWS credentials can read "
            "it")) from None


def _download_prefix(client: Any, uri: str, folder: str) -> str:
    bucket, prefix = s3.split(uri)
    count = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            key = obj["Key"]
            rel = os.path.relpath(key, prefix) if prefix and key != prefix \
                else os.path.basename(key)
            if key.endswith("/") or rel.startswith(".."):
                continue
            target = os.path.join(folder, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            client.download_file(bucket, key, target)
            count += 1
    if count == 0:
        raise DtrainError(f"input {uri}: no objects under this prefix; check the URI")
    return folder


def link_channels(paths: contract.Paths, staged: dict[str, str]) -> None:
    """Make each channel folder of a host's contract a link to the staged folder."""
    for channel, source in staged.items():
        target = paths.channel_dir(channel)
        if os.path.islink(target):
            os.remove(target)  # written before: a requeued Slurm job writes it again
        elif os.path.isdir(target):
            os.rmdir(target)
        os.symlink(source, target)
