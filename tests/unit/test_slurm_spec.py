"""The rules of `compute.target: slurm`: one line per problem naming field, value and fix, and the
target registered everywhere a target is named."""

from __future__ import annotations

import subprocess
import sys
import typing

import pytest
from dtrain.cli.common import TARGETS
from dtrain.core.errors import SpecError
from dtrain.launcher.base import BACKENDS
from dtrain.spec.model import Compute, JobSpec
from dtrain.spec.rules import TARGET_RULES

P4D = {"target": "slurm", "instance_type": "p4d.24xlarge", "instance_count": 2}


def slurm_spec(slurm=None, **extra) -> dict:
    return {"entry_point": "recipe:causal_lm", "compute": dict(P4D),
            "slurm": {"shared_dir": "/fsx/dtrain", **(slurm or {})}, **extra}


def problems(data: dict, **kw) -> list[str]:
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict(data, **kw)
    lines = str(info.value).splitlines()
    return [line.removeprefix("  - ") for line in (lines[1:] if len(lines) > 1 else lines)]


def problem(data: dict, **kw) -> str:
    (line,) = problems(data, **kw)
    return line


def test_slurm_is_a_target_of_the_spec_the_cli_the_rules_and_the_backends():
    targets = typing.get_args(Compute.model_fields["target"].annotation)
    assert set(targets) == set(TARGETS) == set(BACKENDS) == set(TARGET_RULES)
    assert "slurm" in targets


def test_a_p4d_slurm_spec_is_valid_and_defaults_to_a_day():
    spec = JobSpec.from_dict(slurm_spec())
    assert spec.compute.max_run == 86400 and spec.world_size == 16
    assert spec.slurm.python == sys.executable  # the interpreter that validated it
    assert JobSpec.from_dict(slurm_spec({"container_image": "img"})).slurm.python == "python"


def test_the_shared_folder_is_required():
    assert problem(slurm_spec({"shared_dir": None})) == (
        "slurm.shared_dir: required for target slurm; give a folder on the cluster's shared file "
        "system that every node mounts at the same path, e.g. /fsx/dtrain")


@pytest.mark.parametrize("folder", ["/fsx/my jobs", "/fsx/%u"])
def test_the_shared_folder_must_fit_an_sbatch_option(folder):
    assert problem(slurm_spec({"shared_dir": folder})) == (
        f"slurm.shared_dir: {folder!r} has a space or '%', which #SBATCH options cannot hold; "
        "use a folder without")


def test_paths_resolve_against_the_spec_folder_and_s3_is_refused_where_nodes_write(tmp_path):
    spec = JobSpec.from_dict(slurm_spec({"shared_dir": "jobs"}, inputs={"train": "data"},
                                        checkpoint={"uri": "ckpt"}), base_dir=tmp_path)
    assert spec.slurm.shared_dir == str(tmp_path / "jobs")
    assert spec.inputs["train"] == str(tmp_path / "data")  # checked on the login node at submit
    assert spec.checkpoint.uri == str(tmp_path / "ckpt")
    assert problem(slurm_spec(checkpoint={"uri": "s3://b/ckpt"})).startswith(
        "checkpoint.uri: 's3://b/ckpt': Slurm nodes checkpoint to the shared file system")
    assert problem(slurm_spec(output_path="/fsx/out")) == (
        "output_path: '/fsx/out': a Slurm job writes its model and output under "
        "slurm.shared_dir/<job id>/; remove output_path")
    JobSpec.from_dict(slurm_spec(inputs={"train": "s3://bucket/train"}))  # downloaded at submit


def test_cpu_nodes_are_local_but_not_local_gpu():
    cpu = slurm_spec()
    cpu["compute"] = {"target": "slurm", "instance_type": "local", "instance_count": 2}
    assert JobSpec.from_dict(cpu).compute.instance.gpus == 0
    cpu["compute"]["instance_type"] = "local_gpu"
    assert problem(cpu).startswith("compute.instance_type: 'local_gpu' means this machine's GPUs")


