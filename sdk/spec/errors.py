"""Turn pydantic's ValidationError into one line per problem: field path, value, fix."""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

_FIX = {
    "missing": "add it",
    "int_parsing": "give a whole number",
    "int_type": "give a whole number",
    "int_from_float": "give a whole number",
    "float_parsing": "give a number",
    "bool_parsing": "give true or false",
    "bool_type": "give true or false",
    "string_type": "give a string (quote it in YAML)",
    "dict_type": "give a mapping of key: value",
    "list_type": "give a list",
}


def explain(exc: ValidationError, root: type[BaseModel]) -> list[str]:
    problems: list[str] = []
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        path = ".".join(str(p) for p in loc)
        kind = error["type"]
        if kind == "value_error":
            message = str(error.get("ctx", {}).get("error") or error["msg"])
            # Cross-field rules already name their fields, and so may a field validator that
            # names a part of its field (inputs.train); the others get the path here.
            lines = message.split("\n")
            problems.extend(f"{path}: {line}" if path and not line.startswith(f"{path}.")
                            else line for line in lines)
        elif kind == "extra_forbidden":
            problems.append(_unknown_field(root, loc))
        else:
            problems.append(_generic(path, error))
    return problems or [str(exc)]


def _generic(path: str, error: dict[str, Any]) -> str:
    msg = error["msg"][0].lower() + error["msg"][1:]
    where = path or "spec"
    if error["type"] == "missing":
        return f"{where}: required field is missing; add it"
    value = _short(error.get("input"))
    fix = _FIX.get(error["type"])
    return f"{where}: {msg} (got {value})" + (f"; {fix}" if fix else "")


def _unknown_field(root: type[BaseModel], loc: tuple) -> str:
    *parent, name = loc
    path = ".".join(str(p) for p in loc)
    known = _fields_at(root, parent)
    close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.5)
    hint = f"did you mean {'.'.join([*map(str, parent), close[0]])!r}?" if close else (
        f"valid fields here: {', '.join(known)}" if known else "remove it"
    )
    return f"{path}: unknown field; {hint}"


def _fields_at(root: type[BaseModel], parent: list) -> list[str]:
    """Field names of the model found by walking ``parent`` from ``root``."""
    model: Any = root
    for part in parent:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return []
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        model = _model_in(field.annotation)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return []


def _model_in(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
