"""Processes a backend started: described when started, recognised (or not) later.

A recorded pid alone proves nothing: after a reboot or a long time, another process may hold
it. ``this_process``/``describe`` record the host, the boot, the pid namespace and the process's
start time; ``process_alive`` says whether that very process still runs, and ``signal_group``
signals only a process group whose leader is still that process.
"""

from __future__ import annotations

import os
import signal
import socket
from typing import Any


def describe(pid: int) -> dict[str, Any]:
    """Process ``pid`` of this machine, described well enough to tell later whether it runs."""
    return {"host": socket.gethostname(), "pid": pid, "boot_id": _boot_id(),
            "pid_namespace": _pid_namespace(), "created": _created(pid)}


def this_process() -> dict[str, Any]:
    return describe(os.getpid())


def process_alive(owner: dict[str, Any] | None) -> bool | None:
    """Whether the process ``describe()`` described still runs; None when this machine
    cannot tell (it ran on another host, or the record predates the description)."""
    if not owner or owner.get("host") != socket.gethostname():
        return None
    if owner.get("boot_id") != _boot_id():
        return False  # rebooted since: every process of then is gone
    if owner.get("pid_namespace", _pid_namespace()) != _pid_namespace():
        # another container on this kernel with the same host name (--net=host, a shared
        # ~/.dtrain): its pids mean nothing here
        return None
    # a zombie, or a later process that got the same pid, is not the owner
    created = _created(int(owner["pid"]))
    return created is not None and owner.get("created") in (None, created)


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


def _created(pid: int) -> float | None:
    """When ``pid`` started (epoch seconds, as psutil reads it); None if gone or a zombie."""
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return round(process.create_time(), 2)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
