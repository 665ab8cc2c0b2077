"""Processes a backend started: described when started, recognised (or not) later.

A recorded pid alone proves nothing: after a reboot or a long time, another process may hold
it. ``this_process``/``describe`` record the host, the boot, the pid namespace, the process's
start time and its command line; ``judge`` says whether that very process still runs (and if not,
why not), and ``signal_group``/``signal_process`` signal only that very process.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any


def describe(pid: int) -> dict[str, Any]:
    """Process ``pid`` of this machine, described well enough to tell later whether it runs."""
    seen = _inspect(pid)
    deadline = time.monotonic() + 2.0
    while seen and not seen[1] and time.monotonic() < deadline:
        # Just started: Popen returns while exec is still mapping the new program's arguments.
        time.sleep(0.01)
        seen = _inspect(pid)
    return {"host": socket.gethostname(), "pid": pid, "boot_id": _boot_id(),
            "pid_namespace": _pid_namespace(), "created": seen and seen[0],
            "cmdline": seen and seen[1]}


def this_process() -> dict[str, Any]:
    return describe(os.getpid())


def find_running(arguments: list[str]) -> dict[str, Any] | None:
    """A process of this machine whose command line ends with ``arguments`` (the program's
    path may differ between interpreters), described; None if none runs."""
    import psutil

    for found in psutil.process_iter(["cmdline"]):
        cmdline = found.info.get("cmdline") or []
        if len(cmdline) > len(arguments) and cmdline[-len(arguments):] == arguments:
            seen = _inspect(found.pid)
            if seen is not None:
                return describe(found.pid)
    return None


def process_alive(owner: dict[str, Any] | None) -> bool | None:
    """Whether the process ``describe()`` described still runs; None when this machine
    cannot tell (it ran on another host, or the record predates the description)."""
    return judge(owner)[0]


def judge(owner: dict[str, Any] | None) -> tuple[bool | None, str]:
    """(``process_alive``, why): why it is gone or cannot be judged; "" while it runs."""
    if not owner or owner.get("host") != socket.gethostname():
        return None, f"it ran on {owner.get('host') if owner else 'an unrecorded host'}"
    if owner.get("boot_id") != _boot_id():
        return False, "this machine has restarted since it started"  # every process of then is gone
    if owner.get("pid_namespace", _pid_namespace()) != _pid_namespace():
        # another container on this kernel with the same host name (--net=host, a shared
        # ~/.dtrain): its pids mean nothing here
        return None, "it ran in another pid namespace"
    pid = int(owner["pid"])
    seen = _inspect(pid)
    if seen is None:
        return False, f"pid {pid} has exited"
    # a later process that got the same pid is not the owner: another start time or program
    created, cmdline = seen
    recorded = owner.get("cmdline")  # empty: described before its arguments were readable
    if owner.get("created") not in (None, created) or (recorded and recorded != cmdline):
        return False, (f"pid {pid} now belongs to another process (`{' '.join(cmdline)[:80]}`, "
                       f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(created))})")
    return True, ""


def signal_group(owner: dict[str, Any], sig: int) -> bool:
    """Signal the process group led by the described process, only if it is still that process.

    Returns whether a signal was sent."""
    if not process_alive(owner):
        return False
    try:
        os.killpg(int(owner["pid"]), sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def signal_process(owner: dict[str, Any], sig: int = signal.SIGTERM) -> bool:
    """Signal the described process, only if it is still that process."""
    if not process_alive(owner):
        return False
    try:
        os.kill(int(owner["pid"]), sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return None


def _inspect(pid: int) -> tuple[float, list[str]] | None:
    """(start time as psutil reads it, command line) of ``pid``; None if gone or a zombie."""
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return round(process.create_time(), 2), process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
