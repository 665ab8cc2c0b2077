"""The node agent: one per host, reads the container contract and runs the workers.

Workers are started by torch elastic (``torch.distributed.launcher.api``), the engine under
torchrun, with c10d rendezvous at the master host, so RANK/LOCAL_RANK/WORLD_SIZE/... and restarts
(``max_restarts``) behave as torchrun users expect. The agent adds what SageMaker users expect: the
``SM_*`` environment, ``output/failure`` naming the root cause, ``max_run``, and a bounded
SIGTERM grace period that leaves no process behind.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass

from dtrain.core import contract as c
from dtrain.core import logformat
from torch.distributed import launcher
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

logger = logging.getLogger("dtrain.runtime.agent.node")

FAILURE_TAIL_LINES = 20


@dataclass(frozen=True)
class WorkerCommand:
    """The program torch elastic starts per rank (a binary and its arguments)."""

    executable: str
    args: list[str]


def build_worker_command(contract: c.Contract) -> WorkerCommand:
    """User script in the code dir with ``--key value`` args, or ``recipe:NAME`` as a module."""
    entry = contract.settings.entry_point
    if entry.startswith(c.RECIPE_PREFIX):
        name = entry[len(c.RECIPE_PREFIX):]
        module = f"{c.RECIPE_PACKAGE}.{name}"
        if not name.isidentifier() or importlib.util.find_spec(c.RECIPE_PACKAGE) is None \
                or importlib.util.find_spec(module) is None:
            raise ValueError(
                f"entry_point {entry!r}: no recipe module {module}; "
                f"use an installed recipe or a script in source_dir"
            )
        target = ["-m", module]
    else:
        script = os.path.join(contract.module_dir, entry)
        if not os.path.isfile(script):
            raise ValueError(
                f"entry_point {entry!r} not found at {script}; "
                f"put the script in source_dir or fix entry_point"
            )
        target = [script]
    # Workers go through a tiny exec shim that ties their life to this agent (PDEATHSIG),
    # because torch elastic starts each worker in its own session: a SIGKILLed agent would
    # otherwise leave them running. Inline code so the shim imports nothing before exec.
    args = ["-c", _EXEC_SHIM, str(os.getpid()), "-u", *target, *contract.user_args()]
    return WorkerCommand(sys.executable, args)


_EXEC_SHIM = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execv(sys.executable, [sys.executable] + sys.argv[2:])\n"
)


def processes_per_host(contract: c.Contract) -> int:
    return contract.settings.processes_per_host or contract.num_gpus or 1


def _torch_gpu_count(instance_type: str) -> int:
    if instance_type in c.CPU_INSTANCE_TYPES:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def apply_environment(contract: c.Contract) -> None:
    """Set what workers inherit: SM_*/DTRAIN_* always; EFA and CPU-only defaults unless set."""
    os.environ.update(contract.worker_environment())
    for key, value in c.efa_environment(contract.settings.instance_type,
                                        contract.network_interface_name).items():
        os.environ.setdefault(key, value)
    if contract.settings.instance_type in c.CPU_INSTANCE_TYPES:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def rendezvous_endpoint(contract: c.Contract) -> tuple[str, int, str]:
    """(master address, port, this host's address); env overrides let local hosts share 127.0.0.1."""
    override = os.environ.get(c.MASTER_ADDR_ENV)
    master = override or contract.master_host
    local_addr = override or contract.current_host
    port = os.environ.get(c.MASTER_PORT_ENV)
    if port is None:
        # One host needs no well-known port: let the store pick a free one (torchrun --standalone).
        port = 0 if len(contract.hosts) == 1 else c.DEFAULT_MASTER_PORT
    return master, int(port), local_addr


class RankLogsSpecs(LogsSpecs):
    """Per-rank log files with stable names (``rank-<r>.stdout.log``), teed to the agent's output.

    torch's default nests them under a random run folder; stable names let ``dtrain logs`` and
    the failure report find a rank's output. Restarts get their own files so nothing is lost.
    """

    def __init__(self, log_dir: str):
        os.makedirs(log_dir, exist_ok=True)
        super().__init__(log_dir, redirects=Std.ALL, tee=Std.ALL)

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = LogsDest()
        for local_rank, env in envs.items():
            stem = rank_log_stem(self.root_log_dir, int(env["RANK"]),
                                 int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))
            dest.stdouts[local_rank] = dest.tee_stdouts[local_rank] = f"{stem}.stdout.log"
            dest.stderrs[local_rank] = dest.tee_stderrs[local_rank] = f"{stem}.stderr.log"
            dest.error_files[local_rank] = f"{stem}.error.json"
            env["TORCHELASTIC_ERROR_FILE"] = dest.error_files[local_rank]
            if os.path.exists(dest.error_files[local_rank]):
                os.remove(dest.error_files[local_rank])  # torch refuses to overwrite it
        dest.filtered_stdout = os.devnull
        dest.filtered_stderr = os.devnull
        return dest


