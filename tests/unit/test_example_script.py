"""The examples' training script (``examples/sagemaker_src/train.py``) starts the causal-LM recipe
with the job's hyperparameters, reading SageMaker's ``training`` channel when that is the only one
(``estimator.fit("s3://...")``, the SMP ports)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from dtrain.runtime.recipes import causal_lm

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "sagemaker_src" / "train.py"


@pytest.fixture
def script(monkeypatch):
    calls = []
    monkeypatch.setattr(causal_lm, "main", lambda argv: calls.append(argv) or 0)
    spec = importlib.util.spec_from_file_location("example_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("SM_CHANNEL_TRAIN", "SM_CHANNEL_TRAINING"):
        monkeypatch.delenv(name, raising=False)
    return module, calls


def test_the_hyperparameters_go_to_the_recipe_unchanged(script, monkeypatch):
    module, calls = script
    monkeypatch.setenv("SM_CHANNEL_TRAIN", "/opt/ml/input/data/train")
    monkeypatch.setenv("SM_CHANNEL_TRAINING", "/opt/ml/input/data/training")
    assert module.main(["--model", "pythia-1b", "--steps", "3"]) == 0
    assert calls == [["--model", "pythia-1b", "--steps", "3"]]


def test_fits_only_channel_training_is_read_when_there_is_no_train_channel(script, monkeypatch):
    module, calls = script
    monkeypatch.setenv("SM_CHANNEL_TRAINING", "/opt/ml/input/data/training")
    module.main(["--steps", "3"])
    module.main(["--data", "val", "--steps", "3"])  # a channel the job names wins
    assert calls == [["--steps", "3", "--data", "training"], ["--data", "val", "--steps", "3"]]
