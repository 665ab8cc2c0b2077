"""Under torch.autocast the models behave as the plain composition ``linear(act(h))`` would:
same output dtype, fp32 gradients for fp32 parameters, same values. CPU bf16 autocast stands in
for CUDA's, which takes the same path."""

from __future__ import annotations

import sys

import pytest
import torch
from dtrain.runtime.models import from_preset
from dtrain.runtime.models.common import _ACTIVATIONS, activation, activation_then_linear
from torch import nn

TINY = ["gpt-neox-tiny", "gpt2-tiny", "gpt-j-tiny", "gpt-neo-tiny", "bert-tiny", "roberta-tiny"]


def _assert_close_bf16(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    # bf16 keeps 8 bits: an element may be off by a rounding of the largest term summed into it
    got, want = got.detach(), want.detach()
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1.6e-2 * float(want.abs().max()),
                               msg=lambda message: f"{what}: {message}")


def _plain(h: torch.Tensor, act, linear: nn.Linear) -> torch.Tensor:
    return linear(act(h))


def _forward_backward(fn, h, linear, grad, *, backward_under_autocast=False):
    for t in (h, linear.weight, linear.bias):
        if t is not None:
            t.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(h, linear)
        if backward_under_autocast:
            out.backward(grad)
    if not backward_under_autocast:
        out.backward(grad)
    return out, [None if t is None else t.grad for t in (h, linear.weight, linear.bias)]


@pytest.mark.parametrize("name", sorted(_ACTIVATIONS))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("backward_under_autocast", [False, True])
def test_activation_then_linear_under_autocast_matches_the_plain_composition(
    name, bias, backward_under_autocast
):
    torch.manual_seed(0)
    act = activation(name)
    linear = nn.Linear(16, 8, bias=bias)
    h = torch.randn(2, 5, 16, requires_grad=True)
    grad = torch.randn(2, 5, 8)

    plain, plain_grads = _forward_backward(
        lambda h, lin: _plain(h, act, lin), h, linear, grad,
        backward_under_autocast=backward_under_autocast)
    fused, fused_grads = _forward_backward(
        lambda h, lin: activation_then_linear(h, act, lin), h, linear, grad,
        backward_under_autocast=backward_under_autocast)

    assert fused.dtype == plain.dtype == torch.bfloat16
    _assert_close_bf16(fused, plain)
    for got, want in zip(fused_grads, plain_grads, strict=True):
        if want is None:
            assert got is None
            continue
        assert got.dtype == want.dtype == torch.float32  # fp32 master weights get fp32 grads
        _assert_close_bf16(got, want)


def test_activation_then_linear_under_autocast_with_bf16_input_and_frozen_input():
    # In a model h comes out of the previous linear already in bf16; it may not require grad.
    torch.manual_seed(0)
    act = activation("gelu")
    linear = nn.Linear(16, 8)
    h = torch.randn(4, 16).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = activation_then_linear(h, act, linear)
        plain = _plain(h, act, linear)
    _assert_close_bf16(fused, plain)
    fused.float().sum().backward()
    assert linear.weight.grad.dtype == linear.bias.grad.dtype == torch.float32


def test_activation_then_linear_has_no_double_backward():
    act = activation("gelu")
    linear = nn.Linear(6, 4)
    h = torch.randn(3, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(activation_then_linear(h, act, linear).sum(), h, create_graph=True)


@pytest.mark.parametrize("preset", TINY)
def test_model_under_cpu_bf16_autocast_matches_the_plain_mlp(preset, monkeypatch):
    torch.manual_seed(0)
    model = from_preset(preset)
    input_ids = torch.randint(3, 512, (2, 10))

    def logits_and_grads():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids)
        logits.float().logsumexp(-1).mean().backward()
        return logits.detach(), {name: p.grad for name, p in model.named_parameters()}

    fused_logits, fused_grads = logits_and_grads()
    # the same model with the plain composition in every MLP (each family imports it by name)
    monkeypatch.setattr(sys.modules[type(model).__module__], "activation_then_linear", _plain)
    plain_logits, plain_grads = logits_and_grads()

    assert fused_logits.dtype == plain_logits.dtype
    _assert_close_bf16(fused_logits, plain_logits)
    for name, want in plain_grads.items():
        got = fused_grads[name]
        assert got.dtype == torch.float32, name
        _assert_close_bf16(got, want, name)
