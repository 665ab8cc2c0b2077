"""The batch script of a Slurm job and the ``sbatch`` command line: pure functions of the spec.

The script carries every ``#SBATCH`` option (so ``sbatch job.sbatch`` in the job's folder submits
it again by hand), exports the job's environment, expands the job's nodes with ``scontrol show
hostnames``, and starts one ``dtrain.launcher.slurm.node`` per node with ``srun`` (in the
container image through Pyxis when the spec names one), which writes that node's contract and
runs its node agent.
"""

from __future__ import annotations

import math
import os
import shlex
from typing import TYPE_CHECKING

from dtrain.core import contract, instances
from dtrain.launcher.slurm import layout

if TYPE_CHECKING:
    from dtrain.planning.planner import Plan
    from dtrain.spec.model import JobSpec

# Slurm's time limit is max_run plus this: the node agent's own max_run clock starts only after
# the image is pulled and dtrain imported, and it then stops the workers after a checkpoint,
# which must happen before Slurm's limit sends its SIGTERM-then-SIGKILL.
TIME_LIMIT_MARGIN_S = 600
# The rendezvous port is this plus the Slurm job id modulo 1000, so two jobs sharing a node (not
# exclusive) do not collide.
MASTER_PORT_BASE = 29500
# scancel sends SIGTERM, then SIGKILL after the cluster's KillWait (scontrol show config): the
# node agents' grace period ends 5 s before, so each still reports where to resume from.
_GRACE_PERIOD = (
    "# Workers get until 5 s before Slurm's SIGKILL (KillWait after scancel's SIGTERM).",
    "kill_wait=$(scontrol show config | awk '$1 == \"KillWait\" {print $3}')",
    (f"export {contract.GRACE_PERIOD_ENV}="
     "$(( ${kill_wait:-30} > 10 ? ${kill_wait:-30} - 5 : 5 ))"),
)
# Each line of the script's own output (its first line, srun's errors) stamped as the node agents
# stamp theirs (dtrain.core.logformat), so `dtrain logs` merges it with them in time order.
_STAMP_OUTPUT = (
    "# Its own output's lines are time-stamped, as the agents' are, for `dtrain logs`; the",
    "# stamping outlives scancel's SIGTERM (srun must not lose its output while it stops).",
    "stamp() { trap '' TERM; while IFS= read -r line || [ -n \"$line\" ]; do echo \"@$(date +%s.%N) $line\"; done; }",
)


def time_limit_minutes(max_run: int) -> int:
    return math.ceil((max_run + TIME_LIMIT_MARGIN_S) / 60)


def gpus_per_node(spec: JobSpec) -> int:
    """``slurm.gpus_per_node``, else the instance type's GPUs from the catalog (0 on CPU nodes)."""
    if spec.slurm.gpus_per_node is not None:
        return spec.slurm.gpus_per_node
    return spec.compute.instance.gpus


def directives(spec: JobSpec, plan: Plan, job_name: str, job_dir: str) -> list[str]:
    """The ``#SBATCH`` options: dtrain's from the spec, then ``slurm.extra_sbatch``."""
    slurm, gpus = spec.slurm, gpus_per_node(spec)
    options = [f"--job-name={job_name}", f"--nodes={plan.num_nodes}", "--ntasks-per-node=1"]
    if gpus:
        options.append(f"--gpus-per-node={gpus}")
    if slurm.exclusive:
        options += ["--exclusive", "--mem=0"]  # every CPU, GPU, NIC and byte of memory
    else:
        options.append(f"--cpus-per-task={plan.processes_per_node}")  # a core per worker
    options += [f"--{name}={value}" for name, value in
                (("partition", slurm.partition), ("account", slurm.account), ("qos", slurm.qos))
                if value]
    options += [f"--time={time_limit_minutes(spec.compute.max_run)}",
                f"--chdir={job_dir}", f"--output={layout.batch_output(job_dir, '%j')}",
                "--open-mode=append"]  # a requeued job adds to its output
    return options + [line.strip() for line in slurm.extra_sbatch]


