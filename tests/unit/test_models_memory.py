"""What a transformer layer keeps for backward: the memory the flash path saves over eager
depends on it (benchmarks/attention_memory.py measures the whole layer)."""

from __future__ import annotations

import pytest
import torch
from dtrain.runtime.models.common import _ACTIVATIONS, activation, activation_then_linear
from dtrain.runtime.models.gpt_neox import GPTNeoXConfig, GPTNeoXLayer, GPTNeoXMLP
from torch import nn


def _saved_activation_bytes(module: nn.Module, fn) -> tuple[int, list[torch.Tensor]]:
    """Bytes of distinct storages autograd keeps for backward, parameters excluded."""
    param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            storages[storage.data_ptr()] = storage.nbytes()
            saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(storages.values()), saved


@pytest.mark.parametrize("name", sorted(_ACTIVATIONS))
def test_activation_then_linear_matches_the_plain_composition(name):
    torch.manual_seed(0)
    act = activation(name)
    linear = nn.Linear(16, 8).double()
    h = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 5, 8, dtype=torch.float64)

    plain = linear(act(h))
    plain.backward(grad)
    expected = [t.grad.clone() for t in (h, linear.weight, linear.bias)]
    for t in (h, linear.weight, linear.bias):
        t.grad = None

    fused = activation_then_linear(h, act, linear)
    fused.backward(grad)
    assert torch.equal(fused, plain)
    for got, want in zip((h.grad, linear.weight.grad, linear.bias.grad), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda h, w, b: activation_then_linear(h, act, _Fixed(w, b)), (h, linear.weight,
                                                                        linear.bias))


class _Fixed:
    """A stand-in for nn.Linear whose tensors gradcheck perturbs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        self.weight, self.bias = weight, bias


def test_activation_then_linear_leaves_frozen_weights_and_inputs_alone():
    act = activation("gelu")
    linear = nn.Linear(6, 4).requires_grad_(False)
    h = torch.randn(3, 6, requires_grad=True)
    activation_then_linear(h, act, linear).sum().backward()
    assert h.grad is not None and linear.weight.grad is None and linear.bias.grad is None


def test_mlp_keeps_its_input_and_pre_activation_but_not_the_activation_output():
    config = GPTNeoXConfig.from_hf({"hidden_size": 32, "num_hidden_layers": 1,
                                    "num_attention_heads": 4, "vocab_size": 8})
    mlp = GPTNeoXMLP(config)
    x = torch.randn(2, 10, 32, requires_grad=True)
    saved_bytes, saved = _saved_activation_bytes(mlp, lambda: mlp(x).sum().backward())
    tokens = 2 * 10
    assert saved_bytes == tokens * (32 + 4 * 32) * 4  # x and h, fp32
    assert not any(t.shape[-1] == 4 * 32 and t.grad_fn is not None
                   and "Gelu" in t.grad_fn.name() for t in saved)


def test_flash_gpt_neox_layer_keeps_seven_hidden_and_one_intermediate_vector_per_token():
    # x, both layer-norm outputs, q, k, v and the attention output (which the output
    # projection reads without a copy), plus the MLP's pre-activation. A view of the fused QKV
    # projection kept for v, a copy of the attention output, or a kept activation output would
    # each add a tokens x hidden (or intermediate) tensor and fail this.
    hidden, heads, seq = 64, 4, 128
    config = GPTNeoXConfig.from_hf({"hidden_size": hidden, "num_hidden_layers": 1,
                                    "num_attention_heads": heads, "vocab_size": 8,
                                    "rotary_pct": 0.25})
    layer = GPTNeoXLayer(config, backend="flash")
    x = torch.randn(1, seq, hidden, requires_grad=True)
    saved_bytes, saved = _saved_activation_bytes(layer, lambda: layer(x).sum().backward())
    big = seq * (7 * hidden + 4 * hidden) * 4
    rotary_dim = hidden // heads // 4
    # attention's log-sum-exp, the layer norms' mean and rstd, the rotary cos and sin tables
    small = seq * (heads + 2 * 2 + 2 * rotary_dim) * 4
    assert big <= saved_bytes <= big + small
    assert not any(t.shape[-2:] == (seq, seq) for t in saved)


@pytest.mark.parametrize(("preset", "head_activations"), [
    ("gpt-neox-tiny", 0), ("gpt2-tiny", 0), ("gpt-j-tiny", 0), ("gpt-neo-tiny", 0),
    # BERT's prediction-head transform feeds its activation to a LayerNorm, which needs it
    ("bert-tiny", 1), ("roberta-tiny", 1),
])
def test_no_family_keeps_a_layer_mlp_activation_output(preset, head_activations):
    from dtrain.runtime.models import from_preset

    model = from_preset(preset)
    ids = torch.randint(0, 64, (2, 16))
    _, saved = _saved_activation_bytes(model, lambda: model(ids).sum().backward())
    activation_outputs = [t for t in saved if t.grad_fn is not None
                          and t.grad_fn.name().startswith(("Gelu", "Relu", "Silu"))]
    assert len(activation_outputs) == head_activations
