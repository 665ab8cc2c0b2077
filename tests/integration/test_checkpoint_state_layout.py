"""A checkpoint records how its model lays out its parameters, and one of another layout is
refused with a way forward instead of loading wrong weights silently: GPT-2's fused ``c_attn``
became per head (layout 2) when tensor parallelism came, and a DCP checkpoint written before
holds the ``[q | k | v]`` layout under the same names and shapes.

    pytest tests/integration/test_checkpoint_state_layout.py -q
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from dtrain.core.checkpoint_layout import COMPLETE
from dtrain.runtime.models import from_preset
from dtrain.runtime.train.checkpoint import CheckpointManager


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_a_checkpoint_of_an_older_gpt2_layout_is_refused_and_one_of_the_same_layout_loads(
        tmp_path, one_rank_group):
    torch.manual_seed(0)
    model = from_preset("gpt2-tiny")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(tmp_path / "ckpt")
    saved = manager.save(3, model, optimizer, {"data_position": 0})
    record = json.loads((saved / COMPLETE).read_text())
    assert record["state_layout"] == {"model": "gpt2", "version": 2}

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    assert manager.load(saved, model, optimizer)["step"] == 3
    assert any(p.abs().sum() > 0 for p in model.parameters())  # the weights came back

    # pipelined runs recorded their class, not the family, before: that was the current layout
    (saved / COMPLETE).write_text(json.dumps(
        {**record, "state_layout": {"model": "PipelineModel", "version": 1}}))
    assert manager.load(saved, model, optimizer)["step"] == 3

    del record["state_layout"]  # as written before the layout was recorded
    (saved / COMPLETE).write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"holds gpt2's parameters in layout 1, and this "
                       r"dtrain's gpt2 uses layout 2 .*model/ folder"):
        manager.load(saved, model, optimizer)
