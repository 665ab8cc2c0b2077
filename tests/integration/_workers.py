"""Start a recipe as 4 real worker processes posing as 2 hosts x 2 (what torchrun would set)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

WORLD, PER_HOST = 4, 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(job: Path, *, checkpoints: Path, distribution: dict) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SM_", "DTRAIN_"))}
    env.update(SM_MODEL_DIR=str(job / "model"), SM_OUTPUT_DATA_DIR=str(job / "output"),
               DTRAIN_CHECKPOINT_DIR=str(checkpoints), OMP_NUM_THREADS="1",
               DTRAIN_DISTRIBUTION=json.dumps(distribution))
    return env


def launch(recipe: str, args: list[str], job: Path, *, checkpoints: Path,
           distribution: dict, world: int = WORLD, per_host: int = PER_HOST
           ) -> list[subprocess.Popen]:
    job.mkdir(parents=True, exist_ok=True)
    env = job_env(job, checkpoints=checkpoints, distribution=distribution)
    port = str(free_port())
    procs = []
    for rank in range(world):
        worker = dict(env, RANK=str(rank), LOCAL_RANK=str(rank % per_host),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(per_host),
                      GROUP_RANK=str(rank // per_host), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port)
        log = open(job / f"rank{rank}.log", "ab")  # noqa: SIM115 -- lives as long as the worker
        procs.append(subprocess.Popen(
            [sys.executable, "-m", f"dtrain.runtime.recipes.{recipe}", *args],
            env=worker, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait(procs: list[subprocess.Popen], *, timeout: float = 240) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        kill(procs)


def kill(procs: list[subprocess.Popen], sig: int = 9) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    for p in procs:
        p.wait()


def wait_for(predicate, *, timeout: float = 240, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if any(p.poll() is not None for p in procs):
            raise AssertionError("a worker exited before the awaited event")
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.02)


def read_log(job: Path, rank: int = 0) -> str:
    return (job / f"rank{rank}.log").read_text(errors="replace")


def final_weights(job: Path) -> dict[str, torch.Tensor]:
    return load_file(job / "model" / "model.safetensors")


def records(job: Path) -> dict[str, list[float]]:
    """metrics.jsonl as columns: {"loss": [...], "grad_norm": [...], ...}."""
    rows = [json.loads(line) for line in
            (job / "output" / "metrics.jsonl").read_text().splitlines()]
    return {key: [row[key] for row in rows] for key in rows[0]}


def worker_process(root: Path, rank: int) -> psutil.Process:
    """The running worker of ``rank`` whose contract root is under ``root`` (a job's folder)."""
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("RANK") == str(rank) and env.get("DTRAIN_ROOT", "").startswith(str(root)):
            return proc
    raise AssertionError(f"no running worker of rank {rank} under {root}")
