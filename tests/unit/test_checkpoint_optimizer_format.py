"""The optimizer is checkpointed keyed by parameter name (pipeline stages hold different
parameters), and checkpoints written before, with param groups as lists, still resume."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dtrain.runtime.train.checkpoint import COMPLETE, TRAINER_STATE, CheckpointManager
from torch.distributed.checkpoint.state_dict import get_state_dict


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_the_optimizer_is_saved_by_parameter_name_and_loads_back(one_rank, tmp_path):
    model, optimizer = trained()
    folder = CheckpointManager(tmp_path).save(1, model, optimizer, {})
    keys = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    assert "optim.param_groups.0.weight.betas" in keys and "optim.param_groups.0.params" not in keys
    fresh, fresh_optimizer = trained()
    torch.nn.init.zeros_(fresh[0].weight)
    CheckpointManager(tmp_path).load(folder, fresh, fresh_optimizer)
    assert torch.equal(fresh[0].weight, model[0].weight)
    assert fresh_optimizer.param_groups[0]["betas"] == (0.8, 0.9)


def test_a_checkpoint_with_param_groups_as_lists_still_resumes(one_rank, tmp_path):
    model, optimizer = trained()
    folder = tmp_path / "step-000001"
    model_sd, optim_sd = get_state_dict(model, optimizer)  # the earlier layout
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    (folder / TRAINER_STATE).write_text(json.dumps({"step": 1}))
    (folder / COMPLETE).write_text("{}")
    fresh, fresh_optimizer = trained()
    fresh_optimizer.param_groups[0]["lr"] = 0.5
    assert CheckpointManager(tmp_path).load(folder, fresh, fresh_optimizer) == {"step": 1}
    assert fresh_optimizer.param_groups[0]["lr"] == 0.1
    state = fresh_optimizer.state[fresh[0].weight]["exp_avg"]
    assert torch.equal(state, optimizer.state[model[0].weight]["exp_avg"])
