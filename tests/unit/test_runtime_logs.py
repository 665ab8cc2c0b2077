"""Where the runtime's log lines (the attention kernel a model runs) go in a worker: to stderr,
which the node agent keeps as the rank's log, unless the script configures logging itself.

    pytest tests/unit/test_runtime_logs.py -q
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow


def run_script(body: str) -> list[str]:
    script = textwrap.dedent("""
        import logging
        import dtrain.runtime as rt
        log = logging.getLogger("dtrain.runtime.models")
    """) + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)
    return [line for line in proc.stderr.splitlines() if line.strip()]


def test_a_worker_without_logging_set_up_shows_the_runtime_lines_with_its_rank():
    lines = run_script("""
        rt.init(distribution={"sharding_degree": 1})
        log.info("attention kernel: eager (test)")
    """)
    assert len(lines) == 1 and lines[0].endswith("dtrain rank 0 attention kernel: eager (test)")


def test_logging_the_script_sets_up_before_or_after_init_gets_each_line_once():
    before = run_script("""
        logging.basicConfig(level=logging.INFO, format="USER %(message)s")
        rt.init(distribution={"sharding_degree": 1})
        log.info("one")
    """)
    assert before == ["USER one"]
    after = run_script("""
        rt.init(distribution={"sharding_degree": 1})
        log.info("one")
        logging.basicConfig(level=logging.INFO, format="USER %(message)s")
        log.info("two")
    """)
    assert len(after) == 2 and after[0].endswith("dtrain rank 0 one") and after[1] == "USER two"
