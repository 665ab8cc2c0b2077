"""``this_process``/``process_alive``: how a client that owns a step (an EC2 launch) is later
judged alive or gone by another ``dtrain`` process, on this machine or not.

    pytest tests/unit/test_process_owner.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys

from dtrain.launcher.process import judge, process_alive, this_process


def described_child(code: str) -> tuple[subprocess.Popen, dict]:
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    return child, json.loads(child.stdout.readline())


def test_a_running_process_is_alive_and_gone_once_it_exits():
    child, owner = described_child(
        "import json, sys; from dtrain.launcher.process import this_process; "
        "print(json.dumps(this_process()), flush=True); sys.stdin.read()")  # runs until killed
    try:
        assert owner["pid"] == child.pid and process_alive(owner) is True
    finally:
        child.kill()
        child.wait()
    assert process_alive(owner) is False


def test_what_this_machine_cannot_judge_is_unknown_and_a_reboot_ends_everything():
    me = this_process()
    assert process_alive(None) is None
    assert process_alive({**me, "host": "another-host"}) is None
    # another container on the same kernel and host name sees other pids
    assert process_alive({**me, "pid_namespace": (me["pid_namespace"] or 0) + 1}) is None
    assert process_alive({**me, "boot_id": "an-earlier-boot"}) is False
    # a record written before pid namespaces were recorded is judged as before
    assert process_alive({k: v for k, v in me.items() if k != "pid_namespace"}) is True


def test_a_pid_that_another_program_or_a_later_process_holds_is_not_the_owner():
    child, owner = described_child(
        "import json, sys; from dtrain.launcher.process import this_process; "
        "print(json.dumps(this_process()), flush=True); sys.stdin.read()")
    try:
        assert owner["cmdline"][:2] == [sys.executable, "-c"] and judge(owner) == (True, "")
        alive, why = judge({**owner, "cmdline": ["sleep", "300"]})  # same pid and start time
        assert alive is False and why.startswith(f"pid {child.pid} now belongs to another process")
        assert judge({**owner, "created": owner["created"] - 60})[0] is False
        # described before exec had mapped its arguments: the start time alone decides
        assert judge({**owner, "cmdline": []}) == (True, "")
    finally:
        child.kill()
        child.wait()
    assert judge(owner) == (False, f"pid {child.pid} has exited")
