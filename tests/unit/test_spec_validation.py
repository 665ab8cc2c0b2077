"""Every JobSpec rule: a bad value is rejected with a message naming the field, value and fix."""

from __future__ import annotations

import warnings
from pathlib import Path

import jsonschema
import pytest
import yaml
from dtrain.core.errors import SpecError, SpecWarning
from dtrain.spec.model import JobSpec

ROOT = Path(__file__).resolve().parents[2]

RECIPE = {"entry_point": "recipe:causal_lm"}
ROLE = "arn:aws:iam::111122223333:role/dtrain-test"


def sagemaker(**compute) -> dict:
    return {**RECIPE, "inputs": {"train": "s3://dtrain-test-bucket/train"},
            "output_path": "s3://dtrain-test-bucket/out", "sagemaker": {"role": ROLE},
            "compute": {"target": "sagemaker", "instance_type": "ml.p4d.24xlarge", **compute}}


def problems(data: dict, **kw) -> str:
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict(data, **kw)
    return str(info.value)


def test_minimal_spec_defaults_to_a_local_cpu_job():
    spec = JobSpec.from_dict(RECIPE)
    assert spec.compute.target == "local"
    assert spec.compute.instance_type == "local"
    assert spec.world_size == 1
    assert spec.name == "causal-lm"


def test_unknown_field_suggests_the_closest_valid_name():
    msg = problems({**RECIPE, "compute": {"instance_cont": 2}})
    assert "compute.instance_cont: unknown field" in msg
    assert "did you mean 'compute.instance_count'" in msg
    assert "did you mean 'distribution'" in problems({**RECIPE, "distributon": {}})


@pytest.mark.parametrize("field, value, line", [
    ("sharding_degree", "FULL",
     "distribution.sharding_degree: got 'FULL'; give a whole number, 'auto' or 'full'"),
    ("microbatches", 0, "distribution.microbatches: got 0; give a whole number ≥ 1 or 'auto'"),
    ("partition", "foo", "distribution.partition: got 'foo'; give 'auto', 'uniform' or a list"),
    ("partition", [1, "a"], ("distribution.partition: got [1, 'a']; give 'auto', 'uniform' or "
                             "a list of whole numbers")),
])
def test_a_field_of_several_types_gets_one_line_with_every_choice(field, value, line):
    # pydantic reports each type on its own (distribution.sharding_degree.int: ...,
    # ...sharding_degree.literal['auto','full']: ...), which read as two contradicting fixes
    msg = problems({**RECIPE, "distribution": {field: value}})
    assert msg == line


def test_unknown_instance_type_names_the_value_and_closest_type():
    msg = problems({**RECIPE, "compute": {"instance_type": "p4d.24xlarg"}})
    assert msg.startswith("compute.instance_type: unknown instance type 'p4d.24xlarg'")
    assert "did you mean 'p4d.24xlarge'" in msg


def test_sagemaker_instance_names_are_accepted_and_canonicalised():
    spec = JobSpec.from_dict(sagemaker())
    assert spec.compute.instance_type == "p4d.24xlarge"
    assert spec.world_size == 8


@pytest.mark.parametrize("section,field", [
    ("distribution", "sharding_degree"), ("distribution", "tensor_parallel_degree"),
    ("distribution", "gradient_accumulation_steps"), ("compute", "instance_count"),
    ("compute", "max_run")])
def test_a_yes_no_is_never_read_as_a_number(section, field):
    # pydantic alone reads `sharding_degree: true` as 1: plain data parallel, silently
    msg = problems({**RECIPE, section: {field: True}})
    assert msg == f"{section}.{field}: true is a yes/no; give a number"
    assert JobSpec.from_dict({**RECIPE, "distribution": {"activation_checkpointing": True,
                                                        "hierarchical_allgather": False}})


def test_a_yes_no_in_a_list_of_numbers_is_refused_too():
    msg = problems({**RECIPE, "distribution": {"pipeline_parallel_degree": 2,
                                               "partition": [True, 3]}})
    assert msg == "distribution.partition: [true, 3] holds a yes/no; give numbers"


@pytest.mark.parametrize("count", [0, -3])
def test_instance_count_below_one_is_rejected(count):
    msg = problems({**RECIPE, "compute": {"instance_count": count}})
    assert "compute.instance_count" in msg and f"got {count}" in msg


@pytest.mark.parametrize("degree, fragment", [
    (3, "3 does not divide the world size 4"),
    (8, "8 exceeds the world size 4"),
    (0, "got 0"),
])
def test_sharding_degree_must_divide_and_not_exceed_world_size(degree, fragment):
    data = {**RECIPE, "compute": {"processes_per_instance": 2, "instance_count": 2},
            "distribution": {"sharding_degree": degree}}
    msg = problems(data)
    assert "distribution.sharding_degree" in msg and fragment in msg
    if degree:
        assert "use one of 1, 2, 4" in msg


