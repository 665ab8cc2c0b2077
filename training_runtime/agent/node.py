"""The node agent: one per host, reads the container contract and runs the workers.

The agent adds to torch elastic (:mod:`.workers`) what SageMaker users expect: the ``SM_*``
environment, ``output/failure`` naming the root cause (:mod:`.reports`), ``max_run``, and a
bounded SIGTERM grace period that leaves no process behind. It checks first that the image's
torch is one the runtime supports (:mod:`dtrain.runtime.torch_private`).
"""

from __future__ import annotations

import logging
import os
import signal
import time

from dtrain.core import contract as c
from dtrain.runtime import torch_private
from dtrain.runtime.agent import preflight, reports
from dtrain.runtime.agent.workers import (
    WorkerWatch,
    apply_environment,
    build_launch_config,
    build_worker_command,
    is_interruption,
    launch,
    workers_finished,
)
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

logger = logging.getLogger("dtrain.runtime.agent")


def _torch_gpu_count(instance_type: str) -> int:
    if instance_type in c.CPU_INSTANCE_TYPES:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _install_signal_handlers(max_run: int | None) -> dict:
    """SIGTERM before workers start, and max_run as a SIGTERM to ourselves (same shutdown path)."""
    state = {"max_run_reached": False}

    def on_term(signum, _frame):
        raise SignalException(f"received {signal.Signals(signum).name}", sigval=signum)

    def on_alarm(_signum, _frame):
        state["max_run_reached"] = True
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    if max_run:
        signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(int(max_run))
    return state


def grace_period_from_env() -> int:
    return int(os.environ.get(c.GRACE_PERIOD_ENV, c.DEFAULT_GRACE_PERIOD_S))


def run(root: str | None = None, *, grace_period_s: int | None = None) -> int:
    """Run this host's share of the job; returns the agent's exit code, which it also leaves in
    ``output/agent_exit.json``: a launcher that lost sight of this process reads it there."""
    paths = c.host_paths(root)
    reports.remove_records(paths)  # of an earlier run in this folder
    code = _run_host(paths, grace_period_from_env() if grace_period_s is None else grace_period_s)
    reports.write_exit_record(paths, code)
    return code


def _run_host(paths: c.Paths, grace: int) -> int:
    try:
        torch_private.check_torch()
        probe = c.read_contract(paths.root, num_gpus=0)
        contract = c.read_contract(
            paths.root, num_gpus=_torch_gpu_count(probe.settings.instance_type))
        command = build_worker_command(contract)
        problems = preflight.input_problems(contract)
        if problems:
            raise ValueError("; ".join(problems))
        apply_environment(contract)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        reports.write_failure(paths, {"summary": f"node agent could not start: {exc}",
                              "timestamp": time.time(), "rank": None, "exit_code": 2})
        logger.error("%s", exc)
        return 2
    state = _install_signal_handlers(contract.settings.max_run)
    config = build_launch_config(contract, grace_period_s=grace)
    logger.info("host %s (node rank %d/%d): %d worker(s) of %s", contract.current_host,
                contract.node_rank, len(contract.hosts), config.nproc_per_node, command.args[3:])
    started = time.time()
    watch = WorkerWatch()
    try:
        launch(config, command, watch)
        return 0
    except ChildFailedError as exc:
        if is_interruption(exc.failures):
            reports.write_failure(contract.paths, reports.describe_interruption(contract, since=started))
            return c.PREEMPTED_EXIT_CODE
        reports.write_failure(contract.paths, reports.describe_child_failure(
            contract, exc.failures, healthy_until=watch.healthy_until))
        return 1
    except SignalException as exc:
        # the Trainer's note that fit stopped on the signal: a script that leaves after that
        # without exit 143 stopped all the same
        stopped_early = os.path.exists(contract.paths.stopped_early_file)
        if workers_finished(watch.exit_codes) and not stopped_early:
            logger.info("%s arrived as the workers finished; they completed the job",
                        signal.Signals(exc.sigval).name)
            return 0
        if state["max_run_reached"]:
            reports.write_failure(contract.paths, reports.describe_max_run(contract, since=started))
            return c.MAX_RUN_EXIT_CODE
        if exc.sigval == signal.SIGTERM:
            reports.write_failure(contract.paths, reports.describe_interruption(contract, since=started, here=True))
        return 128 + int(exc.sigval)
    except Exception as exc:  # rendezvous and launch errors: report, never hang
        reports.write_failure(contract.paths, {"summary": f"node agent failed on {contract.current_host}: "
                                                  f"{type(exc).__name__}: {exc}",
                                       "timestamp": time.time(), "rank": None, "exit_code": 1})
        logger.exception("node agent failed")
        return 1
    finally:
        signal.alarm(0)
        reports.remove_partial_model(contract)