def rank_log_stem(log_dir: str, rank: int, attempt: int = 0) -> str:
    suffix = f".attempt-{attempt}" if attempt else ""
    return os.path.join(log_dir, f"rank-{rank}{suffix}")


def build_launch_config(contract: c.Contract, *, grace_period_s: int) -> LaunchConfig:
    master, port, local_addr = rendezvous_endpoint(contract)
    nnodes = len(contract.hosts)
    host = contract.current_host
    return LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=processes_per_host(contract),
        run_id=contract.settings.job_name or "dtrain",
        role="worker",
        rdzv_backend="c10d",
        rdzv_endpoint=f"{master}:{port}",
        rdzv_configs={"is_host": contract.node_rank == 0, "timeout": 300},
        max_restarts=contract.settings.max_restarts,
        # Not why agents exit ~4 s after a 2x2 CPU job's last worker line: this poll, torch's log
        # tailing and the exit barrier add ~0.3 s; the rest is CPython tearing down torch (~1 s
        # per worker, ~0.6 s per agent, more on 2 shared cores). Only os._exit would skip that, at
        # the cost of user atexit work and of host 0's rendezvous store the other agents close.
        monitor_interval=0.1,
        logs_specs=RankLogsSpecs(contract.paths.logs_dir),
        log_line_prefix_template=logformat.rank_prefix_template(host),
        local_addr=local_addr,
        shutdown_timeout=grace_period_s,
    )


# ---------------------------------------------------------------- failure reporting

def _tail(path: str, lines: int) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in f.readlines()[-lines:]]
    except OSError:
        return []


def describe_child_failure(contract: c.Contract, error: ChildFailedError) -> dict:
    """The root cause on this host: first failing rank, exit code, last lines of its stderr."""
    rank, failure = error.get_first_failure()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    stem = _latest_stem(contract.paths.logs_dir, rank, attempt)
    tail = _tail(f"{stem}.stderr.log", FAILURE_TAIL_LINES)
    last = next((line for line in reversed(tail) if line.strip()), "")
    if failure.exitcode is not None and failure.exitcode < 0:
        what = f"was killed by signal {-failure.exitcode}"
    else:
        what = f"exited with code {failure.exitcode}"
    return {
        "rank": rank, "host": contract.current_host, "exit_code": failure.exitcode,
        "timestamp": failure.timestamp or time.time(),
        "summary": f"rank {rank} on {contract.current_host} {what}" + (f": {last}" if last else ""),
        "tail": tail,
    }


def is_interruption(failures: dict[int, ProcessFailure]) -> bool:
    """Whether this host's workers stopped after a checkpoint (not a crash).

    True when some worker exited with ``PREEMPTED_EXIT_CODE`` and the rest did too or died of
    SIGTERM: torch elastic SIGTERMs a host's remaining workers as soon as one has exited.
    """
    codes = {failure.exitcode for failure in failures.values()}
    return c.PREEMPTED_EXIT_CODE in codes and codes <= {c.PREEMPTED_EXIT_CODE, -signal.SIGTERM}


class InterruptionAwareAgent(LocalElasticAgent):
    """torch's local agent, except that an interruption is not a failure to restart.

    With ``max_restarts`` > 0 torch elastic would restart workers that stopped after a checkpoint
    because another host got SIGTERM; the restarted group then waits at the rendezvous for that
    host, which is gone, and the job hangs. Spending no restarts on it ends this agent with the
    interruption instead, which ``run`` reports as one.

    It also keeps the workers' exit codes from the last shutdown in ``exit_codes`` (local rank ->
    code), so ``run`` can tell a SIGTERM that stopped the workers from one that arrived while they
    were finishing on their own (e.g. during the final model save).
    """

    def __init__(self, *args, exit_codes: dict[int, int | None], **kwargs):
        super().__init__(*args, **kwargs)
        self.exit_codes = exit_codes

    def _start_workers(self, worker_group):
        started = super()._start_workers(worker_group)
        # Describing an interruption reads checkpoints with dtrain.runtime.train.checkpoint, whose torch
        # imports take seconds: imported after a SIGTERM, they spent the time the launcher leaves
        # for the report before its SIGKILL. Import it while the workers import torch themselves.
        importlib.import_module("dtrain.runtime.train.checkpoint")
        return started

    def _monitor_workers(self, worker_group):
        result = super()._monitor_workers(worker_group)
        if result.is_failed() and is_interruption(result.failures):
            self._remaining_restarts = 0
        return result

    def _shutdown(self, *args, **kwargs) -> None:
        super()._shutdown(*args, **kwargs)
        handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
        self.exit_codes.clear()
        self.exit_codes.update({rank: h.proc.returncode for rank, h in handlers.items()})