def test_sharding_degree_dividing_world_size_is_accepted():
    spec = JobSpec.from_dict(sagemaker(instance_count=4) | {
        "distribution": {"sharding_degree": 16}})
    assert spec.distribution.sharding_degree == 16 and spec.world_size == 32


def test_nccl_backend_on_a_cpu_instance_type_is_rejected():
    msg = problems({**RECIPE, "distribution": {"backend": "nccl"}})
    assert "distribution.backend: 'nccl' needs GPUs" in msg and "'local'" in msg


def test_spot_max_wait_shorter_than_max_run_is_rejected():
    msg = problems(sagemaker(use_spot=True, max_run="2h", max_wait="1h"))
    assert "compute.max_wait: 3600 s is less than compute.max_run 7200 s" in msg


def test_max_wait_without_spot_is_rejected():
    assert "only applies to spot" in problems(sagemaker(max_wait=7200))


def test_durations_accept_units():
    spec = JobSpec.from_dict(sagemaker(use_spot=True, max_run="90m", max_wait="1.5d"))
    assert (spec.compute.max_run, spec.compute.max_wait) == (5400, 129600)


@pytest.mark.parametrize("uri", ["s3://Bad_Bucket/x", "s3:/bucket/x", "s3://ab", "s3://a..b/c"])
def test_malformed_s3_uri_is_rejected(uri):
    msg = problems(sagemaker() | {"inputs": {"train": uri}})
    assert msg.startswith(f"inputs.train: {uri!r} is not a valid S3 URI")  # the path once
    assert "s3://bucket-name/prefix" in msg


@pytest.mark.parametrize("uri", ['s3://bkt/a"b', "s3://bkt/it's", "s3://bkt/a\\b"])
def test_an_s3_location_with_a_quote_or_backslash_is_refused(uri):
    # S3 allows them; the location travels in an EC2 node's shell bootstrap and its JSON reports
    msg = problems(sagemaker() | {"output_path": uri})
    assert msg.startswith(f"output_path: {uri!r} holds a quote, a backslash or a control")


def test_output_path_must_be_s3_for_cloud_targets():
    msg = problems(sagemaker() | {"output_path": "/tmp/out"})
    assert "output_path: '/tmp/out' must be an s3:// URI for sagemaker" in msg
    data = sagemaker()
    del data["output_path"]
    assert "output_path: required for target sagemaker" in problems(data)


def test_local_input_paths_are_rejected_for_cloud_targets(tmp_path):
    msg = problems(sagemaker() | {"inputs": {"train": str(tmp_path)}})
    assert "inputs.train" in msg and "upload it to S3" in msg


def test_local_gpu_needs_this_machine_s_gpus_one_per_worker(monkeypatch):
    # local_gpu on a machine without a GPU validated, then trained on the CPU under a GPU's plan
    gpu = {**RECIPE, "hyperparameters": {"data": "/data/corpus"},
           "compute": {"instance_type": "local_gpu"}}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert ("compute.instance_type: 'local_gpu' runs on this machine's GPUs, and it has none"
            ) in problems(gpu)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert JobSpec.from_dict(gpu).compute.instance_type == "local_gpu"
    assert ("compute: 1 host(s) × 3 workers on this machine's 2 GPU(s)"
            in problems({**gpu, "compute": {"instance_type": "local_gpu",
                                            "processes_per_instance": 3}}))
    # every emulated host runs on the same GPUs
    assert ("compute: 2 host(s) × 2 workers on this machine's 2 GPU(s)"
            in problems({**gpu, "compute": {"instance_type": "local_gpu", "instance_count": 2}}))
    assert JobSpec.from_dict({**gpu, "compute": {"instance_type": "local_gpu", "instance_count": 2,
                                                 "processes_per_instance": 1}})


def test_a_local_output_or_checkpoint_path_that_is_a_file_is_refused(tmp_path):
    # it validated, then the submit failed with "[Errno 17] File exists", naming no field
    taken = tmp_path / "notes.txt"
    taken.write_text("x")
    for field in ("output_path", "checkpoint.uri"):
        data = {**RECIPE, "hyperparameters": {"data": "/data/corpus"}}
        section, _, key = field.rpartition(".")
        (data.setdefault(section, {}) if section else data)[key] = str(taken)
        assert f"{field}: {str(taken)!r} is a file; the job writes into a folder" in \
            problems(data)
        (data.setdefault(section, {}) if section else data)[key] = str(taken / "out")
        assert f"{field}: {str(taken)!r} is a file" in problems(data)  # a folder under it


