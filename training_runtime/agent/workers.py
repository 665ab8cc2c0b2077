"""How the node agent starts this host's workers: the command, their environment, the
rendezvous, torch elastic's launch configuration, per-rank logs and the agent class.

Workers are started by torch elastic (``torch.distributed.launcher.api``), the engine under
torchrun, with c10d rendezvous at the master host, so RANK/LOCAL_RANK/WORLD_SIZE/... and restarts
(``max_restarts``) behave as torchrun users expect. The private parts of torch elastic this
needs are reached through :mod:`dtrain.runtime.torch_private` only.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field

from dtrain.core import contract as c
from dtrain.core import instances, logformat
from dtrain.runtime import torch_private
from dtrain.runtime.agent import secrets
from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.launcher.api import LaunchConfig

logger = logging.getLogger(__name__)  # under the node agent's logger


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


def apply_environment(contract: c.Contract) -> None:
    """Set what workers inherit: SM_*/DTRAIN_* always; EFA and CPU-only defaults unless set;
    the job's secret references resolved (``dtrain.core.secrets``)."""
    secrets.resolve_references(os.environ)
    os.environ.update(contract.worker_environment())
    torch_private.use_a_fresh_worker_store_per_round()
    for key, value in instances.efa_environment(contract.settings.instance_type,
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
    the failure report find a rank's output. Every start of this host's workers gets its own
    files (``rank-<r>.attempt-<n>``), so nothing is lost: counted here, because torch's restart
    count stays 0 on a host whose workers restart for another host's failure.
    """

    def __init__(self, log_dir: str):
        os.makedirs(log_dir, exist_ok=True)
        super().__init__(log_dir, redirects=Std.ALL, tee=Std.ALL)
        self._log_dir = log_dir
        self._starts = 0

    @property
    def root_log_dir(self) -> str:
        return self._log_dir

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = LogsDest()
        attempt, self._starts = self._starts, self._starts + 1
        for local_rank, env in envs.items():
            stem = rank_log_stem(self.root_log_dir, int(env["RANK"]), attempt)
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


def is_interruption(failures: dict[int, ProcessFailure]) -> bool:
    """Whether this host's workers stopped after a checkpoint (not a crash).

    True when some worker exited with ``PREEMPTED_EXIT_CODE`` and the rest did too or died of
    SIGTERM: torch elastic SIGTERMs a host's remaining workers as soon as one has exited.
    """
    codes = {failure.exitcode for failure in failures.values()}
    return c.PREEMPTED_EXIT_CODE in codes and codes <= {c.PREEMPTED_EXIT_CODE, -signal.SIGTERM}


@dataclass
class WorkerWatch:
    """What the agent saw of this host's workers, for ``run``'s report."""

    exit_codes: dict[int, int | None] = field(default_factory=dict)  # at the last shutdown
    healthy_until: float = 0.0  # when a monitoring pass last found every worker running


class InterruptionAwareAgent(torch_private.HookedElasticAgent):
    """torch's local agent, except that an interruption is not a failure to restart.

    With ``max_restarts`` > 0 torch elastic would restart workers that stopped after a checkpoint
    because another host got SIGTERM; the restarted group then waits at the rendezvous for that
    host, which is gone, and the job hangs. Spending no restarts on it ends this agent with the
    interruption instead, which ``run`` reports as one.

    It also fills ``watch``: the workers' exit codes from the last shutdown (local rank -> code),
    so ``run`` can tell a SIGTERM that stopped the workers from one that arrived while they
    were finishing on their own (e.g. during the final model save), and the last moment every
    worker was seen running, the earliest a worker killed by a signal can have died.
    """

    def __init__(self, *args, watch: WorkerWatch, holds_store: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.watch = watch
        self.holds_store = holds_store

    def workers_started(self) -> None:
        self.watch.healthy_until = time.time()
        # Describing an interruption reads checkpoints with dtrain.runtime.train.checkpoint,
        # whose torch imports take seconds: imported after a SIGTERM, they spent the time the
        # launcher leaves for the report before its SIGKILL. Import it while the workers import
        # torch themselves.
        importlib.import_module("dtrain.runtime.train.checkpoint")

    def workers_checked(self, result) -> None:
        if not result.is_failed():
            self.watch.healthy_until = time.time()

    def keep_restarting(self, result) -> bool:
        return not is_interruption(result.failures)

    def workers_shut_down(self, exit_codes: dict[int, int | None]) -> None:
        self.watch.exit_codes.clear()
        self.watch.exit_codes.update(exit_codes)

    def rendezvous_shut_down(self) -> None:
        group = self.get_worker_group()
        # After a success every agent is at its end too (torch's exit barrier waited for them, or
        # gave up after its timeout: DEPARTURE_WAIT_S bounds the wait); after a failure the
        # store's host leaves at once. The others always say they are done.
        succeeded = group.state == WorkerState.SUCCEEDED
        if group.store is not None and (succeeded or not self.holds_store):
            depart(group.store, holds_store=self.holds_store, agents=group.group_world_size,
                   wait_s=DEPARTURE_WAIT_S)


# Host 0's agent holds the rendezvous store, and the other agents still use it after the exit
# barrier, to shut the rendezvous down. Had its process left first, their shutdown failed with a
# C++ traceback ("sendBytes failed ... Broken pipe") and "failed to shutdown the rendezvous" in
# the logs of a job that succeeded. Each agent says here that it is done with the store; the
# host keeps the store until all have, or DEPARTURE_WAIT_S has passed.
DEPARTED_KEY = "dtrain.agents-departed"
DEPARTURE_WAIT_S = 30.0


def depart(store, *, holds_store: bool, agents: int, wait_s: float) -> bool:
    """Record this agent's departure, or, on the store's host, wait for the other ``agents - 1``
    agents' (True when they all departed in time)."""
    if not holds_store:
        try:
            store.add(DEPARTED_KEY, 1)
        except (RuntimeError, ValueError):  # c10d's DistError; the host already left
            return False
        return True
    deadline = time.monotonic() + wait_s
    try:  # runs in torch's finally: an error here must not turn a success into a failure
        while (departed := store.add(DEPARTED_KEY, 0)) < agents - 1:
            if time.monotonic() > deadline:
                logger.warning("%d of %d other agent(s) had not left the rendezvous after "
                               "%.0f s; closing its store", agents - 1 - departed, agents - 1,
                               wait_s)
                return False
            time.sleep(0.05)
    except (RuntimeError, ValueError) as exc:  # c10d's DistError
        logger.warning("could not wait for the other agents to leave the rendezvous: %s", exc)
        return False
    return True


def launch(config: LaunchConfig, command: WorkerCommand, watch: WorkerWatch) -> None:
    """``elastic_launch`` with :class:`InterruptionAwareAgent` as the agent it builds."""
    try:
        torch_private.launch(config, command.executable, command.args,
                             functools.partial(InterruptionAwareAgent, watch=watch,
                                               holds_store=config.rdzv_configs["is_host"]))
    finally:
        # The workers are gone; a SIGTERM now (a stop racing the job's end) must not cut the
        # agent's report short with a traceback.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def workers_finished(exit_codes: dict[int, int | None]) -> bool:
    """Whether every worker exited 0 on its own: the job's work is done, whatever signal came."""
    return bool(exit_codes) and all(code == 0 for code in exit_codes.values())
