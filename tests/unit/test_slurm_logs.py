"""`dtrain logs` of a Slurm job: the batch script's own output (its first line, srun's errors)
merged in time order with the nodes' agent logs, as the batch script stamps it."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from dtrain.core import logformat
from dtrain.launcher import agents
from dtrain.launcher.base import Handle, JobIdentity
from dtrain.launcher.slurm import layout, script
from dtrain.launcher.slurm.launcher import SlurmLauncher, SlurmState


def stamped_by_the_batch_script(lines: list[str]) -> list[str]:
    """``lines`` through the batch script's own ``stamp`` (script.py), run by bash."""
    [stamp] = [line for line in script._STAMP_OUTPUT if line.startswith("stamp()")]
    out = subprocess.run(["bash", "-c", f"{stamp}\nstamp"], input="\n".join(lines) + "\n",
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(out) == len(lines)
    return out


def test_the_stamp_keeps_a_last_line_without_its_newline():
    [stamp] = [line for line in script._STAMP_OUTPUT if line.startswith("stamp()")]
    out = subprocess.run(["bash", "-c", f"{stamp}\nstamp"], input="a\ncut short",
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert [logformat.unstamp(line)[1] for line in out] == ["a", "cut short"]


def test_the_batch_output_merges_with_the_agents_in_the_order_it_was_written(tmp_path):
    job_dir = str(tmp_path)
    (tmp_path / layout.HOSTS_FILE).write_text("n1\nn2\n")
    [first] = stamped_by_the_batch_script(["dtrain: job abc on n1 n2"])
    when, text = logformat.unstamp(first)
    assert text == "dtrain: job abc on n1 n2" and abs(when - time.time()) < 60
    agent = {"n1": [f"@{when + 1:.3f} [n1 0]:step 1", f"@{when + 3:.3f} [n1 0]:step 2"],
             "n2": [f"@{when + 2:.3f} agent on n2 started"]}
    for host, lines in agent.items():
        path = Path(agents.agent_log(job_dir, host))
        path.parent.mkdir(parents=True)
        path.write_text("\n".join(lines) + "\n")
    srun_error = f"@{when + 4:.3f} srun: error: n2: task 1: Exited with exit code 1"
    Path(layout.batch_output(job_dir, "42")).write_text(f"{first}\n{srun_error}\n")
    handle = Handle(JobIdentity("abc", "abc", when), "Failed",
                    SlurmState(job_dir=job_dir, slurm_job_id="42", hosts=["n1", "n2"]))
    logs = SlurmLauncher().logs(handle, follow=False, host=None, rank=None, ended=lambda: True)
    assert list(logs) == [
        "[n1] dtrain: job abc on n1 n2",  # printed last before: it carried no time
        "[n1 0]:step 1", "[n2] agent on n2 started", "[n1 0]:step 2",
        "[n1] srun: error: n2: task 1: Exited with exit code 1"]
    # a rank's lines only, or another node's: the batch output is the first node's, no rank's
    again = SlurmLauncher().logs(handle, follow=False, host="n2", rank=None, ended=lambda: True)
    assert list(again) == ["[n2] agent on n2 started"]
