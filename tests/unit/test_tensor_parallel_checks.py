"""What the runtime refuses before splitting a model, each in one line with the fix."""

from __future__ import annotations

import pytest
from dtrain.core.parallelism import build_parallelism_plan
from dtrain.runtime.distributed.tensor_parallel import check_model
from dtrain.runtime.models import from_preset
from torch import nn


def plan(tp: int, mode: str = "1d", per_node: int = 8):
    return build_parallelism_plan({"sharding_degree": 1, "tensor_parallel_degree": tp,
                                   "tensor_parallel_mode": mode},
                                  world_size=per_node, devices_per_node=per_node)


def test_a_model_without_a_plan_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"^distribution\.tensor_parallel_degree: tensor "
                       r"parallelism has plans for dtrain's model families .* not Sequential; "
                       r"build the model with dtrain\.runtime\.models"):
        check_model(nn.Sequential(nn.Linear(4, 4)), plan(2))


def test_two_d_is_refused_for_families_without_a_grid_plan():
    with pytest.raises(ValueError, match=r"^distribution\.tensor_parallel_mode: 2d has plans for "
                       r"gpt_neox, gpt2, not gptj; use tensor_parallel_mode 1d$"):
        check_model(from_preset("gpt-j-tiny", device="meta"), plan(4, "2d"))


def test_a_degree_that_does_not_split_the_heads_is_refused_naming_those_that_do():
    # gpt-neox-tiny has 4 heads: 8 ranks cannot split them
    with pytest.raises(ValueError, match=r"^distribution\.tensor_parallel_degree: 8 does not "
                       r"divide the model's 4 attention heads .*; use one of 1, 2, 4$"):
        check_model(from_preset("gpt-neox-tiny", device="meta"), plan(8))
    check_model(from_preset("gpt-neox-tiny", device="meta"), plan(4, "2d"))  # q = 2 splits them
