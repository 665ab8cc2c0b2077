"""Cross-field rules of a JobSpec: the checks that need more than one field.

``check_spec`` also resolves what the spec leaves implicit (absolute local paths, the source
folder of a bare script path, a default job name), so later layers see one canonical form.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from dtrain.core import contract, instances, names, s3
from dtrain.core.parallelism import ParallelismError, build_parallelism_plan

if TYPE_CHECKING:
    from dtrain.spec.model import JobSpec

RECIPES = ("causal_lm", "masked_lm")
# A local job with more worker processes than this many per core is likely to crawl.
LOCAL_PROCESSES_PER_CORE = 2


def check_spec(spec: JobSpec, base_dir: Path) -> tuple[list[str], list[str]]:
    """Return ``(problems, notes)``: problems make the spec invalid, notes are warnings."""
    problems: list[str] = []
    notes: list[str] = []
    for rule in (_instance_fits_target, _backend_fits_hardware, _degree_fits_world,
                 _spot_settings, _entry_point, _target_settings):
        rule(spec, base_dir, problems, notes)
    _paths_fit_target(spec, base_dir, problems)
    if spec.name is None:
        spec.name = names.from_entry_point(spec.entry_point)
    return problems, notes


def _instance_fits_target(spec, base_dir, problems, notes) -> None:
    compute = spec.compute
    inst = compute.instance
    if compute.target == "local" and not inst.is_local:
        problems.append(
            f"compute.instance_type: {inst.name!r} is a cloud instance type but compute.target is "
            "'local'; use instance_type 'local' (CPU) or 'local_gpu', or target sagemaker/ec2"
        )
    elif compute.target != "local" and inst.is_local:
        problems.append(
            f"compute.instance_type: {inst.name!r} runs only on this machine; pick a cloud "
            f"instance type for target {compute.target!r}, e.g. 'p4d.24xlarge'"
        )
    elif compute.target == "sagemaker" and not inst.on_sagemaker:
        offered = [t.name for t in instances.CATALOG.values() if t.on_sagemaker]
        problems.append(
            f"compute.instance_type: {inst.name!r} is not offered for SageMaker training; use "
            f"one of {', '.join(offered)}, or target 'ec2'"
        )
    if compute.target == "local":
        total = compute.world_size
        cores = os.cpu_count() or 1
        if inst.name == "local" and total > LOCAL_PROCESSES_PER_CORE * cores:
            notes.append(
                f"compute: {total} local worker processes on {cores} CPU cores will be slow; "
                "lower compute.instance_count or compute.processes_per_instance"
            )


def _backend_fits_hardware(spec, base_dir, problems, notes) -> None:
    dist = spec.distribution
    if dist.backend == "nccl" and not spec.compute.instance.has_gpu:
        problems.append(
            f"distribution.backend: 'nccl' needs GPUs but compute.instance_type "
            f"{spec.compute.instance_type!r} has none; use backend 'auto' or 'gloo', or a GPU "
            "instance type"
        )


def _degree_fits_world(spec, base_dir, problems, notes) -> None:
    """The degrees must make a parallelism plan (the one function the planner and the runtime
    use too); ``auto`` is sized by the planner once the model is known."""
    try:
        build_parallelism_plan(spec.distribution.model_dump(mode="json"),
                               world_size=spec.compute.world_size,
                               devices_per_node=spec.compute.resolved_processes_per_instance)
    except ParallelismError as exc:
        problems.append(str(exc))


def _spot_settings(spec, base_dir, problems, notes) -> None:
    compute = spec.compute
    if compute.use_spot and compute.target == "local":
        problems.append("compute.use_spot: spot capacity exists only for targets sagemaker and ec2")
    if compute.max_wait is not None and not compute.use_spot:
        problems.append(
            "compute.max_wait: only applies to spot jobs; remove it or set compute.use_spot: true"
        )
    if compute.use_spot and compute.max_wait is not None and compute.max_wait < compute.max_run:
        problems.append(
            f"compute.max_wait: {compute.max_wait} s is less than compute.max_run "
            f"{compute.max_run} s; spot jobs need max_wait >= max_run"
        )


def _entry_point(spec, base_dir, problems, notes) -> None:
    entry = spec.entry_point
    if entry.startswith(contract.RECIPE_PREFIX):
        name = entry[len(contract.RECIPE_PREFIX):]
        if name not in RECIPES:
            problems.append(
                f"entry_point: unknown recipe {name!r}; built-in recipes: "
                + ", ".join(contract.RECIPE_PREFIX + r for r in RECIPES)
            )
        return
    if spec.source_dir is None:
        script = _resolve(base_dir, entry)
        spec.source_dir, spec.entry_point = str(script.parent), script.name
    elif s3.is_s3_uri(spec.source_dir):
        return  # a packed sourcedir.tar.gz: its contents are checked where it was built
    else:
        spec.source_dir = str(_resolve(base_dir, spec.source_dir))
    source = Path(spec.source_dir)
    if not source.is_dir():
        problems.append(f"source_dir: {spec.source_dir!r} is not a folder; check the path")
        return
    script = (source / spec.entry_point).resolve()
    if source.resolve() not in script.parents:
        problems.append(
            f"entry_point: {spec.entry_point!r} is outside source_dir {spec.source_dir!r}; "
            "give a path inside it"
        )
    elif not _is_file(script):
        problems.append(
            f"entry_point: {spec.entry_point!r} not found in source_dir {spec.source_dir!r}; "
            "check the name or set source_dir"
        )


def _target_settings(spec, base_dir, problems, notes) -> None:
    target = spec.compute.target
    sm, ec2 = spec.sagemaker, spec.ec2
    if target == "sagemaker" and sm.role is None:
        problems.append(
            "sagemaker.role: required for target sagemaker; give the IAM role ARN the job runs as"
        )
    if bool(sm.subnets) != bool(sm.security_group_ids):
        problems.append(
            "sagemaker.subnets / sagemaker.security_group_ids: give both for a VPC, or neither"
        )
    if ec2.capacity_block and not ec2.capacity_reservation_id:
        problems.append(
            "ec2.capacity_block: needs ec2.capacity_reservation_id (the capacity block's id)"
        )
    if ec2.ssh_cidr is not None and ec2.ssh_cidr.endswith("/0"):
        notes.append(f"ec2.ssh_cidr: {ec2.ssh_cidr} opens SSH to the whole internet")


def _paths_fit_target(spec, base_dir: Path, problems: list[str]) -> None:
    cloud = spec.compute.target != "local"
    for channel, uri in list(spec.inputs.items()):
        if s3.is_s3_uri(uri):
            continue
        if cloud:
            problems.append(
                f"inputs.{channel}: {uri!r} is a local path, which {spec.compute.target} cannot "
                "read; upload it to S3 and give the s3:// URI"
            )
        elif not _exists(path := _resolve(base_dir, uri)):
            problems.append(f"inputs.{channel}: local path {str(path)!r} does not exist")
        else:
            spec.inputs[channel] = str(path)
    for field, owner, attr in (("output_path", spec, "output_path"),
                               ("checkpoint.uri", spec.checkpoint, "uri")):
        value = getattr(owner, attr)
        if cloud and value is None and field == "output_path":
            problems.append(
                f"output_path: required for target {spec.compute.target}; give an s3:// URI "
                "such as s3://my-bucket/dtrain"
            )
        elif value is None:
            continue
        elif cloud and not s3.is_s3_uri(value):
            problems.append(f"{field}: {value!r} must be an s3:// URI for {spec.compute.target}")
        elif s3.is_s3_uri(value):
            try:
                s3.check(value, field)
                if not cloud:
                    problems.append(
                        f"{field}: {value!r}: local jobs write to a local folder; give a path"
                    )
            except ValueError as exc:
                problems.append(str(exc))
        else:
            setattr(owner, attr, str(_resolve(base_dir, value)))


def _resolve(base_dir: Path, value: str) -> Path:
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() else (base_dir / path).resolve()


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):
        return False