@pytest.mark.parametrize(("line", "fix"), [
    ("--time=1:00:00", "is set by dtrain from compute.max_run; set that instead"),
    ("-N 4", "is set by dtrain from compute.instance_count; set that instead"),
    ("-N4", "is set by dtrain from compute.instance_count; set that instead"),
    ("-t10", "is set by dtrain from compute.max_run; set that instead"),
    ("-pdebug", "is set by dtrain from slurm.partition; set that instead"),
    ("--output=/tmp/x", "is set by dtrain: a job's output goes to slurm.shared_dir/<job id>/"),
    ("#SBATCH --mail-type=END", "starts with '#'; give the option alone"),
    ("--array=1-4", "asks for a job array; dtrain submits one job per spec"),
    ("--a\n--b", "spans lines; give one option per item"),
    ("constraint=p4d", "is not an sbatch option; give e.g. '--constraint=p4d'"),
    ("--gres=gpu:4", "asks for GPUs, which dtrain asks for from slurm.gpus_per_node"),
    ("--tres-per-node=gres/gpu:8", "asks for GPUs, which dtrain asks for"),
    ("--gpus-per-task=1", "asks for GPUs, which dtrain asks for"),
    ("--mem=10G", "asks for memory, but slurm.exclusive gives the job each node's memory"),
])
def test_extra_sbatch_lines_may_not_take_what_the_spec_sets(line, fix):
    assert problem(slurm_spec({"extra_sbatch": [line]})).startswith(
        f"slurm.extra_sbatch: {line!r} {fix}")


def test_extra_sbatch_lines_dtrain_does_not_set_are_kept():
    spec = JobSpec.from_dict(slurm_spec({"extra_sbatch": ["--constraint=p4d", "--mail-type=END"]}))
    assert spec.slurm.extra_sbatch == ["--constraint=p4d", "--mail-type=END"]
    # memory on shared nodes, and a gres that is not a GPU, are the user's to ask for
    shared = JobSpec.from_dict(slurm_spec({"exclusive": False,
                                           "extra_sbatch": ["--mem=10G", "--gres=nvme:1"]}))
    assert shared.slurm.extra_sbatch == ["--mem=10G", "--gres=nvme:1"]
    # with gpus_per_node 0 dtrain asks for none: a typed GPU request is the user's
    typed = JobSpec.from_dict(slurm_spec({"gpus_per_node": 0,
                                          "extra_sbatch": ["--gres=gpu:a100:8"]}))
    assert typed.slurm.extra_sbatch == ["--gres=gpu:a100:8"]


def test_names_mounts_spot_and_old_images_are_checked():
    assert problem(slurm_spec({"partition": "p4d; rm -rf /"})).startswith(
        "slurm.partition: 'p4d; rm -rf /' is not a Slurm name")
    JobSpec.from_dict(slurm_spec({"partition": "p4d,p5"}))
    assert problem(slurm_spec({"container_mounts": ["/a:/a"]})) == (
        "slurm.container_mounts: only used with slurm.container_image; set the image or remove "
        "the mounts")
    assert problem(slurm_spec({"container_image": "i", "container_mounts": ["a:/a,b:/b"]})) \
        .startswith("slurm.container_mounts: 'a:/a,b:/b' is not SRC:DST")
    spot = slurm_spec()
    spot["compute"]["use_spot"] = True
    assert problem(spot).startswith("compute.use_spot: spot capacity exists only for")
    assert problem(slurm_spec({"container_image": "r#pytorch-training:2.5.1-gpu"})).startswith(
        "slurm.container_image: torch 2.5.1 is older than dtrain's runtime supports")


def test_validate_prints_every_problem_and_exits_2(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("entry_point: recipe:causal_lm\ncompute: {target: slurm}\n"
                    "slurm: {extra_sbatch: ['--nodes=9']}\n")
    done = subprocess.run([sys.executable, "-m", "dtrain.cli.main", "validate", str(path)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert "slurm.shared_dir: required for target slurm" in done.stderr
    assert "slurm.extra_sbatch: '--nodes=9' is set by dtrain from compute.instance_count" \
        in done.stderr


def test_a_checkpoint_folder_under_a_file_is_refused(tmp_path):
    taken = tmp_path / "notes.txt"
    taken.write_text("x")
    assert problem(slurm_spec(checkpoint={"uri": str(taken / "ckpt")})) == (
        f"checkpoint.uri: {str(taken)!r} is a file; the job writes into a folder there: give a "
        "folder (or a path not taken)")
