"""The local job monitor stops the job's node agents when its own watching fails (a full disk
under its state file): a job shown Failed must not run on unwatched. A real child process stands
in for an agent, in its own session as the monitor starts them."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest
from dtrain.core.states import RUNNING
from dtrain.launcher.local import monitor


def test_a_monitor_that_cannot_write_its_state_stops_the_agents_it_started(monkeypatch, tmp_path):
    started: list[subprocess.Popen] = []

    def start_one_agent(request, job_dir, agents):
        agents.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                       start_new_session=True))
        started.extend(agents)

    def write_state(job_dir, **facts):
        if facts.get("status") == RUNNING:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(monitor, "start_agents", start_one_agent)
    monkeypatch.setattr(monitor, "write_state", write_state)
    with pytest.raises(OSError, match="No space left"):
        monitor.supervise({"grace_period_s": 1}, str(tmp_path), [])
    assert started and started[0].poll() is not None  # stopped, not left to run on


def test_writers_of_the_facts_file_at_once_each_land_whole(tmp_path):
    import threading

    from dtrain.launcher.local import layout

    errors: list[BaseException] = []

    def write(writer: int) -> None:  # the monitor and a `dtrain status` recovering the job
        try:
            for n in range(200):
                layout.write_state(str(tmp_path), **{f"writer{writer}": n})
        except BaseException as exc:  # noqa: BLE001 -- collected for the assert
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and sorted(p.name for p in tmp_path.iterdir()) == [layout.STATE_FILE]
    assert isinstance(layout.read_state(str(tmp_path)), dict)
