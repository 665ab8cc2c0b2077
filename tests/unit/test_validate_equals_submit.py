"""Property: whatever `dtrain validate` accepts, `dtrain submit --dry-run` accepts, on every
target — one rule set per target, run alike by validate, plan and submit."""

from __future__ import annotations

import warnings

import pytest
from dtrain.core.errors import SpecError
from dtrain.jobs import api as jobs
from dtrain.planning.planner import plan
from dtrain.spec.model import JobSpec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROLE = "arn:aws:iam::111122223333:role/Training"
IMAGES = [None, "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.5.1-gpu-py311",
          "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.10.0-gpu-py313",
          "111122223333.dkr.ecr.us-east-1.amazonaws.com/mine:latest"]


@st.composite
def specs(draw) -> dict:
    target = draw(st.sampled_from(["local", "sagemaker", "ec2", "slurm"]))
    cloud = target in ("sagemaker", "ec2")
    compute = {"target": target,
               "instance_type": draw(st.sampled_from(
                   ["p4d.24xlarge", "ml.p5.48xlarge", "g5.12xlarge", "p5e.48xlarge", "local"]
                   if target != "local" else ["local", "p4d.24xlarge"])),
               "instance_count": draw(st.integers(1, 4)),
               "use_spot": draw(sometimes(True, otherwise=False)),
               "max_run": draw(st.sampled_from([600, "2h", "2d"]))}
    if draw(sometimes(True, otherwise=False)):
        compute["max_wait"] = draw(st.sampled_from([300, "3d"]))
    hps = {"model": draw(st.sampled_from(["gpt-neox-tiny", "pythia-1b"]))}
    if draw(sometimes(True, otherwise=False)):
        # a long value under a key the recipe reads (a path: checked where it runs), for
        # SageMaker's hyperparameter size rules
        hps["data"] = "corpus/" + "x" * draw(st.sampled_from([10, 2600, 11000]))
    data = {
        "name": "prop", "entry_point": "recipe:causal_lm", "hyperparameters": hps,
        "compute": compute,
        "distribution": {"sharding_degree": draw(st.sampled_from(["auto", 1, 2, 3, 8, "full"])),
                         "hierarchical_allgather": draw(st.sampled_from(["auto", True, False])),
                         "backend": draw(st.sampled_from(["auto", "nccl", "gloo"]))},
        "inputs": draw(sometimes({"dtrain_code": "s3://data-bkt/x", "val": "data/x"},
                                 otherwise={"train": "s3://data-bkt/train"})),
        "sagemaker": {"role": draw(sometimes(None, otherwise=ROLE)),
                      "keep_alive_period": draw(sometimes(300, otherwise=None)),
                      "image_uri": draw(sometimes(*IMAGES[1:], otherwise=None)),
                      "framework_version": draw(sometimes("2.9", "2.12", "2.5",
                                                          otherwise="2.10"))},
        "ec2": {"capacity_block": draw(sometimes(True, otherwise=False)),
                "capacity_reservation_id": draw(sometimes("cr-0123", otherwise=None)),
                "ssh_cidr": draw(st.sampled_from([None, "203.0.113.7/32"])),
                "subnet_id": draw(sometimes(None, otherwise="subnet-0123")),
                "instance_profile": draw(sometimes(None, otherwise="dtrain-node")),
                "image_uri": draw(sometimes(*IMAGES[1:], otherwise=None))},
        "slurm": {"shared_dir": draw(sometimes(None, "/fsx/my jobs", otherwise="/fsx/dtrain")),
                  "extra_sbatch": draw(sometimes(["--nodes=3"], otherwise=[]))},
    }
    if cloud:
        data["output_path"] = draw(sometimes(None, otherwise="s3://out-bkt/dtrain"))
    return data


def sometimes(*unusual, otherwise):
    """``otherwise`` three times in four, else one of ``unusual``: most drawn specs are valid,
    and every rule still gets its cases."""
    return st.sampled_from([otherwise] * (3 * len(unusual)) + list(unusual))


def accepted(data: dict) -> JobSpec | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            spec = JobSpec.from_dict(data)
            plan(spec)  # dtrain validate runs the planning step too
            return spec
    except SpecError:
        return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=specs())
def test_whatever_validate_accepts_submit_dry_run_accepts(data, tmp_path_factory):
    spec = accepted(data)
    if spec is not None:
        request = jobs.submit(spec, dry_run=True)  # no AWS call: the request is pure
        assert request.target == spec.compute.target


@pytest.mark.parametrize("target", ["local", "sagemaker", "ec2", "slurm"])
def test_a_plain_spec_of_every_target_is_accepted_and_dry_runs(target):
    data = {"name": "p", "entry_point": "recipe:causal_lm",
            "compute": {"target": target,
                        "instance_type": "local" if target == "local" else "p4d.24xlarge"},
            "sagemaker": {"role": ROLE}, "slurm": {"shared_dir": "/fsx/dtrain"},
            "ec2": {"instance_profile": "dtrain-node", "subnet_id": "subnet-0123"}}
    if target in ("sagemaker", "ec2"):
        data["output_path"] = "s3://out-bkt/d"
    assert jobs.submit(accepted(data), dry_run=True).target == target


@pytest.mark.parametrize("extra", [
    {"compute": {"target": "ec2", "instance_type": "p4d.24xlarge", "use_spot": True},
     "ec2": {"capacity_reservation_id": "cr-0123", "capacity_block": True,
             "instance_profile": "dtrain-node", "subnet_id": "subnet-0123"}},
    {"compute": {"target": "ec2", "instance_type": "p4d.24xlarge", "use_spot": True},
     "ec2": {"capacity_reservation_id": "cr-0123", "instance_profile": "dtrain-node",
             "subnet_id": "subnet-0123"}},
    {"compute": {"target": "sagemaker", "instance_type": "ml.p4d.24xlarge", "use_spot": True},
     "sagemaker": {"role": ROLE, "keep_alive_period": 300}},
])
def test_the_issue_s_spot_cases_are_refused_by_validate_not_at_submit(extra):
    data = {"name": "p", "entry_point": "recipe:causal_lm", "output_path": "s3://out-bkt/d",
            **extra}
    with pytest.raises(SpecError, match=r"^(compute\.use_spot|sagemaker\.keep_alive_period): "):
        JobSpec.from_dict(data)