def test_local_input_paths_resolve_against_the_spec_folder(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("text")  # a recipe refuses an empty folder
    spec = JobSpec.from_dict({**RECIPE, "inputs": {"train": "data"}}, base_dir=tmp_path)
    assert spec.inputs["train"] == str(tmp_path / "data")
    assert "does not exist" in problems({**RECIPE, "inputs": {"train": "nope"}}, base_dir=tmp_path)


def test_entry_point_missing_from_source_dir_is_rejected(tmp_path):
    msg = problems({"entry_point": "train.py", "source_dir": str(tmp_path)})
    assert f"entry_point: 'train.py' not found in source_dir {str(tmp_path)!r}" in msg


def test_entry_point_path_sets_source_dir(tmp_path):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("print('hi')\n")
    spec = JobSpec.from_dict({"entry_point": "code/train.py"}, base_dir=tmp_path)
    assert (spec.source_dir, spec.entry_point, spec.name) == (str(tmp_path / "code"),
                                                              "train.py", "train")


def test_entry_point_may_not_escape_source_dir(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "evil.py").write_text("")
    msg = problems({"entry_point": "../evil.py", "source_dir": str(tmp_path / "src")})
    assert "outside source_dir" in msg


def test_unknown_recipe_is_rejected():
    assert "unknown recipe 'gan'" in problems({"entry_point": "recipe:gan"})


def test_hyperparameters_must_be_json_serialisable():
    msg = problems({**RECIPE, "hyperparameters": {"lr": 0.1, "bad": {1, 2}}})
    assert "hyperparameters: 'bad' = {1, 2} is not JSON-serialisable" in msg
    assert "not JSON-serialisable" in problems({**RECIPE, "hyperparameters": {"x": float("nan")}})


def test_reserved_hyperparameter_names_are_rejected():
    assert "reserved" in problems({**RECIPE, "hyperparameters": {"dtrain_entry_point": "x"}})


def test_local_job_with_too_many_processes_warns_but_validates(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = JobSpec.from_dict({**RECIPE, "compute": {"processes_per_instance": 6}})
    assert spec.world_size == 6
    assert any(issubclass(w.category, SpecWarning) and "will be slow" in str(w.message)
               for w in caught)


def test_cloud_instance_type_with_local_target_is_rejected():
    msg = problems({**RECIPE, "compute": {"instance_type": "p4d.24xlarge"}})
    assert "compute.instance_type: 'p4d.24xlarge' is a cloud instance type" in msg


def test_instance_type_not_offered_on_sagemaker_is_rejected():
    assert "not offered for SageMaker" in problems(sagemaker(instance_type="p5e.48xlarge"))


def test_sagemaker_needs_a_well_formed_role():
    data = sagemaker()
    del data["sagemaker"]
    assert "sagemaker.role: required for target sagemaker" in problems(data)
    msg = problems(sagemaker() | {"sagemaker": {"role": "my-role"}})
    assert "sagemaker.role: 'my-role' is not an IAM role ARN" in msg


def test_several_problems_are_reported_together():
    msg = problems(sagemaker(use_spot=True, max_run=7200, max_wait=60)
                   | {"output_path": "s3://X"})
    assert msg.startswith("2 problems in the job spec")


def test_ssh_cidr_must_be_a_cidr():
    assert "not an IPv4 CIDR" in problems({**RECIPE, "ec2": {"ssh_cidr": "10.0.0.300/8"}})


def test_hierarchical_allgather_forced_on_with_stock_nccl_is_rejected():
    data = sagemaker() | {"distribution": {"backend": "nccl", "hierarchical_allgather": True}}
    assert "set distribution.backend to 'auto'" in problems(data)


class TestSmpDistributionTranslation:
    def test_v1_sharded_data_parallel_dict(self):
        smp = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {
            "sharded_data_parallel_degree": 16, "ddp_dist_backend": "nccl", "bf16": True}}},
            "mpi": {"enabled": True, "processes_per_host": 8}}
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            spec = JobSpec.from_dict(sagemaker(instance_count=2) | {"distribution": smp})
        dist = spec.distribution
        assert (dist.sharding_degree, dist.backend, dist.mixed_precision) == (16, "nccl", "bf16")

    def test_smddp_backend_is_dtrain_s_auto_with_a_note(self):
        smp = {"smdistributed": {"modelparallel": {"parameters": {
            "hybrid_shard_degree": 8, "ddp_dist_backend": "smddp"}}}}
        with pytest.warns(SpecWarning, match="ddp_dist_backend smddp: dtrain's backend auto"):
            spec = JobSpec.from_dict(sagemaker(instance_count=2) | {"distribution": smp})
        assert spec.distribution.backend == "auto"

    def test_smp_pipeline_defaults_left_out_are_said_not_copied(self):
        smp = {"smdistributed": {"modelparallel": {"parameters": {"partitions": 2}}}}
        with pytest.warns(SpecWarning, match="SMP's pipeline defaults .* are not copied"):
            JobSpec.from_dict(sagemaker() | {"distribution": smp})
        no_pipeline = {"smdistributed": {"modelparallel": {"parameters": {
            "hybrid_shard_degree": 8}}}}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing to say without a pipeline
            JobSpec.from_dict(sagemaker(instance_count=2) | {"distribution": no_pipeline})

    def test_dtrain_s_own_fields_beside_the_smp_dict_win(self):
        # the porting guide's local run sets sharding_degree and mixed_precision auto over an
        # SMP dict: the translation silently replaced them (8 exceeds the world size 2)
        smp = {"smdistributed": {"modelparallel": {"parameters": {
            "sharded_data_parallel_degree": 8, "bf16": True}}},
            "sharding_degree": "auto", "mixed_precision": "auto"}
        with pytest.warns(SpecWarning, match=r"distribution.sharding_degree 'auto' is used over "
                                             r"the 8 the SMP settings translate to"):
            spec = JobSpec.from_dict({**RECIPE, "distribution": smp,
                                      "compute": {"instance_count": 2}})
        assert (spec.distribution.sharding_degree, spec.distribution.mixed_precision) == \
            ("auto", "auto")

    def test_smddp_is_plain_data_parallel_and_notes_point_at_the_caller(self):
        smddp = {"smdistributed": {"dataparallel": {"enabled": True}}}
        with pytest.warns(SpecWarning, match="plain data parallel") as caught:
            spec = JobSpec.from_dict(sagemaker(instance_count=2) | {"distribution": smddp})
        assert spec.distribution.sharding_degree == 1
        assert caught[0].filename == __file__  # not pydantic's validator frame

    def test_v2_hybrid_shard_degree_dict(self):
        smp = {"torch_distributed": {"enabled": True}, "smdistributed": {"modelparallel": {
            "enabled": True, "parameters": {"hybrid_shard_degree": 8}}}}
        spec = JobSpec.from_dict(sagemaker(instance_count=2) | {"distribution": smp})
        assert spec.distribution.sharding_degree == 8

    def test_v2_degree_zero_means_full_shard(self):
        smp = {"smdistributed": {"modelparallel": {"parameters": {"hybrid_shard_degree": 0}}}}
        assert JobSpec.from_dict(sagemaker() | {"distribution": smp}) \
            .distribution.sharding_degree == "full"

    def test_v1_tensor_parallel_degree_is_translated_with_sharded_data_parallel(self):
        smp = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {
            "tensor_parallel_degree": 4, "sharded_data_parallel_degree": 4, "ddp": True,
            "pipeline_parallel_degree": 1}}}, "mpi": {"enabled": True}}
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            dist = JobSpec.from_dict(sagemaker(instance_count=2) | {"distribution": smp}) \
                .distribution
        assert (dist.tensor_parallel_degree, dist.sharding_degree) == (4, 4)
        assert (dist.tensor_parallel_mode, dist.sequence_parallel) == ("1d", "auto")

    def test_v2_tensor_parallel_degree_is_translated(self):
        smp = {"torch_distributed": {"enabled": True}, "smdistributed": {"modelparallel": {
            "enabled": True, "parameters": {"tensor_parallel_degree": 8,
                                            "hybrid_shard_degree": 2}}}}
        dist = JobSpec.from_dict(sagemaker(instance_count=2) | {"distribution": smp}) \
            .distribution
        assert (dist.tensor_parallel_degree, dist.sharding_degree) == (8, 2)

    def test_v1_pipeline_settings_are_translated(self):
        smp = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {
            "partitions": 2, "microbatches": 8, "pipeline": "simple", "auto_partition": True,
            "ddp": True}}}, "mpi": {"enabled": True}}
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            dist = JobSpec.from_dict(sagemaker(instance_count=2) | {"distribution": smp}) \
                .distribution
        assert (dist.pipeline_parallel_degree, dist.microbatches) == (2, 8)
        assert (dist.pipeline_schedule, dist.partition) == ("gpipe", "auto")

    def test_smp_interleaved_pipeline_is_1f1b_and_active_microbatches_bound_it(self):
        params = {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "interleaved",
                  "auto_partition": False}
        smp = {"smdistributed": {"modelparallel": {"parameters": params}}}
        with pytest.warns(SpecWarning, match="smp.partition"):
            dist = JobSpec.from_dict(sagemaker() | {"distribution": smp}).distribution
        assert (dist.pipeline_schedule, dist.partition) == ("1f1b", "uniform")
        smp["smdistributed"]["modelparallel"]["parameters"] = {
            **params, "pipeline": "simple", "active_microbatches": 2}
        with pytest.warns(SpecWarning, match="active_microbatches 2: pipeline_schedule 1f1b"):
            dist = JobSpec.from_dict(sagemaker() | {"distribution": smp}).distribution
        assert dist.pipeline_schedule == "1f1b"

    def test_smp_pipeline_names_that_disagree_are_refused(self):
        smp = {"smdistributed": {"modelparallel": {"parameters": {
            "pipeline_parallel_degree": 2, "partitions": 4}}}}
        assert "pipeline_parallel_degree and partitions are the same" in problems(
            sagemaker() | {"distribution": smp})

    def test_a_tensor_parallel_group_across_nodes_is_refused_with_the_degrees_that_fit(self):
        msg = problems(sagemaker() | {"distribution": {"tensor_parallel_degree": 16}})
        assert "distribution.tensor_parallel_degree: 16 does not divide the 8 devices" in msg
        assert "use one of [1, 2, 4, 8]" in msg

    def test_two_d_tensor_parallelism_needs_a_square_degree(self):
        msg = problems(sagemaker() | {"distribution": {"tensor_parallel_degree": 2,
                                                       "tensor_parallel_mode": "2d"}})
        # the squares that fit a p4d's 8 GPUs (9, 16, ... would span nodes)
        assert msg == ("distribution.tensor_parallel_mode: 2d needs a square tensor_parallel_degree"
                       " (a q × q grid), but it is 2; use 4, or tensor_parallel_mode 1d")

    def test_unused_smp_parameters_warn(self):
        smp = {"smdistributed": {"modelparallel": {"parameters": {
            "delayed_parameter_initialization": True}}}}
        with pytest.warns(SpecWarning, match="delayed_parameter_initialization"):
            JobSpec.from_dict(sagemaker() | {"distribution": smp})


