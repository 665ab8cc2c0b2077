"""Rules every target shares: degrees, backend, spot basics, the entry point, paths.

Each rule is ``rule(spec, ctx)``; it appends to ``ctx.problems`` (the spec is invalid) or
``ctx.notes`` (warnings), and may resolve what the spec leaves implicit (absolute local paths,
the source folder of a bare script path) so later layers see one canonical form.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from dtrain.core import contract, recipe_inputs, s3, secrets
from dtrain.core.parallelism import ParallelismError, build_parallelism_plan

RECIPES = ("causal_lm", "masked_lm")


@dataclass
class Findings:
    """What the rules found; ``base_dir`` resolves the spec's relative paths."""

    base_dir: Path
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def instance_fits_target(spec, ctx: Findings) -> None:
    compute = spec.compute
    inst = compute.instance
    if compute.target == "local" and not inst.is_local:
        ctx.problems.append(
            f"compute.instance_type: {inst.name!r} is a cloud instance type but compute.target is "
            "'local'; use instance_type 'local' (CPU) or 'local_gpu', or target "
            "sagemaker/ec2/slurm"
        )
    elif compute.target in ("sagemaker", "ec2") and inst.is_local:  # slurm: rules/slurm.py
        ctx.problems.append(
            f"compute.instance_type: {inst.name!r} runs only on this machine; pick a cloud "
            f"instance type for target {compute.target!r}, e.g. 'p4d.24xlarge'"
        )


def backend_fits_hardware(spec, ctx: Findings) -> None:
    if spec.distribution.backend == "nccl" and not spec.compute.instance.has_gpu:
        ctx.problems.append(
            f"distribution.backend: 'nccl' needs GPUs but compute.instance_type "
            f"{spec.compute.instance_type!r} has none; use backend 'auto' or 'gloo', or a GPU "
            "instance type"
        )


def precision_fits_gpu(spec, ctx: Findings) -> None:
    """bf16 on a GPU without bf16 tensor cores (V100) runs emulated, many times slower."""
    inst = spec.compute.instance
    if spec.distribution.mixed_precision != "bf16" or inst.is_local or not inst.has_gpu \
            or inst.peak_bf16_tflops:
        return
    ctx.problems.append(
        f"distribution.mixed_precision: 'bf16' on {inst.name!r}, whose {inst.gpu_model} GPUs "
        "have no bf16 tensor cores; use 'fp16' (what 'auto' picks there) or a GPU with bf16 "
        "(A100, H100)")


def a_gpu_per_process(spec, ctx: Findings) -> None:
    """On GPU nodes each worker takes its own GPU (``cuda:<local rank>``): more workers than
    GPUs fail on the node, after the instances are paid for."""
    compute = spec.compute
    gpus, source = compute.instance.gpus, f"compute.instance_type {compute.instance.name!r}"
    if compute.target == "slurm" and spec.slurm.gpus_per_node is not None:
        gpus, source = spec.slurm.gpus_per_node, "slurm.gpus_per_node"
    processes = compute.resolved_processes_per_instance
    if compute.instance.is_local or not gpus or processes <= gpus:
        return
    ctx.problems.append(
        f"compute.processes_per_instance: {processes} workers per node, but {source} gives "
        f"{gpus} GPU(s) per node and each worker needs its own; set processes_per_instance to "
        f"{gpus} or fewer")


def degrees_make_a_plan(spec, ctx: Findings) -> None:
    """The degrees must make a parallelism plan (the one function the planner and the runtime
    use too); ``auto`` is sized by the planner once the model is known."""
    try:
        build_parallelism_plan(spec.distribution.model_dump(mode="json"),
                               world_size=spec.compute.world_size,
                               devices_per_node=spec.compute.resolved_processes_per_instance)
    except ParallelismError as exc:
        ctx.problems.append(str(exc))


def spot_settings(spec, ctx: Findings) -> None:
    compute = spec.compute
    if compute.max_wait is not None and not compute.use_spot:
        ctx.problems.append(
            "compute.max_wait: only applies to spot jobs; remove it or set compute.use_spot: true"
        )
    if compute.use_spot and compute.max_wait is not None and compute.max_wait < compute.max_run:
        ctx.problems.append(
            f"compute.max_wait: {compute.max_wait} s is less than compute.max_run "
            f"{compute.max_run} s; spot jobs need max_wait >= max_run"
        )


