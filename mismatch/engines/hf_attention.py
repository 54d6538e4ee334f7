"""The transformers attention hook of the emulator: while a block is active, the model's attention
runs as `attention.tiled_attention` with a serving kernel family's tile walk (or torch SDPA for
the reference), on a KV cache stored in FP8 where the spec says so.

`emulated_attention(model, family, kv_fp8)` registers the implementation `ATTN_IMPL` with
transformers and points the model's config at it, restoring the previous one in `finally`;
`fp8_kv_cache` is the case of a measured BF16/FP16 sampler with only its KV cache in FP8.
`eager_experts` keeps fused MoE experts on transformers' eager loop meanwhile.

The active block is per thread (sampler threads of one process may emulate different groups at
once). `lane_attention` is the block of several lanes (lanes.py): each lane's batch rows attend
with their own family (lanes with the same family and cache format in one call), and only the
positions of FP8-cache lanes are rounded as stored. An FP8 KV cache rounds keys and values as
they are stored: the engine's cache (kv_cache.SlotCache) rounds each new position once when it
is written (`kv_store_rounding`) and marks what it hands attention as already rounded
(`mark_rounded`), so attention does not round the whole cache again at every decode step; keys
and values from anywhere else are rounded here.
The FP8 round trip is idempotent, so the numbers are the same either way, bit for bit.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch
import torch.nn.functional as F

from .attention import KernelFamily, quantize_kv, tiled_attention
from .lanes import rows_by_lane

__all__ = ["ATTN_IMPL", "emulated_attention", "lane_attention", "eager_experts", "reads_widened",
           "stores_widened", "fp8_kv_cache", "kv_store_rounding", "mark_rounded"]

ATTN_IMPL = "mismatch_emulated"

_STATE = threading.local()  # .active: this thread's stack of blocks (module docstring)
_ROUNDED = "_mismatch_kv_rounded"  # the mark on keys/values already rounded as stored


def _round_all(written: torch.Tensor, batch_rows: torch.Tensor) -> torch.Tensor:
    return quantize_kv(written)


class _Lanes:
    """A lane block: per lane (kernel family, FP8 KV cache), and how its cache stores keys."""

    def __init__(self, lanes: list[tuple[KernelFamily | None, bool]]) -> None:
        self.lanes = lanes
        self._parts: tuple | None = None  # (rows_by_lane() it was made from, its merge)
        self.fp8 = {i for i, (_, kv_fp8) in enumerate(lanes) if kv_fp8}
        if not self.fp8:
            self.rounding = None
        elif len(self.fp8) == len(lanes):
            self.rounding = _round_all
        else:
            self.rounding = self._round_fp8_lanes

    def _round_fp8_lanes(self, written: torch.Tensor, batch_rows: torch.Tensor) -> torch.Tensor:
        """Round the positions of rows in FP8-cache lanes; `batch_rows`: each position's row."""
        parts = rows_by_lane()
        if len(parts) == 1:
            return quantize_kv(written) if parts[0][0] in self.fp8 else written
        rows = sum(len(r) for _, r in parts)
        fp8_row = torch.zeros(rows, dtype=torch.bool, device=written.device)
        for lane, r in parts:
            if lane in self.fp8:
                fp8_row[r] = True
        pick = fp8_row[batch_rows]
        out = written.clone()
        out[pick] = quantize_kv(written[pick])
        return out


    def parts(self) -> list[tuple[tuple[KernelFamily | None, bool], torch.Tensor]]:
        """The current forward's [((family, FP8 KV), batch rows)]: lanes that attend alike (one
        kernel family, one cache format: e.g. an FP8 and a BF16 sampler on the same GPU) in one
        call, since each row's attention reads only its own row. Cached per forward."""
        lanes = rows_by_lane()
        if self._parts is not None and self._parts[0] is lanes:
            return self._parts[1]
        by: dict[tuple, list[torch.Tensor]] = {}
        for lane, rows in lanes:
            by.setdefault(self.lanes[lane], []).append(rows)
        merged = [(entry, rows[0] if len(rows) == 1 else torch.cat(rows).sort().values)
                  for entry, rows in by.items()]
        self._parts = (lanes, merged)
        return merged


def _stack() -> list:
    stack = getattr(_STATE, "active", None)
    if stack is None:
        stack = _STATE.active = []
    return stack


def _active() -> tuple[KernelFamily | None, bool] | _Lanes:
    stack = _stack()
    return stack[-1] if stack else (None, False)


