"""The page 'What dtrain promises when things go wrong' names, for each promise, the test that
keeps it true: every test it names exists.

    pytest tests/unit/test_docs_failures.py -q
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "concepts" / "when-things-go-wrong.md"


def test_every_test_the_failures_page_names_exists():
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", PAGE.read_text())
    assert len(named) >= 15
    missing = []
    for path, name in named:
        tree = ast.parse((REPO / path).read_text())
        if name not in {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}:
            missing.append(f"{path}::{name}")
    assert missing == []
