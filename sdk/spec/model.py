"""JobSpec: the declarative description of a training job (plain data, validated, no cloud I/O).

A spec comes from YAML/JSON (``JobSpec.from_file``), from Python keyword arguments, or from a
dict (``JobSpec.from_dict``); the CLI's ``--set key.path=value`` overrides apply before
validation. Every rule that can be checked before a cloud call is checked here, and every
problem is reported as ``field.path: what is wrong (the value); what to do``.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from dtrain.core import contract, instances, names, pipeline, s3
from dtrain.core.errors import SpecError, SpecWarning
from dtrain.spec import smp
from dtrain.spec.base import _Model, duration, takes_text
from dtrain.spec.targets import Ec2Options, SageMakerOptions, SlurmOptions
from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

RESERVED_HP_PREFIXES = ("dtrain_", "sagemaker_")
_CHANNEL = re.compile(r"^[A-Za-z0-9.\-_]{1,64}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
Seconds = duration(1, 28 * 86400)


def _note(message: str) -> None:
    """A SpecWarning shown at the user's line: the first caller outside dtrain and pydantic
    (a validator's own frame is inside pydantic, which is all ``stacklevel=2`` would show)."""
    import sys

    import pydantic

    inside = (str(Path(__file__).parents[1]), str(Path(pydantic.__file__).parent))
    frame, level = sys._getframe(1), 2  # level 2: the frame that called _note
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, SpecWarning, stacklevel=level)


DEFAULT_MAX_RUN_S = {"local": 2 * 3600, "sagemaker": 86400, "ec2": 86400, "slurm": 86400}


class Compute(_Model):
    """Where the job runs and on what."""

    target: Literal["local", "sagemaker", "ec2", "slurm"] = Field(
        "local", description="Where the job runs: this machine, SageMaker training jobs, EC2, "
        "or a Slurm cluster (HyperPod, ParallelCluster) from its login node.",
    )
    instance_type: str = Field(
        "local",
        description="Instance type from the catalog (`dtrain instances`), e.g. p4d.24xlarge or "
        "ml.p4d.24xlarge; `local` (CPU processes) or `local_gpu` for this machine; on Slurm, "
        "the nodes' type, or `local` for CPU nodes.",
    )
    instance_count: int = Field(1, ge=1, le=512, description="Number of instances (hosts).")
    processes_per_instance: int | None = Field(
        None, ge=1, le=64,
        description="Worker processes per instance; default: one per GPU (1 on `local`).",
    )
    volume_size_gb: int = Field(100, ge=1, le=16384, description="Storage volume per instance, GB.")
    use_spot: bool = Field(False, description="Use spot capacity (managed spot on SageMaker).")
    max_run: Seconds | None = Field(
        None, description="Longest the job may run, seconds or e.g. '2h'; then it is stopped "
        "(a checkpoint first). Default: 24 h on the cloud targets, 2 h on `local`, so a hung "
        "job cannot keep a laptop busy for a day.",
    )
    max_wait: Seconds | None = Field(
        None, description="Spot only: longest to wait for capacity plus run time; >= max_run."
    )
    max_restarts: int = Field(
        0, ge=0, le=100, description="How often the node agent restarts failed workers."
    )
    price_per_hour: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="Override the catalog's $/hour for one instance (prices change)."
    )
    oversubscribe: bool = Field(
        False, description="`local` only: run even when the worker processes far exceed this "
        "machine's cores (more than 4 per core), where a job crawls.",
    )

    @model_validator(mode="after")
    def _default_max_run(self) -> Compute:
        if self.max_run is None:
            self.max_run = DEFAULT_MAX_RUN_S[self.target]
        return self

    @field_validator("instance_type")
    @classmethod
    def _known_instance_type(cls, value: str) -> str:
        try:
            return instances.get(value).name
        except ValueError as exc:
            raise ValueError(f"{exc}; run `dtrain instances` for the list") from None

    @property
    def instance(self) -> instances.InstanceType:
        return instances.get(self.instance_type)

    @property
    def resolved_processes_per_instance(self) -> int:
        if self.processes_per_instance is not None:
            return self.processes_per_instance
        return max(1, self.instance.gpus)

    @property
    def world_size(self) -> int:
        return self.instance_count * self.resolved_processes_per_instance