def kv_store_rounding() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """How this thread's active block stores keys and values in a KV cache: a function of the
    new positions' values [n, …] and their batch rows [n] that rounds those an FP8 cache holds,
    or None where no position is stored in FP8. The same object for the whole block."""
    top = _active()
    if isinstance(top, _Lanes):
        return top.rounding
    return _round_all if top[1] else None


def reads_widened() -> bool:
    """Whether every row of this thread's active block attends with a tiled kernel family, which
    reads the keys and values it is handed in FP32 (widening them itself, from any layout): a KV
    cache may then hand attention a view of its store instead of a compact copy of its own (and
    store them widened: `stores_widened`)."""
    stack = _stack()
    if not stack:
        return False
    top = stack[-1]
    if isinstance(top, _Lanes):
        return all(family is not None for family, _ in top.lanes)
    return top[0] is not None


def stores_widened() -> bool:
    """Whether a KV cache made under this thread's active block should store its keys and values
    widened to FP32: where every row attends with a tiled kernel (`reads_widened`) in one call.
    Where the rows of a lane block attend in several calls (several kernel families or cache
    formats), each call gathers its rows' keys and values from the cache at every layer and step,
    and gathering from a store twice as wide reads twice the memory: measured slower on the
    study's mixed fleet (reports/benchmarks.md), so such a cache stores the compute dtype."""
    if not reads_widened():
        return False
    top = _stack()[-1]
    return not isinstance(top, _Lanes) or len(set(top.lanes)) == 1


def mark_rounded(*tensors: torch.Tensor) -> None:
    """Mark keys/values that a cache rounded with `kv_store_rounding` as they were stored."""
    for t in tensors:
        setattr(t, _ROUNDED, True)


def _attend(query, key, value, attention_mask, scaling, family: KernelFamily | None,
            kv_fp8: bool, rounded: bool) -> torch.Tensor:
    """[B, H, Tq, D] queries → [B, Tq, H, D] outputs under one kernel family."""
    if kv_fp8 and not rounded:
        key, value = quantize_kv(key), quantize_kv(value)
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
    return out.transpose(1, 2)


def _emulated_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        **kwargs):
    top = _active()
    rounded = getattr(key, _ROUNDED, False)
    if not isinstance(top, _Lanes):
        family, kv_fp8 = top
        return _attend(query, key, value, attention_mask, scaling, family, kv_fp8,
                       rounded).contiguous(), None
    sets = top.parts()
    if len(sets) == 1:  # the lanes present attend alike: one call on the batch as it comes
        (family, kv_fp8), _ = sets[0]
        return _attend(query, key, value, attention_mask, scaling, family, kv_fp8,
                       rounded).contiguous(), None
    b, h, tq, _ = query.shape
    out = query.new_empty(b, tq, h, value.shape[-1])
    per_row = attention_mask is not None and attention_mask.shape[0] == b and b > 1
    for (family, kv_fp8), rows in sets:
        mask = attention_mask.index_select(0, rows) if per_row else attention_mask
        out[rows] = _attend(query.index_select(0, rows), key.index_select(0, rows),
                            value.index_select(0, rows), mask, scaling, family, kv_fp8, rounded)
    return out, None


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
def _block(model: torch.nn.Module, entry):
    """Point the model's attention at ATTN_IMPL with `entry` on this thread's stack."""
    _register_attention()
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTN_IMPL
    stack = _stack()
    stack.append(entry)
    try:
        with eager_experts(model):
            yield
    finally:
        stack.pop()
        config._attn_implementation = previous


@contextlib.contextmanager
def emulated_attention(model: torch.nn.Module, family: KernelFamily | None, kv_fp8: bool):
    """Inside the block the model's attention is `family`'s tiled kernel (None: torch SDPA), on
    an FP8 KV cache when `kv_fp8`, and fused experts run eagerly; nested blocks stack."""
    with _block(model, (family, kv_fp8)):
        yield


@contextlib.contextmanager
def lane_attention(model: torch.nn.Module, lanes: list[tuple[KernelFamily | None, bool]]):
    """`emulated_attention` per lane (lanes.py): the batch rows of lane i attend with
    lanes[i] = (kernel family or None for torch SDPA, FP8 KV cache)."""
    with _block(model, _Lanes(list(lanes))):
        yield


@contextlib.contextmanager
def fp8_kv_cache(model: torch.nn.Module):
    """Only the KV cache in FP8 (per-tensor, scale 1.0, as engines default), attention by torch
    SDPA and the model's own GEMMs: a measured BF16/FP16 sampler with an FP8 KV cache."""
    with emulated_attention(model, None, True):
        yield
