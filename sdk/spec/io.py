"""Reading spec files and applying ``--set key.path=value`` overrides.

Spec files are read as YAML 1.2 reads numbers (``lr: 1e-3`` is the number 0.001, not the
string YAML 1.1 makes of it; ``steps: 010`` is ten, not YAML 1.1's octal eight; ``max_run: 1:30``
is the text it looks like, not YAML 1.1's base-60 ninety), and a key given twice in one mapping
is an error naming its line instead of the last one silently winning.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

import yaml
from dtrain.core.errors import SpecError

# YAML 1.2's core-schema float: YAML 1.1's resolver wants a dot and a signed exponent.
_FLOAT_12 = re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+$")


class _SpecLoader(yaml.SafeLoader):
    """safe_load, with YAML 1.2 exponent floats and duplicate keys refused."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:  # `<<: *shared`: merged by the base class below
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise SpecError(f"{key_node.start_mark.name}, line {line}: a key must be a "
                                f"name, not a {type(key).__name__}; write the field's name")
            if key in seen:
                raise SpecError(f"{key_node.start_mark.name}, line {line}: key {key!r} is given "
                                f"twice (first on line {seen[key]}); keep one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _number(loader: _SpecLoader, node: yaml.ScalarNode) -> Any:
    """An int or float scalar as YAML 1.2 reads it: base 60 (``1:30``) is text, a leading zero
    is decimal; too many digits is an error naming the line."""
    text = loader.construct_scalar(node)
    if ":" in text:
        return text
    try:
        if node.tag == _FLOAT:
            return loader.construct_yaml_float(node)
        digits = text.replace("_", "")
        body = digits.lstrip("+-")
        sign = -1 if digits.startswith("-") else 1
        base = {"0x": 16, "0b": 2}.get(body[:2], 10)
        return sign * int(body[2:] if base != 10 else body, base)
    except ValueError:  # the regex matched, so only its length: beyond Python's digit limit
        raise SpecError(f"{node.start_mark.name}, line {node.start_mark.line + 1}: a number of "
                        f"{len(text)} digits ({text[:12]}...) is more than any field takes; "
                        "give a smaller one") from None


_MERGE, _FLOAT = "tag:yaml.org,2002:merge", "tag:yaml.org,2002:float"
_SpecLoader.add_implicit_resolver(_FLOAT, _FLOAT_12, list("-+0123456789."))
_SpecLoader.add_constructor("tag:yaml.org,2002:int", _number)
_SpecLoader.add_constructor(_FLOAT, _number)


def _load_yaml(text: Any) -> Any:
    return yaml.load(text, Loader=_SpecLoader)  # a SafeLoader subclass: no arbitrary objects


def load_mapping(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a YAML or JSON spec file into a dict, with one-line errors."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = _load_yaml(fh)
    except FileNotFoundError:
        raise SpecError(f"spec file {os.fspath(path)!r} not found; check the path") from None
    except IsADirectoryError:
        raise SpecError(f"{os.fspath(path)!r} is a folder; pass the job's YAML file") from None
    except UnicodeDecodeError as exc:
        raise SpecError(f"{os.fspath(path)}: not UTF-8 text (byte {exc.object[exc.start]:#04x} "
                        f"at offset {exc.start}); save the spec as UTF-8") from None
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


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...], *,
                    text_at: Callable[[list[str]], bool] = lambda parts: False) -> dict:
    """Return a copy of ``data`` with each ``a.b.c=value`` set: parsed as YAML, or as typed
    where ``text_at(path)`` says the field holds text only (``environment.ZIP=007`` stays
    ``"007"``; :func:`dtrain.spec.base.takes_text` answers it for a spec)."""
    result = _deep_copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"--set {item!r}: expected key.path=value, e.g. compute.instance_count=2")
        parts = key.strip().split(".")
        if not all(part.strip() for part in parts):
            raise SpecError(f"--set {item!r}: {key.strip()!r} has an empty name between its dots; "
                            "expected key.path=value, e.g. compute.instance_count=2")
        node = result
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                prefix = ".".join(parts[: depth + 1])
                raise SpecError(f"--set {item!r}: {prefix} is a value, not a section")
            node = child
        node[parts[-1]] = raw.strip() if text_at(parts) and not _quoted_or_null(raw) \
            else parse_value(raw)
    return result


def _quoted_or_null(raw: str) -> bool:
    """``"12345"`` (quoted as YAML would take it) or ``null``: parsed even for a text field."""
    text = raw.strip()
    return text in ("null", "~") or (len(text) > 1 and text[0] == text[-1] and text[0] in "'\"")


def parse_value(raw: str) -> Any:
    """JSON first (so 3e-4 is a number), then YAML (so 'true', '[a, b]' work), else the text."""
    if not raw.strip():
        return ""
    try:
        return json.loads(raw)
    except ValueError:
        pass
    try:
        return _load_yaml(raw)
    except (yaml.YAMLError, SpecError):
        return raw


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data
