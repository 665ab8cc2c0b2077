"""Private torch names live in dtrain.runtime.torch_private, checked against the installed torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from dtrain.core import torch_support
from dtrain.runtime import torch_private

RUNTIME = Path(__file__).resolve().parents[2] / "training_runtime"


def test_every_private_name_the_runtime_uses_exists_in_this_torch():
    assert torch_private.missing_private_names() == []
    torch_private.check_torch()  # the node agent's start-up check passes here


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def private_torch_uses(source: str) -> list[str]:
    """``torch``/``dist`` names with a private part that ``source`` imports or reads."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Attribute):
            names = [_dotted(node) or ""]
        else:
            continue
        found += [n for n in names if n.split(".")[0] in ("torch", "dist") and any(
            p.startswith("_") and not p.startswith("__") for p in n.split(".")[1:])]
    return found


def test_the_private_name_finder_finds_imports_and_attribute_chains():
    assert private_torch_uses("from torch.distributed.fsdp._fully_shard import x") != []
    assert private_torch_uses("dist.distributed_c10d._get_default_group()") != []
    assert private_torch_uses("import torch\ntorch.nn.Linear(1, 1)") == []


def test_no_other_runtime_module_reaches_into_private_torch():
    offenders = [f"{path.relative_to(RUNTIME)}: {name}"
                 for path in RUNTIME.rglob("*.py") if path.name != "torch_private.py"
                 for name in private_torch_uses(path.read_text())]
    assert offenders == []


def test_a_missing_private_name_fails_the_check_naming_torch_and_the_range(monkeypatch):
    monkeypatch.setattr(torch_private, "PRIVATE_NAMES",
                        (*torch_private.PRIVATE_NAMES, ("torch.distributed", "_no_such_name")))
    with pytest.raises(RuntimeError) as info:
        torch_private.check_torch()
    message = str(info.value)
    assert f"torch {torch.__version__} lacks torch.distributed._no_such_name" in message
    assert torch_support.supported_range() in message


def test_a_torch_older_than_the_range_fails_the_check(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu124")
    with pytest.raises(RuntimeError, match=r"torch 2\.5\.1\+cu124 is older than .* 2\.9 to 2\.13"):
        torch_private.check_torch()


def test_the_supported_range_covers_the_torch_the_suite_pins():
    pinned = next(line.split("==")[1] for line in
                  (RUNTIME.parent / "constraints.txt").read_text().splitlines()
                  if line.startswith("torch=="))
    assert torch_support.parse(pinned) == torch_support.TESTED
    assert torch_support.problem(pinned) is None
