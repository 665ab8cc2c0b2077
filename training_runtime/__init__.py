"""The in-container runtime: node agent, process groups, MiCS sharding, models, trainer.

Importing this package must not import torch (the node agent and the client import it), so the
public names are resolved lazily on first access::

    import dtrain.runtime as rt

    hps = rt.hyperparameters()               # the spec's hyperparameters, JSON values
    ctx = rt.init()                          # process group, node groups, mesh, job paths
    model = rt.shard(model, ctx)             # MiCS = FSDP2 HSDP + hierarchical all-gather
    for micro in ctx.accumulate(model, loader):
        micro.scale(loss_fn(model(micro.batch))).backward()
        if micro.is_boundary:
            optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# public name -> module that defines it (imported on first access)
_LAZY = {
    "init": "dtrain.runtime.distributed.context",
    "hyperparameters": "dtrain.runtime.job",
    "RuntimeContext": "dtrain.runtime.distributed.context",
    "DistributionConfig": "dtrain.runtime.distributed.config",
    "shard": "dtrain.runtime.distributed.sharding",
    "MicroStep": "dtrain.runtime.distributed.accumulation",
    "CommStats": "dtrain.runtime.distributed.comm_stats",
    "HierarchicalAllGather": "dtrain.runtime.distributed.collectives",
    "hierarchical_all_gather": "dtrain.runtime.distributed.collectives",
    "Trainer": "dtrain.runtime.train.trainer",
    "TrainerConfig": "dtrain.runtime.train.trainer",
    "TokenDataset": "dtrain.runtime.train.data",
    "DistributedTokenLoader": "dtrain.runtime.train.data",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'dtrain.runtime' has no attribute {name!r}")
    value = getattr(import_module(module_name), name)
    globals()[name] = value
    return value