def _launch(config: LaunchConfig, command: WorkerCommand,
            exit_codes: dict[int, int | None]) -> None:
    """``elastic_launch`` with :class:`InterruptionAwareAgent` as the agent it builds."""
    # launch_agent constructs the agent by this module-level name; the agent process runs
    # one launch at a time, so swapping it for the call is safe.
    original = launcher.api.LocalElasticAgent
    launcher.api.LocalElasticAgent = functools.partial(InterruptionAwareAgent,
                                                       exit_codes=exit_codes)
    try:
        elastic_launch(config, command.executable)(*command.args)
    finally:
        launcher.api.LocalElasticAgent = original
        # The workers are gone; a SIGTERM now (a stop racing the job's end) must not cut the
        # agent's report short with a traceback.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def workers_finished(exit_codes: dict[int, int | None]) -> bool:
    """Whether every worker exited 0 on its own: the job's work is done, whatever signal came."""
    return bool(exit_codes) and all(code == 0 for code in exit_codes.values())


def describe_interruption(contract: c.Contract, *, since: float, here: bool = False) -> dict:
    """The failure report of a host whose workers stopped because some host received SIGTERM
    (``here``: this one). Never raises: what cannot be read is left out of the description.
    """
    step, folder, finished = _checkpoint_of_this_run(contract, since)
    location = _checkpoint_location(contract)
    which = "this host" if here else "a host"
    details = {"reason": "interrupted", "step": step, "rank": None,
               "host": contract.current_host, "exit_code": c.PREEMPTED_EXIT_CODE,
               "timestamp": time.time()}
    if step is None:
        details["summary"] = (
            f"interrupted: the workers on {contract.current_host} stopped early (exit code "
            f"{c.PREEMPTED_EXIT_CODE}) because {which} received SIGTERM; resubmit to resume "
            f"from the newest checkpoint in {location}")
    elif finished:
        details["model_note"] = model_note(step, f"{location.rstrip('/')}/{folder}")
        details["summary"] = f"interrupted: {details['model_note']}"
    else:
        details["summary"] = (
            f"interrupted: training stopped at step {step} after a checkpoint because {which} "
            f"received SIGTERM; resubmit to resume from {location.rstrip('/')}/{folder}")
    return details


def model_note(step: int, checkpoint: str) -> str:
    """What to say when training finished but the final model save did not."""
    return (f"training finished all {step} steps but the final model was not saved, so "
            f"model/ is incomplete; the checkpoint {checkpoint} has everything: resubmit to "
            "resume from it, which only writes the model")


def _checkpoint_of_this_run(contract: c.Contract, since: float
                            ) -> tuple[int | None, str | None, bool]:
    """(step, folder name, whether training had finished) of the newest checkpoint written
    since ``since``; (None, None, False) when there is none or it cannot be read."""
    try:
        from dtrain.runtime.train.checkpoint import (  # torch: lazily
            COMPLETE,
            TRAINER_STATE,
            complete_checkpoints,
        )

        found = complete_checkpoints(contract.checkpoint_dir)
        # Only a checkpoint this run wrote tells where it stopped; an older one would mislead.
        if not found or os.path.getmtime(found[-1][1] / COMPLETE) < since:
            return None, None, False
        step, folder = found[-1]
    except Exception as exc:  # noqa: BLE001 - an unreadable folder must not hide the interruption
        logger.warning("could not read the checkpoints in %s: %s", contract.checkpoint_dir, exc)
        return None, None, False
    try:
        state = json.loads((folder / TRAINER_STATE).read_text())
        finished = step >= int(state["total_steps"])
    except Exception as exc:  # noqa: BLE001 - e.g. a checkpoint written by an older dtrain
        logger.warning("could not read %s: %s", folder / TRAINER_STATE, exc)
        finished = False
    return step, folder.name, finished


def _checkpoint_location(contract: c.Contract) -> str:
    """Where a resubmitted job finds the checkpoints: the S3 URI when they sync there."""
    config = contract.checkpoint_config if isinstance(contract.checkpoint_config, dict) else {}
    uri = config.get("S3Uri")
    return uri if isinstance(uri, str) and uri else str(contract.checkpoint_dir)


