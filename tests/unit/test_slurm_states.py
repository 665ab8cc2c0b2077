"""Slurm's states read as dtrain's, a Slurm job's end from its nodes' reports, and Slurm's
commands as the login node answers them.

The commands are run for real; where a case needs an answer the test cluster cannot give (an
accounting record, a controller that is down), small stand-ins for ``squeue``/``sacct``/
``sbatch``/``scancel`` earlier on PATH give Slurm's own output for it.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from dtrain.core import contract
from dtrain.core.errors import DtrainError
from dtrain.launcher.slurm import commands, states
from dtrain.launcher.slurm.commands import SlurmJob


def end(slurm, reports, job_dir="/nonexistent", *, stop_requested=False):
    return states.ending(slurm, reports, str(job_dir), stop_requested=stop_requested,
                         job_id="7", output="/fsx/j/slurm-7.out", checkpoint_dir="/fsx/ckpt")


def report_failure(root: Path, summary: str, **details) -> str:
    paths = contract.Paths(str(root))
    os.makedirs(paths.output_dir, exist_ok=True)
    Path(paths.failure_file).write_text(summary + "\n")
    Path(paths.failure_details_file).write_text(json.dumps({"summary": summary, **details}))
    return str(root)


@pytest.mark.parametrize(("slurm", "expected"), [
    (SlurmJob("PENDING", "Resources"), ("Pending", "PENDING: Resources")),
    (SlurmJob("REQUEUED"), ("Pending", "REQUEUED")),
    (SlurmJob("CONFIGURING"), ("Starting", "CONFIGURING")),
    (SlurmJob("RUNNING"), ("Running", None)),
    (SlurmJob("COMPLETING"), ("Running", "COMPLETING")),
])
def test_a_job_slurm_still_has_reads_as_pending_starting_or_running(slurm, expected):
    assert not states.has_ended(slurm)
    assert states.progress(slurm) == expected


@pytest.mark.parametrize("state", ["COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL",
                                   "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"])
def test_slurm_s_end_states_and_a_forgotten_job_have_ended(state):
    assert states.has_ended(SlurmJob(state)) and states.has_ended(None)


def test_every_node_reporting_decides_the_end_as_on_every_target(tmp_path):
    done = {"n1": {"exit_code": 0}, "n2": {"exit_code": 0}}
    assert end(SlurmJob("COMPLETED"), done) == ("Completed", None)
    report_failure(tmp_path / "n1", "interrupted: training stopped at step 9 after a "
                   "checkpoint because this host received SIGTERM",
                   reason="interrupted", timestamp=1)
    timed_out = {"n1": {"exit_code": 143}, "n2": {"exit_code": 143}}
    status, reason = end(SlurmJob("TIMEOUT"), timed_out, tmp_path)
    assert status == "Stopped" and reason.startswith("interrupted: training stopped at step 9")
    assert end(SlurmJob("CANCELLED"), timed_out, tmp_path, stop_requested=True) == \
        ("Stopped", "stopped by user")


def test_a_crash_fails_the_job_with_its_report_though_its_peer_was_killed(tmp_path):
    report_failure(tmp_path / "n2", "rank 3 on n2 exited with code 1: KeyError: 'x'",
                   rank=3, timestamp=1)
    reports = {"n2": {"exit_code": 1}, "n1": {"state": "running"}}  # n1 went with the step
    assert end(SlurmJob("FAILED"), reports, tmp_path) == \
        ("Failed", "rank 3 on n2 exited with code 1: KeyError: 'x'")
    started = {"n1": {"exit_code": 2, "reason": "node n1 could not start its agent: x"}, "n2": {}}
    assert end(SlurmJob("FAILED"), started) == \
        ("Failed", "node n1 could not start its agent: x")


def test_ends_no_agent_could_report_are_named_by_slurm():
    assert end(SlurmJob("CANCELLED"), {"n1": {}}, stop_requested=True) == \
        ("Stopped", "stopped by user")
    assert end(SlurmJob("CANCELLED"), {}) == (
        "Stopped", ("cancelled in Slurm (scancel), not by `dtrain stop`; resubmit to resume "
        "from the newest checkpoint in /fsx/ckpt"))
    assert end(SlurmJob("NODE_FAIL"), {"n1": {"state": "running"}}) == (
        "Failed", ("Slurm job 7 ended NODE_FAIL before every node reported; see "
        "/fsx/j/slurm-7.out"))
    assert end(None, {}) == ("Failed", ("Slurm no longer knows job 7 and not every node "
                                       "reported; see /fsx/j/slurm-7.out"))


# ---------------------------------------------------------------- Slurm's commands

@pytest.fixture
def slurm_bin(tmp_path, monkeypatch):
    """``slurm_bin(name, stdout, stderr, code)`` puts a stand-in for one command on PATH."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")

    def add(name: str, stdout: str = "", stderr: str = "", code: int = 0) -> None:
        path = folder / name
        path.write_text(f"#!/bin/sh\nprintf '%s' {_q(stdout)}\nprintf '%s' {_q(stderr)} >&2\n"
                        f"exit {code}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return add


def _q(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def test_sbatch_answers_the_job_id_and_a_missing_sbatch_names_the_login_node(slurm_bin,
                                                                               monkeypatch,
                                                                               tmp_path):
    slurm_bin("sbatch", "4242;cluster\n")
    assert commands.submit(["sbatch", "--parsable", "x"]) == "4242"
    slurm_bin("sbatch", "", "sbatch: error: Invalid partition name specified\n", 1)
    with pytest.raises(DtrainError, match=r"^sbatch failed \(exit code 1\): sbatch: error: "
                                          r"Invalid partition name specified$"):
        commands.submit(["sbatch", "--parsable", "x"])
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    with pytest.raises(DtrainError, match=r"^sbatch not found: run dtrain on the cluster's "
                                          r"login node"):
        commands.submit(["sbatch", "--parsable", "x"])


def test_squeue_answers_first_then_sacct_once_squeue_forgot_the_job(slurm_bin):
    slurm_bin("squeue", "PENDING|Resources\n")
    assert commands.job_state("7") == SlurmJob("PENDING", "Resources")
    slurm_bin("squeue", "RUNNING|None\n")
    assert commands.job_state("7") == SlurmJob("RUNNING", "")
    slurm_bin("squeue", "", "slurm_load_jobs error: Invalid job id specified\n", 1)
    slurm_bin("sacct", "CANCELLED by 1000\n")
    assert commands.job_state("7") == SlurmJob("CANCELLED")
    slurm_bin("sacct", "", "Slurm accounting storage is disabled\n", 1)
    assert commands.job_state("7") is None


def test_a_controller_that_does_not_answer_is_an_error_not_an_end(slurm_bin):
    slurm_bin("squeue", "", "slurm_load_jobs error: Unable to contact slurm controller "
                            "(connect failure)\n", 1)
    with pytest.raises(DtrainError, match="^squeue failed .*Unable to contact slurm controller"):
        commands.job_state("7")


def test_scancel_of_a_job_that_already_ended_is_no_error(slurm_bin):
    slurm_bin("scancel", "", "scancel: error: Kill job error on job id 7: Job/step already "
                             "completing or completed\n", 1)
    commands.cancel("7")
    slurm_bin("scancel", "", "scancel: error: Access/permission denied\n", 1)
    with pytest.raises(DtrainError, match="^scancel 7 failed .*permission denied"):
        commands.cancel("7")


def test_the_job_a_dead_submit_queued_is_found_by_its_folder_in_squeue_sacct_or_its_output(
        slurm_bin, tmp_path):
    from dtrain.launcher.slurm import layout

    job_dir = str(tmp_path / "shared" / "a1b2")
    # squeue knows two jobs of that name: only one was started from this job's folder
    slurm_bin("squeue", f"8|{tmp_path}/shared/other\n9|{job_dir}\n")
    assert commands.find_job("t", job_dir, since=0) == "9"
    slurm_bin("squeue", "")  # forgotten by squeue: the accounting record
    slurm_bin("sacct", f"11|{job_dir}/\n")
    assert commands.find_job("t", job_dir, since=0) == "11"
    slurm_bin("sacct", "", "Slurm accounting storage is disabled\n", 1)
    assert commands.find_job("t", job_dir, since=0) is None
    slurm_bin("squeue", "", "slurm_load_jobs error: Unable to contact slurm controller\n", 1)
    with pytest.raises(DtrainError, match="^squeue failed"):  # not "no such job"
        commands.find_job("t", job_dir, since=0)
    # the batch outputs in the folder: the jobs that started there, by id
    os.makedirs(job_dir)
    for job_id in ("12", "7", "notes"):
        Path(layout.batch_output(job_dir, job_id)).write_text("")
    assert layout.batch_output_ids(job_dir) == ["7", "12"]
    assert layout.batch_output_ids(str(tmp_path / "none")) == []
