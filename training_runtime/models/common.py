"""Pieces every model family shares: config reading, activations, rotary embeddings, and the
base class that gives each model deterministic initialisation, weight tying and HF key mapping.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from dtrain.core.presets import ties_embeddings
from dtrain.runtime.models.attention import check_backend
from torch import nn


@dataclass(frozen=True)
class Activation:
    """An activation with its backward written in terms of the activation's *input*, so a layer
    can keep that input for backward instead of the (equally large) output; see
    :func:`activation_then_linear`."""

    name: str
    forward: Callable[[torch.Tensor], torch.Tensor]
    # (grad_out, input) -> grad_in, computed in place over grad_out (which the caller owns)
    backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


# Each backward writes the input gradient over the output gradient it is given (``grad_input=``
# is the aten out-argument of these element-wise kernels): the caller owns that buffer, and one
# fewer tokens x intermediate tensor is the point of Activation. Module-level functions (bound
# with partial, never lambdas) keep models picklable.
def _gelu_forward(x: torch.Tensor, *, approximate: str) -> torch.Tensor:
    return F.gelu(x, approximate=approximate)


def _gelu_backward(grad: torch.Tensor, x: torch.Tensor, *, approximate: str) -> torch.Tensor:
    return torch.ops.aten.gelu_backward.grad_input(grad, x, approximate=approximate,
                                                   grad_input=grad)


def _gelu(approximate: str) -> tuple[Callable, Callable]:
    return (partial(_gelu_forward, approximate=approximate),
            partial(_gelu_backward, approximate=approximate))


def _relu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.threshold_backward.grad_input(grad, x, 0, grad_input=grad)


def _silu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.silu_backward.grad_input(grad, x, grad_input=grad)


_ACTIVATIONS: dict[str, tuple[Callable, Callable]] = {
    "gelu": _gelu("none"),
    # HF's "gelu_new"/"gelu_fast" are the tanh approximation under other names.
    "gelu_new": _gelu("tanh"),
    "gelu_fast": _gelu("tanh"),
    "gelu_pytorch_tanh": _gelu("tanh"),
    "relu": (F.relu, _relu_backward),
    "silu": (F.silu, _silu_backward),
    "swish": (F.silu, _silu_backward),
}


def activation(name: str) -> Activation:
    """The activation function an HF config names (``hidden_act``/``activation_function``)."""
    try:
        forward, backward = _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"activation {name!r} is not supported; use one of {', '.join(_ACTIVATIONS)}"
        ) from None
    return Activation(name, forward, backward)


class _ActivationThenLinear(torch.autograd.Function):
    """``F.linear(act(h), weight, bias)`` that saves ``h`` and recomputes ``act(h)`` in backward.

    The plain composition keeps both ``h`` (for the activation's backward) and ``act(h)`` (for
    the linear's): two ``tokens x intermediate`` tensors, the largest activations of a
    transformer layer once attention no longer stores its scores. Keeping one and recomputing
    an element-wise function costs little time and saves a quarter of a layer's activations.
    The backward drops the recomputed activation before it computes the input gradient, which
    it writes over the activation's output gradient: at its peak it holds two such tensors
    (``h`` and one gradient) where the plain composition holds four.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, act: Activation):
        ctx.act = act
        ctx.has_bias = bias is not None
        ctx.save_for_backward(h, weight)
        return F.linear(act(h), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        # Grad mode is on here only under create_graph=True. once_differentiable would not do:
        # it keeps no graph, without a word, when grad_out does not require grad (loss.sum()).
        if torch.is_grad_enabled():
            raise RuntimeError("activation_then_linear has no double backward (its gradients "
                               "are written in place); compute linear(act(h)) plainly for that")
        h, weight = ctx.saved_tensors
        need_h, need_weight, need_bias, _ = ctx.needs_input_grad
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])
        grad_h = grad_weight = grad_bias = None
        if need_weight:
            recomputed = ctx.act(h)
            grad_weight = grad_flat.t() @ recomputed.reshape(-1, h.shape[-1])
            del recomputed
        if need_bias and ctx.has_bias:
            grad_bias = grad_flat.sum(0)
        if need_h:
            grad_h = ctx.act.backward(grad_out @ weight, h)
        return grad_h, grad_weight, grad_bias, None


