"""Automatic partitioning, in one process: the units a model is cut into are the model, the
measuring pass counts what the planner predicts, and on a deliberately unbalanced model (a large
vocabulary head) the automatic cut's slowest stage is at least 25 % cheaper than the uniform
one's, by the measured FLOPs."""

from __future__ import annotations

import pytest
import torch
from dtrain.core import pipeline as ppl
from dtrain.runtime.distributed.pipeline.measure import measure_unit_costs
from dtrain.runtime.distributed.pipeline.units import StageModule, check_untied, model_units
from dtrain.runtime.models import from_preset, used_kernels

FAMILIES = ["gpt-neox-tiny", "gpt2-tiny", "gpt-j-tiny", "gpt-neo-tiny", "bert-tiny",
            "roberta-tiny"]
# GPT-NeoX with 8 blocks and a 5376-token vocabulary: its head costs about six blocks
UNBALANCED = {"num_hidden_layers": 8, "vocab_size": 5376}


@pytest.mark.parametrize("preset", FAMILIES)
def test_the_units_run_in_order_are_the_model(preset):
    torch.manual_seed(0)
    model = from_preset(preset, attention="eager")
    ids = torch.randint(3, 512, (2, 8))
    x = ids
    for unit in model_units(model):
        x = unit.run(model, x)
    torch.testing.assert_close(x, model(ids), atol=0, rtol=0)


def test_stages_hold_consecutive_units_under_the_whole_model_s_names():
    torch.manual_seed(0)
    model = from_preset("gpt-neox-tiny", attention="eager", num_hidden_layers=4)
    units = model_units(model)
    ids = torch.randint(3, 512, (2, 8))
    first, second = StageModule(model, units[:3]), StageModule(model, units[3:])
    names = [n for n, _ in model.named_parameters()]
    assert [n for n, _ in first.named_parameters()] == names[:len(list(first.parameters()))]
    assert [n for n, _ in second.named_parameters()] == names[len(list(first.parameters())):]
    assert first.block_paths == ["gpt_neox.layers.0", "gpt_neox.layers.1"]
    torch.testing.assert_close(second(first(ids)), model(ids), atol=0, rtol=0)


def test_each_stage_built_on_meta_starts_with_the_whole_model_s_values():
    # before, every stage restarted the draw: the j-th block of each stage started identical
    torch.manual_seed(0)
    whole = from_preset("gpt-neox-tiny", num_hidden_layers=6, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = from_preset("gpt-neox-tiny", num_hidden_layers=6, tie_word_embeddings=False,
                        device="meta")
    units = model_units(model)
    values = dict(whole.named_parameters())
    for part in (units[:3], units[3:6], units[6:]):
        stage = StageModule(model, part)
        stage.to_empty(device="cpu")
        stage.init_weights()
        for name, param in stage.named_parameters():
            assert torch.equal(param, values[name]), name


def test_a_stage_records_its_family_s_parameter_layout_in_checkpoints():
    from dtrain.runtime.train.checkpoint import state_layout

    model = from_preset("gpt2-tiny", device="meta", tie_word_embeddings=False)
    stage = StageModule(model, model_units(model)[:2])
    assert state_layout(stage) == state_layout(model) == {"model": "gpt2", "version": 2}


@pytest.mark.parametrize("preset", ["gpt-neox-tiny", "gpt2-tiny"])
def test_the_measuring_pass_counts_what_the_planner_predicts(preset):
    model = from_preset(preset, device="meta")
    measured = measure_unit_costs(model, model_units(model), micro_batch_size=2, seq_len=16)
    predicted = ppl.transformer_unit_costs(model.hf_config_dict(), seq_len=16,
                                           micro_batch_size=2, bytes_per_value=4)
    assert measured == predicted


@pytest.mark.parametrize("preset", ["gpt-j-tiny", "gpt-neo-tiny"])
def test_predicted_flops_hold_for_the_other_causal_families(preset):
    model = from_preset(preset, device="meta")
    measured = measure_unit_costs(model, model_units(model), micro_batch_size=1, seq_len=32)
    predicted = ppl.transformer_unit_costs(model.hf_config_dict(), seq_len=32,
                                           micro_batch_size=1)
    assert [c.flops for c in measured] == [c.flops for c in predicted]


def test_measuring_computes_nothing_and_runs_no_attention_kernel():
    before = used_kernels()
    model = from_preset("gpt-neox-tiny", attention="flash")  # weights on the CPU
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    costs = measure_unit_costs(model, model_units(model), micro_batch_size=4, seq_len=64)
    assert costs[1].flops > 0 and used_kernels() == before
    assert all(p.grad is None and torch.equal(p, weights[n]) for n, p in model.named_parameters())


def test_auto_partition_of_a_heavy_head_beats_uniform_by_over_a_quarter():
    model = from_preset("gpt-neox-tiny", device="meta", **UNBALANCED)
    costs = measure_unit_costs(model, model_units(model), micro_batch_size=4, seq_len=64)
    uniform = max(ppl.uniform_partition(8, 2).stage_flops(costs))
    auto = ppl.balanced_partition(costs, 2)
    slowest = max(auto.stage_flops(costs))
    assert slowest <= 0.75 * uniform, (slowest / uniform, auto.starts)
    assert auto.describe(0) == "embeddings + blocks 0-6"  # the head's stage keeps one block


def test_tied_embeddings_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"ties its output layer to the token embedding .* set "
                                         r"tie_word_embeddings false"):
        check_untied(from_preset("gpt2-tiny", device="meta"))
    check_untied(from_preset("gpt2-tiny", device="meta", tie_word_embeddings=False))
