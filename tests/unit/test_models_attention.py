"""The attention core: masks, kernel choice and fallback, and fast paths equal the eager one."""

from __future__ import annotations

import logging

import pytest
import torch
from dtrain.core.presets import get_preset
from dtrain.runtime.models import attention as attn
from dtrain.runtime.models import build_model

FAMILY_PRESETS = {
    "gpt_neox-parallel-residual": ("gpt-neox-tiny", {"use_parallel_residual": True}),
    "gpt_neox-sequential-residual": ("gpt-neox-tiny", {"use_parallel_residual": False}),
    "gpt2": ("gpt2-tiny", {}),
    "gptj": ("gpt-j-tiny", {}),
    "gpt_neo-global-and-local": ("gpt-neo-tiny", {}),
    "bert-padded": ("bert-tiny", {}),
    "roberta-padded": ("roberta-tiny", {}),
}


def _qkv(batch=2, heads=3, seq=9, dim=8):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(batch, heads, seq, dim, generator=generator) for _ in range(3)]


def test_window_mask_sees_only_the_most_recent_keys():
    mask = attn.build_mask(1, 5, 5, causal=True, window_size=2)[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0],
                             [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_padding_mask_hides_padded_keys_and_never_empties_a_row():
    padding = torch.tensor([[0, 0, 1, 1]])  # left padding: query 0 has no visible key
    mask = attn.build_mask(1, 4, 4, causal=True, key_padding_mask=padding)[0, 0]
    assert mask.any(dim=-1).all()
    assert not mask[2:, :2].any()


@pytest.mark.parametrize("backend", ["flash", "sdpa"])
@pytest.mark.parametrize("case", ["causal", "bidirectional-padded", "causal-window",
                                  "causal-padded", "no-scale"])
def test_fast_backends_equal_eager(backend, case):
    q, k, v = _qkv()
    padding = torch.ones(2, 9, dtype=torch.long)
    padding[1, 6:] = 0
    kwargs = {
        "causal": {"causal": True},
        "bidirectional-padded": {"causal": False, "key_padding_mask": padding},
        "causal-window": {"causal": True, "window_size": 3},
        "causal-padded": {"causal": True, "key_padding_mask": padding},
        "no-scale": {"causal": True, "scale": 1.0},  # GPT-Neo does not scale scores
    }[case]
    expected = attn.attention(q, k, v, backend="eager", **kwargs)
    torch.testing.assert_close(attn.attention(q, k, v, backend=backend, **kwargs), expected,
                               atol=1e-5, rtol=0)


def test_flash_backward_matches_eager():
    q, k, v = (t.requires_grad_() for t in _qkv())
    attn.attention(q, k, v, backend="flash", causal=True).square().sum().backward()
    fast_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    attn.attention(q, k, v, backend="eager", causal=True).square().sum().backward()
    for fast, slow in zip(fast_grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)


def test_flash_falls_back_to_plain_sdpa_with_a_logged_reason(monkeypatch, caplog):
    monkeypatch.setattr(attn, "_USED_KERNELS", {})
    monkeypatch.setattr(attn, "_FLASH_REFUSED", set())
    original = attn.F.scaled_dot_product_attention
    calls = []

    def flash_kernel_refuses_once(*args, **kwargs):
        calls.append(kwargs.get("attn_mask") is not None)
        if len(calls) == 1:
            raise RuntimeError("No available kernel. Aborting execution.")
        return original(*args, **kwargs)

    monkeypatch.setattr(attn.F, "scaled_dot_product_attention", flash_kernel_refuses_once)
    q, k, v = _qkv()
    padding = torch.ones(2, 9, dtype=torch.long)
    padding[0, 5:] = 0
    with caplog.at_level(logging.INFO, logger="dtrain.runtime.models"):
        for _ in range(2):
            out = attn.attention(q, k, v, backend="flash", causal=True, key_padding_mask=padding)
    expected = attn.attention(q, k, v, backend="eager", causal=True, key_padding_mask=padding)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    assert len(calls) == 3  # the refusal is remembered: no second try of the flash kernel
    assert "flash kernel cannot take" in attn.used_kernels()["sdpa"]
    assert "No available kernel" in caplog.text


def test_unknown_backend_is_a_user_error():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="use one of flash, sdpa, eager"):
        attn.attention(q, k, v, backend="xformers", causal=True)


def test_chosen_kernel_is_logged_once_and_reported(monkeypatch, caplog):
    monkeypatch.setattr(attn, "_USED_KERNELS", {})
    q, k, v = _qkv()
    with caplog.at_level(logging.INFO, logger="dtrain.runtime.models"):
        for _ in range(3):
            attn.attention(q, k, v, backend="flash", causal=True)
    kernels = attn.used_kernels()
    assert set(kernels) in ({"sdpa-flash"}, {"sdpa"}, {"flash-attn"})
    assert caplog.text.count("attention kernel:") == 1


@pytest.mark.parametrize("backend", ["flash", "sdpa"])
@pytest.mark.parametrize("case", list(FAMILY_PRESETS))
def test_model_logits_with_fast_attention_equal_eager(case, backend):
    preset, overrides = FAMILY_PRESETS[case]
    config = {**get_preset(preset), **overrides}
    torch.manual_seed(0)
    eager = build_model(config, attention="eager").eval()
    fast = build_model(config, attention=backend).eval()
    fast.load_state_dict(eager.state_dict())
    input_ids = torch.randint(3, config["vocab_size"], (2, 12))
    attention_mask = torch.ones(2, 12, dtype=torch.long)
    attention_mask[1, 8:] = 0
    with torch.no_grad():
        for mask in (None, attention_mask):
            torch.testing.assert_close(fast(input_ids, mask), eager(input_ids, mask),
                                       atol=1e-5, rtol=0)
