"""Each node's user data: the shipped bootstrap script with the job's config filled in (pure).

The node side (``dtrain.launcher.ec2.node``) reads what this writes: ``ec2_bootstrap.sh``
installs the wheel, and the config's JSON becomes ``job.json`` for
``python -m dtrain.launcher.ec2.node.bootstrap``.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from importlib import resources
from typing import TYPE_CHECKING, Any

from dtrain.core import s3
from dtrain.core.errors import SpecError
from dtrain.launcher import packaging
from dtrain.launcher.base import runtime_settings
from dtrain.launcher.ec2 import layout
from dtrain.launcher.ec2.placeholders import placeholder

if TYPE_CHECKING:
    from dtrain.planning.planner import Plan
    from dtrain.spec.model import JobSpec

USER_DATA_LIMIT = 16 * 1024  # EC2's limit on raw user data
# The shutdown backstop fires this long after max_run, so the agent's own max_run handling and
# the artifact upload come first.
SHUTDOWN_MARGIN_S = 900
BOOTSTRAP_TEMPLATE = "ec2_bootstrap.sh"
HOST = "{host}"  # in a URI of the script: the node's private IP, which only the node knows


def job_prefix(spec: JobSpec, job_name: str) -> str:
    """``{output_path}/{job}``: where source, status, logs and outputs of the job live."""
    return s3.join(spec.output_path, job_name)


def packs_source(spec: JobSpec) -> bool:
    """A local source folder is packed and uploaded; a recipe has none, an s3:// one is ready."""
    return bool(spec.source_dir) and not spec.is_recipe and not s3.is_s3_uri(spec.source_dir)


def source_uri(spec: JobSpec, prefix: str) -> str | None:
    """Where the node finds the job's code archive (None: a recipe, the code is in the wheel)."""
    if spec.is_recipe or not spec.source_dir:
        return None
    if s3.is_s3_uri(spec.source_dir):  # a sourcedir.tar.gz packed beforehand
        return spec.source_dir
    return layout.source_uri(prefix, packaging.SOURCE_ARCHIVE)


def node_config(spec: JobSpec, plan: Plan, job_name: str) -> dict[str, Any]:
    """What the bootstrap needs to know about the job (embedded in the user data as JSON)."""
    prefix = job_prefix(spec, job_name)
    settings = runtime_settings(spec, plan, job_name=job_name, instance_type=plan.instance.name,
                                processes_per_host=plan.processes_per_node)
    return {
        "job": job_name,
        "prefix": prefix,
        "num_nodes": plan.num_nodes,
        # Drawn at submit: keeps a re-used job name from meeting an earlier run's rendezvous.
        "launch_token": placeholder("launch_token"),
        "region": spec.ec2.region,
        "max_run": spec.compute.max_run,
        "source": source_uri(spec, prefix),
        "settings": asdict(settings),
        "hyperparameters": spec.hyperparameters,
        "channels": dict(spec.inputs),
        "checkpoint_uri": layout.checkpoint_uri(prefix, spec.checkpoint.uri),
        "environment": dict(spec.environment),
        "image_uri": spec.ec2.image_uri,
    }


def render(spec: JobSpec, plan: Plan, *, job_name: str) -> str:
    """Every node's bootstrap script: the shipped template with this job's values filled in (a
    node reads its rank from the instance metadata)."""
    template = resources.files("dtrain.launcher.ec2.node").joinpath(BOOTSTRAP_TEMPLATE).read_text()
    config = json.dumps(node_config(spec, plan, job_name), indent=1, sort_keys=True)
    prefix = job_prefix(spec, job_name)
    values = {
        "WHEEL_URI": layout.source_uri(prefix, packaging.wheel_name()),
        "STATUS_URI": layout.status_uri(prefix, HOST),
        "LOG_URI": layout.bootstrap_log_uri(prefix, HOST),
        "BOOTSTRAP_LOG": layout.BOOTSTRAP_LOG,
        "REPORTED": layout.REPORTED,
        "LAUNCH_TOKEN": placeholder("launch_token"),
        "SHUTDOWN_AFTER_MIN": str((spec.compute.max_run + SHUTDOWN_MARGIN_S + 59) // 60),
        "JOB_CONFIG": config,
    }
    text = template
    for key, value in values.items():
        text = text.replace(f"@@{key}@@", value)
    size = len(text.encode())
    if size > USER_DATA_LIMIT:
        # checked where it is rendered: the spec's rules cannot see the bootstrap template
        raise SpecError(
            f"hyperparameters: the node bootstrap is {size} bytes, over EC2's "
            f"{USER_DATA_LIMIT}-byte user-data limit; move large values into an input channel")
    return text