def _smp_sections(schema: dict[str, Any]) -> None:
    """The SageMaker SDK's distribution sections, which validation translates
    (``dtrain.spec.smp``), in the schema too: an editor's or CI's check accepts what
    ``dtrain validate`` does."""
    schema["properties"].update({key: {
        "type": "object", "title": key.replace("_", " ").title(),
        "description": f"The SageMaker SDK's `distribution` section `{key}`, translated into "
                       "the fields above (see the porting guide)."}
        for key in smp.WRAPPER_KEYS})


class Distribution(_Model):
    """How the work is split across processes: MiCS sharded data parallelism, optionally
    composed with tensor and pipeline parallelism."""

    model_config = ConfigDict(json_schema_extra=_smp_sections)

    sharding_degree: int | Literal["auto", "full"] = Field(
        "auto",
        description="Size of a MiCS partition group: 1 = plain data parallel (DDP), world size "
        "or `full` = ZeRO-3 full shard, in between = MiCS; `auto` = the planner's "
        "scale-aware choice.",
    )
    backend: Literal[contract.BACKENDS] = Field(
        "auto",
        description="`auto`: NCCL on GPUs plus dtrain's topology-aware collectives, gloo on "
        "CPU; `nccl`: stock NCCL collectives only; `gloo`.",
    )
    gradient_accumulation_steps: int = Field(
        1, ge=1, le=1024, description="Micro-batches per optimizer step (2-hop gradient sync)."
    )
    mixed_precision: Literal[contract.MIXED_PRECISIONS] = Field(
        "auto", description="Compute dtype; `auto` = bf16 where the GPU has it, fp16 on V100, "
        "fp32 on CPU.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute block activations in backward to save memory."
    )
    hierarchical_allgather: Literal["auto"] | bool = Field(
        "auto",
        description="All-gather across nodes in two stages (inter-node, then intra-node) when a "
        "partition group spans nodes; `auto` = on there with backend `auto`.",
    )
    attention: Literal[contract.ATTENTION_KERNELS] = Field(
        "flash", description="Attention kernel of dtrain's models in the built-in recipes "
        "(their `attention` hyperparameter overrides it); a script passes it on as "
        "`from_preset(..., attention=ctx.config.attention)`."
    )
    tensor_parallel_degree: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        1,
        description="Ranks that split each layer of the model (inside one node); MiCS shards "
        "what they leave over the other ranks. 1 = off; `auto` = the planner's smallest degree "
        "at which the model's states, layer and activations fit the devices.",
    )
    tensor_parallel_mode: Literal["1d", "2d"] = Field(
        "1d",
        description="`1d`: Megatron-style (heads, MLP and vocabulary split; with "
        "sequence_parallel the norms split the sequence); `2d`: Optimus-style q × q grid (a "
        "square degree), every activation split over the grid too.",
    )
    sequence_parallel: Literal["auto"] | bool = Field(
        "auto",
        description="1-D tensor parallelism: split layer norms and residual activations along "
        "the sequence; `auto` = on when tensor_parallel_degree is above 1.",
    )
    pipeline_parallel_degree: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        1,
        description="Pipeline stages the model's blocks are cut into, one group of ranks each "
        "(the outermost axis: only the activations between stages cross it, so it may span "
        "nodes). 1 = off; `auto` = the planner picks pipeline, tensor-parallel and sharding "
        "degrees together by its cost model (memory fit first, then step time).",
    )
    microbatches: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="Pipeline only: data-loader micro-batches per pipeline step; the schedule "
        "overlaps them across stages. `auto` = 2 × pipeline_parallel_degree. 1f1b needs at least "
        "pipeline_parallel_degree; interleaved schedules a whole number of rounds of it.",
    )
    pipeline_schedule: Literal[pipeline.SCHEDULE_CHOICES] = Field(
        "auto",
        description="Pipeline only: `gpipe` (all forwards, then all backwards), `1f1b` (one "
        "forward, one backward: fewer activations held), `interleaved-1f1b` (several stages per "
        "rank: a smaller bubble), `interleaved-zero-bubble` (and backward split into input and "
        "weight gradients to fill the bubble), `zbv` (zero-bubble, two stages per rank in a V); "
        "`auto` = interleaved (zero-bubble when no partition group reshards parameters, i.e. "
        "sharding degree 1; else interleaved-1f1b) when the model has a block for each of the "
        "stages (2 per rank), else 1f1b, or gpipe with fewer micro-batches than ranks.",
    )
    stages_per_rank: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="Pipeline only: stages (virtual stages) each rank holds; `auto` = 2 for the "
        "interleaved schedules and zbv, 1 otherwise.",
    )
    partition: Literal[pipeline.PARTITION_CHOICES] | list[int] = Field(
        "auto",
        description="Pipeline only: how blocks are cut into stages. `auto` = balance the "
        "measured FLOPs of the embeddings, blocks and head, stages fitting in memory (as "
        "SageMaker's auto_partition); `uniform` = the same number of blocks per stage; or the "
        "block each stage after the first starts with, e.g. [6] for blocks 0-5 and 6-end.",
    )
    gradient_sync: Literal[contract.GRADIENT_SYNC_SETTINGS] = Field(
        "auto",
        description="How replicas all-reduce gradients: `fsdp` = FSDP2's all-reduce per block "
        "inside backward; `overlapped` = SDP-style: gradient shards go into equal fusion "
        "buffers that a background communicator all-reduces (through host memory) while "
        "backward goes on; `auto` = overlapped where the all-reduce crosses nodes (never with "
        "pipeline parallelism, whose stages keep fsdp).",
    )

    @model_validator(mode="before")
    @classmethod
    def _translate_smp(cls, data: Any) -> Any:
        translated, notes = smp.translate_distribution(data)
        for note in notes:
            _note(note)
        return translated


