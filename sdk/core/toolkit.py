"""The SageMaker training toolkit's conventions, which every target follows (stdlib only).

So that a script written against SageMaker's ``SM_*`` variables and ``--key value`` arguments
runs unchanged on every target: hyperparameters travel JSON-encoded as strings (as the SageMaker
SDK sends them) and are decoded with the toolkit's rule; environment values are plain strings
when the value is a string and compact, key-sorted JSON otherwise; arguments are sorted
``--key value`` pairs. ``c`` below is a :class:`dtrain.core.contract.Contract`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def encode_hyperparameters(values: Mapping[str, Any]) -> dict[str, str]:
    """Each value JSON-encoded as a string, as the SageMaker SDK sends hyperparameters."""
    return {str(k): json.dumps(v) for k, v in values.items()}


def decode_hyperparameters(values: Mapping[str, str]) -> dict[str, Any]:
    """The toolkit's rule: ``json.loads`` each value, keep the raw string when it is not JSON."""
    decoded = {}
    for key, value in values.items():
        try:
            decoded[key] = json.loads(value)
        except (TypeError, ValueError):
            decoded[key] = value
    return decoded


def module_name(entry_point: str) -> str:
    return entry_point.removesuffix(".py")


def to_env_vars(mapping: Mapping[str, Any]) -> dict[str, str]:
    """The toolkit's rule: ``SM_<KEY>``; strings as-is, anything else compact sorted JSON."""
    def value(v: Any) -> str:
        if isinstance(v, str):
            return v
        return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return {f"SM_{str(k).upper()}": value(v) for k, v in mapping.items()}


def to_cmd_args(hyperparameters: Mapping[str, Any]) -> list[str]:
    """The toolkit's rule: sorted keys, ``--key value`` (``-k`` for one letter), dicts as k=v,..."""
    args: list[str] = []
    for key in sorted(hyperparameters):
        value = hyperparameters[key]
        args.append(f"--{key}" if len(key) > 1 else f"-{key}")
        if isinstance(value, Mapping):
            args.append(",".join(f"{k}={v}" for k, v in sorted(value.items())))
        else:
            args.append(str(value))
    return args


def training_env(c: Any) -> dict[str, Any]:
    """What ``SM_TRAINING_ENV`` holds: the toolkit's environment as one object."""
    entry = c.settings.entry_point
    return {
        "additional_framework_parameters": {}, "channel_input_dirs": c.channels,
        "current_host": c.current_host,
        "current_instance_type": c.settings.instance_type,
        "hosts": sorted(c.hosts), "hyperparameters": c.hyperparameters,
        "input_config_dir": c.paths.input_config_dir,
        "input_data_config": c.input_data_config, "input_dir": c.paths.input_dir,
        "is_master": c.current_host == c.master_host,
        "job_name": c.settings.job_name, "log_level": c.log_level,
        "master_hostname": c.master_host, "model_dir": c.paths.model_dir,
        "module_dir": c.module_dir, "module_name": module_name(entry),
        "network_interface_name": c.network_interface_name,
        "num_cpus": c.num_cpus, "num_gpus": c.num_gpus,
        "output_data_dir": c.paths.output_data_dir,
        "output_dir": c.paths.output_dir,
        "output_intermediate_dir": c.paths.output_intermediate_dir,
        "resource_config": c.resource_config, "user_entry_point": entry,
    }


def sm_environment(c: Any) -> dict[str, str]:
    """The ``SM_*`` variables exactly as the SageMaker training toolkit sets them."""
    env: dict[str, Any] = {
        "hosts": sorted(c.hosts), "network_interface_name": c.network_interface_name,
        "hps": c.hyperparameters, "user_entry_point": c.settings.entry_point,
        "framework_params": {}, "resource_config": c.resource_config,
        "input_data_config": c.input_data_config,
        "output_data_dir": c.paths.output_data_dir, "channels": sorted(c.channels),
        "current_host": c.current_host,
        "current_instance_type": c.settings.instance_type,
        "module_name": module_name(c.settings.entry_point),
        "log_level": c.log_level, "input_dir": c.paths.input_dir,
        "input_config_dir": c.paths.input_config_dir,
        "output_dir": c.paths.output_dir, "num_cpus": c.num_cpus,
        "num_gpus": c.num_gpus, "model_dir": c.paths.model_dir,
        "module_dir": c.module_dir, "training_env": training_env(c),
        "user_args": c.user_args(),
        "output_intermediate_dir": c.paths.output_intermediate_dir,
    }
    env.update({f"channel_{name}": path for name, path in c.channels.items()})
    env.update({f"hp_{key}": value for key, value in c.hyperparameters.items()})
    return to_env_vars(env)
