"""A local job's folder: one contract root per simulated host, the request, and the facts file.

The monitor (``python -m dtrain.launcher.local.monitor``) owns the job while it runs and writes
what happens to ``job_state.json``; ``LocalLauncher.status`` reads it. Neither touches the job
store: the jobs layer writes what ``status`` returns.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any

from dtrain.launcher.agents import agent_log, host_root  # noqa: F401 - this layout, shared

REQUEST_FILE = "request.json"
STATE_FILE = "job_state.json"
MONITOR_LOG = "monitor.log"


def read_state(job_dir: str) -> dict[str, Any]:
    """The monitor's facts so far ({} before it wrote any)."""
    try:
        with open(os.path.join(job_dir, STATE_FILE)) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_state(job_dir: str, **facts: Any) -> dict[str, Any]:
    """Merge ``facts`` into the facts file, atomically (a reader never sees half a file); each
    writer has a temporary file of its own (the monitor and a `dtrain status` recovering the
    job may write at once)."""
    state = {**read_state(job_dir), **facts}
    path = os.path.join(job_dir, STATE_FILE)
    fd, tmp = tempfile.mkstemp(dir=job_dir, prefix=f".{STATE_FILE}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(state, fh, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return state