def _latest_stem(log_dir: str, rank: int, attempt_hint: int) -> str:
    for attempt in range(max(attempt_hint, 50), -1, -1):
        stem = rank_log_stem(log_dir, rank, attempt)
        if os.path.exists(f"{stem}.stderr.log"):
            return stem
    return rank_log_stem(log_dir, rank)


def write_failure(paths: c.Paths, details: dict) -> None:
    """``output/failure`` (SageMaker's free text) plus ``failure.json`` for the launcher.

    Logs instead of raising when the files cannot be written: the exit code still tells.
    """
    text = details["summary"]
    if details.get("tail"):
        text += "\n\n" + "\n".join(details["tail"])
    try:
        os.makedirs(paths.output_dir, exist_ok=True)
        with open(paths.failure_file, "w") as f:
            f.write(text + "\n")
        with open(paths.failure_details_file, "w") as f:
            json.dump(details, f)
    except OSError as exc:
        logger.error("could not write %s (%s): %s", paths.failure_file, exc, text)


def _remove_partial_model(contract: c.Contract) -> None:
    """A final model save cut off by SIGKILL leaves files next to model/ (or, across mounts,
    hidden ones in it); remove them before SageMaker or the EC2 node uploads model/."""
    try:
        from dtrain.runtime.train.checkpoint import remove_partial_model_files

        remove_partial_model_files(contract.paths.model_dir)
    except Exception as exc:  # noqa: BLE001 - cleanup must not change the job's outcome
        logger.warning("could not remove a partial model save: %s", exc)


# ---------------------------------------------------------------- the run

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
    """Run this host's share of the job; returns the agent's exit code."""
    paths = c.Paths(os.path.abspath(root or os.environ.get(c.ROOT_ENV) or c.DEFAULT_ROOT))
    grace = grace_period_from_env() if grace_period_s is None else grace_period_s
    try:
        probe = c.read_contract(paths.root, num_gpus=0)
        contract = c.read_contract(
            paths.root, num_gpus=_torch_gpu_count(probe.settings.instance_type))
        command = build_worker_command(contract)
    except (OSError, ValueError, KeyError) as exc:
        write_failure(paths, {"summary": f"node agent could not start: {exc}",
                              "timestamp": time.time(), "rank": None, "exit_code": 2})
        logger.error("%s", exc)
        return 2
    for stale in (paths.failure_file, paths.failure_details_file):
        if os.path.exists(stale):
            os.remove(stale)
    apply_environment(contract)
    state = _install_signal_handlers(contract.settings.max_run)
    config = build_launch_config(contract, grace_period_s=grace)
    logger.info("host %s (node rank %d/%d): %d worker(s) of %s", contract.current_host,
                contract.node_rank, len(contract.hosts), config.nproc_per_node, command.args[3:])
    started = time.time()
    exit_codes: dict[int, int | None] = {}
    try:
        _launch(config, command, exit_codes)
        return 0
    except ChildFailedError as exc:
        if is_interruption(exc.failures):
            write_failure(contract.paths, describe_interruption(contract, since=started))
            return c.PREEMPTED_EXIT_CODE
        write_failure(contract.paths, describe_child_failure(contract, exc))
        return 1
    except SignalException as exc:
        if workers_finished(exit_codes):
            logger.info("%s arrived as the workers finished; they completed the job",
                        signal.Signals(exc.sigval).name)
            return 0
        if state["max_run_reached"]:
            write_failure(contract.paths, describe_max_run(contract, since=started))
            return c.MAX_RUN_EXIT_CODE
        if exc.sigval == signal.SIGTERM:
            write_failure(contract.paths, describe_interruption(contract, since=started, here=True))
        return 128 + int(exc.sigval)
    except Exception as exc:  # rendezvous and launch errors: report, never hang
        write_failure(contract.paths, {"summary": f"node agent failed on {contract.current_host}: "
                                                  f"{type(exc).__name__}: {exc}",
                                       "timestamp": time.time(), "rank": None, "exit_code": 1})
        logger.exception("node agent failed")
        return 1
    finally:
        signal.alarm(0)
        _remove_partial_model(contract)


def describe_max_run(contract: c.Contract, *, since: float) -> dict:
    """The failure report of a host stopped at max_run, with where to resume from."""
    summary = (f"max_run of {contract.settings.max_run} s reached on {contract.current_host}; "
               "workers were stopped")
    details = {"reason": "max_run", "timestamp": time.time(), "rank": None,
               "host": contract.current_host, "exit_code": c.MAX_RUN_EXIT_CODE}
    note = describe_interruption(contract, since=since, here=True).get("model_note")
    if note:
        details["model_note"] = note
        summary += f"; {note}"
    return {"summary": summary, **details}