def activation_then_linear(h: torch.Tensor, act: Activation, linear: nn.Linear) -> torch.Tensor:
    """``linear(act(h))`` -- the second half of every MLP here -- keeping ``h`` but not
    ``act(h)`` for backward. Same values and gradients as the plain composition, also under
    autocast.

    A layer that computes its product itself (a tensor-parallel layer, whose weight is split over
    ranks) offers ``activation_then_forward(h, act)`` and keeps the same saving through
    :func:`activation_then_matmul` on its own blocks; any other tensor-subclass weight or input
    runs the plain composition through the module."""
    own = getattr(linear, "activation_then_forward", None)
    if own is not None:
        return own(h, act)
    if type(linear.weight) not in (torch.Tensor, nn.Parameter) or type(h) is not torch.Tensor:
        return linear(act(h))
    return activation_then_matmul(h, act, linear.weight, linear.bias)


def activation_then_matmul(h: torch.Tensor, act: Activation, weight: torch.Tensor,
                           bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(act(h), weight, bias)`` on plain tensors, keeping ``h`` alone for backward."""
    device_type = h.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        # Cast as autocast casts F.linear's inputs, and run with autocast off: backward's
        # matmuls need the tensors forward used, not fp32 weights next to a bf16 gradient. The
        # casts' own backward returns each gradient in its input's dtype (fp32 master weights).
        # h is cast before the activation, not after; in a model it is already in that dtype.
        dtype = torch.get_autocast_dtype(device_type)
        h, weight, bias = (_autocast_cast(t, dtype) for t in (h, weight, bias))
        with torch.autocast(device_type, enabled=False):
            return _ActivationThenLinear.apply(h, weight, bias, act)
    return _ActivationThenLinear.apply(h, weight, bias, act)


def _autocast_cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # autocast leaves float64 alone
    if tensor is None or tensor.dtype == torch.float64:
        return tensor
    return tensor.to(dtype)


def config_value(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of ``names`` present (and not None) in an HF config; HF renamed keys over time."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


def require(config: dict[str, Any], *names: str) -> Any:
    value = config_value(config, *names)
    if value is None:
        raise ValueError(
            f"model config for {config.get('model_type')!r} lacks {names[0]!r}; "
            "add it to the config.json (or preset)"
        )
    return value


def rotary_cos_sin(
    seq_len: int, dim: int, *, base: float, device: torch.device, dtype: torch.dtype,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``(seq_len, dim)``, recomputed each forward: a buffer built on the meta
    device would hold garbage after ``to_empty``, and this costs little next to attention."""
    exponent = torch.arange(0, dim, 2, device=device, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base ** exponent)
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    if interleaved:  # GPT-J pairs (0,1), (2,3), ...
        angles = freqs.repeat_interleave(2, dim=-1)
    else:  # GPT-NeoX pairs dim i with dim i + dim/2
        angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool
) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x`` (batch, seq, heads, head_dim).

    Rotary runs before the heads are moved forward for attention: its output is then laid out
    (batch, seq, heads, head_dim) in memory, the attention kernels keep that layout, and the
    attention output reaches the output projection without another copy.
    """
    rot_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    if interleaved:
        rotated = torch.stack((-x_rot[..., 1::2], x_rot[..., ::2]), dim=-1).flatten(-2)
    else:
        half = rot_dim // 2
        rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


class HFCompatibleModel(nn.Module):
    """Base class: HF names, tying, deterministic init, and the HF state-dict mapping.

    Subclasses set the class attributes below and build their modules under HF's names, so the
    key mapping to a HF checkpoint is the identity unless a family overrides it (GPT-2).
    """

    model_type: str = ""
    hf_architecture: str = ""
    base_model_prefix: str = ""
    _no_split_modules: ClassVar[list[str]] = []
    # our key -> the key it shares storage with, when the config ties embeddings
    _tied_weights_keys: ClassVar[dict[str, str]] = {}
    # HF checkpoint keys that hold no weights we need (old persistent buffers)
    _ignored_hf_keys: tuple[str, ...] = ()
    # Raised when a family changes how it lays out a parameter in its own state dict (a DCP
    # checkpoint holds that layout, not HF's): a checkpoint of another layout is refused.
    state_layout: int = 1

    def __init__(self, hf_config: dict[str, Any], *, attention: str) -> None:
        super().__init__()
        self.attention_backend = check_backend(attention)
        self.hf_config = dict(hf_config)
        self.initializer_range = float(hf_config.get("initializer_range") or 0.02)
        self.tie_word_embeddings = ties_embeddings({"model_type": self.model_type, **hf_config})
        # Drawn when the model is built (the next model differs), used whenever it initialises:
        # what runs between (sharding, pipeline partitioning) changes nothing.
        self.init_seed = int(torch.randint(2**62, (), device="cpu"))

    def tie_weights(self) -> None:
        """Share tied parameters; also re-ties after ``to_empty``, which breaks sharing."""
        if not self.tie_word_embeddings:
            return
        for target, source in self._tied_weights_keys.items():
            owner_name, _, attr = target.rpartition(".")
            owner = self.get_submodule(owner_name)
            source_param = self.get_parameter(source)
            if getattr(owner, attr) is not source_param:
                setattr(owner, attr, source_param)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter, each from its own seed: ``init_seed`` (drawn from
        the torch RNG when the model was built) and the parameter's name.

        Linear/Embedding weights ~ N(0, initializer_range), biases 0, LayerNorm 1/0, padding
        embedding rows 0, any other parameter 0. Works after ``to_empty`` from the meta device.
        Each random weight is drawn whole and copied in, so a model already split (pipeline
        stages; DTensors, whose copies the runtime's ``shard`` turns into each rank's slice of
        the whole) starts exactly as the whole model on the same device type. A random op on a
        DTensor would instead draw the same values on every rank where DTensor keeps no RNG
        state (CPU).
        """
        self.tie_weights()
        init_parameters(self, seed=self.init_seed, std=self.initializer_range)

    def hf_config_dict(self) -> dict[str, Any]:
        """The ``config.json`` content: the given config, with the fields the family normalised
        (every family keeps its parsed config as ``self.config``, with ``to_hf()``)."""
        return {**self.hf_config, "model_type": self.model_type,
                "architectures": [self.hf_architecture],
                "tie_word_embeddings": self.tie_word_embeddings, **self.config.to_hf()}

    def from_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Map an HF checkpoint's tensors to our keys (drops known non-weight buffers)."""
        ignored = [re.compile(pattern) for pattern in self._ignored_hf_keys]
        return {key: value for key, value in state_dict.items()
                if not any(pattern.search(key) for pattern in ignored)}

    def to_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our tensors under HF's keys; the inverse of :meth:`from_hf_state_dict`."""
        return dict(state_dict)


