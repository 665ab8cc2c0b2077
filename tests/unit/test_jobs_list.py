"""``dtrain list`` asks the targets of unfinished jobs for news for at most ``refresh_s`` seconds:
a target that hangs neither holds the list nor the process's exit. A stand-in launcher whose
status call sleeps plays the hanging target; the list runs in a process of its own, timed to
its exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent("""
    import time
    from dtrain.jobs import api
    from dtrain.jobs.store import JobStore

    class Hanging:
        def status(self, handle):
            time.sleep(60)

    store = JobStore()
    for n in range(3):
        store.create(name=f"job{n}", target="sagemaker", spec={}, job_id=f"job{n}")
    api.launcher_for = lambda target, clients=None: Hanging()
    api.handle_of = lambda record, launcher: record
    start = time.monotonic()
    records = api.list_jobs(store=store, refresh_s=1.0)
    print(len(records), round(time.monotonic() - start, 1), flush=True)
""")


def test_a_hanging_target_holds_neither_the_list_nor_the_exit(dtrain_home):
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=50, check=True)
    listed, seconds = done.stdout.split()
    assert listed == "3" and float(seconds) < 3
    assert time.monotonic() - start < 20  # the process ended without waiting for the calls
