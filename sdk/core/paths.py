"""Where dtrain keeps its own files on this machine (stdlib only)."""

from __future__ import annotations

import os

HOME_ENV = "DTRAIN_HOME"
JOBS_DB_ENV = "DTRAIN_JOBS_DB"


def dtrain_home() -> str:
    """``$DTRAIN_HOME`` or ``~/.dtrain``: the job store, local job folders."""
    return os.environ.get(HOME_ENV) or os.path.join(os.path.expanduser("~"), ".dtrain")


def default_db_path() -> str:
    """``$DTRAIN_JOBS_DB`` or ``$DTRAIN_HOME/jobs.db``."""
    return os.environ.get(JOBS_DB_ENV) or os.path.join(dtrain_home(), "jobs.db")
