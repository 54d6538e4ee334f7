"""Triton kernel of the fused scorer head (imported only when Triton runs; see scorer_head.py
for the numerics, which this kernel follows step for step).

One program per BLOCK_N rows. It walks the vocabulary in BLOCK_V tiles; each tile's logits come
from the logits tensor (loaded and widened to FP32) or from a tl.dot of the hidden rows with the
tile's weight rows over H in BLOCK_H slices (FP32 accumulator, `input_precision="ieee"` so FP32
inputs do not go through TF32 on tensor cores; Triton docs, `triton.language.dot`), rounded once
to the input dtype as an lm_head GEMM writes it. Label and candidate logits are picked out of the
tile they fall in, so they are the very values the log-sum-exp saw.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .head_output import TAYLOR_SERIES_BELOW, HeadOutput

SERIES_BELOW = tl.constexpr(TAYLOR_SERIES_BELOW)


@triton.jit
def _q_delta(d):
    series = d * d * (0.5 - d * (1.0 / 6 - d * (1.0 / 24 - d * (1.0 / 120 - d * (
        1.0 / 720 - d * (1.0 / 5040))))))
    return tl.where(tl.abs(d) < SERIES_BELOW, series, tl.exp(-d) - 1.0 + d)



@triton.jit
def _g_log1p(c):
    # c − log1p(c); above the series range log1p(c) = log(u)·c/(u − 1) with u = 1 + c, accurate
    # to a few ulps without a library call (Goldberg, "What every computer scientist should know
    # about floating-point arithmetic", Theorem 4)
    series = c * c * (0.5 - c * (1.0 / 3 - c * (0.25 - c * (0.2 - c * (1.0 / 6 - c * (
        1.0 / 7))))))
    u = 1.0 + c
    log1p = tl.where(u == 1.0, c, tl.log(u) * c / (u - 1.0))
    return tl.where(tl.abs(c) < SERIES_BELOW, series, c - log1p)


@triton.jit
def _head_kernel(lab_ptr, h_ptr, w_ptr, x_ptr, cid_ptr, slp_ptr,
                 lp_ptr, ent_ptr, top_ptr, cand_ptr, kl_ptr,
                 N, V, H, K, stride_h, stride_w, stride_x, stride_c,
                 FROM_LOGITS: tl.constexpr, HAS_CAND: tl.constexpr, HAS_KL: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    lab = tl.load(lab_ptr + rows, mask=row_ok, other=0)
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    if HAS_CAND:
        cid = tl.load(cid_ptr + rows[:, None] * stride_c + ks[None, :],
                      mask=row_ok[:, None] & k_ok[None, :], other=-1)
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    t = tl.zeros((BLOCK_N,), tl.float32)
    best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    best_i = tl.zeros((BLOCK_N,), tl.int64)
    lab_l = tl.zeros((BLOCK_N,), tl.float32)
    cand_l = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        if FROM_LOGITS:
            tile = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :],
                           mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
            for h0 in range(0, H, BLOCK_H):
                hs = h0 + tl.arange(0, BLOCK_H)
                h_ok = hs < H
                a = tl.load(h_ptr + rows[:, None] * stride_h + hs[None, :],
                            mask=row_ok[:, None] & h_ok[None, :], other=0.0)
                b = tl.load(w_ptr + cols[None, :] * stride_w + hs[:, None],
                            mask=col_ok[None, :] & h_ok[:, None], other=0.0)
                acc = tl.dot(a, b, acc, input_precision="ieee")
            # rounded once to the input dtype, as the lm_head GEMM writes its output
            tile = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
        tile = tl.where(col_ok[None, :], tile, float("-inf"))
        tm = tl.max(tile, 1)
        ti = tl.argmax(tile, 1, tie_break_left=True).to(tl.int64)
        new_m = tl.maximum(m, tm)
        alpha = tl.exp(m - new_m)
        # padding columns are -inf: centre them at 0 so that no 0·inf is ever formed
        centered = tl.where(col_ok[None, :], tile - new_m[:, None], 0.0)
        p = tl.where(col_ok[None, :], tl.exp(centered), 0.0)
        corr = (tl.where(s > 0, m, new_m) - new_m) * s  # m is -inf until the first tile
        t = alpha * (t + corr) + tl.sum(p * centered, 1)
        s = alpha * s + tl.sum(p, 1)
        m = new_m
        better = tm > best
        best_i = tl.where(better, ti + v0, best_i)
        best = tl.where(better, tm, best)
        hit = cols[None, :] == lab[:, None]
        lab_l += tl.sum(tl.where(hit, tile, 0.0), 1)
        if HAS_CAND:  # one [BLOCK_N, BLOCK_V] pick per candidate slot (unrolled): no 3-D tile
            for j in tl.static_range(BLOCK_K):
                cid_j = tl.sum(tl.where(ks[None, :] == j, cid, 0), 1)
                val = tl.sum(tl.where(cols[None, :] == cid_j[:, None], tile, 0.0), 1)
                cand_l += tl.where(ks[None, :] == j, val[:, None], 0.0)
    log_s = tl.log(s)
    lse = m + log_s
    tl.store(lp_ptr + rows, lab_l - lse, mask=row_ok)
    tl.store(ent_ptr + rows, log_s - t / s, mask=row_ok)
    tl.store(top_ptr + rows, best_i, mask=row_ok)
    if HAS_CAND:
        cand_lp = cand_l - lse[:, None]
        both = row_ok[:, None] & k_ok[None, :]
        tl.store(cand_ptr + rows[:, None] * stride_c + ks[None, :], cand_lp, mask=both)
        if HAS_KL:
            slp = tl.load(slp_ptr + rows[:, None] * stride_c + ks[None, :], mask=both,
                          other=0.0).to(tl.float32)
            slp_m = tl.where(k_ok[None, :], slp, float("-inf"))
            e = tl.exp(slp_m - tl.max(slp_m, 1)[:, None])
            mu = e / tl.sum(e, 1)[:, None]
            delta = tl.where(k_ok[None, :], slp - cand_lp, 0.0)
            delta = tl.where(k_ok[None, :], delta - tl.sum(mu * delta, 1)[:, None], 0.0)
            a = tl.sum(mu * delta, 1)
            b = tl.sum(mu * _q_delta(delta), 1)
            tl.store(kl_ptr + rows, tl.maximum(b - _g_log1p(b - a), 0.0), mask=row_ok)


def launch(labels, hidden, weight, logits, candidate_ids, sampler_lp, block_rows, block_vocab,
           block_hidden) -> HeadOutput:
    """Allocate outputs and run the kernel; inputs were checked by the caller."""
    device = labels.device
    from_logits = logits is not None
    n = labels.shape[0]
    v = logits.shape[1] if from_logits else weight.shape[0]
    h = 0 if from_logits else hidden.shape[1]
    k = 0 if candidate_ids is None else candidate_ids.shape[1]
    lab = labels.contiguous()
    x = logits.contiguous() if from_logits else lab
    hid = lab if from_logits else hidden.contiguous()
    w = lab if from_logits else weight.contiguous()
    cid = candidate_ids.long().contiguous() if k else lab
    slp = sampler_lp.float().contiguous() if sampler_lp is not None else lab
    lp = torch.empty(n, dtype=torch.float32, device=device)
    ent = torch.empty(n, dtype=torch.float32, device=device)
    top = torch.empty(n, dtype=torch.int64, device=device)
    cand = torch.empty(n, k, dtype=torch.float32, device=device)
    kl = torch.empty(n, dtype=torch.float32, device=device)
    if n:
        grid = (triton.cdiv(n, block_rows),)
        _head_kernel[grid](lab, hid, w, x, cid, slp, lp, ent, top, cand, kl, n, v, h, k,
                           hid.stride(0) if not from_logits else 0,
                           w.stride(0) if not from_logits else 0,
                           x.stride(0) if from_logits else 0, max(k, 1),
                           FROM_LOGITS=from_logits, HAS_CAND=k > 0,
                           HAS_KL=sampler_lp is not None, BLOCK_N=block_rows,
                           BLOCK_V=block_vocab, BLOCK_H=max(block_hidden, 16),
                           BLOCK_K=max(triton.next_power_of_2(k), 2),
                           enable_fp_fusion=True)  # tolerance kernel: FMAs are welcome
    return HeadOutput(logprobs=lp, entropy=ent, top1=top,
                      candidate_logprobs=cand if k else None,
                      kl_candidates=kl if sampler_lp is not None else None)
