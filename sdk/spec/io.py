"""Reading spec files and applying ``--set key.path=value`` overrides."""

from __future__ import annotations

import json
import os
from typing import Any

import yaml
from dtrain.core.errors import SpecError


def load_mapping(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a YAML or JSON spec file into a dict, with one-line errors."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise SpecError(f"spec file {os.fspath(path)!r} not found; check the path") from None
    except IsADirectoryError:
        raise SpecError(f"{os.fspath(path)!r} is a folder; pass the job's YAML file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(f"{os.fspath(path)}{where}: invalid YAML ({problem})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SpecError(
            f"{os.fspath(path)}: the spec must be a mapping of fields, got {type(data).__name__}"
        )
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict:
    """Return a copy of ``data`` with each ``a.b.c=value`` set (value parsed as YAML)."""
    result = _deep_copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"--set {item!r}: expected key.path=value, e.g. compute.instance_count=2")
        parts = key.strip().split(".")
        node = result
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                prefix = ".".join(parts[: depth + 1])
                raise SpecError(f"--set {item!r}: {prefix} is a value, not a section")
            node = child
        node[parts[-1]] = parse_value(raw)
    return result


def parse_value(raw: str) -> Any:
    """JSON first (so 3e-4 is a number), then YAML (so 'true', '[a, b]' work), else the text."""
    if not raw.strip():
        return ""
    try:
        return json.loads(raw)
    except ValueError:
        pass
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data
