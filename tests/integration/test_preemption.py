"""SIGTERM (a spot interruption) on a real 4-rank job: 2 node agents posing as 2 hosts x 2 gloo
workers, MiCS sharding degree 2, one checkpoint folder shared by both hosts.

Only the second host is interrupted, as when one spot instance gets its notice: its agent forwards
SIGTERM to its two workers, and rank 0 on the other host learns of it only from the ranks' vote at
the step boundary. Every rank stops at the same step, the ranks write one complete checkpoint
together, the job ends inside the grace period, and a restart carries on from exactly that step.
Were the ranks not to agree, the interrupted ones would enter the checkpoint's collectives while
the others entered the next step's, and the job would hang until the agent's SIGKILL.

    pytest tests/integration/test_preemption.py -q
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import _workers as w
import pytest
from dtrain.core import contract as c
from dtrain.core.metrics_format import parse_metrics
from dtrain.runtime.train.checkpoint import (
    COMPLETE,
    TRAINER_STATE,
    complete_checkpoints,
    step_dir_name,
)
from dtrain.runtime.train.trainer import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow

HOSTS = ["algo-1", "algo-2"]
GRACE_S = 30  # the agent's default
STEPS = 1000  # far more than the run gets through before it is stopped
HYPERPARAMETERS = {
    "model": "gpt-neox-tiny", "steps": STEPS, "micro_batch_size": 2, "seq_len": 32,
    "lr": 3e-3, "warmup_steps": 2, "log_interval": 1, "seed": 7,
    "checkpoint_interval": STEPS,  # no periodic checkpoint: only SIGTERM can write one
}


def write_job(root: Path, hyperparameters: dict, *, max_restarts: int = 0) -> None:
    for host in HOSTS:
        c.write_host_contract(
            str(root / host), current_host=host, hosts=HOSTS,
            settings=c.Settings(entry_point="recipe:causal_lm", job_name="preempt",
                                processes_per_host=2, distribution={"sharding_degree": 2},
                                max_restarts=max_restarts),
            hyperparameters=hyperparameters, checkpoint_local_path=str(root / "checkpoints"))


def start_agents(root: Path) -> list[subprocess.Popen]:
    env = dict(os.environ, DTRAIN_MASTER_ADDR="127.0.0.1", DTRAIN_MASTER_PORT=str(w.free_port()),
               OMP_NUM_THREADS="1")
    agents = []
    for host in HOSTS:
        with open(root / f"{host}.agent.log", "ab") as log:
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "dtrain.runtime", "--root", str(root / host),
                 "--grace-period", str(GRACE_S)],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return agents


def stop_group(agents: list[subprocess.Popen]) -> None:
    """SIGKILL whatever is left of the agents' sessions (their workers die with them)."""
    for agent in agents:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()


def rank0_log(root: Path) -> str:
    log = root / HOSTS[0] / "output" / "logs" / "rank-0.stdout.log"
    return log.read_text(errors="replace") if log.exists() else ""


def logged_steps(text: str) -> list[int]:
    return [m["step"] for line in text.splitlines() if (m := parse_metrics(line)) is not None]


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    root = tmp_path_factory.mktemp("preempt")
    corpus = root / "corpus.txt"
    corpus.write_text(Path(__file__).read_text() * 3)
    hyperparameters = {**HYPERPARAMETERS, "data": str(corpus)}
    write_job(root, hyperparameters)
    agents = start_agents(root)
    try:
        # Two logged steps: the model is sharded, the collectives run and the handler is in place.
        w.wait_for(lambda: len(logged_steps(rank0_log(root))) >= 2, timeout=120, procs=agents)
        agents[1].send_signal(signal.SIGTERM)  # ranks 2 and 3 only
        signalled = time.monotonic()
        codes = [agent.wait(timeout=GRACE_S + 30) for agent in agents]
        stop_seconds = time.monotonic() - signalled
    finally:
        stop_group(agents)
    stopped_log = rank0_log(root)
    return {"root": root, "codes": codes, "stop_seconds": stop_seconds, "log": stopped_log,
            "stop_step": logged_steps(stopped_log)[-1], "hyperparameters": hyperparameters}


