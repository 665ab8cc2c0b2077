"""Distribution settings the runtime reads: the ``distribution`` argument or ``DTRAIN_DISTRIBUTION``.

Plain data with validation; no torch import, so the node agent can parse it cheaply. The degrees
(``sharding_degree``, ``hierarchical_allgather``, ``tensor_parallel_*``, ``sequence_parallel``,
``gradient_sync``, the pipeline's) are checked where they are turned into a plan,
:func:`dtrain.core.parallelism.build_parallelism_plan`, the function the planner uses too.
"""

from __future__ import annotations

import difflib
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from dtrain.core.contract import (
    ATTENTION_KERNELS,
    BACKENDS,
    DISTRIBUTION_ENV,
    GRADIENT_SYNC_SETTINGS,
    MIXED_PRECISIONS,
)
from dtrain.core.contract import DISTRIBUTION_DEFAULTS as _DEFAULTS
from dtrain.core.parallelism import ParallelismPlan

ENV_VAR = DISTRIBUTION_ENV


@dataclass(frozen=True)
class DistributionConfig:
    """What ``distribution`` in the job spec says, as the runtime needs it."""

    sharding_degree: int | str = _DEFAULTS["sharding_degree"]
    backend: str = _DEFAULTS["backend"]
    gradient_accumulation_steps: int = _DEFAULTS["gradient_accumulation_steps"]
    mixed_precision: str = _DEFAULTS["mixed_precision"]
    activation_checkpointing: bool = _DEFAULTS["activation_checkpointing"]
    hierarchical_allgather: bool | str = _DEFAULTS["hierarchical_allgather"]
    attention: str = _DEFAULTS["attention"]
    tensor_parallel_degree: int | str = _DEFAULTS["tensor_parallel_degree"]
    tensor_parallel_mode: str = _DEFAULTS["tensor_parallel_mode"]
    sequence_parallel: bool | str = _DEFAULTS["sequence_parallel"]
    gradient_sync: str = _DEFAULTS["gradient_sync"]
    pipeline_parallel_degree: int | str = _DEFAULTS["pipeline_parallel_degree"]
    microbatches: int | str = _DEFAULTS["microbatches"]
    pipeline_schedule: str = _DEFAULTS["pipeline_schedule"]
    stages_per_rank: int | str = _DEFAULTS["stages_per_rank"]
    partition: str | list[int] = _DEFAULTS["partition"]
    # the launcher's plan (dtrain plan printed it); None: built at run time from the above
    parallelism: ParallelismPlan | None = None

    def __post_init__(self) -> None:
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
        _check_choice("attention", self.attention, ATTENTION_KERNELS)
        _check_choice("gradient_sync", self.gradient_sync, GRADIENT_SYNC_SETTINGS)
        steps = self.gradient_accumulation_steps
        if not (isinstance(steps, int) and steps >= 1):
            raise ValueError(
                f"distribution.gradient_accumulation_steps must be an integer >= 1, got {steps!r}"
            )
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(  # noqa: TRY004 -- a settings error, like the others
                "distribution.activation_checkpointing must be true or false, "
                f"got {self.activation_checkpointing!r}"
            )
        if isinstance(self.parallelism, Mapping):
            object.__setattr__(self, "parallelism", ParallelismPlan.from_dict(self.parallelism))

    def plan_inputs(self) -> dict[str, Any]:
        """The settings :func:`~dtrain.core.parallelism.build_parallelism_plan` reads."""
        return {"sharding_degree": self.sharding_degree, "backend": self.backend,
                "hierarchical_allgather": self.hierarchical_allgather,
                "tensor_parallel_degree": self.tensor_parallel_degree,
                "tensor_parallel_mode": self.tensor_parallel_mode,
                "sequence_parallel": self.sequence_parallel,
                "gradient_sync": self.gradient_sync,
                "pipeline_parallel_degree": self.pipeline_parallel_degree,
                "microbatches": self.microbatches, "pipeline_schedule": self.pipeline_schedule,
                "stages_per_rank": self.stages_per_rank, "partition": self.partition}

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, strict: bool = True) -> DistributionConfig:
        """Build from a dict. An unknown key is refused (a script's typo would otherwise fall
        back to a default); with ``strict=False`` (the contract, which a newer client may have
        written with more than this runtime reads) it warns."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown and strict:
            close = {k: _meant(k, known) for k in unknown}
            raise ValueError("unknown distribution settings: " + ", ".join(
                f"{k!r}" + (f" (did you mean {close[k][0]!r}?)" if close[k] else "")
                for k in unknown))
        if unknown:
            warnings.warn(f"ignoring unknown distribution keys {unknown}", stacklevel=2)
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DistributionConfig:
        raw = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
        if not raw:
            return cls()
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{ENV_VAR} is not valid JSON ({err}); set it to a JSON object"
            ) from None
        if not isinstance(data, dict):
            raise ValueError(f"{ENV_VAR} must be a JSON object, got {raw!r}")  # noqa: TRY004
        return cls.from_mapping(data, strict=False)

    @classmethod
    def resolve(
        cls, distribution: DistributionConfig | Mapping[str, Any] | None
    ) -> DistributionConfig:
        if distribution is None:
            return cls.from_env()
        if isinstance(distribution, DistributionConfig):
            return distribution
        if isinstance(distribution, Mapping):
            return cls.from_mapping(distribution)
        raise ValueError(
            f"distribution must be a dict or DistributionConfig, got {type(distribution).__name__}"
        )


def _meant(key: str, known: set[str]) -> list[str]:
    """The setting ``key`` may have meant: one it begins (``tensor_parallel`` is most likely
    ``tensor_parallel_degree``), else the closest spelling."""
    begun = sorted(k for k in known if k.startswith(key))
    if begun:
        return sorted(begun, key=lambda k: not k.endswith("_degree"))[:1]
    return difflib.get_close_matches(key, known, n=1)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"distribution.{name} must be one of {', '.join(choices)}; got {value!r}")