class Checkpoint(_Model):
    """Sharded checkpoints written under the contract's checkpoints/ folder."""

    uri: str | None = Field(
        None,
        description="Where checkpoints are kept beyond the job: an s3:// URI (SageMaker, EC2) or "
        "a local folder; default: inside the job's output.",
    )
    interval_steps: int = Field(
        0, ge=0, description="Save every N optimizer steps; 0 = only at the end and on SIGTERM."
    )
    keep_last: int = Field(2, ge=1, description="How many complete checkpoints to keep.")


# The folder relative paths in the spec resolve against while it is validated (from_file: the
# spec file's folder); a context variable because pydantic's validation context does not reach
# a model built by its own __init__.
_BASE_DIR: ContextVar[Path | None] = ContextVar("dtrain_spec_base_dir", default=None)


class JobSpec(_Model):
    """A training job: what to run, on what, and how it is distributed."""

    name: str | None = Field(
        None, description="Job name (letters, digits, hyphens; up to 40); default: from the "
        "entry point.",
    )
    entry_point: str = Field(
        description="Script to run (relative to source_dir), or a built-in recipe such as "
        "`recipe:causal_lm`."
    )
    source_dir: str | None = Field(
        None, description="Folder with the training code; default: the entry point's folder."
    )
    hyperparameters: dict[str, Any] = Field(
        default_factory=dict,
        description="Passed to the script as --key value arguments and SM_HPS (JSON values).",
    )
    compute: Compute = Field(default_factory=Compute, description="Where and on what it runs.")
    distribution: Distribution = Field(
        default_factory=Distribution, description="Sharding and communication settings."
    )
    inputs: dict[str, str] = Field(
        default_factory=dict,
        description="Input channels: name -> s3:// URI, or a local path for local jobs.",
    )
    output_path: str | None = Field(
        None, description="Where model and output artifacts go: s3:// URI for cloud targets, "
        "a local folder for local jobs (default: under $DTRAIN_HOME/jobs).",
    )
    checkpoint: Checkpoint = Field(default_factory=Checkpoint, description="Checkpointing.")
    # their JSON schemas take what _numbers_as_text reads: numbers, and tags as SageMaker lists
    environment: Annotated[dict[str, str], WithJsonSchema(
        {"type": "object", "additionalProperties": {"type": ["string", "number"]}})] = Field(
        default_factory=dict, description="Environment variables for every worker."
    )
    tags: Annotated[dict[str, str], WithJsonSchema({"anyOf": [
        {"type": "object", "additionalProperties": {"type": ["string", "number"]}},
        {"type": "array", "items": {
            "type": "object", "required": ["Key", "Value"], "additionalProperties": False,
            "properties": {"Key": {"type": "string"}, "Value": {"type": ["string", "number"]}}}},
    ]})] = Field(
        default_factory=dict, description="Tags on cloud resources: a mapping, or SageMaker's "
        "list of {Key, Value}.")
    sagemaker: SageMakerOptions = Field(
        default_factory=SageMakerOptions, description="SageMaker-only settings."
    )
    ec2: Ec2Options = Field(default_factory=Ec2Options, description="EC2-only settings.")
    slurm: SlurmOptions = Field(default_factory=SlurmOptions, description="Slurm-only settings.")

    # --- construction -------------------------------------------------------------------

    def __init__(self, **data: Any) -> None:
        """``JobSpec(name=..., compute={...})`` from Python: the same one-line ``SpecError``
        messages as ``from_dict`` (relative paths resolve against the working directory)."""
        try:
            super().__init__(**data)
        except ValidationError as exc:
            from dtrain.spec.errors import explain

            raise SpecError(explain(exc, type(self))) from None

    @classmethod
    def from_dict(cls, data: Any, *, base_dir: str | os.PathLike | None = None) -> JobSpec:
        """Validate ``data``; relative paths resolve against ``base_dir`` (default: cwd)."""
        if not isinstance(data, dict):
            raise SpecError(f"spec: expected a mapping of fields, got {type(data).__name__}")
        odd = [key for key in data if not isinstance(key, str)]
        if odd:
            raise SpecError(f"spec: field names are text, got {odd[0]!r}; quote it or remove it")
        token = _BASE_DIR.set(Path(base_dir or os.getcwd()))
        try:
            return cls(**data)
        finally:
            _BASE_DIR.reset(token)

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, overrides: list[str] = ()) -> JobSpec:
        """Load YAML or JSON, apply ``key.path=value`` overrides, validate."""
        from dtrain.spec.io import apply_overrides, load_mapping

        data = apply_overrides(load_mapping(path), overrides,
                               text_at=lambda parts: takes_text(cls, parts))
        return cls.from_dict(data, base_dir=Path(path).resolve().parent)

    # --- field rules ----------------------------------------------------------------------

    @field_validator("name")
    @classmethod
    def _job_name(cls, value: str | None) -> str | None:
        return value if value is None else names.check(value)

    @field_validator("hyperparameters")
    @classmethod
    def _json_hyperparameters(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key, item in value.items():
            if key.startswith(RESERVED_HP_PREFIXES):
                raise ValueError(f"{key!r} is reserved (prefixes dtrain_, sagemaker_); rename it")
            try:
                json.dumps(item, allow_nan=False)
            except (TypeError, ValueError, RecursionError):
                raise ValueError(
                    f"{key!r} = {item!r:.60} is not JSON-serialisable; use strings, numbers, "
                    "booleans, lists or mappings of those"
                ) from None
        return value

    @field_validator("inputs")
    @classmethod
    def _channel_names(cls, value: dict[str, str]) -> dict[str, str]:
        for channel, uri in value.items():
            if not _CHANNEL.match(channel):
                raise ValueError(
                    f"channel name {channel!r} is invalid; use up to 64 letters, digits, . - _"
                )
            if s3.is_s3_uri(uri):
                s3.check(uri, f"inputs.{channel}")
        return value

    @field_validator("environment", "tags", mode="before")
    @classmethod
    def _numbers_as_text(cls, value: Any, info: ValidationInfo) -> Any:
        """``OMP_NUM_THREADS: 4`` means "4"; SageMaker-style tags (``[{"Key": ..., "Value":
        ...}]``, as the SageMaker SDK takes them) are read as a mapping."""
        if info.field_name == "tags" and isinstance(value, list) and all(
                isinstance(tag, dict) and set(tag) == {"Key", "Value"} for tag in value):
            value = {tag["Key"]: tag["Value"] for tag in value}
        if isinstance(value, dict):
            return {key: str(item) if isinstance(item, (int, float)) and
                    not isinstance(item, bool) else item for key, item in value.items()}
        return value

    @field_validator("environment")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not _ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
        return value

    @field_validator("tags")
    @classmethod
    def _aws_tags(cls, value: dict[str, str]) -> dict[str, str]:
        for key, item in value.items():
            if not 1 <= len(key) <= 128 or len(item) > 256 or key.lower().startswith("aws:"):
                raise ValueError(
                    f"tag {key!r}: keys are 1-128 characters and may not start with 'aws:', "
                    "values at most 256 characters"
                )
        return value

    @model_validator(mode="after")
    def _cross_field_rules(self, info: ValidationInfo) -> JobSpec:
        from dtrain.spec.rules import check_spec

        problems, notes = check_spec(self, _BASE_DIR.get() or Path(os.getcwd()))
        for note in notes:
            _note(note)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    # --- derived facts ------------------------------------------------------------------

    @property
    def is_recipe(self) -> bool:
        return self.entry_point.startswith(contract.RECIPE_PREFIX)

    @property
    def world_size(self) -> int:
        return self.compute.world_size

    def to_dict(self) -> dict[str, Any]:
        """The validated spec as plain JSON-compatible data (round-trips through from_dict)."""
        return self.model_dump(mode="json")
