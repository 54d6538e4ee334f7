"""Triton kernel of the fake-quant codecs (imported only when Triton runs; fake_quant.py states
the arithmetic and why each step is exact)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_RNE_MAGIC = tl.constexpr(8388608.0)  # 2^23: (v + 2^23) − 2^23 rounds 0 ≤ v < 2^22 half-to-even
_SIGN = tl.constexpr(-2147483648)  # 0x80000000 as int32


@triton.jit
def _pow2(e):
    """Exact FP32 2^e for int32 e in [-149, 127] (subnormals below -126)."""
    normal = ((tl.maximum(e, -126) + 127) << 23).to(tl.float32, bitcast=True)
    sub = (1 << tl.maximum(e + 149, 0)).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, sub)


@triton.jit
def _floor_log2(a):
    """floor(log2 a) for normal a >= 0 from the exponent field; -127 for zero and subnormals."""
    return ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _round_grid(a, EMIN: tl.constexpr, MBITS: tl.constexpr, MAXV: tl.constexpr):
    """Round magnitudes a >= 0 to the grid of a float with EMIN / MBITS, half to even, and
    saturate at MAXV."""
    e = tl.maximum(_floor_log2(a), EMIN)
    v = a * _pow2(MBITS - e)  # exact: a power-of-two scaling into [0, 2^(MBITS+1)]
    r = ((v + _RNE_MAGIC) - _RNE_MAGIC) * _pow2(e - MBITS)
    return tl.minimum(r, MAXV)


@triton.jit
def _with_sign(mag, sign_bits):
    return (mag.to(tl.int32, bitcast=True) | sign_bits).to(tl.float32, bitcast=True)


@triton.jit
def _sign_of(y):
    return y.to(tl.int32, bitcast=True) & _SIGN


@triton.jit
def _fp8_round(y):
    """Clamp to ±448 and round to E4M3, half to even. A NaN stays NaN, as torch's clamp and
    cast keep it (0/0 arises where a row's amax/448 underflows to 0: the reference's NaN)."""
    c = tl.minimum(tl.maximum(y, -448.0), 448.0)
    r = _with_sign(_round_grid(tl.abs(c), -6, 3, 448.0), _sign_of(c))
    return tl.where(y != y, y, r)


@triton.jit
def _fake_quant_kernel(x_ptr, out_ptr, scale_ptr, M, B, MODE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_B)
    ok = (rows < M)[:, None] & (cols < B)[None, :]
    offs = rows[:, None] * B + cols[None, :]
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    s = tl.load(scale_ptr)
    amax = tl.max(tl.abs(x), 1)  # padding is 0: it changes no group's amax
    if MODE == 0:  # fp8-act: x · fl(1/s), clamp ±448, E4M3, · s
        y = x * tl.math.div_rn(1.0, s)
        out = _fp8_round(y) * s
    elif MODE == 1:  # fp8-channel: x / (amax/448) per row
        sc = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)),
                      1.0)
        # div_rn legalizes dtypes but does not broadcast shapes: broadcast explicitly
        sc_b = tl.broadcast_to(sc[:, None], (BLOCK_M, BLOCK_B))
        out = _fp8_round(tl.math.div_rn(x, sc_b)) * sc_b
    elif MODE == 2 or MODE == 3:  # MXFP4: E8M0 scale per 32, E2M1 elements
        if MODE == 2:  # OCP: floor(log2 amax) − emax(E2M1) = − 2
            e = _floor_log2(amax) - 2
        else:  # RCEIL: ceil(log2(amax / 6)) from the bits of amax / 6
            d = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
            bits = d.to(tl.int32, bitcast=True)
            biased = (bits >> 23) & 0xFF
            e = tl.where(biased > 0, biased - 126 - ((bits & 0x7FFFFF) == 0).to(tl.int32),
                         tl.where(bits > 0x400000, -126, -127))
        e = tl.minimum(tl.maximum(e, -127), 127)
        y = x * _pow2(-e)[:, None]
        out = _with_sign(_round_grid(tl.abs(y), 0, 1, 6.0), _sign_of(y)) * _pow2(e)[:, None]
    elif MODE == 4:  # nvfp4-act: SF = E4M3(gs · amax · fl(1/6)), elements x · 1/(SF · 1/gs)
        gs = tl.math.div_rn(1.0, s)
        sf = tl.minimum(gs * (amax * 0.16666666666666666), 448.0)
        sf = _round_grid(sf, -6, 3, 448.0)
        inv_gs = tl.math.div_rn(1.0, gs)
        out_scale = tl.where(sf != 0, tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32),
                                                     sf * inv_gs), 0.0)
        y = x * out_scale[:, None]
        q = _with_sign(_round_grid(tl.abs(y), 0, 1, 6.0), _sign_of(y))
        out = q * sf[:, None] * s
    else:  # nvfp4 weights (modelopt): SF = E4M3(clamp(amax / (6·s2))), |x| / (SF·s2)
        bs = tl.math.div_rn(amax, tl.full(amax.shape, 1.0, tl.float32) * (6.0 * s))
        bs = tl.where(bs == 0, 1.0, bs)
        bs = tl.minimum(tl.maximum(bs, 0.001953125), 448.0)  # [2^-9, 448]
        sf = _round_grid(bs, -6, 3, 448.0)
        per_block = sf * s
        per_block_b = tl.broadcast_to(per_block[:, None], (BLOCK_M, BLOCK_B))
        mag = _round_grid(tl.math.div_rn(tl.abs(x), per_block_b), 0, 1, 6.0)
        neg = tl.where(x < 0, _SIGN, 0)
        out = _with_sign(mag, neg) * per_block[:, None]
    tl.store(out_ptr + offs, out, mask=ok)


def launch(x: torch.Tensor, scale: torch.Tensor, mode: int) -> torch.Tensor:
    """x: [M, B] contiguous FP32 (each row one scale group); scale: [1] FP32 → [M, B] FP32."""
    m, b = x.shape
    out = torch.empty_like(x)
    if x.numel():
        block_b = triton.next_power_of_2(b)
        block_m = max(1, min(64, 4096 // block_b))
        _fake_quant_kernel[(triton.cdiv(m, block_m),)](
            x, out, scale.contiguous(), m, b, MODE=mode, BLOCK_M=block_m, BLOCK_B=block_b,
            enable_fp_fusion=False)
    return out
