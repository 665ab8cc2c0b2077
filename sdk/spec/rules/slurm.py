"""Rules of ``compute.target: slurm``: a shared folder, cluster paths, what ``#SBATCH`` may add.

The job's files live on the cluster's shared file system, so paths are resolved here (relative
ones against the spec's folder) but checked for existence only at submit, on the login node:
validating on a laptop must not depend on the cluster's mounts. What Slurm itself decides (a
partition exists, a time limit fits it) is answered by ``sbatch`` at submit.
"""

from __future__ import annotations

import re
import sys

from dtrain.core import s3
from dtrain.spec.rules.common import Findings, file_in_the_way, resolve
from dtrain.spec.rules.local import no_spot
from dtrain.spec.rules.sagemaker import image_torch

_SLURM_NAMES = re.compile(r"^[A-Za-z0-9_.\-]+(,[A-Za-z0-9_.\-]+)*$")
_OPTION_NAME = re.compile(r"^(--[A-Za-z][A-Za-z0-9\-]*|-[A-Za-z])")  # -N4: "-N"
# The spec field behind each sbatch option dtrain writes itself.
SET_BY_DTRAIN = {
    "compute.instance_count": ("--nodes", "-N", "--ntasks", "-n"),
    "compute.processes_per_instance": ("--ntasks-per-node",),
    "compute.max_run": ("--time", "-t"),
    "name": ("--job-name", "-J"),
    "slurm.partition": ("--partition", "-p"),
    "slurm.account": ("--account", "-A"),
    "slurm.qos": ("--qos", "-q"),
    "slurm.gpus_per_node": ("--gpus-per-node", "--gpus", "-G"),  # more in _extra_option_problem
    "slurm.exclusive": ("--exclusive",),
    "slurm.shared_dir": ("--output", "-o", "--error", "-e", "--chdir", "-D", "--open-mode"),
}


def shared_folder(spec, ctx: Findings) -> None:
    """The job's folder, checkpoints and local inputs are paths of the shared file system."""
    slurm = spec.slurm
    if slurm.shared_dir is None:
        ctx.problems.append(
            "slurm.shared_dir: required for target slurm; give a folder on the cluster's shared "
            "file system that every node mounts at the same path, e.g. /fsx/dtrain")
    elif s3.is_s3_uri(slurm.shared_dir):
        ctx.problems.append(f"slurm.shared_dir: {slurm.shared_dir!r} is in S3; give a folder "
                            "on the cluster's shared file system, e.g. /fsx/dtrain")
    elif re.search(r"[\s%]", slurm.shared_dir):  # #SBATCH --output would split or expand it
        ctx.problems.append(f"slurm.shared_dir: {slurm.shared_dir!r} has a space or '%', which "
                            "#SBATCH options cannot hold; use a folder without")
    else:
        slurm.shared_dir = str(resolve(ctx.base_dir, slurm.shared_dir))
    if spec.output_path is not None:
        ctx.problems.append(
            f"output_path: {spec.output_path!r}: a Slurm job writes its model and output under "
            "slurm.shared_dir/<job id>/; remove output_path")
    uri = spec.checkpoint.uri
    if uri is not None and s3.is_s3_uri(uri):
        ctx.problems.append(f"checkpoint.uri: {uri!r}: Slurm nodes checkpoint to the shared "
                            "file system; give a folder there, e.g. /fsx/checkpoints/my-job")
    elif uri is not None:
        path = resolve(ctx.base_dir, uri)
        spec.checkpoint.uri = str(path)
        ctx.problems += filter(None, [file_in_the_way("checkpoint.uri", path)])
    for channel, value in list(spec.inputs.items()):
        if not s3.is_s3_uri(value):  # S3 is downloaded into the job's folder at submit
            spec.inputs[channel] = str(resolve(ctx.base_dir, value))
    if spec.source_dir is not None and s3.is_s3_uri(spec.source_dir):
        ctx.problems.append(f"source_dir: {spec.source_dir!r}: a Slurm job copies its code from "
                            "a folder of the login node; give that folder")