def test_from_file_applies_overrides_and_resolves_paths(tmp_path):
    (tmp_path / "train.py").write_text("")
    path = tmp_path / "job.yaml"
    path.write_text("entry_point: train.py\ncompute:\n  instance_count: 1\n")
    spec = JobSpec.from_file(path, overrides=["compute.instance_count=2",
                                              "hyperparameters.lr=3e-4",
                                              "distribution.sharding_degree=2"])
    assert spec.compute.instance_count == 2
    assert spec.hyperparameters == {"lr": 3e-4}
    assert spec.source_dir == str(tmp_path)


@pytest.mark.parametrize("override, fragment", [
    ("compute", "expected key.path=value"),
    ("entry_point.x=1", "entry_point is a value, not a section"),
])
def test_bad_overrides_are_user_errors(tmp_path, override, fragment):
    path = tmp_path / "job.yaml"
    path.write_text("entry_point: recipe:causal_lm\n")
    with pytest.raises(SpecError, match=fragment):
        JobSpec.from_file(path, overrides=[override])


def test_file_errors_are_one_line_spec_errors(tmp_path):
    with pytest.raises(SpecError, match="not found"):
        JobSpec.from_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("entry_point: [unclosed\n")
    with pytest.raises(SpecError, match=r"line \d+, column \d+: invalid YAML"):
        JobSpec.from_file(bad)