def environment(spec: JobSpec) -> dict[str, str]:
    """What every process of the job inherits: the EFA settings the catalog gives the instance
    type (the node agent adds the interface NCCL binds to), then the spec's ``environment``."""
    return {"PYTHONUNBUFFERED": "1", **instances.efa_environment(spec.compute.instance_type, None),
            **spec.environment}


def srun_command(spec: JobSpec, job_dir: str) -> list[str]:
    """One ``dtrain.launcher.slurm.node`` per node, in the container image if there is one:
    ``srun``, its options, then the command (one shell line each)."""
    slurm, gpus = spec.slurm, gpus_per_node(spec)
    lines = ["srun", '--nodes="$SLURM_JOB_NUM_NODES"', "--ntasks-per-node=1",
             "--kill-on-bad-exit=1"]  # a crash on one node ends the others at once
    if gpus:
        lines.append(f"--gpus-per-node={gpus}")
    node = shlex.join([slurm.python, "-m", "dtrain.launcher.slurm.node", job_dir])
    if not slurm.container_image:
        return lines + [node]
    mounts = [f"{job_dir}:{job_dir}",
              *(f"{path}:{path}" for path in sorted(set(_used_in_place(spec, job_dir)))),
              *slurm.container_mounts]
    install = (f"{shlex.quote(slurm.python)} -m pip install --quiet --no-deps "
               f"{shlex.quote(job_dir)}/{layout.WHEEL_DIR}/*.whl")
    return lines + [shlex.quote(f"--container-image={slurm.container_image}"),
                    shlex.quote(f"--container-mounts={','.join(mounts)}"),
                    "bash -c " + shlex.quote(f"{install} && exec {node}")]


def _used_in_place(spec: JobSpec, job_dir: str) -> list[str]:
    """Folders outside the job's that the nodes read or write at their own paths, so they are
    mounted in a container too: local input channels, and ``checkpoint.uri`` (else checkpoints
    would go to the container's own file system and be lost with it)."""
    paths = [path for path in spec.inputs.values() if not path.startswith("s3://")]
    checkpoints = spec.checkpoint.uri
    if checkpoints and os.path.commonpath([checkpoints, job_dir]) != job_dir:
        paths.append(checkpoints)
    return paths


def build_script(spec: JobSpec, plan: Plan, *, job_id: str, job_name: str, job_dir: str) -> str:
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {option}" for option in directives(spec, plan, job_name, job_dir)]
    lines += [
        f"# dtrain job {job_id} ({job_name}), written by `dtrain submit`: one node agent per node.",
        "set -euo pipefail",
        *(f"export {key}={shlex.quote(value)}" for key, value in environment(spec).items()),
        f"job_dir={shlex.quote(job_dir)}",
        "# The contract's hosts: the job's nodes, as Slurm names them.",
        'scontrol show hostnames "$SLURM_JOB_NODELIST" > "$job_dir/hosts"',
        f'{layout.HOSTS_ENV}=$(tr "\\n" " " < "$job_dir/hosts")',
        f"export {layout.HOSTS_ENV}",
        "# The rendezvous port, on this (the first) node: from the job id, past any in use (two",
        "# jobs sharing a node whose ids differ by 1000 would otherwise clash).",
        f"port=$(({MASTER_PORT_BASE} + SLURM_JOB_ID % 1000))",
        'while (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do port=$((port + 1)); done',
        f"export {contract.MASTER_PORT_ENV}=$port",
        *_GRACE_PERIOD,
        *_STAMP_OUTPUT,
        f'echo "dtrain: job {job_id} on ${layout.HOSTS_ENV}" | stamp',
        " \\\n  ".join([*srun_command(spec, job_dir), "2>&1 | stamp"]),
    ]
    return "\n".join(lines) + "\n"


def sbatch_command(job_dir: str) -> list[str]:
    """``--parsable``: sbatch prints only the job id (``123`` or ``123;cluster``)."""
    return ["sbatch", "--parsable", f"{job_dir}/{layout.SCRIPT_FILE}"]
