"""Rules of ``compute.target: local``: this machine's cores, local paths, no spot."""

from __future__ import annotations

import os
from pathlib import Path

from dtrain.core import contract, recipe_inputs, s3
from dtrain.spec.rules.common import Findings, exists, file_in_the_way, resolve

# A local job with more worker processes than this many per core is likely to crawl; with more
# than MAX_PROCESSES_PER_CORE it is refused unless the spec says compute.oversubscribe.
SLOW_PROCESSES_PER_CORE = 2
MAX_PROCESSES_PER_CORE = 4
# GPUs that have no /dev/nvidia* node: WSL2's (/dev/dxg) and AMD's under ROCm (/dev/kfd)
OTHER_GPU_DEVICES = ("/dev/dxg", "/dev/kfd")


def fits_this_machine(spec, ctx: Findings) -> None:
    compute = spec.compute
    total = compute.world_size
    cores = os.cpu_count() or 1
    if compute.instance.name != "local" or total <= SLOW_PROCESSES_PER_CORE * cores:
        return
    if total > MAX_PROCESSES_PER_CORE * cores and not compute.oversubscribe:
        ctx.problems.append(
            f"compute: {total} local worker processes on {cores} CPU cores is more than "
            f"{MAX_PROCESSES_PER_CORE} per core; use at most {MAX_PROCESSES_PER_CORE * cores} "
            "(compute.instance_count × processes_per_instance), or set compute.oversubscribe: "
            "true to run it anyway"
        )
    else:
        ctx.notes.append(
            f"compute: {total} local worker processes on {cores} CPU cores will be slow; "
            "lower compute.instance_count or compute.processes_per_instance"
        )


def gpus_here(spec, ctx: Findings) -> None:
    """``local_gpu`` runs a worker per GPU of this machine, every emulated host on the same
    GPUs: without one it would train on the CPU under a GPU's plan (nccl, bf16), and more
    workers than GPUs share one, which NCCL refuses."""
    compute = spec.compute
    if compute.instance.name != "local_gpu":
        return
    gpus = contract.count_gpus()
    if gpus == 0:
        if os.environ.get("CUDA_VISIBLE_DEVICES") is None and any(
                os.path.exists(device) for device in OTHER_GPU_DEVICES):
            return  # GPUs without /dev/nvidia* (WSL2, ROCm): the node agent counts them
        ctx.problems.append(
            "compute.instance_type: 'local_gpu' runs on this machine's GPUs, and it has none "
            "(no /dev/nvidia* device, or CUDA_VISIBLE_DEVICES hides them); use instance_type "
            "'local' to train on its CPU")
        return
    per_host = compute.processes_per_instance or gpus
    if compute.instance_count * per_host > gpus:
        ctx.problems.append(
            f"compute: {compute.instance_count} host(s) × {per_host} workers on this machine's "
            f"{gpus} GPU(s), and each worker needs its own; give instance_count × "
            f"processes_per_instance at most {gpus}")


def no_spot(spec, ctx: Findings) -> None:
    if spec.compute.use_spot:
        ctx.problems.append(
            "compute.use_spot: spot capacity exists only for targets sagemaker and ec2")


def local_paths(spec, ctx: Findings) -> None:
    """Inputs and outputs are folders of this machine, resolved against the spec's folder."""
    for channel, uri in list(spec.inputs.items()):
        if s3.is_s3_uri(uri):
            continue  # downloaded once at submit
        path = resolve(ctx.base_dir, uri)
        if not exists(path):
            ctx.problems.append(f"inputs.{channel}: local path {str(path)!r} does not exist; "
                                "give an existing folder or file (relative paths are resolved "
                                "against the spec's folder)")
        else:
            spec.inputs[channel] = str(path)
    for field_name, owner, attr in (("output_path", spec, "output_path"),
                                    ("checkpoint.uri", spec.checkpoint, "uri")):
        value = getattr(owner, attr)
        if value is None:
            continue
        if s3.is_s3_uri(value):
            try:
                s3.check(value, field_name)
                ctx.problems.append(
                    f"{field_name}: {value!r}: local jobs write to a local folder; give a path")
            except ValueError as exc:
                ctx.problems.append(str(exc))
        else:
            path = resolve(ctx.base_dir, value)
            ctx.problems += filter(None, [file_in_the_way(field_name, path)])
            setattr(owner, attr, str(path))


def recipe_data(spec, ctx: Findings) -> None:
    """A recipe's data given as a local input: an empty token file or binary 'text' is refused
    here, naming the channel, rather than in every worker."""
    if not spec.is_recipe:
        return
    data = spec.hyperparameters.get("data", recipe_inputs.DEFAULTS["data"])
    uri = spec.inputs.get(data) if isinstance(data, str) else None
    if uri and not s3.is_s3_uri(uri) and exists(Path(uri)):
        ctx.problems += recipe_inputs.data_problems(Path(uri), what=f"inputs.{data}")


RULES = (fits_this_machine, gpus_here, no_spot, local_paths, recipe_data)