def test_spec_round_trips_through_its_dict():
    spec = JobSpec.from_dict(sagemaker(instance_count=2, use_spot=True, max_wait=86400))
    assert JobSpec.from_dict(spec.to_dict()) == spec


def test_every_schema_property_has_a_description():
    schema = JobSpec.model_json_schema()
    missing = [f"{name}.{prop}" for name, model in
               [("JobSpec", schema), *schema["$defs"].items()]
               for prop, body in model.get("properties", {}).items()
               if not body.get("description")]
    assert missing == []


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.yaml")),
                         ids=lambda path: path.name)
def test_the_examples_pass_the_schema_dtrain_schema_prints(example):
    # what an editor or a CI check does with `dtrain schema`: durations ('10m'), SageMaker's
    # tag lists and numbers in environment are valid there as they are to dtrain
    validator = jsonschema.Draft202012Validator(JobSpec.model_json_schema())
    assert [e.message for e in validator.iter_errors(yaml.safe_load(example.read_text()))] == []
    extra = {"entry_point": "train.py", "environment": {"OMP_NUM_THREADS": 4},
             "tags": [{"Key": "team", "Value": "ml"}], "sagemaker": {"keep_alive_period": "10m"}}
    assert [e.message for e in validator.iter_errors(extra)] == []
    assert list(validator.iter_errors({**extra, "compute": {"max_run": "soon"}}))
    # the SageMaker SDK's distribution sections, as the porting guide writes them
    smp = {"entry_point": "train.py", "distribution": {
        "smdistributed": {"modelparallel": {"enabled": True,
                                           "parameters": {"sharded_data_parallel_degree": 2}}},
        "mpi": {"enabled": True, "processes_per_host": 8}}}
    assert [e.message for e in validator.iter_errors(smp)] == []


