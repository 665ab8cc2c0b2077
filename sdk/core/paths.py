"""Where dtrain keeps its own files on this machine (stdlib only)."""

from __future__ import annotations

import os

HOME_ENV = "DTRAIN_HOME"
JOBS_DB_ENV = "DTRAIN_JOBS_DB"


def dtrain_home() -> str:
    """``$DTRAIN_HOME`` or ``~/.dtrain``: the job store, local job folders."""
    home = os.environ.get(HOME_ENV) or os.path.join("~", ".dtrain")
    return os.path.abspath(os.path.expanduser(home))  # '~/dt' or 'dt' mean one place, not ./~/


def default_db_path() -> str:
    """``$DTRAIN_JOBS_DB`` or ``$DTRAIN_HOME/jobs.db``."""
    given = os.environ.get(JOBS_DB_ENV)
    return os.path.abspath(os.path.expanduser(given)) if given else \
        os.path.join(dtrain_home(), "jobs.db")
