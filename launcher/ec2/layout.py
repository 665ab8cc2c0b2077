"""Where one EC2 job keeps its things in S3: the layout the client and the node side share.

Under the job's prefix (``{output_path}/{job}``): ``source/`` (code archive, runtime wheel),
``rendezvous/{launch token}/{rank}.json``, ``status/{host}.json`` (each node's report),
``logs/{host}/`` (the agent's and the ranks' logs), ``output/{host}/``, ``model/`` and, unless
``checkpoint.uri`` says otherwise, ``checkpoints/``. Both sides import this module and
nothing of each other.
"""

from __future__ import annotations

import json
from typing import Any

from dtrain.core import s3

# In a node's work dir, shared by the bootstrap's shell half (its user data) and Python half: the
# node's log, and the mark that the Python half wrote its final status (without it, the shell
# half reports the failure itself).
BOOTSTRAP_LOG = "bootstrap.log"
REPORTED = "reported"


def source_uri(prefix: str, name: str) -> str:
    return s3.join(prefix, "source", name)


def rendezvous_folder(prefix: str, launch_token: str) -> str:
    return s3.join(prefix, "rendezvous", launch_token)


def status_folder(prefix: str) -> str:
    return s3.join(prefix, "status")


def status_uri(prefix: str, host: str) -> str:
    return s3.join(status_folder(prefix), f"{host}.json")


def logs_folder(prefix: str, host: str | None = None) -> str:
    return s3.join(prefix, "logs", *([host] if host else []))


def bootstrap_log_uri(prefix: str, host: str) -> str:
    """The node's own log (bootstrap and agent lines), which ``dtrain logs`` reads."""
    return s3.join(logs_folder(prefix, host), BOOTSTRAP_LOG)


def output_folder(prefix: str, host: str) -> str:
    return s3.join(prefix, "output", host)


def model_folder(prefix: str) -> str:
    return s3.join(prefix, "model")


def checkpoint_uri(prefix: str, configured: str | None) -> str:
    """``checkpoint.uri`` if the spec set it, else ``{prefix}/checkpoints``: one answer for the
    download before the agent starts, the upload at the end and the contract's ``S3Uri``."""
    return configured or s3.join(prefix, "checkpoints")


# ---------------------------------------------------------------- S3 objects

def list_keys(client: Any, folder: str) -> list[str]:
    """Every key under ``folder`` (a folder: ``a/b`` lists ``a/b/...``, not ``a/bc``)."""
    bucket, prefix = s3.split(folder)
    prefix = f"{prefix}/" if prefix else ""
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [item["Key"] for item in page.get("Contents", [])]
    return keys


def put_json(client: Any, uri: str, body: dict[str, Any]) -> None:
    bucket, key = s3.split(uri)
    client.put_object(Bucket=bucket, Key=key, Body=json.dumps(body, sort_keys=True).encode(),
                      ContentType="application/json")


def read_json(client: Any, bucket: str, key: str) -> Any:
    return json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
