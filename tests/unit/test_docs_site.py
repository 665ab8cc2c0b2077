"""The docs site builds with `mkdocs build --strict` (broken links, anchors and nav entries
fail), and its hand-written pages stay true to the code."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def test_mkdocs_build_strict_passes(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
         "--config-file", str(REPO / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    site = tmp_path / "site"
    assert (site / "reference" / "spec" / "index.html").exists()
    assert not (site / "gen_reference.py").exists(), "the generator is not published"
    mics = (site / "concepts" / "mics" / "index.html").read_text()
    assert mics.count('class="mermaid"') >= 2, "mermaid fences render as diagrams"


def test_every_page_is_in_the_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    missing = [p for p in pages if p not in nav]
    assert not missing, f"add these pages to nav in mkdocs.yml: {missing}"


RUNTIME_DIR = REPO / "training_runtime"  # the folder behind dtrain.runtime


def _top_level_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _lazy_exports() -> dict[str, str]:
    """``dtrain.runtime``'s public names -> defining module, read without importing torch."""
    tree = ast.parse((RUNTIME_DIR / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_LAZY"
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def _module_file(module: str) -> Path | None:
    rel = module.removeprefix("dtrain.runtime").strip(".").replace(".", "/")
    for candidate in (RUNTIME_DIR / f"{rel}.py", RUNTIME_DIR / rel / "__init__.py"):
        if rel and candidate.is_file():
            return candidate
    return None


def _exists(dotted: str) -> bool:
    """``dtrain.runtime.NAME`` (a lazy export) or ``dtrain.runtime.PACKAGE.MODULE[.NAME]``."""
    rest = dotted.removeprefix("dtrain.runtime.").split(".")
    lazy = _lazy_exports()
    if len(rest) == 1 and rest[0] in lazy:
        return rest[0] in _top_level_names(_module_file(lazy[rest[0]]))
    for split in range(len(rest), 0, -1):
        module = _module_file("dtrain.runtime." + ".".join(rest[:split]))
        if module is not None:
            names = rest[split:]
            return not names or (len(names) == 1 and names[0] in _top_level_names(module))
    return False


def test_runtime_api_page_names_only_what_exists_and_covers_the_public_api():
    page = (DOCS / "reference" / "runtime-api.md").read_text()
    names = sorted(set(re.findall(r"dtrain\.runtime(?:\.[A-Za-z_]\w*)+", page)))
    assert names
    missing = [name for name in names if not _exists(name)]
    assert not missing, f"docs/reference/runtime-api.md names what does not exist: {missing}"
    for public in _lazy_exports():
        assert f"dtrain.runtime.{public}" in page, f"dtrain.runtime.{public} is not documented"


def test_benchmarks_page_has_a_section_per_script_and_invents_no_figures():
    page = (DOCS / "benchmarks.md").read_text()
    for script in sorted((REPO / "benchmarks").glob("*.py")):
        if script.name.startswith("_"):
            continue
        assert f"## `benchmarks/{script.name}`" in page, f"docs/benchmarks.md: add {script.name}"
        assert f"python benchmarks/{script.name}" in page, "each section shows its command"
