"""Pieces every CLI command shares: spec options, spec loading, output. Imports only click."""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable
from typing import Any

import click

# compute.target's values (dtrain.spec.model.Compute), for --target; kept here so the CLI's
# options need no spec import, and checked against the spec by tests/unit/test_slurm_spec.py
TARGETS = ("local", "sagemaker", "ec2", "slurm")

OUTPUT_OPTION = click.option(
    "--output", "-o", "output", type=click.Choice(["text", "json"]), default="text",
    show_default=True, help="Print for people (text) or for programs (json).",
)


def spec_options(func: Callable | None = None, *, required: bool = True) -> Callable:
    """SPEC argument plus --set and --target, in the same shape for every command."""
    if func is None:
        return lambda f: spec_options(f, required=required)
    func = click.option(
        "--target", type=click.Choice(TARGETS), default=None,
        help="Override compute.target (same as --set compute.target=...).",
    )(func)
    func = click.option(
        "--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
        help="Override a spec field before validation, e.g. --set compute.instance_count=2 "
             "(value parsed as YAML, kept as typed for a text field such as environment.X; "
             "repeatable).",
    )(func)
    return click.argument("spec_path", metavar="SPEC" if required else "[SPEC]",
                          type=click.Path(dir_okay=False), required=required)(func)


def load_spec(spec_path: str, overrides: tuple[str, ...], target: str | None = None):
    """Load and validate a spec; warnings are printed to stderr, errors raise SpecError."""
    from dtrain.core.errors import SpecWarning
    from dtrain.spec.model import JobSpec

    all_overrides = list(overrides) + ([f"compute.target={target}"] if target else [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SpecWarning)
        spec = JobSpec.from_file(spec_path, overrides=all_overrides)
    for item in caught:
        if issubclass(item.category, SpecWarning):
            click.echo(f"warning: {item.message}", err=True)
        else:
            warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)
    return spec


def echo_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
