"""The one attention core every model family calls.

``attention="flash"`` uses the ``flash-attn`` package on a CUDA GPU that it supports, else
PyTorch's scaled-dot-product attention restricted to its flash kernel (CUDA and CPU both have
one), and falls back to unrestricted SDPA, with a logged reason, when the flash kernel cannot take
the inputs. ``"sdpa"`` lets PyTorch pick the kernel. ``"eager"`` materialises the scores matrix;
it is the reference the fast paths are tested against.

Inputs are ``(batch, heads, seq, head_dim)``. Masks are boolean, ``True`` = may attend.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

logger = logging.getLogger("dtrain.runtime.models")

ATTENTION_BACKENDS = ("flash", "sdpa", "eager")

# kernel name -> why it was chosen; filled as kernels are first used, read by the trainer.
_USED_KERNELS: dict[str, str] = {}
# (device type, dtype, has mask) combinations the SDPA flash kernel refused: skip the retry.
_FLASH_REFUSED: set[tuple[str, torch.dtype, bool]] = set()

try:  # optional: the flash-attn package is only useful on a supported CUDA GPU
    from flash_attn import flash_attn_func as _flash_attn_func
except ImportError:  # pragma: no cover - depends on the environment
    _flash_attn_func = None


def check_backend(attention: str) -> str:
    """Validate an ``attention=`` argument early, where the user can still fix it."""
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention={attention!r} is not supported; use one of {', '.join(ATTENTION_BACKENDS)}"
        )
    return attention


def used_kernels() -> dict[str, str]:
    """Kernels used so far in this process, each with the reason it was chosen."""
    return dict(_USED_KERNELS)


def _record(kernel: str, reason: str, device: torch.device) -> None:
    # Logged once per kernel: attention runs every layer of every step. On the meta device (a
    # pipeline's measuring pass) no kernel runs, so none is recorded.
    if kernel not in _USED_KERNELS and device.type != "meta":
        _USED_KERNELS[kernel] = reason
        logger.info("attention kernel: %s (%s)", kernel, reason)


def build_mask(
    batch: int,
    q_len: int,
    k_len: int,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None = None,
    window_size: int | None = None,
    device: torch.device | None = None,
    always: bool = False,
) -> torch.Tensor | None:
    """Boolean mask ``(batch or 1, 1, q_len, k_len)`` or None when nothing is masked.

    ``key_padding_mask`` is the HF ``attention_mask`` (1 = real token). ``window_size`` is
    GPT-Neo's local attention: a query sees the ``window_size`` most recent keys, itself included.
    ``always=True`` builds the plain causal mask too (the eager path has no ``is_causal``).
    """
    if key_padding_mask is None and window_size is None and not always:
        return None  # pure causal or full attention: the kernels take is_causal instead
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal or window_size is not None:
        offset = k_len - q_len  # queries are the last q_len positions of the keys
        q_pos = torch.arange(q_len, device=device)[:, None] + offset
        distance = q_pos - torch.arange(k_len, device=device)[None, :]
        mask = distance >= 0 if causal else mask
        if window_size is not None:
            mask = mask & (distance < window_size)
    mask = mask[None, None]
    if key_padding_mask is not None:
        mask = mask & key_padding_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
    # A query with no visible key (a left-padded position) would produce NaN; let it see all
    # keys instead. Its output is never used, and every kernel then agrees on it.
    empty_rows = ~mask.any(dim=-1, keepdim=True)
    return mask | empty_rows


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """softmax(QK^T * scale + mask) V, computed in full; the reference for parity tests."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal and mask is None:
        mask = build_mask(1, q.shape[-2], k.shape[-2], causal=True, device=q.device, always=True)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


def _sdpa(q, k, v, *, causal: bool, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale
    )


def _flash_attn_usable(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    return (
        _flash_attn_func is not None
        and q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        # padding needs the varlen API and windows a different call; SDPA handles both
        and mask is None
    )


def _flash(q, k, v, *, causal: bool, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    if _flash_attn_usable(q, mask):
        _record("flash-attn", "flash-attn package on CUDA", q.device)
        out = _flash_attn_func(  # flash-attn wants (batch, seq, heads, dim)
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            softmax_scale=scale, causal=causal,
        )
        return out.transpose(1, 2)
    key = (q.device.type, q.dtype, mask is not None)
    if key not in _FLASH_REFUSED:
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = _sdpa(q, k, v, causal=causal, mask=mask, scale=scale)
            _record("sdpa-flash", f"torch SDPA flash kernel on {q.device.type}", q.device)
            return out
        except RuntimeError as err:
            _FLASH_REFUSED.add(key)
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            logger.info("SDPA flash kernel refused %s %s%s: %s", q.device.type, q.dtype,
                        " with mask" if mask is not None else "", reason)
    _record("sdpa", f"flash kernel cannot take {q.device.type} {q.dtype} "
            f"{'masked ' if mask is not None else ''}inputs; plain SDPA", q.device)
    return _sdpa(q, k, v, causal=causal, mask=mask, scale=scale)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backend: str,
    causal: bool,
    key_padding_mask: torch.Tensor | None = None,
    window_size: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention over ``(batch, heads, seq, head_dim)`` tensors with the chosen backend."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = build_mask(q.shape[0], q.shape[-2], k.shape[-2], causal=causal,
                      key_padding_mask=key_padding_mask, window_size=window_size, device=q.device)
    if backend == "eager":
        _record("eager", "attention='eager' requested", q.device)
        return eager_attention(q, k, v, causal=causal, mask=mask, scale=scale)
    if backend == "sdpa":
        _record("sdpa", "attention='sdpa' requested", q.device)
        return _sdpa(q, k, v, causal=causal, mask=mask, scale=scale)
    if backend == "flash":
        return _flash(q, k, v, causal=causal, mask=mask, scale=scale)
    check_backend(backend)
    raise AssertionError(f"unhandled attention backend {backend!r}")
