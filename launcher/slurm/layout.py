"""One Slurm job's folder on the shared file system: the layout the client and the nodes share.

``<slurm.shared_dir>/<job id>/`` holds ``job.sbatch`` (the batch script, exactly as dry-run
printed it), ``node.json`` (what each node writes its contract from), ``hosts`` (the job's nodes,
written by the batch script), ``slurm-<slurm id>.out`` (the batch script's output), ``code/``
(the job's source), ``wheel/`` (dtrain for a container image), ``inputs/`` (S3 channels),
``checkpoints/`` (unless ``checkpoint.uri`` says otherwise), one contract root per node
(``<node>/``, with ``output/agent.log`` and the ranks' logs) and ``status/<node>.json``, where
each node says when its agent started and how it ended. Both sides import this module and
nothing of each other.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from dtrain.launcher.agents import agent_log, host_root  # noqa: F401 - this layout, shared

SCRIPT_FILE = "job.sbatch"
NODE_CONFIG_FILE = "node.json"
HOSTS_FILE = "hosts"
CODE_DIR = "code"
WHEEL_DIR = "wheel"
# The batch script exports the job's nodes here for every node's ``dtrain.launcher.slurm.node``.
HOSTS_ENV = "DTRAIN_SLURM_HOSTS"


def batch_output(job_dir: str, slurm_job_id: str) -> str:
    """The batch script's ``--output`` (``slurm-%j.out`` in the job's folder)."""
    return os.path.join(job_dir, f"slurm-{slurm_job_id}.out")


def batch_output_ids(job_dir: str) -> list[str]:
    """The Slurm ids of the jobs that wrote a batch output in the folder (started there)."""
    paths = glob.glob(batch_output(glob.escape(job_dir), "*"))
    prefix, suffix = batch_output(job_dir, "\0").split("\0")
    ids = (path[len(prefix):-len(suffix)] for path in paths)
    return sorted((i for i in ids if i.isdigit()), key=int)


def status_file(job_dir: str, host: str) -> str:
    return os.path.join(job_dir, "status", f"{host}.json")


def read_hosts(job_dir: str) -> list[str]:
    """The job's nodes in Slurm's order ([] before the batch script wrote them)."""
    try:
        with open(os.path.join(job_dir, HOSTS_FILE)) as fh:
            return [line.strip() for line in fh if line.strip()]
    except OSError:
        return []


def read_json(path: str) -> dict[str, Any]:
    """A JSON object written by ``write_json`` ({} when it is not there yet)."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: str, data: dict[str, Any]) -> None:
    """Atomically: a reader on another node never sees half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.tmp", "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
    os.replace(f"{path}.tmp", path)


def read_statuses(job_dir: str, hosts: list[str]) -> dict[str, dict[str, Any]]:
    """host -> what its node reported ({} for a node that has not reported yet)."""
    return {host: read_json(status_file(job_dir, host)) for host in hosts}
