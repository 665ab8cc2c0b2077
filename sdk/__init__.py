"""dtrain: declarative distributed training jobs on this machine, SageMaker, EC2 or Slurm.

This module must stay cheap to import: containers import ``dtrain.runtime`` through it, and the
CLI's start-up time depends on it. Public names are therefore resolved lazily.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access)
_LAZY = {
    "JobSpec": "dtrain.spec.model",
    "SpecError": "dtrain.core.errors",
    "DtrainError": "dtrain.core.errors",
    "plan": "dtrain.planning.planner",
    "Plan": "dtrain.planning.planner",
    "Estimator": "dtrain.estimator",
    "instances": "dtrain.core.instances",
    "sagemaker": "dtrain.sagemaker",  # dtrain.sagemaker.PyTorch, the SageMaker SDK's estimator
}

# spelled out (not built from _LAZY) so linters and IDEs can read it; a unit test keeps the two
# in step
__all__ = ["DtrainError", "Estimator", "JobSpec", "Plan", "SpecError", "__version__",
           "instances", "plan", "sagemaker"]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'dtrain' has no attribute {name!r}")
    module = import_module(module_name)
    value = module if module_name.endswith("." + name) else getattr(module, name)
    globals()[name] = value
    return value
