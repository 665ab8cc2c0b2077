"""The base of every spec section: unknown fields are refused, defaults are validated too, and a
yes/no is never taken for a number."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_yes_no_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads `true` as 1 for an int field: `sharding_degree: true` would mean DDP
        if isinstance(value, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            number = _accepts(annotation, int) or _accepts(annotation, float)
            if number and not _accepts(annotation, bool):
                raise ValueError(f"{str(value).lower()} is a yes/no; give a number")
        return value


def _accepts(annotation: Any, kind: type) -> bool:
    """Whether ``annotation`` (unions, ``Annotated``, ``Optional`` unwrapped) admits ``kind``."""
    if annotation is kind:
        return True
    return any(_accepts(arg, kind) for arg in get_args(annotation) if not isinstance(arg, str))
