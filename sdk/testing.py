"""Test helpers for running your own dtrain job specs against a local fake AWS (moto) in CI.

Use the ``moto_aws`` fixture in a pytest suite (needs ``moto[server]``, in ``dtrain[dev]``)::

    # conftest.py
    pytest_plugins = ["dtrain.testing"]

    # test_my_job.py
    import subprocess

    def test_my_spec_submits(moto_aws):
        moto_aws.s3.create_bucket(Bucket="my-bucket")
        subprocess.run(["dtrain", "submit", "job.yaml", "--target", "sagemaker",
                        "--set", "output_path=s3://my-bucket/dtrain",
                        "--set", f"sagemaker.role={moto_aws.role_arn}"], check=True)
        job = moto_aws.sagemaker.list_training_jobs()["TrainingJobSummaries"][0]
        assert job["TrainingJobStatus"] == "Completed"

The fixture starts ``moto.server.ThreadedMotoServer`` on a free loopback port and, for the
test's duration, sets ``AWS_ENDPOINT_URL`` (so every boto3 client, including a ``dtrain``
subprocess, talks to it), fake credentials, ``AWS_DEFAULT_REGION`` and a temporary
``DTRAIN_HOME``. It yields a ``MotoAws`` with ready clients (``s3``, ``sagemaker``, ``logs``),
the endpoint and a role ARN. moto completes training jobs at once and has no
``StopTrainingJob``; tests that need those behave as described in dtrain's own tests.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

REGION = "us-east-1"
ROLE_ARN = "arn:aws:iam::123456789012:role/DtrainTestRole"
_FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_REGION": REGION,
}


@dataclass
class MotoAws:
    endpoint: str
    region: str = REGION
    role_arn: str = ROLE_ARN
    _clients: dict[str, Any] = field(default_factory=dict)

    def client(self, service: str) -> Any:
        """A boto3 client for ``service`` bound to the moto server (cached)."""
        if service not in self._clients:
            import boto3

            self._clients[service] = boto3.client(service, region_name=self.region,
                                                  endpoint_url=self.endpoint)
        return self._clients[service]

    @property
    def s3(self) -> Any:
        return self.client("s3")

    @property
    def sagemaker(self) -> Any:
        return self.client("sagemaker")

    @property
    def logs(self) -> Any:
        return self.client("logs")

    def environ(self) -> dict[str, str]:
        """What a subprocess needs to reach this server (already set in ``os.environ``)."""
        return {**_FAKE_ENV, "AWS_ENDPOINT_URL": self.endpoint}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def moto_aws(tmp_path, monkeypatch) -> Iterator[MotoAws]:
    """A moto server for one test, with the environment pointing every AWS client at it."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    aws = MotoAws(endpoint=f"http://127.0.0.1:{port}")
    # moto keeps its state per process, not per server: start every test from empty.
    _reset(aws.endpoint)
    for key, value in aws.environ().items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("DTRAIN_HOME", str(tmp_path / "dtrain-home"))
    try:
        yield aws
    finally:
        _reset(aws.endpoint)
        server.stop()


def _reset(endpoint: str) -> None:
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"),
                           timeout=10).read()
