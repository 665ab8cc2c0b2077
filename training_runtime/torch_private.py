"""Every private torch name the runtime uses, in one place, checked against the torch it runs on.

torch's elastic agent offers no public hook to stop it from restarting workers that stopped on
purpose, to read its workers' exit codes, nor to act after it shut its rendezvous down; FSDP2's
custom all-gather takes an instance of a class that lives in a private module; activation
checkpointing's wrapper and the default process group have no public import path either;
DTensor's collectives (tensor parallelism) go through the private functional-collectives module,
where the communication statistics count them; the 2-D cross-entropy finds the LM head's product
behind its logits through DTensor's conversions, whose autograd functions are private; the
overlapped gradient sync waits for its communicator in an autograd final callback, which only
the private execution engine queues; FSDP2 has no getter for whether a module reshards after
forward, which pipelining's zero-bubble schedules must not do. They are reached only through
this module, which was checked on the torch range of :mod:`dtrain.core.torch_support`.
``check_torch`` runs when the node agent starts, so an image with an unsupported torch fails at
once with one line naming its torch and the range, not in the middle of a job; a test fails when
a name disappears.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
from dtrain.core import torch_support

# (module, attribute) of every private name used below
PRIVATE_NAMES = (
    ("torch.distributed.fsdp._fully_shard._fsdp_api", "AllGather"),
    ("torch.distributed.fsdp._fully_shard._fsdp_api", "ReduceScatter"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper"),
    ("torch.distributed.distributed_c10d", "_get_default_group"),
    ("torch", "_foreach_mul_"),
    ("torch.distributed", "_functional_collectives"),
    ("torch.distributed._functional_collectives", "_resolve_group"),
    ("torch.distributed.distributed_c10d", "_resolve_process_group"),
    ("torch.distributed.elastic.agent.server.local_elastic_agent", "LocalElasticAgent"),
    ("torch.distributed.launcher.api", "LocalElasticAgent"),  # what launch_agent builds
    ("torch.autograd.variable", "Variable._execution_engine"),
    # fsdp_reshards_after_forward reads FSDPState._fsdp_param_groups[i].post_forward_mesh_info
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup"),
    # value_source passes their backward nodes (VALUE_PRESERVING_NODES)
    ("torch.distributed.tensor._api", "_ToTorchTensor"),
    ("torch.distributed.tensor._api", "_FromTorchTensor"),
)
# private members of torch's elastic agent that ``HookedElasticAgent`` overrides or reads
PRIVATE_AGENT_METHODS = ("_start_workers", "_monitor_workers", "_shutdown")
PRIVATE_AGENT_ATTRIBUTES = ("_pcontext", "_remaining_restarts")
# What ``HookedElasticAgent.rendezvous_shut_down`` relies on: torch's launcher shuts the
# rendezvous down through the handler of the spec the agent was built with.
LAUNCHER_SHUTS_DOWN_THE_RENDEZVOUS = ("torch.distributed.launcher.api", "launch_agent",
                                      "spec.rdzv_handler.shutdown()")
# An undocumented switch of torch's c10d rendezvous (read by the agent at each round): "1" gives
# each round's workers a fresh store on a new port instead of the agent's store of round 0. With
# the shared one, restarted workers find the keys of the workers they replace (gloo addresses,
# barrier counts) and connect to dead ports or wait forever.
FRESH_WORKER_STORE_ENV = ("torch.distributed.elastic.rendezvous.dynamic_rendezvous",
                          "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")


def missing_private_names() -> list[str]:
    """The private names this torch lacks (empty when every one is there)."""
    missing = []
    for module, name in PRIVATE_NAMES:
        try:
            functools.reduce(getattr, name.split("."), importlib.import_module(module))
        except (ImportError, AttributeError):
            missing.append(f"{module}.{name}")
    agent = _local_elastic_agent()
    for method in PRIVATE_AGENT_METHODS:
        if not callable(getattr(agent, method, None)):
            missing.append(f"LocalElasticAgent.{method}")
    # instance attributes: set in the constructors of the agent or its base classes
    source = "".join(inspect.getsource(cls) for cls in agent.__mro__
                     if cls.__module__.startswith("torch."))
    missing += [f"LocalElasticAgent.{name}" for name in PRIVATE_AGENT_ATTRIBUTES
                if f"self.{name} =" not in source and f"self.{name}:" not in source]
    module, function, call = LAUNCHER_SHUTS_DOWN_THE_RENDEZVOUS
    if call not in inspect.getsource(getattr(importlib.import_module(module), function)):
        missing.append(f"{module}.{function}'s {call}")
    module, variable = FRESH_WORKER_STORE_ENV
    if variable not in inspect.getsource(importlib.import_module(module)):
        missing.append(f"{module}'s {variable} switch")
    return missing


def use_a_fresh_worker_store_per_round() -> None:
    """Let every restart of the workers rendezvous in a new store (see FRESH_WORKER_STORE_ENV)."""
    os.environ[FRESH_WORKER_STORE_ENV[1]] = "1"


def check_torch() -> None:
    """Raise RuntimeError naming this torch and the supported range when the runtime cannot
    run on it (too old, or a private name it needs is gone)."""
    problem = torch_support.problem(torch.__version__)
    if problem is None:
        missing = missing_private_names()
        if missing:
            problem = (f"torch {torch.__version__} lacks {', '.join(missing)}, which dtrain's "
                       f"runtime uses (checked on torch {torch_support.supported_range()})")
    if problem:
        raise RuntimeError(f"{problem}; use an image with torch "
                           f"{torch_support.supported_range()}")


# ---------------------------------------------------------------- FSDP2, checkpointing, c10d

def fsdp_all_gather_base() -> type:
    """FSDP2's ``AllGather`` comm interface, the base of a custom all-gather."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    return AllGather