def test_a_local_job_far_beyond_this_machine_is_refused_unless_forced(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    huge = {"entry_point": "recipe:causal_lm",
            "compute": {"instance_count": 512, "processes_per_instance": 64}}
    assert problems(huge) == (
        "compute: 32768 local worker processes on 2 CPU cores is more than 4 per core; use at "
        "most 8 (compute.instance_count × processes_per_instance), or set "
        "compute.oversubscribe: true to run it anyway")
    with pytest.warns(SpecWarning, match="will be slow"):
        JobSpec.from_dict({**huge, "compute": {**huge["compute"], "oversubscribe": True}})


def test_max_run_defaults_protect_a_laptop_and_leave_cloud_jobs_a_day():
    assert JobSpec.from_dict({"entry_point": "recipe:causal_lm"}).compute.max_run == 2 * 3600
    assert JobSpec.from_dict(sagemaker()).compute.max_run == 86400
    assert JobSpec.from_dict({"entry_point": "recipe:causal_lm",
                              "compute": {"max_run": "5h"}}).compute.max_run == 5 * 3600


@pytest.mark.parametrize("override, message", [
    ({"sagemaker": {"framework_version": "2.5"}},
     ("sagemaker.framework_version: torch 2.5 is older than dtrain's runtime supports (2.9 to "
     "2.13")),
    ({"sagemaker": {"image_uri": "763104351884.dkr.ecr.us-east-1.amazonaws.com/"
                                 "pytorch-training:2.5.1-gpu-py311-cu124-ubuntu22.04-sagemaker"}},
     "sagemaker.image_uri: torch 2.5.1 is older than dtrain's runtime supports"),
])
def test_an_image_whose_torch_the_runtime_cannot_run_is_refused_before_any_instance_starts(
        override, message):
    data = sagemaker()
    data["sagemaker"] = {**data["sagemaker"], **override["sagemaker"]}
    assert message in problems(data)


def test_a_custom_image_and_the_default_framework_version_pass():
    data = sagemaker()
    assert JobSpec.from_dict(data).sagemaker.framework_version == "2.10"
    data["sagemaker"] = {**data["sagemaker"], "image_uri": "1.dkr.ecr.us-east-1.amazonaws.com/mine:7"}
    assert JobSpec.from_dict(data).sagemaker.image_uri.endswith("mine:7")


@pytest.mark.parametrize("key", ["steps", "micro_batch_size", "seq_len"])
def test_a_recipe_refuses_counts_below_one_naming_the_hyperparameter(key):
    msg = problems({**RECIPE, "hyperparameters": {key: 0}})
    assert f"hyperparameters.{key}: 0 is not a whole number >= 1" in msg


def test_a_recipe_refuses_a_seq_len_beyond_the_positions_of_the_model_it_names():
    msg = problems({**RECIPE, "hyperparameters": {"model": "gpt-neox-tiny", "seq_len": 1024}})
    assert ("hyperparameters.seq_len: 1024 is more than the 256 positions of model "
            "'gpt-neox-tiny'; lower seq_len to at most 256") in msg


def test_a_recipe_refuses_numbers_it_cannot_parse_as_its_parser_would():
    msg = problems({**RECIPE, "hyperparameters": {"lr": "abc", "warmup_steps": 2.5,
                                                  "seed": True, "weight_decay": "1e-2"}})
    assert "hyperparameters.lr: 'abc' is not a number; give one" in msg
    assert "hyperparameters.warmup_steps: 2.5 is not a whole number; give one" in msg
    assert "hyperparameters.seed: True is not a whole number" in msg
    assert "weight_decay" not in msg  # "1e-2" is what --weight_decay 1e-2 parses


BAD_WORDS = {"attention": "flashy", "activation_checkpointing": "maybe",
             "checkpoint_interval": "abc", "keep_last": 1.5}
GOOD_WORDS = {"attention": "sdpa", "activation_checkpointing": "Yes", "checkpoint_interval": 5,
              "keep_last": "2"}


def test_a_recipe_refuses_a_word_or_count_its_parser_would_refuse_on_the_nodes():
    # all four validated and planned, then every rank failed at its argument parser
    msg = problems({**RECIPE, "hyperparameters": BAD_WORDS})
    assert ("hyperparameters.attention: 'flashy' is not one of flash, sdpa, eager; give one of "
            "them") in msg
    assert ("hyperparameters.activation_checkpointing: 'maybe' is neither true nor false; give "
            "true or false") in msg
    assert "hyperparameters.checkpoint_interval: 'abc' is not a whole number" in msg
    assert "hyperparameters.keep_last: 1.5 is not a whole number" in msg
    spec = JobSpec.from_dict({**sagemaker(), "hyperparameters": {
        **GOOD_WORDS, "activation_checkpointing": True}})
    assert spec.hyperparameters["attention"] == "sdpa"


@pytest.mark.parametrize("words", [BAD_WORDS, GOOD_WORDS], ids=["refused", "accepted"])
def test_validation_and_the_recipe_s_parser_agree_on_each_value(words):
    from dtrain.runtime.recipes.common import build_parser

    parser = build_parser("causal_lm", "", recipe="causal_lm", lr=1e-3)
    for key, value in words.items():
        try:
            parser.parse_args([f"--{key}", str(value)])
            parsed = True
        except SystemExit:
            parsed = False
        assert parsed is (words is GOOD_WORDS), (key, value)


def test_a_recipe_refuses_a_hyperparameter_it_would_ignore_and_notes_the_planner_s():
    # stesp: 10 validated and the recipe trained its default 100 steps, logging a warning
    msg = problems({**RECIPE, "hyperparameters": {"stesp": 10, "learning_rate": 1e-3}})
    assert ("hyperparameters.stesp: not a hyperparameter of recipe:causal_lm, which would "
            "ignore it; did you mean 'steps'?") in msg
    assert "hyperparameters.learning_rate: not a hyperparameter" in msg
    # a size only the planner reads is fine, but said: the recipe trains its model regardless
    with pytest.warns(SpecWarning, match=r"hyperparameters.num_layers: recipe:causal_lm does not "
                                         r"read it \(it trains model 'gpt-neox-tiny'\)"):
        JobSpec.from_dict({**RECIPE, "hyperparameters": {"num_layers": 4}})


def test_the_recipe_hyperparameters_validation_knows_are_what_the_recipes_parse():
    from dtrain.core import recipe_inputs
    from dtrain.runtime.recipes.common import build_parser

    parser = build_parser("recipe", "", recipe="causal_lm", lr=1e-3)
    parsed = {action.dest for action in parser._actions if action.dest != "help"}
    assert parsed == set(recipe_inputs.HYPERPARAMETERS)


def test_a_recipe_refuses_data_that_names_none_of_the_jobs_channels(tmp_path):
    inputs = {"train": str(tmp_path)}
    msg = problems({**RECIPE, "inputs": inputs, "hyperparameters": {"data": "trian"}})
    assert ("hyperparameters.data: 'trian' is not a channel of this job (train); add it under "
            "inputs or fix the name") in msg
    msg = problems({**RECIPE, "inputs": {"val": str(tmp_path)}})
    assert "hyperparameters.data: 'train' (the default) is not a channel of this job (val)" in msg
    for fine in ("TRAIN", "corpus/part.txt", "tokens.bin"):  # a channel, case-blind, or a path
        JobSpec.from_dict({**RECIPE, "inputs": inputs, "hyperparameters": {"data": fine}})


def test_a_recipe_job_without_inputs_is_warned_before_its_nodes_refuse_it():
    # it validated silently, then every node stopped with "'train' ... is neither a channel"
    with pytest.warns(SpecWarning, match=r"hyperparameters.data: 'train' \(the default\) is not "
                                         r"a channel of this job \(none\); the nodes will "
                                         r"refuse the job"):
        JobSpec.from_dict(RECIPE)
    with warnings.catch_warnings():  # a path is the nodes' business: nothing to say
        warnings.simplefilter("error", SpecWarning)
        JobSpec.from_dict({**RECIPE, "hyperparameters": {"data": "/data/corpus"}})


def test_a_recipe_refuses_a_model_folder_without_weights(tmp_path):
    # a folder with only config.json validated and planned, then every worker failed loading it
    folder = tmp_path / "mymodel"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt_neox", "hidden_size": 64, '
                                        '"num_hidden_layers": 2, "vocab_size": 256}')
    data = {**RECIPE, "hyperparameters": {"data": "/data/corpus", "model": str(folder)}}
    assert (f"hyperparameters.model: {folder} has a config.json but no weights "
            "(model.safetensors or model.safetensors.index.json), which the recipe starts "
            "from") in problems(data)
    (folder / "model.safetensors").write_bytes(b"")
    assert JobSpec.from_dict(data).hyperparameters["model"] == str(folder)