def entry_point(spec, ctx: Findings) -> None:
    entry = spec.entry_point
    if entry.startswith(contract.RECIPE_PREFIX):
        name = entry[len(contract.RECIPE_PREFIX):]
        if name not in RECIPES:
            ctx.problems.append(
                f"entry_point: unknown recipe {name!r}; built-in recipes: "
                + ", ".join(contract.RECIPE_PREFIX + r for r in RECIPES)
            )
        return
    if spec.source_dir is None:
        script = resolve(ctx.base_dir, entry)
        spec.source_dir, spec.entry_point = str(script.parent), script.name
    elif s3.is_s3_uri(spec.source_dir):
        return  # a packed sourcedir.tar.gz: its contents are checked where it was built
    else:
        spec.source_dir = str(resolve(ctx.base_dir, spec.source_dir))
    source = Path(spec.source_dir)
    if not source.is_dir():
        ctx.problems.append(f"source_dir: {spec.source_dir!r} is not a folder; check the path")
        return
    script = (source / spec.entry_point).resolve()
    if source.resolve() not in script.parents:
        ctx.problems.append(
            f"entry_point: {spec.entry_point!r} is outside source_dir {spec.source_dir!r}; "
            "give a path inside it"
        )
    elif not is_file(script):
        ctx.problems.append(
            f"entry_point: {spec.entry_point!r} not found in source_dir {spec.source_dir!r}; "
            "check the name or set source_dir"
        )


def recipe_hyperparameters(spec, ctx: Findings) -> None:
    """What a recipe needs of the hyperparameters the spec gives (the rest: the node agent)."""
    if spec.entry_point.startswith(contract.RECIPE_PREFIX):
        recipe = spec.entry_point[len(contract.RECIPE_PREFIX):]
        problems, notes = recipe_inputs.unread_hyperparameters(spec.hyperparameters,
                                                               recipe=recipe)
        ctx.problems += problems
        ctx.notes += notes
        ctx.problems += recipe_inputs.hyperparameter_problems(spec.hyperparameters, recipe=recipe,
                                                              model_known=False,
                                                              channels=spec.inputs.keys())
        if not spec.inputs:
            ctx.notes += recipe_inputs.no_inputs_note(spec.hyperparameters)


def cloud_paths(spec, ctx: Findings) -> None:
    """A cloud target reads and writes S3 only."""
    target = spec.compute.target
    for channel, uri in spec.inputs.items():
        if not s3.is_s3_uri(uri):
            what = "a web address" if "://" in uri else "a local path"
            ctx.problems.append(
                f"inputs.{channel}: {uri!r} is {what}, which {target} cannot read; "
                "upload it to S3 and give the s3:// URI (s3://bucket/key)"
            )
    if spec.output_path is None:
        ctx.problems.append(
            f"output_path: required for target {target}; give an s3:// URI such as "
            "s3://my-bucket/dtrain"
        )
    for field_name, value in (("output_path", spec.output_path),
                              ("checkpoint.uri", spec.checkpoint.uri)):
        if value is None:
            continue
        if not s3.is_s3_uri(value):
            ctx.problems.append(f"{field_name}: {value!r} must be an s3:// URI for {target}")
            continue
        try:
            s3.check(value, field_name)
        except ValueError as exc:
            ctx.problems.append(str(exc))


def resolve(base_dir: Path, value: str) -> Path:
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() else (base_dir / path).resolve()


def is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def file_in_the_way(field_name: str, path: Path) -> str | None:
    """The problem of a folder to write into (``path``) where a file is, or is one of its
    parents (the job would fail making it, naming no field)."""
    taken = next((p for p in (path, *path.parents) if exists(p)), None)
    if taken is None or taken.is_dir():
        return None
    return (f"{field_name}: {str(taken)!r} is a file; the job writes into a folder there: give a "
            "folder (or a path not taken)")


def channel_names(spec, ctx: Findings) -> None:
    """``dtrain_*`` channels carry dtrain's own code; the contract hides them from scripts."""
    for channel in spec.inputs:
        if channel.startswith(contract.RESERVED_PREFIX):
            ctx.problems.append(
                f"inputs.{channel}: this channel name is reserved by dtrain (channels named "
                f"{contract.RESERVED_PREFIX}* carry its code); rename the channel")


def environment_secrets(spec, ctx: Findings) -> None:
    """Secret-looking variables should be references, which never travel in a request."""
    for name, value in spec.environment.items():
        if secrets.reference(value) is None and secrets.looks_secret(name) and value:
            ctx.notes.append(
                f"environment.{name}: looks like a secret given in plain text; it travels in "
                f"the job's request (dry runs show it as {secrets.REDACTED}); give a reference "
                f"instead, e.g. {name}: secretsmanager:<secret name> or ssm:<parameter name>, "
                "resolved on the node")


def environment_settings(spec, ctx: Findings) -> None:
    """Variables the node agent reads itself: a bad value would fail the job on its nodes."""
    grace = spec.environment.get(contract.GRACE_PERIOD_ENV)
    if grace is not None and not grace.strip().isdigit():
        ctx.problems.append(f"environment.{contract.GRACE_PERIOD_ENV}: {grace!r} is not a whole "
                            "number of seconds; give one, e.g. 60")


COMMON_RULES = (instance_fits_target, backend_fits_hardware, precision_fits_gpu, a_gpu_per_process,
                degrees_make_a_plan, spot_settings, entry_point, channel_names,
                recipe_hyperparameters, environment_secrets, environment_settings)
