"""Which modules dtrain.runtime.shard makes FSDP units of their own (no process group needed)."""

from __future__ import annotations

import pytest
from dtrain.runtime.distributed.sharding import find_blocks, output_head
from dtrain.runtime.models import from_preset
from torch import nn


def test_an_untied_output_layer_is_a_unit_of_its_own():
    model = from_preset("gpt-neox-tiny", attention="sdpa")
    assert not model.tie_word_embeddings
    assert output_head(model) is model.lm_head


def test_an_output_layer_tied_to_the_input_embedding_stays_in_the_root():
    model = from_preset("gpt2-tiny", attention="sdpa")
    assert model.tie_word_embeddings
    assert output_head(model) is None


def test_a_model_without_lm_head_or_with_a_frozen_one_has_none():
    assert output_head(nn.Sequential(nn.Linear(2, 2))) is None
    model = from_preset("gpt-neox-tiny", attention="sdpa")
    model.lm_head.requires_grad_(False)
    assert output_head(model) is None


def test_block_classes_that_match_nothing_are_named_in_the_error():
    # before: "no transformer blocks found ...; pass block_classes" though they were passed
    with pytest.raises(ValueError, match=r"^no blocks of Conv1d found in Sequential; pass "):
        find_blocks(nn.Sequential(nn.Linear(2, 2)), [nn.Conv1d])
    model = from_preset("gpt-neox-tiny", attention="sdpa")
    assert len(find_blocks(model, None)) == model.config.num_layers
