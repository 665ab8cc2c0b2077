"""jobs.wait_for polls at the target's own pace: half a second locally, seconds on AWS, whose
describe calls are rate-limited per account."""

from __future__ import annotations

from dtrain.jobs import api as jobs
from dtrain.jobs.store import JobStore
from dtrain.launcher.base import TargetState, Update, get_launcher


class _TwoPolls:
    """A target whose job is running on the first status call and completed on the second."""

    poll_s = 7.0
    state_type = TargetState

    def __init__(self) -> None:
        self.calls = 0

    def status(self, handle):
        self.calls += 1
        return Update(status="Running" if self.calls == 1 else "Completed")

    def pending_cleanup(self, record):
        return None


def _wait(monkeypatch, tmp_path, **kwargs) -> list[float]:
    store = JobStore(str(tmp_path / "jobs.db"))
    record = store.create(name="demo", target="local", spec={})
    monkeypatch.setattr(jobs, "launcher_for", lambda target, clients=None: _TwoPolls())
    sleeps: list[float] = []
    monkeypatch.setattr(jobs.time, "sleep", sleeps.append)
    assert jobs.wait_for(record.id, store=store, **kwargs).status == "Completed"
    return sleeps


def test_wait_for_sleeps_the_targets_interval_unless_told(monkeypatch, tmp_path):
    assert _wait(monkeypatch, tmp_path) == [7.0]
    assert _wait(monkeypatch, tmp_path, poll_s=0.25) == [0.25]


def test_cloud_targets_poll_in_seconds_and_local_in_half_seconds():
    from dtrain.launcher.ec2.launcher import Ec2Launcher
    from dtrain.launcher.sagemaker.launcher import SageMakerLauncher

    assert get_launcher("local").poll_s == 0.5
    assert SageMakerLauncher.poll_s >= 5 and Ec2Launcher.poll_s >= 5


class _EndedWithCleanupPending:
    """A target whose job has ended but whose clean-up never finishes (EC2: nodes that take
    their time to terminate), on a clock the test controls."""

    poll_s = 10.0
    state_type = TargetState

    def __init__(self, clock) -> None:
        self.clock = clock

    def status(self, handle):
        self.clock.now += 1.0  # each look at the cloud takes a moment
        return Update(status="Completed")

    def pending_cleanup(self, record):
        from dtrain.launcher.base import PendingCleanup

        return PendingCleanup(what="security group sg-1", once="the 2 nodes have terminated",
                              retry_hint="`dtrain status` tries again")


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_waiting_for_the_clean_up_stops_at_the_callers_timeout(monkeypatch, tmp_path):
    store = JobStore(str(tmp_path / "jobs.db"))
    record = store.create(name="demo", target="ec2", spec={})
    clock = _Clock()
    monkeypatch.setattr(jobs, "launcher_for", lambda target, clients=None:
                        _EndedWithCleanupPending(clock))
    monkeypatch.setattr(jobs, "time", clock)
    notes: list[str] = []
    started = clock.now
    final = jobs.wait_for(record.id, store=store, timeout_s=60, settle_s=300,
                          on_note=notes.append)
    assert final.status == "Completed"
    assert clock.now - started <= 60  # not the 300 s the clean-up alone may take
    assert notes[-1].startswith("warning: security group sg-1 still not removed after ")
    # without a timeout the clean-up gets its own bound
    clock.now, notes[:] = 1000.0, []
    jobs.wait_for(record.id, store=store, settle_s=300, on_note=notes.append)
    assert 290 <= clock.now - 1000.0 <= 301 and "after 300 s" in notes[-1]
