"""`dtrain logs` of a multi-host local job prints the hosts' lines in the order they were
written: each node agent stamps its output lines with their time (only on the local target)
and the reader merges the hosts by it, printing the lines without the stamps.

    pytest tests/unit/test_log_merge.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from dtrain.core import logformat
from dtrain.launcher.base import Handle, JobIdentity
from dtrain.launcher.local import layout
from dtrain.launcher.local.launcher import LocalLauncher, LocalState


def write_log(job_dir, host: str, lines: list[str]) -> None:
    path = layout.agent_log(str(job_dir), host)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(line + "\n" for line in lines)


def test_merge_orders_the_hosts_lines_by_time_and_keeps_unstamped_lines_with_their_message():
    merged = logformat.merge_by_time({
        "algo-1": ["@10.000 a first", "@30.000 a third", "  continued"],
        "algo-2": ["@20.000 b second", "@40.000 b fourth"],
    })
    assert merged == [("algo-1", "a first"), ("algo-2", "b second"), ("algo-1", "a third"),
                      ("algo-1", "  continued"), ("algo-2", "b fourth")]


def test_local_logs_of_two_hosts_come_in_time_order_without_stamps_and_filter_by_rank(tmp_path):
    write_log(tmp_path, "algo-1", ["@1.000 [algo-1 0]:step 1", "@3.000 agent says hi",
                                   "@5.000 [algo-1 0]:step 3"])
    write_log(tmp_path, "algo-2", ["@2.000 [algo-2 1]:step 1", "@4.000 [algo-2 1]:step 2"])
    handle = Handle(job=JobIdentity(id="1", name="j", submitted_at=0.0), status="Completed",
                    state=LocalState(job_dir=str(tmp_path), hosts=["algo-1", "algo-2"]))
    lines = list(LocalLauncher().logs(handle, follow=False, host=None, rank=None,
                                      ended=lambda: True))
    assert lines == ["[algo-1 0]:step 1", "[algo-2 1]:step 1", "[algo-1] agent says hi",
                     "[algo-2 1]:step 2", "[algo-1 0]:step 3"]
    only_rank_1 = list(LocalLauncher().logs(handle, follow=False, host=None, rank=1,
                                            ended=lambda: True))
    assert only_rank_1 == ["[algo-2 1]:step 1", "[algo-2 1]:step 2"]


def test_stamped_output_covers_stdout_stderr_and_child_processes_and_is_drained_at_exit():
    script = textwrap.dedent("""
        import subprocess, sys
        from dtrain.runtime.agent.stamp import stamp_output
        drain = stamp_output()
        print("from stdout", flush=True)
        print("from stderr", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-c", "print('from a child')"], check=True)
        print("last words")  # not flushed: the drain must still carry it out
        drain()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=True)
    stamped = [logformat.unstamp(raw) for raw in proc.stdout.splitlines()]
    assert [line for _when, line in stamped] == ["from stdout", "from stderr", "from a child",
                                                 "last words"]
    times = [when for when, _line in stamped]
    assert None not in times and times == sorted(times)
    assert proc.stderr == ""
