"""Estimator builds the same JobSpec a YAML file would; the client never imports torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from dtrain.core.errors import SpecError, SpecWarning
from dtrain.estimator import Estimator


def test_estimator_kwargs_become_a_local_job_spec(tmp_path):
    (tmp_path / "train.py").write_text("")
    est = Estimator(entry_point="train.py", source_dir=str(tmp_path), instance_count=2,
                    processes_per_instance=2, hyperparameters={"epochs": 1}, max_restarts=1)
    (tmp_path / "data").mkdir()
    spec = est.spec(str(tmp_path / "data"))
    assert spec.compute.target == "local" and spec.world_size == 4
    assert spec.inputs == {"training": str(tmp_path / "data")} and spec.compute.max_restarts == 1


def test_cloud_instance_types_default_to_sagemaker(tmp_path):
    (tmp_path / "train.py").write_text("")
    spec = Estimator(entry_point="train.py", source_dir=str(tmp_path),
                     instance_type="ml.p4d.24xlarge", role="arn:aws:iam::123456789012:role/r",
                     output_path="s3://my-bucket/out").spec()
    assert spec.compute.target == "sagemaker"


def test_sagemaker_style_tags_and_numbers_in_the_environment_are_read_as_meant(tmp_path):
    (tmp_path / "train.py").write_text("")
    spec = Estimator(entry_point="train.py", source_dir=str(tmp_path),
                     tags=[{"Key": "team", "Value": "ml"}, {"Key": "project", "Value": "x"}],
                     environment={"OMP_NUM_THREADS": 4}).spec()
    assert spec.tags == {"team": "ml", "project": "x"}  # not {"Key": "Value"}
    assert spec.environment == {"OMP_NUM_THREADS": "4"}


def test_every_target_s_settings_can_be_given_from_python(tmp_path):
    (tmp_path / "train.py").write_text("")
    common = {"entry_point": "train.py", "source_dir": str(tmp_path),
              "instance_type": "p4d.24xlarge", "output_path": "s3://my-bucket/out"}
    ec2 = Estimator(**common, target="ec2", base_job_name="my_job", volume_size=500,
                    ec2={"instance_profile": "dtrain-node", "subnet_id": "subnet-0abc",
                         "region": "us-west-2"}).spec()
    assert (ec2.name, ec2.compute.volume_size_gb, ec2.ec2.subnet_id) == \
        ("my-job", 500, "subnet-0abc")
    sagemaker = Estimator(**common, role="arn:aws:iam::123456789012:role/r",
                          use_spot_instances=True, max_run="2h", max_wait="3h",
                          sagemaker={"region": "us-west-2", "keep_alive_period": 0}).spec()
    assert sagemaker.sagemaker.role.endswith(":role/r") and sagemaker.sagemaker.region == \
        "us-west-2"
    assert (sagemaker.compute.max_run, sagemaker.compute.max_wait) == (7200, 10800)
    kept = Estimator(**common, role="arn:aws:iam::123456789012:role/r",
                     checkpoint_s3_uri="s3://my-bucket/ckpt",
                     checkpoint={"interval_steps": 50, "keep_last": 3},
                     sagemaker={"region": "us-west-2"}).spec().checkpoint
    assert (kept.uri, kept.interval_steps, kept.keep_last) == ("s3://my-bucket/ckpt", 50, 3)
    # every compute field: a refusal's fix ("set compute.oversubscribe: true") can be applied
    with pytest.warns(SpecWarning, match="will be slow"):
        crowded = Estimator(entry_point="train.py", source_dir=str(tmp_path), instance_count=3,
                            processes_per_instance=3, oversubscribe=True,
                            price_per_hour=0.5).spec()
    assert (crowded.compute.oversubscribe, crowded.compute.price_per_hour) == (True, 0.5)
    # an SMP distribution's processes per host, as dtrain.sagemaker.PyTorch reads them
    smp = {"smdistributed": {"modelparallel": {"parameters": {"hybrid_shard_degree": 2}}},
           "mpi": {"enabled": True, "processes_per_host": 2}}
    with pytest.warns(SpecWarning, match="distribution.mpi is not used"):
        ported = Estimator(entry_point="train.py", source_dir=str(tmp_path),
                           distribution=smp).spec()
    assert (ported.compute.processes_per_instance, ported.distribution.sharding_degree) == (2, 2)


def test_client_side_job_modules_do_not_import_torch():
    code = ("import sys, dtrain.cli.main, dtrain.jobs.api, dtrain.estimator, dtrain.launcher.local.launcher, "
            "dtrain.launcher.local.monitor; sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize(("argument", "value", "said"), [
    ("distribution", "smp", "distribution: input should be a valid dictionary"),
    ("hyperparameters", [1, 2], "hyperparameters: input should be a valid dictionary"),
    ("environment", ["A=1"], "environment: input should be a valid dictionary"),
    ("sagemaker", "x", "sagemaker: input should be a valid dictionary"),
])
def test_an_argument_of_the_wrong_type_is_named_as_the_spec_names_it(argument, value, said):
    # an AttributeError, a TypeError or a ValueError from dict() came out of the constructor
    with pytest.raises(SpecError, match=said):
        Estimator(entry_point="recipe:causal_lm", **{argument: value}).spec()
