"""The rules of a JobSpec that need more than one field: one rule set per target.

``check_spec`` runs the rules every target shares, then the rule set of the spec's target; the
same function serves ``dtrain validate``, ``dtrain plan`` and ``dtrain submit`` (which calls
the planner, which validates), so what validation accepts, submission accepts. What needs the
cloud (a bucket exists, a role can be assumed) is checked at submit, and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dtrain.core import names
from dtrain.spec.rules import ec2, local, sagemaker, slurm
from dtrain.spec.rules.common import COMMON_RULES, Findings

if TYPE_CHECKING:
    from dtrain.spec.model import JobSpec

TARGET_RULES = {"local": local.RULES, "sagemaker": sagemaker.RULES, "ec2": ec2.RULES,
                "slurm": slurm.RULES}


def check_spec(spec: JobSpec, base_dir: Path) -> tuple[list[str], list[str]]:
    """Return ``(problems, notes)``: problems make the spec invalid, notes are warnings."""
    ctx = Findings(base_dir=base_dir)
    for rule in (*COMMON_RULES, *TARGET_RULES[spec.compute.target]):
        rule(spec, ctx)
    if spec.name is None:
        spec.name = names.from_entry_point(spec.entry_point)
    return ctx.problems, ctx.notes
