"""The base of every spec section: unknown fields are refused, defaults are validated too, and a
yes/no is never taken for a number."""

from __future__ import annotations

import re
import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _parse_duration(value: Any) -> Any:
    """Seconds as an int, or a string like ``90m``, ``2h``, ``1.5d``."""
    if isinstance(value, str):
        match = _DURATION.match(value)
        if not match:
            raise ValueError(f"{value!r} is not a duration; use seconds or e.g. '90m', '2h', '1d'")
        return int(float(match.group(1)) * _UNIT_SECONDS[match.group(2)])
    return value


def duration(low: int, high: int) -> Any:
    """A field type of whole seconds in ``[low, high]``, given as seconds or as ``90m``, ``2h``,
    ``1d``; its JSON schema (``dtrain schema``) takes both forms."""
    return Annotated[int, BeforeValidator(_parse_duration), Field(ge=low, le=high),
                     WithJsonSchema({"anyOf": [
                         {"type": "integer", "minimum": low, "maximum": high},
                         {"type": "string", "pattern": _DURATION.pattern}]})]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_yes_no_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads `true` as 1 for an int field: `sharding_degree: true` would mean DDP
        if info.field_name is None:
            return value
        options = _options(cls.model_fields[info.field_name].annotation)
        if isinstance(value, bool) and _wants_a_number(options):
            raise ValueError(f"{str(value).lower()} is a yes/no; give a number")
        if isinstance(value, (list, tuple)) and any(isinstance(item, bool) for item in value):
            items = [arg for option in options if get_origin(option) in (list, tuple)
                     for arg in get_args(option) if arg is not Ellipsis]
            if items and _wants_a_number([o for item in items for o in _options(item)]):
                shown = ", ".join(str(v).lower() if isinstance(v, bool) else repr(v)
                                  for v in value)
                raise ValueError(f"[{shown}] holds a yes/no; give numbers")
        return value


def takes_text(model: type[BaseModel], parts: list[str]) -> bool:
    """Whether the field at ``parts`` (``environment.ZIP``, ``name``) holds text only, so a
    ``--set`` value for it is kept as typed (``007``, ``1.10``, ``true``) rather than read as a
    number or a yes/no."""
    annotation: Any = model
    for part in parts:
        options = [o for o in _options(annotation) if o is not type(None)]
        if len(options) != 1:
            return False
        current = options[0]
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(part)
            if field is None:
                return False
            annotation = field.annotation
        elif get_origin(current) is dict:  # a key of a mapping: its values' type
            annotation = get_args(current)[1]
        else:
            return False
    return [o for o in _options(annotation) if o is not type(None)] == [str]


def _options(annotation: Any) -> list[Any]:
    """The alternatives of a union (``Optional`` and ``Annotated`` unwrapped), else itself."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _options(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [option for arg in get_args(annotation) for option in _options(arg)]
    return [annotation]


def _wants_a_number(options: list[Any]) -> bool:
    return any(option in (int, float) for option in options) and bool not in options
