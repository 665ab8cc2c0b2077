"""Arbitrary spec dicts either validate or raise SpecError — never any other exception."""

from __future__ import annotations

import warnings

from dtrain.core.errors import SpecError
from dtrain.spec.model import JobSpec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FIELDS = {
    "": ["name", "entry_point", "source_dir", "hyperparameters", "compute", "distribution",
         "inputs", "output_path", "checkpoint", "environment", "tags", "sagemaker", "ec2",
         "typo"],
    "compute": ["target", "instance_type", "instance_count", "processes_per_instance",
                "use_spot", "max_run", "max_wait", "max_restarts", "price_per_hour"],
    "distribution": ["sharding_degree", "backend", "gradient_accumulation_steps",
                     "mixed_precision", "hierarchical_allgather", "attention", "smdistributed",
                     "torch_distributed"],
}
VALUES = ["local", "sagemaker", "ec2", "p4d.24xlarge", "ml.p5.48xlarge", "auto", "nccl", "2h",
          "recipe:causal_lm", "train.py", "s3://bucket-a/x", "s3://B", "full", "bf16", ""]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 600), st.floats(allow_nan=True),
    st.sampled_from(VALUES), st.text(max_size=12),
)
leaf = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6)


def section(name: str):
    return st.dictionaries(st.sampled_from(FIELDS[name]), leaf, max_size=5)


spec_dicts = st.fixed_dictionaries({}, optional={
    "entry_point": st.sampled_from(["recipe:causal_lm", "recipe:masked_lm", "train.py"]) | leaf,
    "compute": section("compute") | leaf,
    "distribution": section("distribution") | leaf,
    "hyperparameters": st.dictionaries(st.text(max_size=8), leaf, max_size=3) | leaf,
    "inputs": st.dictionaries(st.text(max_size=8), leaf, max_size=2) | leaf,
    "output_path": leaf, "name": leaf, "typo": leaf, "sagemaker": leaf, "ec2": leaf,
    "tags": leaf, "environment": leaf, "checkpoint": leaf, "source_dir": leaf,
})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=spec_dicts)
def test_arbitrary_dicts_validate_or_raise_spec_error(data):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            spec = JobSpec.from_dict(data)
        except SpecError as exc:
            assert exc.problems and all(isinstance(p, str) and p for p in exc.problems)
            return
    assert JobSpec.from_dict(spec.to_dict()) == spec


@settings(max_examples=100, deadline=None)
@given(data=leaf)
def test_non_mapping_specs_raise_spec_error(data):
    try:
        JobSpec.from_dict(data)
    except SpecError:
        pass