def test_a_recipe_refuses_local_data_it_cannot_train_on_naming_the_channel(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    (tokens / "tokens.bin").write_bytes(b"")
    (tokens / "tokens.json").write_text('{"dtype": "uint16", "vocab_size": 260}')
    msg = problems({**RECIPE, "inputs": {"train": str(tokens)}})
    assert f"inputs.train: {tokens / 'tokens.bin'} is empty (no tokens)" in msg
    garbage = tmp_path / "text"
    garbage.mkdir()
    (garbage / "notes.txt").write_bytes(bytes(range(256)) * 16)
    msg = problems({**RECIPE, "inputs": {"corpus": str(garbage)},
                    "hyperparameters": {"data": "corpus"}})
    assert f"inputs.corpus: {garbage / 'notes.txt'} is binary, not text" in msg
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("")
    msg = problems({**RECIPE, "inputs": {"train": str(empty)}})
    assert f"inputs.train: the text files in {empty} are all empty; add data" in msg
    msg = problems({**RECIPE, "inputs": {"train": str(empty / "notes.txt")}})
    assert f"inputs.train: {empty / 'notes.txt'} is empty; add data" in msg


def test_environment_values_are_text_and_a_boolean_must_be_quoted():
    spec = JobSpec.from_dict({**RECIPE, "environment": {"OMP_NUM_THREADS": 4, "EPS": 1e-5},
                              "tags": {"cost-center": 42}})
    assert spec.environment == {"OMP_NUM_THREADS": "4", "EPS": "1e-05"}
    assert spec.tags == {"cost-center": "42"}
    assert "give a string (quote it in YAML)" in problems({**RECIPE,
                                                          "environment": {"DEBUG": True}})


@pytest.mark.parametrize(("settings", "environment", "fragment"), [
    ({"py_version": "py39"}, {},
     "sagemaker.py_version: 'py39', but the AWS image of torch 2.10 has py313"),
    ({"input_mode": "Pipe"}, {},
     "sagemaker.input_mode: Pipe streams each channel through a FIFO, but recipe:causal_lm"),
    ({"enable_network_isolation": True}, {"HF_TOKEN": "secretsmanager:prod/hf"},
     "sagemaker.enable_network_isolation: the node resolves environment HF_TOKEN from Secrets"),
])
def test_sagemaker_settings_the_job_cannot_run_with_are_refused_before_it_is_paid_for(
        settings, environment, fragment):
    data = sagemaker()
    data["sagemaker"] = {**data["sagemaker"], **settings}
    assert fragment in problems({**data, "environment": environment})
    ok = sagemaker()  # the same settings where they work
    ok["sagemaker"] = {**ok["sagemaker"], "py_version": "py313", "input_mode": "FastFile",
                       "enable_network_isolation": True}
    assert JobSpec.from_dict({**ok, "environment": {"HF_HOME": "/tmp/hf"}})


def test_a_grace_period_in_the_environment_must_be_whole_seconds():
    # the node agent reads it with int(): "30s" failed the job on its nodes (a local submit too)
    assert "environment.DTRAIN_STOP_GRACE_PERIOD: '30s' is not a whole number of seconds" in \
        problems({**RECIPE, "environment": {"DTRAIN_STOP_GRACE_PERIOD": "30s"}})
    spec = JobSpec.from_dict({**RECIPE, "environment": {"DTRAIN_STOP_GRACE_PERIOD": "60"}})
    assert spec.environment["DTRAIN_STOP_GRACE_PERIOD"] == "60"


def test_set_keeps_a_text_field_s_value_as_typed():
    # --set environment.ZIP=007 stored '7' and V=1.10 '1.1' (read as numbers); name=12345 and
    # framework_version=2.10 were refused as numbers ("quote it in YAML", on a command line)
    spec = JobSpec.from_file(ROOT / "examples" / "local-cpu.yaml", overrides=[
        "environment.ZIP=007", "environment.V=1.10", "environment.FLAG=true", "name=12345",
        "environment.QUOTED='quoted'", "hyperparameters.lr=3e-4", "compute.instance_count=1",
        "output_path=null"])
    assert spec.environment["ZIP"] == "007" and spec.environment["V"] == "1.10"
    assert spec.environment["FLAG"] == "true" and spec.environment["QUOTED"] == "quoted"
    assert spec.name == "12345" and spec.output_path is None
    assert spec.hyperparameters["lr"] == 3e-4 and spec.compute.instance_count == 1
    ported = JobSpec.from_file(ROOT / "examples" / "sagemaker-p4d.yaml",
                               overrides=["sagemaker.framework_version=2.10"])
    assert ported.sagemaker.framework_version == "2.10"


def test_set_with_an_empty_name_or_a_value_for_a_section_names_the_fix():
    example = ROOT / "examples" / "local-cpu.yaml"
    with pytest.raises(SpecError, match=r"--set '.compute=2': '.compute' has an empty name "
                                        r"between its dots; expected key.path=value"):
        JobSpec.from_file(example, overrides=[".compute=2"])
    with pytest.raises(SpecError, match=r"^compute: .* \(got 3\); give a section of fields .*"
                                        r"with --set, set one field: section.field=value\)"):
        JobSpec.from_file(example, overrides=["compute=3"])


def test_bf16_on_a_gpu_without_bf16_tensor_cores_is_refused_and_auto_is_not():
    # it was planned at the fp16 tensor-core rate, for a job that would run bf16 emulated
    data = sagemaker(instance_type="ml.p3dn.24xlarge")
    msg = problems({**data, "distribution": {"mixed_precision": "bf16"}})
    assert ("distribution.mixed_precision: 'bf16' on 'p3dn.24xlarge', whose V100-32GB GPUs "
            "have no bf16 tensor cores; use 'fp16'") in msg
    JobSpec.from_dict({**data, "distribution": {"mixed_precision": "auto"}})


@pytest.mark.parametrize(("field", "value", "said"), [
    # an infinite price planned "$inf" and made `dtrain plan -o json` print invalid JSON
    ("price_per_hour", float("inf"), ("compute.price_per_hour: input should be a finite number "
                                      "(got inf); give a finite number")),
    ("instance_count", 1e20, "(got 1e+20); give a smaller whole number"),
])
def test_numbers_beyond_what_a_field_takes_are_named_with_a_fix(field, value, said):
    assert said in problems({**RECIPE, "compute": {field: value}})


def test_an_infinite_degree_asks_for_what_the_field_takes():
    msg = problems({**RECIPE, "distribution": {"sharding_degree": float("inf")}})
    assert msg == "distribution.sharding_degree: got inf; give a whole number, 'auto' or 'full'"


def test_a_web_address_as_an_input_is_not_called_a_local_path():
    data = {**sagemaker(), "inputs": {"train": "https://my-bucket.s3.amazonaws.com/train"}}
    assert ("inputs.train: 'https://my-bucket.s3.amazonaws.com/train' is a web address, which "
            "sagemaker cannot read; upload it to S3 and give the s3:// URI") in problems(data)


def test_a_name_ending_in_a_hyphen_is_told_the_rule_it_breaks():
    assert "starting and ending with a letter or digit" in problems({**RECIPE, "name": "abc-"})
