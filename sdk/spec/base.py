"""The base of every spec section: unknown fields are refused, defaults are validated too."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)
