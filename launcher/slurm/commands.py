"""Slurm's own commands, run on the login node: ``sbatch``, ``squeue``, ``sacct``, ``scancel``.

They find the cluster as they always do (``slurm.conf``, or ``SLURM_CONF``), so dtrain needs no
settings of its own. Every failure becomes one line saying which command failed and how.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass

from dtrain.core.errors import DtrainError

TIMEOUT_S = 60
INSTALL_HINT = ("run dtrain on the cluster's login node, where Slurm's commands are (elsewhere: "
                "apt-get install slurm-client, with the cluster's slurm.conf)")


@dataclass(frozen=True)
class SlurmJob:
    """What Slurm says of a job: its state (``RUNNING``, ``CANCELLED``...) and reason."""

    state: str
    reason: str = ""


def run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S,
                              stdin=subprocess.DEVNULL, check=False)
    except FileNotFoundError:
        raise DtrainError(f"{argv[0]} not found: {INSTALL_HINT}") from None
    except subprocess.TimeoutExpired:
        raise DtrainError(f"{argv[0]} did not answer in {TIMEOUT_S} s; is slurmctld up? "
                          "(`scontrol ping`)") from None
    if check and done.returncode != 0:
        raise DtrainError(f"{argv[0]} failed (exit code {done.returncode}): "
                          f"{first_line(done.stderr or done.stdout)}")
    return done


def first_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[0] if lines else "no output"


def submit(argv: list[str]) -> str:
    """Run ``sbatch --parsable ...``; returns the Slurm job id."""
    out = run(argv).stdout.strip()
    job_id = out.split(";", 1)[0]
    if not job_id.isdigit():
        raise DtrainError(f"sbatch answered {first_line(out)!r}, not a job id")
    return job_id


def job_state(job_id: str) -> SlurmJob | None:
    """The job as ``squeue`` knows it (also shortly after it ended, for MinJobAge), else as
    ``sacct`` remembers it; None when neither knows it any more."""
    done = run(["squeue", "--noheader", "--states=all", f"--jobs={job_id}",
                "--format=%T|%r"], check=False)
    if done.returncode == 0 and done.stdout.strip():
        state, _, reason = done.stdout.strip().splitlines()[0].partition("|")
        return SlurmJob(state.strip(), "" if reason.strip() == "None" else reason.strip())
    if done.returncode != 0 and "invalid job id" not in done.stderr.lower():
        raise DtrainError(f"squeue failed (exit code {done.returncode}): "
                          f"{first_line(done.stderr)}")
    return _from_accounting(job_id)


def _from_accounting(job_id: str) -> SlurmJob | None:
    """``sacct``'s record of the job; None where accounting is off or has no record."""
    done = run(["sacct", "--noheader", "--parsable2", "--allocations", f"--jobs={job_id}",
                "--format=State"], check=False)
    lines = done.stdout.strip().splitlines() if done.returncode == 0 else []
    if not lines:
        return None
    return SlurmJob(lines[0].split()[0])  # "CANCELLED by 1000" -> CANCELLED


def cancel(job_id: str) -> None:
    """``scancel``: SIGTERM to every process of the job, SIGKILL after the cluster's KillWait.

    A job that already ended is no error: the stop and the end crossed."""
    done = run(["scancel", job_id], check=False)
    text = (done.stderr or "").lower()
    if done.returncode != 0 and "already completing or completed" not in text \
            and "invalid job id" not in text:
        raise DtrainError(f"scancel {job_id} failed (exit code {done.returncode}): "
                          f"{first_line(done.stderr)}")


def find_job(job_name: str, job_dir: str, *, since: float) -> str | None:
    """The id of the job ``sbatch`` queued from ``job_dir`` (its ``--chdir``) under
    ``job_name``, for a submit that died before it recorded the id: as ``squeue`` knows it, else
    as ``sacct`` remembers it (jobs submitted after ``since``); None when neither knows one."""
    done = run(["squeue", "--noheader", "--all", "--states=all", f"--name={job_name}",
                "--format=%i|%Z"], check=False)
    if done.returncode != 0:  # slurmctld down: that is no answer, not "no such job"
        raise DtrainError(f"squeue failed (exit code {done.returncode}): "
                          f"{first_line(done.stderr)}")
    found = _queued_from(done.stdout, job_dir)
    if found:
        return found
    started = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since - 60))
    done = run(["sacct", "--noheader", "--parsable2", "--allocations", f"--name={job_name}",
                f"--starttime={started}", "--format=JobID,WorkDir"], check=False)
    return _queued_from(done.stdout, job_dir) if done.returncode == 0 else None


def _queued_from(lines: str, job_dir: str) -> str | None:
    """The id on the first ``id|work dir`` line whose folder is ``job_dir``."""
    for line in lines.splitlines():
        job_id, _, work_dir = line.strip().partition("|")
        if job_id.isdigit() and os.path.normpath(work_dir) == os.path.normpath(job_dir):
            return job_id
    return None
