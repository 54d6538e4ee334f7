"""The transformers attention hook of the emulator: while a block is active, the model's attention
runs as `attention.tiled_attention` with a serving kernel family's tile walk (or torch SDPA for
the reference), on a KV cache stored in FP8 where the spec says so.

`emulated_attention(model, family, kv_fp8)` registers the implementation `ATTN_IMPL` with
transformers and points the model's config at it, restoring the previous one in `finally`;
`fp8_kv_cache` is the case of a measured BF16/FP16 sampler with only its KV cache in FP8.
`eager_experts` keeps fused MoE experts on transformers' eager loop meanwhile.

The active block is per thread (sampler threads of one process may emulate different groups at
once). An FP8 KV cache rounds keys and values as they are stored: the engine's cache
(kv_cache.SlotCache) rounds each new position once when it is written (`kv_store_rounding`) and
marks what it hands attention as already rounded (`mark_rounded`), so attention does not round
the whole cache again at every decode step; keys and values from anywhere else are rounded here.
The FP8 round trip is idempotent, so the numbers are the same either way, bit for bit.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch
import torch.nn.functional as F

from .attention import KernelFamily, quantize_kv, tiled_attention

__all__ = ["ATTN_IMPL", "emulated_attention", "eager_experts", "fp8_kv_cache",
           "kv_store_rounding", "mark_rounded"]

ATTN_IMPL = "mismatch_emulated"

_STATE = threading.local()  # .active: this thread's stack of (family, kv_fp8) blocks
_ROUNDED = "_mismatch_kv_rounded"  # the mark on keys/values already rounded as stored


def _stack() -> list[tuple[KernelFamily | None, bool]]:
    stack = getattr(_STATE, "active", None)
    if stack is None:
        stack = _STATE.active = []
    return stack


def _active() -> tuple[KernelFamily | None, bool]:
    stack = _stack()
    return stack[-1] if stack else (None, False)


def kv_store_rounding() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How this thread's active block stores keys and values in a KV cache: `quantize_kv` for an
    FP8 cache, None for the compute dtype."""
    return quantize_kv if _active()[1] else None


def mark_rounded(*tensors: torch.Tensor) -> None:
    """Mark keys/values that a cache rounded with `kv_store_rounding` as they were stored."""
    for t in tensors:
        setattr(t, _ROUNDED, True)


def _emulated_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        **kwargs):
    family, kv_fp8 = _active()
    if kv_fp8:
        key, value = (x if getattr(x, _ROUNDED, False) else quantize_kv(x) for x in (key, value))
    tq, tk = query.shape[2], key.shape[2]
    if attention_mask is None:
        allowed = torch.ones(tq, tk, dtype=torch.bool, device=query.device).tril(tk - tq)
        allowed = allowed[None, None]
    elif attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:
        allowed = attention_mask == 0
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if family is None:
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale)
    else:  # grouped-query attention without copying K/V per query head
        out = tiled_attention(query, key, value, allowed, scale, family)
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPL, _emulated_attention)
    AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)


@contextlib.contextmanager
def eager_experts(model: torch.nn.Module):
    """Run fused MoE experts through transformers' eager per-expert loop rather than a grouped
    GEMM. Qwen3-MoE-layout experts get the emulator's own forward anyway (moe.py); this keeps
    any other layout on one and the same expert kernel on every side of a comparison."""
    config = model.config
    previous = getattr(config, "_experts_implementation", None)
    config._experts_implementation = "eager"
    try:
        yield
    finally:
        config._experts_implementation = previous


@contextlib.contextmanager
def emulated_attention(model: torch.nn.Module, family: KernelFamily | None, kv_fp8: bool):
    """Inside the block the model's attention is `family`'s tiled kernel (None: torch SDPA), on
    an FP8 KV cache when `kv_fp8`, and fused experts run eagerly; nested blocks stack."""
    _register_attention()
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTN_IMPL
    stack = _stack()
    stack.append((family, kv_fp8))
    try:
        with eager_experts(model):
            yield
    finally:
        stack.pop()
        config._attn_implementation = previous


@contextlib.contextmanager
def fp8_kv_cache(model: torch.nn.Module):
    """Only the KV cache in FP8 (per-tensor, scale 1.0, as engines default), attention by torch
    SDPA and the model's own GEMMs: a measured BF16/FP16 sampler with an FP8 KV cache."""
    with emulated_attention(model, None, True):
        yield
