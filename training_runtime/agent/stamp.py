"""Time stamps on the node agent's output, so `dtrain logs` can merge the hosts' lines in time
order (``dtrain.core.logformat``): the agent's stdout and stderr, its workers' teed lines
included, go through a pipe whose reader writes each line with its time to where the output
went before. Only where the launcher asks for it (the local target; CloudWatch stamps lines
itself on SageMaker)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from dtrain.core import logformat


def stamp_output() -> Callable[[], None]:
    """Start stamping this process's output; returns the function that drains it at exit."""
    original = os.dup(1)
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)

    def pump() -> None:
        with os.fdopen(read_end, "rb") as source, os.fdopen(original, "wb", buffering=0) as out:
            for line in source:  # ends when every writer has closed its end
                out.write(logformat.stamp(time.time()).encode() + line)

    thread = threading.Thread(target=pump, name="dtrain-log-stamps", daemon=True)
    thread.start()

    def drain() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.close(1)
        os.close(2)
        thread.join(timeout=5)
    return drain
