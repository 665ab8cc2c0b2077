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


def test_a_checkpoint_of_another_model_is_refused_instead_of_loaded_in_part(
        tmp_path, one_rank_group):
    # a model of fewer layers resumed silently from part of the weights (DCP loads what the
    # model asks for); one of more layers failed on a bare "Missing key in checkpoint"
    def model_of(layers: int, width: int = 8) -> torch.nn.Module:
        return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))

    four = model_of(4)
    manager = CheckpointManager(tmp_path / "ckpt")
    saved = manager.save(4, four, torch.optim.SGD(four.parameters(), lr=0.1),
                         {"data_position": 0})
    cases = [(model_of(3), r"it holds 3.weight, 3.bias, which this model has not"),
             (model_of(5), r"it lacks this model's 4.weight, 4.bias"),
             (model_of(4, width=6), r"0.weight is \[8, 8\] there and \[6, 6\] here")]
    for model, difference in cases:
        with pytest.raises(ValueError, match=rf"checkpoint {saved} was written by a different "
                                             rf"model: {difference}.*new checkpoint location"):
            manager.load(saved, model, torch.optim.SGD(model.parameters(), lr=0.1))
    same = model_of(4)
    assert manager.load(saved, same, torch.optim.SGD(same.parameters(), lr=0.1))["step"] == 4

    # a model family's checkpoint loaded into another: said so, not blamed on GPT-2's layout
    neox = from_preset("gpt-neox-tiny")
    saved = manager.save(5, neox, torch.optim.SGD(neox.parameters(), lr=0.1), {"data_position": 0})
    gpt2 = from_preset("gpt2-tiny")
    with pytest.raises(ValueError, match=r"was written by a different model: it lacks this "
                                         r"model's .*; it holds "):
        manager.load(saved, gpt2, torch.optim.SGD(gpt2.parameters(), lr=0.1))

    # the same names and shapes, tied otherwise: the saved head would have become the embedding
    untied = from_preset("gpt2-tiny", tie_word_embeddings=False)
    saved = manager.save(6, untied, torch.optim.SGD(untied.parameters(), lr=0.1),
                         {"data_position": 0})
    with pytest.raises(ValueError, match=r"different model: one parameter under several names "
                                         r"there: none, and here: lm_head.weight = "
                                         r"transformer.wte.weight\."):
        manager.load(saved, gpt2, torch.optim.SGD(gpt2.parameters(), lr=0.1))
    tied = manager.save(7, gpt2, torch.optim.SGD(gpt2.parameters(), lr=0.1), {"data_position": 0})
    assert manager.load(tied, gpt2, torch.optim.SGD(gpt2.parameters(), lr=0.1))["step"] == 7
    # ties are told by the state dict's names: a compiled model's (_orig_mod.) resumes plainly
    compiled = torch.compile(from_preset("gpt2-tiny"))
    saved = manager.save(8, compiled, torch.optim.SGD(compiled.parameters(), lr=0.1),
                         {"data_position": 0})
    assert manager.load(saved, gpt2, torch.optim.SGD(gpt2.parameters(), lr=0.1))["step"] == 8
