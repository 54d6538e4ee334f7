"""Triton kernel of the accumulation-model GEMM (imported only when Triton runs; gemm.py states
the model, quantize/accumulate.py is the reference it follows step for step)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mismatch.quantize.accumulate import Accumulation


@triton.jit
def _acc_gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn,
                     KEEP_MASK: tl.constexpr, TRUNCATE: tl.constexpr,
                     PROMOTE_SLICES: tl.constexpr, MMA_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, MMA_K)
    partial = tl.zeros((BLOCK_M, BLOCK_N), tl.float64)  # the limited-precision accumulator
    total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for i in range(0, tl.cdiv(K, MMA_K)):
        ks = i * MMA_K + rk
        a = tl.load(a_ptr + rm[:, None] * sam + ks[None, :] * sak,
                    mask=(rm < M)[:, None] & (ks < K)[None, :], other=0.0).to(tl.float64)
        b = tl.load(b_ptr + ks[:, None] * sbk + rn[None, :] * sbn,
                    mask=(ks < K)[:, None] & (rn < N)[None, :], other=0.0).to(tl.float64)
        partial = partial + tl.dot(a, b)  # one slice, exact in float64 for FP8 inputs
        if TRUNCATE:  # round toward zero to the accumulator's mantissa bits
            partial = (partial.to(tl.int64, bitcast=True) & KEEP_MASK).to(tl.float64,
                                                                          bitcast=True)
        else:  # an FP32 register
            partial = partial.to(tl.float32).to(tl.float64)
        if PROMOTE_SLICES > 0:
            if (i + 1) % PROMOTE_SLICES == 0:
                total = total + partial.to(tl.float32)
                partial = tl.zeros((BLOCK_M, BLOCK_N), tl.float64)
    out = total + partial.to(tl.float32)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], out, mask=(rm < M)[:, None] & (rn < N)[None, :])


def launch(a: torch.Tensor, b: torch.Tensor, acc: Accumulation, block_m: int,
           block_n: int) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[1]
    a32, b32 = a.float(), b.float()  # exact widening of FP8/BF16/FP16 grid values
    c = torch.empty(m, n, dtype=torch.float32, device=a.device)
    if m and n:
        truncate = acc.acc_mbits is not None
        keep = ~((1 << (52 - acc.acc_mbits)) - 1) if truncate else 0
        # promotion after whole slices; a last, partial slice needs no promotion check: the
        # final total + partial adds the same value either way
        promote = 0 if acc.promote_every is None else acc.promote_every // acc.mma_k
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _acc_gemm_kernel[grid](a32, b32, c, m, n, k, a32.stride(0), a32.stride(1),
                               b32.stride(0), b32.stride(1), KEEP_MASK=keep, TRUNCATE=truncate,
                               PROMOTE_SLICES=promote, MMA_K=acc.mma_k, BLOCK_M=block_m,
                               BLOCK_N=block_n, enable_fp_fusion=False)
    return c
