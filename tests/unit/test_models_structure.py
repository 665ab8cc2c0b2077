"""What the sharding code relies on: block classes, outside checkpoint wrapping, no
torch.distributed inside the models, and presets for every family."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from dtrain.core.presets import get_preset
from dtrain.runtime import models
from dtrain.runtime.models import from_preset, model_class
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

TINY = ["gpt-neox-tiny", "gpt2-tiny", "gpt-j-tiny", "gpt-neo-tiny", "bert-tiny", "roberta-tiny"]
FULL_SIZE = ["gpt2", "gpt-j-6b", "gpt-neo-125m", "gpt-neo-1.3b", "bert-base", "roberta-base",
             "pythia-160m"]


def _blocks(model):
    return [m for m in model.modules() if type(m).__name__ in model._no_split_modules]


def test_models_never_import_torch_distributed():
    for path in Path(models.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.startswith("torch.distributed") for n in names), path.name


@pytest.mark.parametrize("preset", TINY)
def test_no_split_modules_names_one_block_per_layer(preset):
    model = from_preset(preset, device="meta")
    assert len(model._no_split_modules) == 1
    assert len(_blocks(model)) == get_preset(preset)["num_hidden_layers"]


@pytest.mark.parametrize("preset", TINY)
def test_checkpoint_wrapping_blocks_from_outside_keeps_loss_and_grads(preset):
    torch.manual_seed(0)
    model = from_preset(preset, attention="flash")
    input_ids = torch.randint(3, 512, (2, 10))

    def loss_and_grads():
        model.zero_grad()
        loss = model(input_ids).float().logsumexp(-1).mean()
        loss.backward()
        # by parameter object: the wrapper renames parameters but keeps them
        return loss.detach(), {p: p.grad.clone() for p in model.parameters()}

    expected_loss, expected_grads = loss_and_grads()
    for block in _blocks(model):  # what the sharding code does: wrap each block in place
        parent_name, _, child_name = _module_name(model, block).rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, checkpoint_wrapper(block))
    loss, grads = loss_and_grads()
    torch.testing.assert_close(loss, expected_loss, atol=0, rtol=0)
    assert grads.keys() == expected_grads.keys()
    for param, grad in expected_grads.items():
        torch.testing.assert_close(grads[param], grad, atol=1e-6, rtol=0)


def _module_name(model, module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


@pytest.mark.parametrize("preset", FULL_SIZE)
def test_full_size_presets_build_on_meta(preset):
    model = from_preset(preset, device="meta")
    assert type(model) is model_class(get_preset(preset)["model_type"])
    assert all(p.is_meta for p in model.parameters())