def nodes_dtrain_can_run(spec, ctx: Findings) -> None:
    """CPU nodes (`local`) or a catalog instance type; the Python the nodes run dtrain with."""
    inst = spec.compute.instance
    if inst.name == "local_gpu":
        ctx.problems.append(
            "compute.instance_type: 'local_gpu' means this machine's GPUs; on Slurm give the "
            "nodes' instance type (e.g. p4d.24xlarge), or 'local' for CPU nodes")
    slurm = spec.slurm
    if slurm.python is None:
        # the nodes run the interpreter (and so the environment) that validated the spec, which
        # is why that environment must live on the shared file system
        slurm.python = "python" if slurm.container_image else sys.executable


def sbatch_options(spec, ctx: Findings) -> None:
    slurm = spec.slurm
    for field in ("partition", "account", "qos"):
        value = getattr(slurm, field)
        if value is not None and not _SLURM_NAMES.match(value):
            ctx.problems.append(f"slurm.{field}: {value!r} is not a Slurm name; use letters, "
                                "digits, '_', '-', '.' (commas between several)")
    for line in slurm.extra_sbatch:
        problem = _extra_option_problem(line, exclusive=slurm.exclusive,
                                        dtrain_asks_gpus=slurm.gpus_per_node != 0)
        if problem:
            ctx.problems.append(f"slurm.extra_sbatch: {line!r} {problem}")
    for mount in slurm.container_mounts:
        if "," in mount or "\n" in mount or not mount.startswith("/"):
            ctx.problems.append(f"slurm.container_mounts: {mount!r} is not SRC:DST with an "
                                "absolute SRC (one mount per item, no commas)")
    if slurm.container_mounts and not slurm.container_image:
        ctx.problems.append("slurm.container_mounts: only used with slurm.container_image; set "
                            "the image or remove the mounts")


def _extra_option_problem(line: str, *, exclusive: bool, dtrain_asks_gpus: bool) -> str | None:
    if "\n" in line:
        return "spans lines; give one option per item"
    if line.lstrip().startswith("#"):
        return "starts with '#'; give the option alone, e.g. '--constraint=p4d'"
    match = _OPTION_NAME.match(line.strip())
    if not match:
        return "is not an sbatch option; give e.g. '--constraint=p4d'"
    name = match.group(1)
    if name in ("--array", "-a"):
        return "asks for a job array; dtrain submits one job per spec"
    value = line.strip()[len(name):].lstrip("= ")
    asks_gpus = name in ("--gpus-per-task", "--gpus-per-socket") or (
        name in ("--gres", "--tres-per-node", "--tres-per-task")
        and any(item.split("/")[-1].startswith("gpu") for item in value.split(",")))
    if asks_gpus and dtrain_asks_gpus:
        return ("asks for GPUs, which dtrain asks for from slurm.gpus_per_node; set that, or "
                "set it to 0 and ask for them here")
    if exclusive and name in ("--mem", "--mem-per-cpu", "--mem-per-gpu"):
        return ("asks for memory, but slurm.exclusive gives the job each node's memory "
                "(--mem=0); drop it, or set slurm.exclusive false")
    field = next((f for f, names in SET_BY_DTRAIN.items() if name in names), None)
    if field is None:
        return None
    if field == "slurm.shared_dir":
        return "is set by dtrain: a job's output goes to slurm.shared_dir/<job id>/"
    return f"is set by dtrain from {field}; set that instead"

def image_runs_the_runtime(spec, ctx: Findings) -> None:
    if spec.slurm.container_image:
        image_torch(ctx, "slurm.container_image", spec.slurm.container_image)


RULES = (shared_folder, nodes_dtrain_can_run, sbatch_options, image_runs_the_runtime, no_spot)
