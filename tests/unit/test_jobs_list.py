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


def test_long_durations_read_in_hours_and_a_damaged_record_keeps_the_columns(dtrain_home):
    import re
    import sqlite3

    from click.testing import CliRunner
    from dtrain.cli.jobs import list_command
    from dtrain.jobs.store import JobStore

    store = JobStore()
    long = store.create(name="two-days", target="local", spec={}, status="Running")
    store.update(long.id, status="Completed", started_at=1000.0,
                 ended_at=1000.0 + 2 * 86400 + 65)
    short = store.create(name="short", target="local", spec={}, status="Running")
    store.update(short.id, status="Completed", started_at=1000.0, ended_at=1125.0)
    bad = store.create(name="bad", target="local", spec={}, status="Completed")
    with sqlite3.connect(store.path) as conn:
        conn.execute("UPDATE jobs SET spec = '{no' WHERE id = ?", (bad.id,))
    result = CliRunner().invoke(list_command, ["--no-refresh"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "48h01m" in result.output and "2m05s" in result.output  # '2881m05s' before
    created = lines[0].index("CREATED")  # 'unreadable' pushed its row's columns right
    assert all(re.search(r"\d{4}-\d\d-\d\d", line).start() == created for line in lines[1:])
