"""The container contract: the /opt/ml-style tree and the ``SM_*`` environment every host sees.

Launchers write it (``write_host_contract``) and the node agent reads it (``read_contract``), so
the names live here once. STDLIB ONLY: the runtime imports this module inside containers.

Shapes follow SageMaker and its training toolkit, so a script written against ``SM_*`` variables
runs unchanged: ``hyperparameters.json`` holds every value JSON-encoded as a string (as the
SageMaker SDK sends them); environment values are plain strings when the value is a string and
compact, key-sorted JSON otherwise (the toolkit's ``mapping.to_env_vars``). dtrain's own settings
travel as hyperparameters prefixed ``dtrain_`` (like the SDK's ``sagemaker_program``) because on
SageMaker only hyperparameters and environment reach the container; they never reach the script.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dtrain.core import toolkit

DEFAULT_ROOT = "/opt/ml"
ROOT_ENV = "DTRAIN_ROOT"
RESERVED_PREFIX = "dtrain_"
# Environment the runtime reads besides SM_* (another engineer's MiCS runtime reads the first two).
DISTRIBUTION_ENV = "DTRAIN_DISTRIBUTION"
CHECKPOINT_DIR_ENV = "DTRAIN_CHECKPOINT_DIR"
# The spec's checkpoint.interval_steps and keep_last, which the Trainer reads (recipes included).
CHECKPOINT_INTERVAL_ENV = "DTRAIN_CHECKPOINT_INTERVAL_STEPS"
CHECKPOINT_KEEP_LAST_ENV = "DTRAIN_CHECKPOINT_KEEP_LAST"
MASTER_ADDR_ENV = "DTRAIN_MASTER_ADDR"
MASTER_PORT_ENV = "DTRAIN_MASTER_PORT"
DEFAULT_MASTER_PORT = 29500
RECIPE_PREFIX = "recipe:"
# Seconds workers get between SIGTERM and SIGKILL when a job is stopped (local target, agent).
GRACE_PERIOD_ENV = "DTRAIN_STOP_GRACE_PERIOD"
STOPPED_EARLY_FILE = "stopped_early.json"  # in SM_OUTPUT_DIR (Paths.stopped_early_file)
DEFAULT_GRACE_PERIOD_S = 30
RECIPE_PACKAGE = "dtrain.runtime.recipes"
# Exit code of a worker that stopped after a checkpoint because of SIGTERM (the Trainer's recipes),
# and of a node agent whose workers all did so: 128 + SIGTERM, what a SIGTERMed process reports.
# An interruption to resume from, not a crash.
PREEMPTED_EXIT_CODE = 143
# Exit code of a node agent that stopped its workers at max_run, as coreutils' timeout(1).
MAX_RUN_EXIT_CODE = 124
# Neither applies when every worker exited 0: a SIGTERM or max_run that came while the workers
# finished on their own (the final model save) leaves the agent's exit code 0, the job complete.
# The table: docs/concepts/container-contract.md, "Exit codes".

# Instance types without accelerators run workers on CPU with gloo.
CPU_INSTANCE_TYPES = frozenset({"local"})
# What the runtime assumes for a distribution key the launcher did not send; the same defaults
# as the JobSpec's Distribution (the runtime's DistributionConfig reads them from here).
DISTRIBUTION_DEFAULTS: dict[str, Any] = {
    "sharding_degree": "auto",
    "backend": "auto",
    "gradient_accumulation_steps": 1,
    "mixed_precision": "auto",
    "activation_checkpointing": False,
    "hierarchical_allgather": "auto",
    "attention": "flash",
    "tensor_parallel_degree": 1,
    "tensor_parallel_mode": "1d",
    "sequence_parallel": "auto",
    "gradient_sync": "auto",
    "pipeline_parallel_degree": 1,
    "microbatches": "auto",
    "pipeline_schedule": "auto",
    "stages_per_rank": "auto",
    "partition": "auto",
    # the resolved dtrain.core.parallelism plan (a dict), or None when sharding_degree is auto
    # and the model's size is known only at run time
    "parallelism": None,
}
# The choices of the distribution settings, for the spec's fields and the runtime's parse.
BACKENDS = ("auto", "nccl", "gloo")
MIXED_PRECISIONS = ("auto", "bf16", "fp16", "fp32")
ATTENTION_KERNELS = ("flash", "sdpa", "eager")
GRADIENT_SYNC_SETTINGS = ("auto", "fsdp", "overlapped")


def bare_instance_type(instance_type: str) -> str:
    """``ml.p4d.24xlarge`` -> ``p4d.24xlarge`` (SageMaker names carry the prefix, EC2's do not)."""
    return instance_type.removeprefix("ml.")


@dataclass(frozen=True)
class Paths:
    """Every path of the contract under one root (``/opt/ml`` on SageMaker)."""

    root: str

    def _join(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    @property
    def input_dir(self) -> str:
        return self._join("input")

    @property
    def input_config_dir(self) -> str:
        return self._join("input", "config")

    @property
    def data_dir(self) -> str:
        return self._join("input", "data")

    def channel_dir(self, channel: str) -> str:
        return self._join("input", "data", channel)

    @property
    def resource_config_file(self) -> str:
        return self._join("input", "config", "resourceconfig.json")

    @property
    def hyperparameters_file(self) -> str:
        return self._join("input", "config", "hyperparameters.json")

    @property
    def input_data_config_file(self) -> str:
        return self._join("input", "config", "inputdataconfig.json")

    @property
    def checkpoint_config_file(self) -> str:
        return self._join("input", "config", "checkpointconfig.json")

    @property
    def model_dir(self) -> str:
        return self._join("model")

    @property
    def code_dir(self) -> str:
        return self._join("code")

    @property
    def output_dir(self) -> str:
        return self._join("output")

    @property
    def output_data_dir(self) -> str:
        return self._join("output", "data")

    @property
    def output_intermediate_dir(self) -> str:
        return self._join("output", "intermediate")

    @property
    def failure_file(self) -> str:
        return self._join("output", "failure")

    @property
    def failure_details_file(self) -> str:
        """dtrain's machine-readable twin of ``failure`` (rank, host, exit code, timestamp)."""
        return self._join("output", "failure.json")

    @property
    def stopped_early_file(self) -> str:
        """Left by the Trainer when ``fit`` stopped on a signal (``preempted``): the node agent
        then reports a stop even if the script went on to exit 0."""
        return self._join("output", STOPPED_EARLY_FILE)

    @property
    def agent_exit_file(self) -> str:
        """The node agent's exit code, written as it exits (a launcher that lost sight of it
        reads it here)."""
        return self._join("output", "agent_exit.json")

    @property
    def logs_dir(self) -> str:
        return self._join("output", "logs")

    @property
    def checkpoints_dir(self) -> str:
        return self._join("checkpoints")

    def make_dirs(self, channels: list[str] = ()) -> None:
        for path in (self.input_config_dir, self.model_dir, self.output_data_dir,
                     self.output_intermediate_dir, self.logs_dir, self.checkpoints_dir,
                     *(self.channel_dir(c) for c in channels)):
            os.makedirs(path, exist_ok=True)


@dataclass(frozen=True)
class Settings:
    """dtrain's reserved ``dtrain_*`` hyperparameters, decoded."""

    entry_point: str
    job_name: str = ""
    instance_type: str = "local"
    source_dir: str | None = None
    distribution: dict[str, Any] = field(default_factory=lambda: dict(DISTRIBUTION_DEFAULTS))
    processes_per_host: int | None = None
    max_restarts: int = 0
    max_run: int | None = None
    checkpoint_interval_steps: int = 0  # 0: only at the end and on SIGTERM
    checkpoint_keep_last: int = 2

    def to_hyperparameters(self) -> dict[str, Any]:
        values = {
            "entry_point": self.entry_point, "job_name": self.job_name,
            "instance_type": self.instance_type, "source_dir": self.source_dir,
            "distribution": resolve_distribution(self.distribution),
            "processes_per_host": self.processes_per_host, "max_restarts": self.max_restarts,
            "max_run": self.max_run, "checkpoint_interval_steps": self.checkpoint_interval_steps,
            "checkpoint_keep_last": self.checkpoint_keep_last,
        }
        return {RESERVED_PREFIX + k: v for k, v in values.items() if v is not None}

    @classmethod
    def from_hyperparameters(cls, reserved: Mapping[str, Any]) -> Settings:
        values = {k[len(RESERVED_PREFIX):]: v for k, v in reserved.items()}
        if "entry_point" not in values:
            raise ValueError(
                "hyperparameters.json has no 'dtrain_entry_point'; "
                "write the contract with dtrain.core.contract.write_host_contract"
            )
        known = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in values.items() if k in known}
        kwargs["distribution"] = resolve_distribution(kwargs.get("distribution") or {})
        for key in ("processes_per_host", "max_restarts", "max_run", "checkpoint_interval_steps",
                    "checkpoint_keep_last"):
            if kwargs.get(key) is not None:
                kwargs[key] = int(kwargs[key])
        return cls(**kwargs)


def resolve_distribution(distribution: Mapping[str, Any]) -> dict[str, Any]:
    """The distribution dict workers see in ``DTRAIN_DISTRIBUTION``: every key present."""
    return {**DISTRIBUTION_DEFAULTS, **dict(distribution)}


# ---------------------------------------------------------------- writer (launcher side)

def _write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def write_host_contract(
    root: str,
    *,
    current_host: str,
    hosts: list[str],
    settings: Settings,
    hyperparameters: Mapping[str, Any] | None = None,
    channels: list[str] = (),
    checkpoint_s3_uri: str | None = None,
    checkpoint_local_path: str | None = None,
    network_interface_name: str = "eth0",
) -> Paths:
    """Write one host's config files and folders under ``root``; returns its paths.

    ``checkpoint_local_path`` replaces the host's own ``checkpoints/`` folder, e.g. with one
    folder every simulated host shares (a sharded checkpoint is written by all hosts together).
    """
    user_hps = dict(hyperparameters or {})
    clash = sorted(k for k in user_hps if k.startswith(RESERVED_PREFIX))
    if clash:
        raise ValueError(
            f"hyperparameters {clash} use the reserved prefix '{RESERVED_PREFIX}'; rename them"
        )
    if current_host not in hosts:
        raise ValueError(f"current_host {current_host!r} is not in hosts {hosts}")
    paths = Paths(os.path.abspath(root))
    paths.make_dirs(list(channels))
    group = {"instance_group_name": "homogeneousCluster",
             "instance_type": settings.instance_type, "hosts": sorted(hosts)}
    _write_json(paths.resource_config_file, {
        "current_host": current_host, "current_instance_type": settings.instance_type,
        "current_group_name": "homogeneousCluster", "hosts": sorted(hosts),
        "instance_groups": [group], "network_interface_name": network_interface_name,
    })
    _write_json(paths.hyperparameters_file,
                toolkit.encode_hyperparameters({**user_hps, **settings.to_hyperparameters()}))
    _write_json(paths.input_data_config_file, {
        c: {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated",
            "RecordWrapperType": "None"} for c in channels
    })
    checkpoint = {"LocalPath": checkpoint_local_path or paths.checkpoints_dir}
    if checkpoint_s3_uri:
        checkpoint["S3Uri"] = checkpoint_s3_uri
    _write_json(paths.checkpoint_config_file, checkpoint)
    return paths


# ---------------------------------------------------------------- reader (runtime side)

def _read_json(path: str, default: Any) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default


def count_gpus() -> int:
    """GPUs visible to this container without importing torch (device nodes, CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len(glob.glob("/dev/nvidia[0-9]*"))


@dataclass(frozen=True)
class Contract:
    """Typed view of one host's contract: what the node agent needs and what workers see."""

    paths: Paths
    current_host: str
    hosts: list[str]
    network_interface_name: str
    hyperparameters: dict[str, Any]
    settings: Settings
    channels: dict[str, str]
    input_data_config: dict[str, Any]
    resource_config: dict[str, Any]
    checkpoint_config: dict[str, Any]
    num_gpus: int
    num_cpus: int
    log_level: int = 20

    @property
    def node_rank(self) -> int:
        """Index of this host in the sorted host list (SageMaker's ``algo-N`` order)."""
        return sorted(self.hosts).index(self.current_host)

    @property
    def master_host(self) -> str:
        return min(self.hosts)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint_config.get("LocalPath") or self.paths.checkpoints_dir

    @property
    def module_dir(self) -> str:
        return self.settings.source_dir or self.paths.code_dir

    def user_args(self) -> list[str]:
        return toolkit.to_cmd_args(self.hyperparameters)

    def sm_environment(self) -> dict[str, str]:
        """The ``SM_*`` variables exactly as the SageMaker training toolkit sets them."""
        return toolkit.sm_environment(self)

    def worker_environment(self) -> dict[str, str]:
        """``SM_*`` plus what dtrain's runtime reads: distribution, checkpoints, root."""
        return {
            **self.sm_environment(),
            DISTRIBUTION_ENV: json.dumps(self.settings.distribution, sort_keys=True),
            CHECKPOINT_DIR_ENV: self.checkpoint_dir,
            CHECKPOINT_INTERVAL_ENV: str(self.settings.checkpoint_interval_steps),
            CHECKPOINT_KEEP_LAST_ENV: str(self.settings.checkpoint_keep_last),
            ROOT_ENV: self.paths.root,
        }


def host_paths(root: str | None = None) -> Paths:
    """The contract folders under ``root``: by default ``$DTRAIN_ROOT``, else ``/opt/ml``."""
    return Paths(os.path.abspath(root or os.environ.get(ROOT_ENV) or DEFAULT_ROOT))


def read_contract(root: str | None = None, *, num_gpus: int | None = None) -> Contract:
    """Read one host's contract from ``root`` (default: :func:`host_paths`')."""
    paths = host_paths(root)
    resource = _read_json(paths.resource_config_file, None)
    if resource is None:
        raise FileNotFoundError(
            f"no contract at {paths.root}: {paths.resource_config_file} is missing; "
            f"pass --root or set {ROOT_ENV} to the job's host folder"
        )
    raw = toolkit.decode_hyperparameters(_read_json(paths.hyperparameters_file, {}))
    reserved = {k: v for k, v in raw.items() if k.startswith(RESERVED_PREFIX)}
    settings = Settings.from_hyperparameters(reserved)
    input_data = _read_json(paths.input_data_config_file, {})
    if num_gpus is None:
        num_gpus = 0 if settings.instance_type in CPU_INSTANCE_TYPES else count_gpus()
    return Contract(
        paths=paths,
        current_host=resource["current_host"],
        hosts=list(resource["hosts"]),
        network_interface_name=resource.get("network_interface_name", "eth0"),
        # sagemaker_* keys are the SDK's framework settings: the toolkit keeps them from scripts
        hyperparameters={k: v for k, v in raw.items()
                         if k not in reserved and not k.startswith("sagemaker_")},
        settings=settings,
        # dtrain_* channels carry dtrain's code and runtime, not the script's data
        channels={c: paths.channel_dir(c) for c in sorted(input_data)
                  if not c.startswith(RESERVED_PREFIX)},
        input_data_config=input_data,
        resource_config=resource,
        checkpoint_config=_read_json(paths.checkpoint_config_file, {}),
        num_gpus=num_gpus,
        num_cpus=os.cpu_count() or 1,
        log_level=int(os.environ.get("SM_LOG_LEVEL", "20")),
    )
