"""What the node agent reports when its workers do not finish: ``output/failure`` (SageMaker's
free text) and ``failure.json`` (rank, host, exit code, time) naming the root cause, and for an
interruption or max_run where to resume from."""

from __future__ import annotations

import json
import logging
import os
import time

from dtrain.core import contract as c
from dtrain.runtime.agent.workers import rank_log_stem
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

logger = logging.getLogger("dtrain.runtime.agent")

FAILURE_TAIL_LINES = 20


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


def remove_partial_model(contract: c.Contract) -> None:
    """A final model save cut off by SIGKILL leaves files next to model/ (or, across mounts,
    hidden ones in it); remove them before SageMaker or the EC2 node uploads model/."""
    try:
        from dtrain.runtime.train.checkpoint import remove_partial_model_files

        remove_partial_model_files(contract.paths.model_dir)
    except Exception as exc:  # noqa: BLE001 - cleanup must not change the job's outcome
        logger.warning("could not remove a partial model save: %s", exc)


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
