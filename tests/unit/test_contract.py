"""The container contract: files and SM_* variables as SageMaker and its toolkit define them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dtrain.core import contract as c
from dtrain.core import instances, toolkit


def write(tmp_path, **overrides):
    kwargs = {
        "current_host": "algo-2", "hosts": ["algo-2", "algo-1"],
        "settings": c.Settings(entry_point="train.py", job_name="j1", source_dir="/src",
                            processes_per_host=2, max_restarts=1, max_run=60,
                            distribution={"sharding_degree": 4}),
        "hyperparameters": {"epochs": 3, "lr": 0.1, "name": "tiny", "flag": True,
                         "layers": [1, 2], "opt": {"b": 2, "a": 1}},
        "channels": ["train", "eval"],
    }
    kwargs.update(overrides)
    return c.write_host_contract(str(tmp_path), **kwargs)


def test_files_and_folders_follow_the_sagemaker_layout(tmp_path):
    paths = write(tmp_path)
    for sub in ("input/config/resourceconfig.json", "input/config/hyperparameters.json",
                "input/config/inputdataconfig.json", "input/config/checkpointconfig.json",
                "input/data/train", "input/data/eval", "model", "output/data", "checkpoints"):
        assert (tmp_path / sub).exists(), sub
    resource = json.loads((tmp_path / "input/config/resourceconfig.json").read_text())
    assert resource["current_host"] == "algo-2"
    assert resource["hosts"] == ["algo-1", "algo-2"]
    assert resource["network_interface_name"] == "eth0"
    assert paths.failure_file == str(tmp_path / "output" / "failure")


def test_hyperparameters_file_holds_every_value_json_encoded_as_a_string(tmp_path):
    write(tmp_path)
    raw = json.loads((tmp_path / "input/config/hyperparameters.json").read_text())
    assert all(isinstance(v, str) for v in raw.values())
    assert raw["epochs"] == "3" and raw["name"] == '"tiny"' and raw["flag"] == "true"
    assert json.loads(raw["dtrain_distribution"])["sharding_degree"] == 4


def test_reader_decodes_and_separates_reserved_settings(tmp_path):
    write(tmp_path)
    contract = c.read_contract(str(tmp_path), num_gpus=0)
    assert contract.hyperparameters == {"epochs": 3, "lr": 0.1, "name": "tiny", "flag": True,
                                        "layers": [1, 2], "opt": {"b": 2, "a": 1}}
    s = contract.settings
    assert (s.entry_point, s.job_name, s.processes_per_host, s.max_restarts, s.max_run) == \
        ("train.py", "j1", 2, 1, 60)
    assert set(s.distribution) == set(c.DISTRIBUTION_DEFAULTS)
    assert s.distribution["sharding_degree"] == 4
    assert contract.node_rank == 1 and contract.master_host == "algo-1"
    assert contract.channels == {"eval": str(tmp_path / "input/data/eval"),
                                 "train": str(tmp_path / "input/data/train")}


def test_non_json_hyperparameter_values_are_kept_as_strings():
    assert toolkit.decode_hyperparameters({"a": "abc", "b": "1.5", "c": '"q"'}) == \
        {"a": "abc", "b": 1.5, "c": "q"}


def test_sm_variables_have_the_toolkit_names_shapes_and_encodings(tmp_path):
    write(tmp_path)
    env = c.read_contract(str(tmp_path), num_gpus=0).sm_environment()
    assert json.loads(env["SM_HOSTS"]) == ["algo-1", "algo-2"]
    assert env["SM_CURRENT_HOST"] == "algo-2"
    assert env["SM_NUM_GPUS"] == "0" and int(env["SM_NUM_CPUS"]) >= 1
    assert json.loads(env["SM_CHANNELS"]) == ["eval", "train"]
    assert env["SM_CHANNEL_TRAIN"] == str(tmp_path / "input/data/train")
    hps = json.loads(env["SM_HPS"])
    assert hps["epochs"] == 3 and not any(k.startswith("dtrain_") for k in hps)
    assert env["SM_HP_EPOCHS"] == "3" and env["SM_HP_NAME"] == "tiny"
    assert env["SM_HP_FLAG"] == "true" and env["SM_HP_OPT"] == '{"a":1,"b":2}'
    assert json.loads(env["SM_USER_ARGS"]) == [
        "--epochs", "3", "--flag", "True", "--layers", "[1, 2]", "--lr", "0.1",
        "--name", "tiny", "--opt", "a=1,b=2"]
    assert env["SM_MODEL_DIR"] == str(tmp_path / "model")
    assert env["SM_OUTPUT_DATA_DIR"] == str(tmp_path / "output/data")
    assert env["SM_OUTPUT_INTERMEDIATE_DIR"] == str(tmp_path / "output/intermediate")
    assert env["SM_INPUT_CONFIG_DIR"] == str(tmp_path / "input/config")
    assert env["SM_MODULE_DIR"] == "/src" and env["SM_USER_ENTRY_POINT"] == "train.py"
    assert env["SM_NETWORK_INTERFACE_NAME"] == "eth0" and env["SM_LOG_LEVEL"] == "20"
    assert json.loads(env["SM_INPUT_DATA_CONFIG"])["train"]["TrainingInputMode"] == "File"
    assert json.loads(env["SM_RESOURCE_CONFIG"])["current_host"] == "algo-2"
    training_env = json.loads(env["SM_TRAINING_ENV"])
    assert training_env["hosts"] == ["algo-1", "algo-2"] and training_env["is_master"] is False


def test_workers_also_get_the_resolved_distribution_and_checkpoint_dir(tmp_path):
    write(tmp_path)
    env = c.read_contract(str(tmp_path), num_gpus=0).worker_environment()
    assert json.loads(env["DTRAIN_DISTRIBUTION"])["sharding_degree"] == 4
    assert env["DTRAIN_CHECKPOINT_DIR"] == str(tmp_path / "checkpoints")
    assert env["DTRAIN_ROOT"] == str(tmp_path)


def test_single_letter_hyperparameters_become_short_options():
    assert toolkit.to_cmd_args({"k": 1, "epochs": 2}) == ["--epochs", "2", "-k", "1"]


def test_user_hyperparameters_may_not_use_the_reserved_prefix(tmp_path):
    with pytest.raises(ValueError, match="reserved prefix"):
        write(tmp_path, hyperparameters={"dtrain_entry_point": "x.py"})


def test_reading_a_missing_contract_says_where_it_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match="resourceconfig.json"):
        c.read_contract(str(tmp_path / "nowhere"))


def test_efa_variables_only_on_efa_instance_types():
    assert instances.efa_environment("ml.p4d.24xlarge", "eth0") == {
        "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_SOCKET_IFNAME": "eth0"}
    assert "FI_EFA_USE_DEVICE_RDMA" not in instances.efa_environment("g5.48xlarge", "eth0")
    assert instances.efa_environment("ml.g5.xlarge", "eth0") == {}
    assert instances.efa_environment("local", "lo") == {}
    # a Slurm job's script, written before its nodes are known, names no interface
    assert instances.efa_environment("p4d.24xlarge", None) == {
        "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}


def test_contract_module_imports_only_the_standard_library():
    code = ("import sys; import dtrain.core.contract; "
            "bad = [m for m in ('torch', 'pydantic', 'boto3', 'yaml', 'click') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dtrain_channels_are_not_the_scripts_input_channels(tmp_path):
    write(tmp_path, channels=["train", "dtrain_code"])
    contract = c.read_contract(str(tmp_path), num_gpus=0)
    assert sorted(contract.channels) == ["train"]
    env = contract.sm_environment()
    assert json.loads(env["SM_CHANNELS"]) == ["train"] and "SM_CHANNEL_DTRAIN_CODE" not in env


def test_a_script_run_by_hand_keeps_its_files_under_dtrain_root(tmp_path, monkeypatch):
    # its checkpoints and model went to /opt/ml whatever DTRAIN_ROOT said, so every run by
    # hand resumed from whatever an earlier one, of any model, had left there
    from dtrain.runtime.distributed.context import _from_contract

    for key in ("SM_MODEL_DIR", "SM_OUTPUT_DATA_DIR", c.CHECKPOINT_DIR_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(c.ROOT_ENV, str(tmp_path))
    paths = _from_contract()  # this process's environment
    assert (paths["checkpoint_dir"], paths["model_dir"]) == (tmp_path / "checkpoints",
                                                             tmp_path / "model")
    assert _from_contract({c.ROOT_ENV: str(tmp_path / "run2")})["model_dir"] == \
        tmp_path / "run2" / "model"
    # the environment given is the one read, not this process's
    assert str(_from_contract({})["checkpoint_dir"]) == f"{c.DEFAULT_ROOT}/checkpoints"
    # a job's own variables win
    assert _from_contract({"SM_MODEL_DIR": "/job/model"})["model_dir"] == Path("/job/model")
