"""save_pretrained/load_pretrained round trips, meta-device initialisation and the registry."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch
from dtrain.core.presets import get_preset
from dtrain.runtime.models import build_model, from_preset, layout_model, num_parameters
from dtrain.runtime.models.common import _ACTIVATIONS
from dtrain.runtime.models.hf_io import INDEX_NAME, WEIGHTS_NAME, load_pretrained, save_pretrained

PRESETS = ["gpt-neox-tiny", "gpt2-tiny", "gpt-j-tiny", "gpt-neo-tiny", "bert-tiny", "roberta-tiny"]


def _inputs() -> dict[str, torch.Tensor]:
    input_ids = torch.randint(3, 512, (2, 10), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones(2, 10, dtype=torch.long)
    attention_mask[0, 7:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@pytest.mark.parametrize("preset", PRESETS)
def test_save_then_load_reproduces_logits_exactly(preset, tmp_path):
    torch.manual_seed(0)
    model = from_preset(preset, attention="eager").eval()
    save_pretrained(model, tmp_path)
    assert (tmp_path / WEIGHTS_NAME).is_file()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == model.model_type
    assert config["architectures"] == [model.hf_architecture]
    loaded = load_pretrained(tmp_path, attention="eager")
    inputs = _inputs()
    with torch.no_grad():
        assert torch.equal(loaded(**inputs), model(**inputs))


def _copies(model):
    return {"pickle": pickle.loads(pickle.dumps(model)), "deepcopy": copy.deepcopy(model)}


@pytest.mark.parametrize("preset", PRESETS)
def test_pickled_and_deep_copied_models_give_identical_logits(preset):
    torch.manual_seed(0)
    model = from_preset(preset, attention="eager").eval()
    inputs = _inputs()
    with torch.no_grad():
        expected = model(**inputs)
        for how, copied in _copies(model).items():
            assert torch.equal(copied(**inputs), expected), how


@pytest.mark.parametrize("name", sorted(_ACTIVATIONS))
def test_every_activation_survives_pickling(name):
    torch.manual_seed(0)
    model = from_preset("gpt-neox-tiny", attention="eager", hidden_act=name).eval()
    inputs = _inputs()
    with torch.no_grad():
        expected = model(**inputs)
        for how, copied in _copies(model).items():
            assert torch.equal(copied(**inputs), expected), how


@pytest.mark.parametrize("preset", PRESETS)
def test_sharded_save_writes_an_index_and_loads(preset, tmp_path):
    torch.manual_seed(0)
    model = from_preset(preset, attention="eager").eval()
    save_pretrained(model, tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (tmp_path / WEIGHTS_NAME).exists()
    assert all((tmp_path / shard).is_file() for shard in shards)
    loaded = load_pretrained(tmp_path, attention="eager")
    inputs = _inputs()
    with torch.no_grad():
        assert torch.equal(loaded(**inputs), model(**inputs))


def test_resave_unsharded_removes_stale_shards(tmp_path):
    model = from_preset("gpt-neox-tiny")
    save_pretrained(model, tmp_path, max_shard_size="40KB")
    save_pretrained(model, tmp_path)
    assert not (tmp_path / INDEX_NAME).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", WEIGHTS_NAME]


@pytest.mark.parametrize("preset", PRESETS)
def test_meta_build_then_init_weights_matches_a_normal_build(preset):
    config = get_preset(preset)
    torch.manual_seed(123)
    meta_model = build_model(config, device="meta")
    assert all(p.is_meta for p in meta_model.parameters())
    torch.randn(7)  # what runs between the build and the initialisation does not matter
    meta_model.to_empty(device="cpu")
    meta_model.init_weights()

    torch.manual_seed(123)
    normal_model = build_model(config)

    inputs = _inputs()
    with torch.no_grad():
        out = meta_model(**inputs)
        assert torch.isfinite(out).all()
        assert torch.equal(out, normal_model(**inputs))
    for (name, a), (_, b) in zip(meta_model.state_dict().items(),
                                 normal_model.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_layout_model_leaves_the_rng_alone_and_the_next_model_built_differs():
    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    layout_model(get_preset("gpt-neox-tiny"))  # e.g. to read its parameter names
    assert torch.equal(torch.random.get_rng_state(), state)
    first = from_preset("gpt-neox-tiny", device="meta")
    second = from_preset("gpt-neox-tiny", device="meta")
    for model in (first, second):
        model.to_empty(device="cpu")
        model.init_weights()
    assert not torch.equal(first.gpt_neox.embed_in.weight, second.gpt_neox.embed_in.weight)


@pytest.mark.parametrize("model_type,tied", [("gpt_neox", False), ("gptj", False),
                                              ("gpt2", True), ("bert", True)])
def test_a_config_that_does_not_say_ties_as_its_family_does_on_the_hub(model_type, tied):
    # GPT-NeoX and GPT-J configs default to untied: a NeoX folder without the key was tied
    from dtrain.core.presets import ties_embeddings

    config = {k: v for k, v in get_preset(f"{model_type.replace('_', '-').replace('gptj', 'gpt-j')}"
                                            "-tiny").items() if k != "tie_word_embeddings"}
    assert ties_embeddings(config) is tied
    assert build_model(config, device="meta").tie_word_embeddings is tied


def test_init_weights_reties_embeddings_broken_by_to_empty():
    model = from_preset("gpt-neox-tiny", tie_word_embeddings=True, device="meta")
    model.to_empty(device="cpu")
    model.init_weights()
    assert model.lm_head.weight is model.gpt_neox.embed_in.weight


def test_tied_embeddings_save_once_and_load_tied(tmp_path):
    model = from_preset("gpt-neox-tiny", tie_word_embeddings=True)
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.gpt_neox.embed_in.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_num_parameters_counts_tied_weights_once():
    untied = from_preset("gpt-neox-tiny", device="meta")
    tied = from_preset("gpt-neox-tiny", tie_word_embeddings=True, device="meta")
    config = get_preset("gpt-neox-tiny")
    assert num_parameters(untied) - num_parameters(tied) == config["vocab_size"] * 64


def test_unknown_model_type_and_attention_are_user_errors(tmp_path):
    with pytest.raises(ValueError, match="model_type='llama' is not supported"):
        build_model({"model_type": "llama"})
    with pytest.raises(ValueError, match="attention='xformers' is not supported"):
        from_preset("gpt-neox-tiny", attention="xformers")
    with pytest.raises(ValueError, match="has no config.json"):
        load_pretrained(tmp_path)


def test_load_dtype_casts_weights(tmp_path):
    save_pretrained(from_preset("gpt-neox-tiny"), tmp_path)
    model = load_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
