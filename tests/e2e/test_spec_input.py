"""What the user writes arrives as written: YAML numbers, duplicate keys, encodings, Python."""

from __future__ import annotations

import json
from functools import partial

import _cli
import pytest
from dtrain.core.errors import SpecError
from dtrain.spec.model import JobSpec

# check=False: the exit code is what these tests assert on
dtrain = partial(_cli.dtrain, check=False, timeout=60)


def test_numbers_written_as_numbers_arrive_as_numbers(tmp_path):
    spec = tmp_path / "job.yaml"
    (tmp_path / "train.py").write_text("")  # a script's hyperparameters are its own
    spec.write_text("entry_point: train.py\n"
                    "hyperparameters: {lr: 1e-3, wd: 5E+2, tag: '1e-3', steps: 10}\n")
    out = json.loads(dtrain("validate", str(spec), "-o", "json").stdout)
    assert out["hyperparameters"] == {"lr": 0.001, "wd": 500.0, "tag": "1e-3", "steps": 10}
    # --set values read the same way
    out = json.loads(dtrain("validate", str(spec), "--set", "hyperparameters.lr=2e-4",
                            "-o", "json").stdout)
    assert out["hyperparameters"]["lr"] == 0.0002


def test_yaml_1_1_s_octal_and_base_60_numbers_are_read_as_yaml_1_2_reads_them(tmp_path):
    # steps: 010 trained 8 steps, and max_run: 1:30 (meant as 1 h 30) stopped the job at 90 s
    from dtrain.spec.io import load_mapping, parse_value

    spec = tmp_path / "job.yaml"
    spec.write_text("entry_point: train.py\nhyperparameters: {steps: 010, big: 1_000, "
                    "hex: 0x10}\ncompute: {max_run: 1:30}\n")
    data = load_mapping(spec)
    assert data["hyperparameters"] == {"steps": 10, "big": 1000, "hex": 16}
    assert data["compute"]["max_run"] == "1:30"
    assert (parse_value("010"), parse_value("1:30"), parse_value("-2.5")) == (10, "1:30", -2.5)
    result = dtrain("validate", str(spec))
    assert result.returncode == 2
    assert "compute.max_run: '1:30' is not a duration" in result.stderr


def test_a_merge_key_shares_settings_and_odd_keys_or_numbers_are_one_line(tmp_path):
    from dtrain.spec.io import load_mapping

    spec = tmp_path / "job.yaml"
    spec.write_text("entry_point: train.py\nshared: &c {instance_count: 2}\ncompute:\n"
                    "  <<: *c\n  processes_per_instance: 1\n")
    assert load_mapping(spec)["compute"] == {"instance_count": 2, "processes_per_instance": 1}
    spec.write_text("entry_point: train.py\n? [a, b]\n: 1\n")
    with pytest.raises(SpecError, match=r"line 2: a key must be a name, not a list"):
        load_mapping(spec)
    spec.write_text(f"entry_point: train.py\ncompute: {{instance_count: {'9' * 5000}}}\n")
    result = dtrain("validate", str(spec))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: {spec}, line 2: a number of 5000 digits")


def test_a_key_given_twice_is_an_error_naming_its_line(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("entry_point: recipe:causal_lm\ncompute:\n  instance_count: 1\n"
                    "  instance_count: 2\n")
    result = dtrain("validate", str(spec))
    assert result.returncode == 2
    assert result.stderr == (f"error: {spec}, line 4: key 'instance_count' is given twice "
                             "(first on line 3); keep one\n")


def test_a_spec_that_is_not_utf8_is_one_line_and_exit_2(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_bytes("entry_point: recipe:causal_lm\nname: caf\xe9\n".encode("latin-1"))
    result = dtrain("validate", str(spec))
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {spec}: not UTF-8 text (byte 0xe9")
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1


def test_jobspec_from_python_raises_the_same_one_line_errors_as_from_dict():
    with pytest.raises(SpecError) as from_python:
        JobSpec(entry_point="recipe:causal_lm", compute={"instance_count": 0})
    with pytest.raises(SpecError) as from_dict:
        JobSpec.from_dict({"entry_point": "recipe:causal_lm", "compute": {"instance_count": 0}})
    assert str(from_python.value) == str(from_dict.value) == \
        "compute.instance_count: input should be greater than or equal to 1 (got 0)"
    assert "pydantic" not in str(from_python.value)
    assert JobSpec(entry_point="recipe:causal_lm").name == "causal-lm"
