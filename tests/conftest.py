"""Shared fixtures: every test gets its own DTRAIN_HOME so no test touches ~/.dtrain."""

from __future__ import annotations

import os
import time

import pytest


@pytest.fixture(autouse=True)
def dtrain_home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("dtrain-home")
    monkeypatch.setenv("DTRAIN_HOME", str(home))
    monkeypatch.delenv("DTRAIN_JOBS_DB", raising=False)
    # AWS settings of the test, never of the machine: a region boto3 and dtrain agree on, and
    # no config file or credentials from the developer's home
    monkeypatch.setenv("AWS_CONFIG_FILE", str(home / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "aws-credentials"))
    if not os.environ.get("AWS_REGION"):
        monkeypatch.setenv("AWS_DEFAULT_REGION", os.environ.get("AWS_DEFAULT_REGION",
                                                               "us-east-1"))
    return home


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_zombie(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture
def live_processes():
    """``live_processes(text)`` -> cmdlines of running (non-zombie) processes that mention text.

    ``settle_s`` gives processes that are already exiting that long to be gone.
    """
    def find(text: str, *, settle_s: float = 5.0) -> list[str]:
        me = str(os.getpid())
        deadline = time.monotonic() + settle_s
        while True:
            found = [
                cmd for pid in os.listdir("/proc")
                if pid.isdigit() and pid != me and text in (cmd := _cmdline(pid))
                and not _is_zombie(pid)
            ]
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.1)
    return find
