"""Our models load Hugging Face checkpoints and compute what transformers computes.

Each case builds a tiny random transformers model from a preset config (never a download),
saves it with transformers' own save_pretrained, loads it with dtrain's load_pretrained, and
compares logits in fp32 on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from dtrain.core.presets import get_preset
from dtrain.runtime.models.hf_io import load_pretrained, save_pretrained

transformers = pytest.importorskip("transformers")  # imported once for the whole module

MASKED_LM = {"bert", "roberta"}
# case id -> (preset, config overrides)
CASES = {
    "gpt_neox-parallel-residual": ("gpt-neox-tiny", {"use_parallel_residual": True}),
    "gpt_neox-sequential-residual": ("gpt-neox-tiny", {"use_parallel_residual": False}),
    "gpt2": ("gpt2-tiny", {}),
    "gptj": ("gpt-j-tiny", {}),
    "gpt_neo-global-and-local": ("gpt-neo-tiny", {}),
    "bert-padded": ("bert-tiny", {}),
    "roberta-padded": ("roberta-tiny", {}),
}
SEQ = 12  # longer than gpt-neo-tiny's window of 4, so local layers differ from global ones


def _hf_model(config: dict):
    config = dict(config)
    hf_config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    auto = (transformers.AutoModelForMaskedLM if hf_config.model_type in MASKED_LM
            else transformers.AutoModelForCausalLM)
    return auto.from_config(hf_config).eval()


def _inputs(config: dict) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, config["vocab_size"], (2, SEQ), generator=generator)
    attention_mask = torch.ones(2, SEQ, dtype=torch.long)
    attention_mask[1, SEQ - 4:] = 0  # right padding on the second row
    if config["model_type"] not in MASKED_LM:
        return {"input_ids": input_ids, "attention_mask": attention_mask}
    input_ids[1, SEQ - 4:] = config["pad_token_id"]  # RoBERTa positions depend on pad tokens
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if config.get("type_vocab_size", 1) > 1:
        inputs["token_type_ids"] = torch.randint(0, 2, (2, SEQ), generator=generator)
    return inputs


def _assert_close_on_real_tokens(actual, expected, inputs, atol):
    # Logits at padding positions are never used. Where a padded query sees no real key at all
    # (GPT-Neo's local window past the padding) the libraries legitimately fill it differently.
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(actual[real], expected[real], atol=atol, rtol=0)


@pytest.fixture(scope="module", params=list(CASES))
def hf_checkpoint(request, tmp_path_factory):
    preset, overrides = CASES[request.param]
    config = {**get_preset(preset), **overrides}
    torch.manual_seed(0)
    model = _hf_model(config)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return model, folder, _inputs(config)


def test_loaded_hf_checkpoint_gives_transformers_logits(hf_checkpoint):
    hf_model, folder, inputs = hf_checkpoint
    model = load_pretrained(folder, attention="eager", dtype=torch.float32)
    with torch.no_grad():
        _assert_close_on_real_tokens(model(**inputs), hf_model(**inputs).logits, inputs, 1e-4)
        unpadded = {"input_ids": inputs["input_ids"]}
        torch.testing.assert_close(model(**unpadded), hf_model(**unpadded).logits,
                                   atol=1e-4, rtol=0)


def test_transformers_loads_our_saved_folder(hf_checkpoint, tmp_path):
    hf_model, folder, inputs = hf_checkpoint
    model = load_pretrained(folder, attention="sdpa")
    save_pretrained(model, tmp_path)
    reloaded = type(hf_model).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        _assert_close_on_real_tokens(reloaded(**inputs).logits, model(**inputs), inputs, 1e-5)
