"""Property: for any cluster shape and distribution, what `dtrain plan -o json` prints is the
plan the runtime builds from the contract on every host, or validation refuses the spec with
the field named — a runtime error is never the first to say no.

The runtime side goes the way a real job does: the planner's distribution is written into the
contract's ``dtrain_*`` hyperparameters, read back into ``DTRAIN_DISTRIBUTION`` by the node agent,
parsed by the runtime, and resolved on the world the job runs on. The same plans then run on real
gloo process groups for a sample (tests/integration/test_plan_on_gloo.py).
"""

from __future__ import annotations

import json
import re
import warnings

from dtrain.core import contract
from dtrain.core.errors import SpecError
from dtrain.core.parallelism import ParallelismPlan
from dtrain.planning.planner import plan as make_plan
from dtrain.runtime.distributed.config import DistributionConfig
from dtrain.runtime.distributed.context import ProcessFacts, resolve_plan
from dtrain.spec.model import JobSpec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FIELD = re.compile(r"^[a-z_]+(\.[A-Za-z_0-9]+)*( / [a-z_.]+)?: ")
CLOUD_TYPES = ["p4d.24xlarge", "p5.48xlarge", "g5.12xlarge", "g5.48xlarge", "p3.16xlarge"]
MODELS = [None, "gpt-neox-tiny", "pythia-1b", "gpt-neox-20b"]


@st.composite
def specs(draw) -> dict:
    target = draw(st.sampled_from(["local", "sagemaker", "ec2", "slurm"]))
    if target == "local":
        compute = {"instance_type": "local", "instance_count": draw(st.integers(1, 4)),
                   "processes_per_instance": draw(st.integers(1, 4))}
    else:
        compute = {"instance_type": draw(st.sampled_from(CLOUD_TYPES)),
                   "instance_count": draw(st.integers(1, 16))}
        per_node = draw(st.sampled_from([None, 1, 2, 4, 8]))
        if per_node:
            compute["processes_per_instance"] = per_node
    world = compute["instance_count"] * (compute.get("processes_per_instance") or 8)
    distribution = {
        "sharding_degree": draw(st.one_of(st.sampled_from(["auto", "full"]),
                                          st.integers(0, 2 * world))),
        "hierarchical_allgather": draw(st.sampled_from(["auto", True, False])),
        "backend": draw(st.sampled_from(["auto", "nccl", "gloo"])),
        "tensor_parallel_degree": draw(st.sampled_from([1, 1, 2, 3, 4, 8, "auto"])),
        "tensor_parallel_mode": draw(st.sampled_from(["1d", "2d"])),
        "sequence_parallel": draw(st.sampled_from(["auto", True, False])),
        "pipeline_parallel_degree": draw(st.sampled_from([1, 1, 1, 2, 3, 4, "auto"])),
        "pipeline_schedule": draw(st.sampled_from(["auto", "auto", "1f1b", "gpipe",
                                                   "interleaved-1f1b", "zbv"])),
        "microbatches": draw(st.sampled_from(["auto", "auto", 1, 4, 5])),
    }
    model = draw(st.sampled_from(MODELS))
    return {
        "name": "prop", "entry_point": "recipe:causal_lm",
        "hyperparameters": {"model": model} if model else {"steps": 1},
        "compute": {"target": target, **compute}, "distribution": distribution,
        "output_path": "s3://dtrain-bucket/out" if target in ("sagemaker", "ec2") else None,
        "sagemaker": {"role": "arn:aws:iam::111122223333:role/Training"},
        "slurm": {"shared_dir": "/fsx/dtrain"},
        "ec2": {"instance_profile": "dtrain-node", "subnet_id": "subnet-0123"},
    }


def validate_and_plan(data: dict) -> dict | None:
    """What `dtrain plan -o json` prints, or None when it refuses (validation or planning)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return make_plan(JobSpec.from_dict(data)).to_dict()
    except SpecError as exc:
        lines = [line.strip().removeprefix("- ") for line in str(exc).splitlines()
                 if not line.endswith("problems in the job spec:")]
        assert lines and all(FIELD.match(line) for line in lines), str(exc)
        return None


def runtime_plan(printed: dict) -> ParallelismPlan | None:
    """The plan a worker of this job resolves, the way the contract carries it there."""
    settings_ = contract.Settings(entry_point="recipe:causal_lm",
                                  distribution=printed["distribution"])
    carried = contract.Settings.from_hyperparameters(settings_.to_hyperparameters())
    env = {contract.DISTRIBUTION_ENV: json.dumps(carried.distribution)}
    facts = ProcessFacts(rank=0, local_rank=0, world_size=printed["world_size"],
                         local_world_size=printed["processes_per_node"], node_rank=0)
    return resolve_plan(DistributionConfig.from_env(env), facts)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=specs())
def test_the_runtime_builds_the_printed_plan_or_validation_refuses_naming_the_field(data):
    printed = validate_and_plan(data)
    if printed is None:
        return
    plan = runtime_plan(printed)
    if printed["parallelism"] is None:  # sharding_degree auto, no model size: sized at run time
        assert plan is None
        return
    assert plan == ParallelismPlan.from_dict(printed["parallelism"])
    assert plan.mesh_shape[0] * plan.dp_degree * plan.tp == printed["world_size"]
    # the pipeline axis is outermost: a stage fills part of one node or whole nodes
    per_stage, per_node = printed["world_size"] // plan.pp, printed["processes_per_node"]
    assert per_stage % per_node == 0 or per_node % per_stage == 0
    assert (plan.pp > 1) == (printed["pipeline"] is not None and printed["pipeline"]["degree"] > 1)
    # a tensor-parallel group stays inside a node, as a 2-D grid when asked for one
    assert printed["processes_per_node"] % plan.tp == 0
    assert plan.tp_mode == printed["distribution"]["tensor_parallel_mode"]
    assert plan.tp_grid ** 2 == plan.tp if plan.tp_mode == "2d" else plan.tp_grid is None
    # the hierarchical all-gather is only ever planned where the runtime can build its groups
    assert not plan.hierarchical_allgather or plan.shard_group_whole_nodes
    assert plan.hierarchical_allgather == (printed["distribution"]["hierarchical_allgather"]
                                           is not False and plan.shard_group_whole_nodes and
                                           (printed["distribution"]["backend"] == "auto" or
                                            printed["distribution"]["hierarchical_allgather"]
                                            is True))


def test_the_issue_s_three_p4d_at_degree_12_plans_what_the_runtime_builds():
    data = {"name": "p", "entry_point": "recipe:causal_lm",
            "compute": {"target": "ec2", "instance_type": "p4d.24xlarge", "instance_count": 3},
            "distribution": {"sharding_degree": 12}, "output_path": "s3://dtrain-bucket/o",
            "ec2": {"instance_profile": "dtrain-node", "subnet_id": "subnet-0123"}}
    printed = validate_and_plan(data)
    assert printed["parallelism"]["hierarchical_allgather"] is False
    assert runtime_plan(printed) == ParallelismPlan.from_dict(printed["parallelism"])
    data["distribution"]["hierarchical_allgather"] = True
    assert validate_and_plan(data) is None  # refused before any machine starts