def test_sigterm_on_one_host_stops_every_host_inside_the_grace_period(preempted,
                                                                       live_processes):
    interrupted, other = preempted["codes"][1], preempted["codes"][0]
    assert interrupted == 128 + signal.SIGTERM, preempted["log"]
    # The other host's workers stopped with the job: its agent reports the interruption and where
    # to resume from, with the same exit code, and blames none of its ranks.
    assert other == PREEMPTED_EXIT_CODE
    paths, step = c.Paths(str(preempted["root"] / HOSTS[0])), preempted["stop_step"]
    details = json.loads(Path(paths.failure_details_file).read_text())
    assert (details["reason"], details["rank"], details["step"]) == ("interrupted", None, step)
    checkpoint = preempted["root"] / "checkpoints" / step_dir_name(step)
    assert Path(paths.failure_file).read_text() == (
        f"interrupted: training stopped at step {step} after a checkpoint because a host "
        f"received SIGTERM; resubmit to resume from {checkpoint}\n")
    # The agent SIGKILLs only after GRACE_S: ending sooner means the workers left on their own.
    assert preempted["stop_seconds"] < GRACE_S
    assert live_processes(str(preempted["root"])) == []
    assert not (preempted["root"] / HOSTS[0] / "model" / "model.safetensors").exists()


def test_sigterm_writes_one_complete_checkpoint_of_every_rank_at_the_stop_step(preempted):
    folder = preempted["root"] / "checkpoints"
    step = preempted["stop_step"]
    assert step < STEPS
    assert [p.name for p in folder.iterdir()] == [step_dir_name(step)]  # no *.tmp left behind
    assert [s for s, _ in complete_checkpoints(folder)] == [step]
    checkpoint = folder / step_dir_name(step)
    record = json.loads((checkpoint / COMPLETE).read_text())
    assert (record["step"], record["world_size"]) == (step, 4)
    assert record["state_layout"]["model"] == "gpt_neox"
    assert json.loads((checkpoint / TRAINER_STATE).read_text())["step"] == step
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == \
        [f"__{rank}_0.distcp" for rank in range(4)]
    assert sorted(p.name for p in (checkpoint / "rng").iterdir()) == \
        [f"rank-{rank:05d}.pt" for rank in range(4)]


def test_restart_resumes_from_exactly_the_stop_step(preempted):
    root, step = preempted["root"], preempted["stop_step"]
    # Same job, two more steps to go, so the restart finishes and writes the model.
    write_job(root, {**preempted["hyperparameters"], "steps": step + 2})
    agents = start_agents(root)
    try:
        codes = [agent.wait(timeout=120) for agent in agents]
    finally:
        stop_group(agents)
    log = rank0_log(root)
    assert codes == [0, 0], log
    assert f"resumed from {root / 'checkpoints' / step_dir_name(step)} at step {step}" in log
    assert logged_steps(log.split("resumed from", 1)[1]) == [step + 1, step + 2]
    assert (root / HOSTS[0] / "model" / "model.safetensors").is_file()


def test_an_interruption_is_not_restarted_even_with_max_restarts(tmp_path, live_processes):
    # torch elastic would restart the other host's workers after their 143 exits, and the new
    # group would wait at the rendezvous for the interrupted host forever (this test then times
    # out); the agent spends no restart on an interruption.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(__file__).read_text() * 3)
    write_job(tmp_path, {**HYPERPARAMETERS, "data": str(corpus)}, max_restarts=1)
    agents = start_agents(tmp_path)
    try:
        w.wait_for(lambda: len(logged_steps(rank0_log(tmp_path))) >= 2, timeout=120,
                   procs=agents)
        agents[1].send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        codes = [agent.wait(timeout=GRACE_S + 30) for agent in agents]
        stop_seconds = time.monotonic() - signalled
    finally:
        stop_group(agents)
    assert codes == [PREEMPTED_EXIT_CODE, 128 + signal.SIGTERM]
    assert stop_seconds < GRACE_S
    details = json.loads(Path(c.Paths(str(tmp_path / HOSTS[0])).failure_details_file).read_text())
    assert details["reason"] == "interrupted"
    assert not (tmp_path / HOSTS[0] / "output" / "logs" / "rank-0.attempt-1.stdout.log").exists()
    assert live_processes(str(tmp_path)) == []