# The segment torch's activation-checkpoint wrapper adds to a parameter's name.
_CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module."


def _seed_of(seed: int, name: str) -> int:
    """A parameter's own seed: the same on every rank and stage, another for every name."""
    digest = hashlib.blake2b(f"{seed}\0{name}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1  # a non-negative int64


def init_parameters(root: nn.Module, *, seed: int, std: float) -> None:
    """Initialise ``root``'s parameters (see :meth:`HFCompatibleModel.init_weights`), each from
    ``seed`` and its name in the unwrapped model; a tied parameter once."""
    done: set[int] = set()
    for module_name, module in root.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in done:
                continue
            done.add(id(param))
            path = f"{module_name}.{name}" if module_name else name
            _init_parameter(module, name, param, std=std,
                            seed=_seed_of(seed, path.replace(_CHECKPOINT_WRAPPED, "")))


def _init_parameter(module: nn.Module, name: str, param: nn.Parameter, *, std: float,
                    seed: int) -> None:
    if isinstance(module, nn.LayerNorm):
        param.fill_(1.0 if name == "weight" else 0.0)
    elif isinstance(module, (nn.Linear, nn.Embedding)) and name == "weight":
        generator = torch.Generator(device=param.device).manual_seed(seed)
        whole = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        whole.normal_(mean=0.0, std=std, generator=generator)
        padding_idx = getattr(module, "padding_idx", None)
        if padding_idx is not None:
            whole[padding_idx].zero_()
        param.copy_(whole)  # a split parameter keeps its part (see init_weights)
    else:
        param.zero_()
