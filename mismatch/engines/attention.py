"""Attention as the sampler's kernel family computes it: tiled online softmax, BF16 P·V, split-KV.

FlashAttention-style kernels never form the full score matrix: they walk the keys in tiles,
keep a running row max m and row sum l in FP32, rescale the FP32 output accumulator when m
grows, and — the habit that matters for mismatch — cast the probabilities P to the input dtype
(BF16) before the P·V matmul (FlashAttention-2 `flash_fwd_kernel.h`, FlashAttention-3 and
FlashInfer do the same). Decoding a single query with a long cache, they split the keys across
thread blocks ("split-KV" / flash-decoding) and merge the partial (m, l, O) in FP32. The trainer
side instead runs a reference attention (torch SDPA), so the two differ by reduction order and
by where P is rounded: the attention part of the "kernels" mismatch source.

Tile sizes per family (keys per tile, for head_dim ≤ 64 as the embedded model has), from the
public kernels: FlashAttention-2 (A100) prefill 128 (`Flash_fwd_kernel_traits<32, 128, 128, …>`)
and decode 256 (`run_mha_fwd_splitkv_dispatch`: kBlockN = 256 for head_dim ≤ 64);
FlashAttention-3 (Hopper, hopper/tile_size.h `tile_size_fwd_sm90`) 128 causal and 192
non-causal (a single decode query attends to the whole cache); Blackwell forward kernels 128;
FlashInfer 64 (a typical value, not read from its source). Decoding may split the keys across
up to 4 blocks.
The KV cache may be stored in FP8 E4M3 with a per-tensor scale; serving engines default that
scale to 1.0 when the checkpoint has none (vLLM's BaseKVCacheMethod,
vllm/model_executor/layers/quantization/kv_cache.py, initializes k_scale and v_scale to 1.0),
which is what `kv_scale=1.0` means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mismatch.quantize.formats import E4M3_MAX
from mismatch.registry import add_once

# A query row with every key masked has softmax sum 0 (and output 0): dividing by the smallest
# normal FP32 instead keeps it 0 rather than NaN, and changes no row with a positive sum.
_MIN_SOFTMAX_SUM = torch.finfo(torch.float32).tiny

__all__ = ["KernelFamily", "KERNEL_FAMILIES", "tiled_attention", "quantize_kv"]


@dataclass(frozen=True, kw_only=True)
class KernelFamily:
    """Tiling habits of one attention kernel family."""

    name: str
    """Family name as in mismatch.profiles."""
    tile_k: int
    """Keys per tile of the online softmax (prefill)."""
    decode_tile_k: int
    """Keys per tile when a single query attends to the cache (decode)."""
    decode_splits: int
    """KV splits when a single query attends to a long cache (1: no split)."""
    p_in_input_dtype: bool = True
    """Cast P to the input dtype before P·V (FlashAttention's habit)."""


KERNEL_FAMILIES: dict[str, KernelFamily] = {}


def _register_family(k: KernelFamily) -> None:
    add_once(KERNEL_FAMILIES, k.name, k, "attention kernel family")


for _k in (
    KernelFamily(name="fa2", tile_k=128, decode_tile_k=256, decode_splits=4),
    KernelFamily(name="fa3", tile_k=128, decode_tile_k=192, decode_splits=4),
    KernelFamily(name="flashinfer", tile_k=64, decode_tile_k=64, decode_splits=4),
    KernelFamily(name="trtllm", tile_k=128, decode_tile_k=128, decode_splits=4),
):
    _register_family(_k)


def quantize_kv(x: torch.Tensor, kv_scale: float = 1.0) -> torch.Tensor:
    """Store-and-load through an FP8 E4M3 KV cache with a per-tensor scale: [...] → [...] x.dtype."""
    y = (x.float() / kv_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (y.float() * kv_scale).to(x.dtype)


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor,
             scale: float, family: KernelFamily, tile_k: int, v_dtype: torch.dtype):
    """Online softmax over key tiles. q: [B, H, M, D] FP32, k/v: [B, H, Tk, D] FP32 (v holding
    values of `v_dtype`), blocked: [B, 1|H, M, Tk] bool, True where a query may not see a key
    → (m [B,H,M], l [B,H,M], o [B,H,M,D]) unnormalized, FP32. The first tile starts from the
    empty state, whose rescaling only multiplies zeros: it is skipped (a decode split is usually
    one tile), the bits unchanged (tests/test_engines.py writes the online softmax out in full)."""
    m = l = o = None  # the empty state: m = −inf, l = 0, o = 0
    for k0 in range(0, k.shape[2], tile_k):
        s = torch.matmul(q, k[:, :, k0:k0 + tile_k].transpose(-1, -2)).mul_(scale)  # (B,H,M,tile)
        s.masked_fill_(blocked[..., k0:k0 + tile_k], -math.inf)
        m_new = s.amax(-1) if m is None else torch.maximum(m, s.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
        p = s.sub_(m_safe[..., None]).exp_()  # in place: s is not read again
        if family.p_in_input_dtype:
            pv = p.to(v_dtype).float()  # rounded before P·V, products then exact in FP32
        else:
            pv = p
        pv = torch.matmul(pv, v[:, :, k0:k0 + tile_k])
        if m is None:  # from the empty state the rescaling multiplies zeros: l = 0·0 + Σp,
            l = p.sum(-1)  # o = 0·0 + P·V (the + 0 turns a −0 into +0, as that sum does)
            o = pv.add_(0.0)
        else:
            alpha = torch.exp(torch.where(torch.isinf(m), torch.full_like(m, -math.inf),
                                          m - m_safe))
            l = l * alpha + p.sum(-1)
            o = o * alpha[..., None] + pv
        m = m_new
    if m is None:  # no keys at all
        b, h, tq, _ = q.shape
        m = torch.full((b, h, tq), -math.inf, dtype=torch.float32, device=q.device)
        l = torch.zeros((b, h, tq), dtype=torch.float32, device=q.device)
        o = torch.zeros((b, h, tq, v.shape[-1]), dtype=torch.float32, device=q.device)
    return m, l, o


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    allowed: torch.Tensor, scale: float, family: KernelFamily) -> torch.Tensor:
    """q: [B, H, Tq, D]; k, v: [B, Hkv, Tk, D] with H a multiple of Hkv (grouped-query
    attention: query head i reads KV head i // (H / Hkv)); allowed: bool mask broadcastable to
    [B, H, Tq, Tk] → output [B, H, Tq, D] in q.dtype.

    The query heads sharing a KV head are computed as extra rows of one matrix product against
    that head's keys (as GQA kernels do), so K and V are never copied per query head; K and V
    are widened to FP32 once per call (not at all when they come in FP32: a KV cache may store
    its values, all of the input dtype, widened once as they are written). The input dtype, the
    one P is rounded to before P·V, is q's."""
    b, h, tq, d = q.shape
    hkv = k.shape[1]
    if h % hkv:
        raise ValueError(f"{h} query heads cannot share {hkv} KV heads")
    g = h // hkv
    decode = tq == 1
    splits = family.decode_splits if decode else 1
    tile = family.decode_tile_k if decode else family.tile_k
    tk = k.shape[2]
    qf = q.float().reshape(b, hkv, g * tq, d)  # heads of one group as rows
    kf, vf = k.float(), v.float()
    if allowed.dim() == 4 and allowed.shape[1] == h and g > 1:
        allowed = allowed.reshape(allowed.shape[0], hkv, g * tq, allowed.shape[-1])
    elif g > 1:  # one mask for every head: repeat it for the group's rows
        allowed = allowed.expand(allowed.shape[0], 1, tq, allowed.shape[-1])
        allowed = allowed.repeat(1, 1, g, 1)
    per = max(tile, math.ceil(tk / splits / tile) * tile)
    blocked = ~allowed
    parts = [_partial(qf, kf[:, :, s0:s0 + per], vf[:, :, s0:s0 + per],
                      blocked[..., s0:s0 + per], scale, family, tile, q.dtype)
             for s0 in range(0, tk, per)]
    if len(parts) == 1:
        m, l, o = parts[0]
    else:  # merge the split-KV partials in FP32, as the flash-decoding combine kernel does
        m = torch.stack([p[0] for p in parts]).amax(0)
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        l = o = None  # from zeros: the first part's l·w (never −0) and o·w + 0
        for pm, pl, po in parts:
            w = torch.exp(torch.where(torch.isinf(pm), torch.full_like(pm, -math.inf), pm - m_safe))
            l = pl * w if l is None else l + pl * w
            o = (po * w[..., None]).add_(0.0) if o is None else o + po * w[..., None]
    out = o / l.clamp_min(_MIN_SOFTMAX_SUM)[..., None]
    return out.reshape(b, h, tq, -1).to(q.dtype)
