"""What the node agent reports when its workers do not finish: ``output/failure`` (SageMaker's
free text) and ``failure.json`` (rank, host, exit code, time) naming the root cause, and for an
interruption or max_run where to resume from."""

from __future__ import annotations

import json
import logging
import os
import signal
import time

from dtrain.core import contract as c
from dtrain.runtime.agent.workers import rank_log_stem
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

logger = logging.getLogger("dtrain.runtime.agent")

FAILURE_TAIL_LINES = 20


def _tail(path: str, lines: int) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in f.readlines()[-lines:]]
    except OSError:
        return []


def describe_child_failure(contract: c.Contract, failures: dict[int, ProcessFailure], *,
                           healthy_until: float) -> dict:
    """The root cause on this host: first failing rank, exit code, last lines of its stderr.

    torch's list also holds the workers the agent itself ended once one had failed (SIGTERM, then
    SIGKILL a grace period later, dated later): they are no cause. torch dates failures to the
    second, so two in the same second tie: a rank that exited with a code failed when it last
    wrote to its stderr (a traceback, as it exits); one killed by a signal, as early as the last
    moment every worker was seen running (``healthy_until``), which puts it first among the
    failures one look found, since a killed rank makes the others fail.
    """
    earliest = min(f.timestamp for f in failures.values())
    causes = {r: f for r, f in failures.items()
              if f.timestamp == earliest and f.exitcode != -signal.SIGTERM}
    failures = causes or failures

    def failed_at(rank: int) -> float:
        code = failures[rank].exitcode
        if code is not None and code >= 0:
            try:
                stderr = f"{_latest_stem(contract.paths.logs_dir, rank)}.stderr.log"
                return max(os.path.getmtime(stderr), healthy_until)
            except OSError:
                pass
        return healthy_until

    times = {rank: failed_at(rank) for rank in failures}
    rank = min(times, key=lambda r: (times[r], r))
    failure = failures[rank]
    tail = _tail(f"{_latest_stem(contract.paths.logs_dir, rank)}.stderr.log", FAILURE_TAIL_LINES)
    last = next((line for line in reversed(tail) if line.strip()), "")
    if failure.exitcode is not None and failure.exitcode < 0:
        what = f"was killed by {_signal_name(-failure.exitcode)}"
    else:
        what = f"exited with code {failure.exitcode}"
    return {
        "rank": rank, "host": contract.current_host, "exit_code": failure.exitcode,
        "timestamp": times[rank],
        "summary": f"rank {rank} on {contract.current_host} {what}" + (f": {last}" if last else ""),
        "tail": tail,
    }


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


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
            f"{c.PREEMPTED_EXIT_CODE}) because {which} received SIGTERM, before this run wrote "
            f"a checkpoint; resubmitted, the job resumes from the newest one in {location} if "
            "there is one, else starts afresh")
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


def _latest_stem(log_dir: str, rank: int) -> str:
    for attempt in range(50, -1, -1):
        stem = rank_log_stem(log_dir, rank, attempt)
        if os.path.exists(f"{stem}.stderr.log"):
            return stem
    return rank_log_stem(log_dir, rank)


def write_failure(paths: c.Paths, details: dict) -> None:
    """``output/failure`` (SageMaker's free text) plus ``failure.json`` for the launcher.

    Logs instead of raising when the files cannot be written: the exit code still tells.
    """
    text = details["summary"]
    tail = [line for line in details.get("tail") or [] if line.strip()]
    if tail and not (len(tail) == 1 and text.endswith(f": {tail[0]}")):  # more than the summary
        text += "\n\n" + "\n".join(details["tail"])
    try:
        os.makedirs(paths.output_dir, exist_ok=True)
        with open(paths.failure_file, "w") as f:
            f.write(text + "\n")
        with open(paths.failure_details_file, "w") as f:
            json.dump(details, f)
    except OSError as exc:
        logger.error("could not write %s (%s): %s", paths.failure_file, exc, text)


def remove_records(paths: c.Paths) -> None:
    """Delete the failure report, exit record and stop note (``stopped_early.json``) an earlier
    run left in this host's folder."""
    for stale in (paths.failure_file, paths.failure_details_file, paths.agent_exit_file,
                  paths.stopped_early_file):
        try:
            os.remove(stale)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("could not remove %s: %s", stale, exc)


def write_exit_record(paths: c.Paths, code: int) -> None:
    """``output/agent_exit.json``: this agent's exit code, written as it exits (atomically)."""
    record = {"exit_code": code, "ended_at": time.time(), "pid": os.getpid()}
    try:
        os.makedirs(paths.output_dir, exist_ok=True)
        with open(f"{paths.agent_exit_file}.tmp", "w") as f:
            json.dump(record, f)
        os.replace(f"{paths.agent_exit_file}.tmp", paths.agent_exit_file)
    except OSError as exc:
        logger.error("could not write %s: %s", paths.agent_exit_file, exc)


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
