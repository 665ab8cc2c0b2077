"""jobs.wait_for polls at the target's own pace: half a second locally, seconds on AWS, whose
describe calls are rate-limited per account."""

from __future__ import annotations

from dtrain import jobs
from dtrain.launcher.base import get_launcher
from dtrain.store import JobStore


class _TwoPolls:
    """A target whose job is running on the first status call and completed on the second."""

    poll_s = 7.0

    def __init__(self) -> None:
        self.calls = 0

    def status(self, record, *, store):
        self.calls += 1
        return store.update(record.id, status="Running" if self.calls == 1 else "Completed")

    def pending_cleanup(self, record):
        return None


def _wait(monkeypatch, tmp_path, **kwargs) -> list[float]:
    store = JobStore(str(tmp_path / "jobs.db"))
    record = store.create(name="demo", target="local", spec={})
    monkeypatch.setattr(jobs, "_launcher", lambda target, clients=None: _TwoPolls())
    sleeps: list[float] = []
    monkeypatch.setattr(jobs.time, "sleep", sleeps.append)
    assert jobs.wait_for(record.id, store=store, **kwargs).status == "Completed"
    return sleeps


def test_wait_for_sleeps_the_targets_interval_unless_told(monkeypatch, tmp_path):
    assert _wait(monkeypatch, tmp_path) == [7.0]
    assert _wait(monkeypatch, tmp_path, poll_s=0.25) == [0.25]


def test_cloud_targets_poll_in_seconds_and_local_in_half_seconds():
    from dtrain.launcher.ec2 import Ec2Launcher
    from dtrain.launcher.sagemaker import SageMakerLauncher

    assert get_launcher("local").poll_s == 0.5
    assert SageMakerLauncher.poll_s >= 5 and Ec2Launcher.poll_s >= 5