def fsdp_reduce_scatter_base() -> type:
    """FSDP2's ``ReduceScatter`` comm interface, the base of a custom reduce-scatter."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    return ReduceScatter


def fsdp_reshards_after_forward(module: torch.nn.Module) -> list[bool]:
    """For each FSDP2 parameter group a ``fully_shard``-ed ``module`` owns, whether it frees the
    unsharded parameters after forward (there is no public getter)."""
    from torch.distributed.fsdp import fully_shard

    groups = fully_shard.state(module)._fsdp_param_groups
    return [group.post_forward_mesh_info is not None for group in groups]


def checkpoint_wrapper(module: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper as wrap,
    )

    return wrap(module)


def default_group() -> Any:
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group()


def foreach_mul_(tensors: list[torch.Tensor], factor: Any) -> None:
    torch._foreach_mul_(tensors, factor)


def queue_autograd_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward pass ends (FSDP2's final hooks use this
    too; callbacks run in the order they were queued)."""
    from torch.autograd.variable import Variable

    Variable._execution_engine.queue_callback(callback)


def functional_collectives() -> Any:
    """The module DTensor issues its collectives through, looked up by name at each call."""
    import torch.distributed._functional_collectives as funcol

    return funcol


def resolve_functional_group(group: Any) -> Any:
    """The ``ProcessGroup`` a functional collective's ``group`` argument names (a group, its
    name, a 1-D mesh or ``(mesh, dim)``)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    resolved = funcol._resolve_group(group)
    if isinstance(resolved, dist.ProcessGroup):
        return resolved
    return dist.distributed_c10d._resolve_process_group(resolved)


# Autograd nodes that pass a tensor's values on unchanged: views, and DTensor's conversions to
# and from its local tensor (the backward nodes of private functions of torch.distributed.tensor).
VALUE_PRESERVING_NODES = ("ViewBackward0", "AliasBackward0", "_ToTorchTensorBackward",
                          "_FromTorchTensorBackward")


CAST_NODE = "ToCopyBackward0"  # .to(dtype), .float(), ...


def value_source(tensor: torch.Tensor, *, through_a_cast: bool = False) -> tuple[Any, bool]:
    """The autograd node that computed ``tensor``'s values (None for a tensor without one): its
    ``grad_fn``, followed back through :data:`VALUE_PRESERVING_NODES` and, when asked, one cast
    (whether it is lossless is the caller's to judge); and whether a cast was passed."""
    node, cast = tensor.grad_fn, False
    while node is not None and (type(node).__name__ in VALUE_PRESERVING_NODES or (
            through_a_cast and not cast and type(node).__name__ == CAST_NODE)):
        cast = cast or type(node).__name__ == CAST_NODE
        inputs = [previous for previous, _ in node.next_functions if previous is not None]
        if len(inputs) != 1:
            return None, cast
        node = inputs[0]
    return node, cast


# ---------------------------------------------------------------- torch elastic's agent

def _local_elastic_agent() -> type:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    return LocalElasticAgent


class HookedElasticAgent(_local_elastic_agent()):
    """torch's local agent with five public hooks instead of its private methods:

    * ``workers_started()`` after each start of the worker group;
    * ``workers_checked(result)`` after every monitoring pass;
    * ``keep_restarting(result) -> bool`` after a monitoring pass that found a failure (False:
      spend no restart on it);
    * ``workers_shut_down(exit_codes)`` with each worker's exit code (local rank -> code);
    * ``rendezvous_shut_down()`` once torch's launcher has shut the rendezvous down, the last
      thing it does with the agents' store before it returns.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # launch_agent ends with spec.rdzv_handler.shutdown() on the spec it built this agent
        # with (LAUNCHER_SHUTS_DOWN_THE_RENDEZVOUS); there is no hook after it.
        handler = self.get_worker_group().spec.rdzv_handler
        shut_down = handler.shutdown

        def shutdown() -> bool:
            closed = shut_down()
            self.rendezvous_shut_down()
            return closed

        handler.shutdown = shutdown

    def workers_started(self) -> None:
        pass

    def workers_checked(self, result: Any) -> None:
        pass

    def keep_restarting(self, result: Any) -> bool:
        return True

    def workers_shut_down(self, exit_codes: dict[int, int | None]) -> None:
        pass

    def rendezvous_shut_down(self) -> None:
        pass

    def _start_workers(self, worker_group):
        started = super()._start_workers(worker_group)
        self.workers_started()
        return started

    def _monitor_workers(self, worker_group):
        result = super()._monitor_workers(worker_group)
        self.workers_checked(result)
        if result.is_failed() and not self.keep_restarting(result):
            self._remaining_restarts = 0
        return result

    def _shutdown(self, *args, **kwargs) -> None:
        super()._shutdown(*args, **kwargs)
        handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
        self.workers_shut_down({rank: h.proc.returncode for rank, h in handlers.items()})


def launch(config: Any, executable: str, args: list[str],
           agent: Callable[..., HookedElasticAgent]) -> None:
    """``elastic_launch(config, executable)(*args)`` with ``agent`` as the agent it builds."""
    from torch.distributed import launcher
    from torch.distributed.launcher.api import elastic_launch

    # launch_agent constructs the agent by this module-level name; the agent process runs
    # one launch at a time, so swapping it for the call is safe.
    original = launcher.api.LocalElasticAgent
    launcher.api.LocalElasticAgent = functools.partial(agent)
    try:
        elastic_launch(config, executable)(*args)
    finally:
        launcher.api.LocalElasticAgent = original
