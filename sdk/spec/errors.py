"""Turn pydantic's ValidationError into one line per problem: field path, value, fix."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from dtrain.core.sizing import either
from pydantic import BaseModel, ValidationError

_FIX = {
    "missing": "add it",
    "int_parsing": "give a whole number",
    "int_type": "give a whole number",
    "int_from_float": "give a whole number",
    "float_parsing": "give a number",
    "finite_number": "give a finite number",
    "int_parsing_size": "give a smaller whole number",
    "bool_parsing": "give true or false",
    "bool_type": "give true or false",
    "string_type": "give a string (quote it in YAML)",
    "dict_type": "give a mapping of key: value",
    "model_type": "give a section of fields (key: value; with --set, set one field: "
                  "section.field=value)",
    "list_type": "give a list",
}


def explain(exc: ValidationError, root: type[BaseModel]) -> list[str]:
    problems: list[str | tuple] = []  # a tuple: a field of several types, its errors in unions
    unions: dict[tuple, list[dict[str, Any]]] = {}
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        field = _union_field(root, loc)
        if field:  # pydantic tags each type's error (…sharding_degree.int, …partition.list[int].1)
            if field not in unions:
                problems.append(field)  # its place, filled in below
            unions.setdefault(field, []).append(error)
            continue
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
    lines = [_one_of(p, unions[p]) if isinstance(p, tuple) else p for p in problems]
    return lines or [str(exc)]


def _union_field(root: type[BaseModel], loc: tuple) -> tuple | None:
    """The place of a field that takes several types (``int | Literal["auto"]``) when ``loc``
    goes through it to the tag pydantic gives one of its types; None otherwise."""
    model: Any = root
    for depth, part in enumerate(loc):
        if model is None or str(part) not in model.model_fields:
            return None
        annotation = model.model_fields[str(part)].annotation
        model = _model_in(annotation)
        options = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if (typing.get_origin(annotation) in (typing.Union, types.UnionType)
                and len(options) > 1 and model is None):
            return loc[:depth + 1] if len(loc) > depth + 1 else None
    return None


def _one_of(loc: tuple, errors: list[dict[str, Any]]) -> str:
    """One line for a field of several types that matched none: what each would take."""
    wanted: list[str] = []
    for error in errors:
        kind, ctx, tag = error["type"], error.get("ctx") or {}, str(error["loc"][len(loc)])
        number = "a whole number" if "int" in tag else "a number"
        if len(error["loc"]) > len(loc) + 1:  # inside one type: a list's item
            wanted.append("a list of whole numbers" if tag == "list[int]" else tag)
        elif kind == "literal_error":
            wanted += str(ctx.get("expected", "")).split(" or ")
        elif kind in ("greater_than_equal", "less_than_equal"):
            wanted.append(f"{number} {'≥' if kind == 'greater_than_equal' else '≤'} "
                          f"{ctx.get('ge', ctx.get('le'))}")
        elif kind in ("int_parsing", "int_type", "int_from_float", "float_parsing",
                      "finite_number", "int_parsing_size"):
            wanted.append(number)
        elif kind == "value_error":
            wanted.append(str(ctx.get("error") or error["msg"]))
        else:
            wanted.append(_FIX.get(kind, error["msg"].lower()).removeprefix("give "))
    choices = either(list(dict.fromkeys(w for w in wanted if w)) or ["a valid value"])
    given = min(errors, key=lambda error: len(error["loc"])).get("input")  # the whole value
    return f"{'.'.join(map(str, loc))}: got {_short(given)}; give {choices}"


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
