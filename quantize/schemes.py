"""The arithmetic of the four scaling schemes: each encodes [..., K] values into a QTensor and
decodes one back to exact float32 values, in the order of operations a CodecSpec names.

- cast    a plain dtype cast (BF16, FP16).
- fp8     E4M3/E5M2 elements with FP32 scales per tensor, row, 128×128 block or 1×128 group.
- mx      E2M1 elements in blocks of 32 with a shared E8M0 power-of-two scale.
- nvfp4   E2M1 elements in blocks of 16 with an E4M3 scale each and one FP32 scale per tensor.

Each scheme's pair is a row of `SCHEMES`; codecs.py dispatches to it. The activation codecs on
the emulators' hot path also have a value-level twin (`FAKE_QUANT`: no codes, no packing), which
tests hold bit-identical to decode∘encode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from .formats import (
    E2M1,
    E2M1_MAX,
    E4M3_MAX,
    E8M0_BIAS,
    decode_codes,
    decode_packed,
    div_scalar,
    e2m1_round_,
    e8m0_decode,
    e8m0_from_exponent,
    encode_codes,
    sign_mask,
    threshold_codes,
)
from .codec_table import NVFP4_GLOBAL_DIVISOR
from .qtensor import QTensor, pack_nibbles

if TYPE_CHECKING:
    from .codec_table import CodecSpec, MXScaleRule

__all__ = ["SCHEMES", "FAKE_QUANT", "NVFP4_SCALE_MIN", "NVFP4_GLOBAL_DIVISOR",
           "nvfp4_global_scale"]

NVFP4_SCALE_MIN = 2.0**-9  # modelopt clamps block scales here: the smallest E4M3 subnormal


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., K] → [..., K/block, block]."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _element_codes(v: torch.Tensor, spec: CodecSpec) -> torch.Tensor:
    """Codes of already-scaled values v (finite: the input was validated) with the codec's
    tie and sign rules."""
    assert spec.element is not None
    return encode_codes(v, spec.element, ties=spec.ties, sign=spec.sign_rule, check_nan=False)


# ---------------------------------------------------------------------------------------------
# Cast codecs


def _encode_cast(x: torch.Tensor, spec: CodecSpec, global_scale: torch.Tensor | None) -> QTensor:
    return QTensor(spec.name, tuple(x.shape), x.to(spec.cast_dtype))


def _decode_cast(q: QTensor, spec: CodecSpec) -> torch.Tensor:
    return q.codes.float()


# ---------------------------------------------------------------------------------------------
# FP8


def _fp8_amax(x: torch.Tensor, spec: CodecSpec) -> torch.Tensor:
    """Amax per scale region, shaped to broadcast against x (float32)."""
    ax = x.abs().float()
    if spec.granularity == "tensor":
        return ax.amax()
    if spec.granularity == "channel":
        return ax.amax(dim=-1, keepdim=True)
    if spec.granularity == "group":
        return _blocks(ax, spec.block).amax(dim=-1)
    r, c = spec.block_rows, spec.block  # 2-D blocks over the last two dims
    tiles = ax.reshape(*ax.shape[:-2], ax.shape[-2] // r, r, ax.shape[-1] // c, c)
    return tiles.amax(dim=(-3, -1))


def _fp8_expand(scale: torch.Tensor, x_shape: torch.Size, spec: CodecSpec) -> torch.Tensor:
    """Broadcast per-region scales to the element shape."""
    if spec.granularity in ("tensor", "channel"):
        return scale
    if spec.granularity == "group":
        return scale.repeat_interleave(spec.block, dim=-1)
    return scale.repeat_interleave(spec.block_rows, dim=-2).repeat_interleave(spec.block, dim=-1)


def _encode_fp8(x: torch.Tensor, spec: CodecSpec, global_scale: torch.Tensor | None) -> QTensor:
    fmt = spec.element
    assert fmt is not None and fmt.torch_dtype is not None
    if global_scale is not None:
        scale = global_scale.float()
    else:
        amax = _fp8_amax(x, spec)
        # An all-zero region has no scale to speak of; 1.0 keeps the division finite.
        scale = torch.where(amax > 0, div_scalar(amax, fmt.max_finite), torch.ones_like(amax))
    full = _fp8_expand(scale, x.shape, spec)
    if spec.scale_apply == "divide_in_input_dtype":
        y = x / full  # modelopt: a 0-dim FP32 scale keeps a BF16 weight in BF16
    elif spec.scale_apply == "multiply_reciprocal_f32":
        y = x.float() * (1.0 / full)
    else:
        y = x.float() / full
    if fmt.overflow == "saturate":
        y = torch.clamp(y, -fmt.max_finite, fmt.max_finite)
    codes = y.to(fmt.torch_dtype).view(torch.uint8)
    return QTensor(spec.name, tuple(x.shape), codes, scales=scale)


def _decode_fp8(q: QTensor, spec: CodecSpec) -> torch.Tensor:
    assert spec.element is not None and q.scales is not None
    values = decode_codes(q.codes, spec.element)
    return values * _fp8_expand(q.scales, values.shape, spec)


# ---------------------------------------------------------------------------------------------
# MXFP4


def _mx_exponent(amax: torch.Tensor, rule: MXScaleRule) -> torch.Tensor:
    """Unbiased E8M0 exponent per block from the block amax (float32) [..., nb] → int32."""
    emax = 2  # E2M1's largest exponent: 6 = 1.5 · 2^2
    zero = amax == 0
    if rule == "floor":
        _, e = torch.frexp(amax)  # amax = m · 2^e, m in [0.5, 1): floor(log2 amax) = e − 1
        exp = e.to(torch.int32) - 1 - emax
    elif rule == "rceil":
        descale = div_scalar(amax, E2M1_MAX)
        m, e = torch.frexp(descale)  # ceil(log2 descale) = e − 1 when descale is a power of 2
        exp = e.to(torch.int32) - (m == 0.5).to(torch.int32)
    else:  # modelopt 0.47: ceil(float32 log2(amax / 6)), floored at −127
        descale = div_scalar(amax, E2M1_MAX)
        exp = torch.ceil(torch.clamp(torch.log2(descale), min=-float(E8M0_BIAS))).to(torch.int32)
    exp = torch.where(zero, torch.full_like(exp, -E8M0_BIAS), exp)
    return torch.clamp(exp, -E8M0_BIAS, E8M0_BIAS)


def _encode_mx(x: torch.Tensor, spec: CodecSpec, global_scale: torch.Tensor | None) -> QTensor:
    xb = _blocks(x, spec.block)  # (..., nb, 32)
    amax = xb.abs().amax(dim=-1).float()  # (..., nb)
    scale_codes = e8m0_from_exponent(_mx_exponent(amax, spec.mx_scale_rule))
    scaled = xb.float() / e8m0_decode(scale_codes).unsqueeze(-1)
    codes = _element_codes(scaled, spec).reshape(x.shape)
    return QTensor(spec.name, tuple(x.shape), pack_nibbles(codes), scales=scale_codes)


def _decode_mx(q: QTensor, spec: CodecSpec) -> torch.Tensor:
    assert spec.element is not None and q.scales is not None
    values = _blocks(decode_packed(q.codes, spec.element), spec.block)
    return (values * e8m0_decode(q.scales).unsqueeze(-1)).reshape(q.shape)


# ---------------------------------------------------------------------------------------------
# NVFP4


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """modelopt's per-tensor scale: amax (in x's dtype, exact) / (6 · 448) in float32.

    An all-zero tensor would get 0 and then 0/0 block scales (modelopt 0.47 writes NaN scales and
    code 7 there); we store 1.0 instead, so all-zero tensors round-trip to zeros.
    """
    s2 = div_scalar(x.abs().amax().float(), NVFP4_GLOBAL_DIVISOR)
    return torch.where(s2 > 0, s2, torch.ones_like(s2))


def _encode_nvfp4_weight(x: torch.Tensor, spec: CodecSpec, s2: torch.Tensor) -> QTensor:
    xb = _blocks(x, spec.block)  # (..., nb, 16)
    low, high = torch.aminmax(xb, dim=-1)  # one read of x; |x| is never materialized
    amax = torch.maximum(high, -low).float()  # (..., nb), exact
    block_scale = amax / (E2M1_MAX * s2)
    block_scale = torch.where(block_scale == 0, torch.ones_like(block_scale), block_scale)
    sf = block_scale.clamp(NVFP4_SCALE_MIN, E4M3_MAX).to(torch.float8_e4m3fn)
    # |x| / d = |x / d| exactly (division is sign-symmetric): round magnitudes, sign apart.
    magnitude = xb.abs() / (sf.float() * s2).unsqueeze(-1)  # FP32: the product, then the division
    codes = threshold_codes(magnitude, E2M1, spec.ties) | \
        (sign_mask(xb, spec.sign_rule).to(torch.uint8) << 3)
    return QTensor(spec.name, tuple(x.shape), pack_nibbles(codes.reshape(x.shape)), scales=sf,
                   global_scale=s2)


def _encode_nvfp4_activation(x: torch.Tensor, spec: CodecSpec, input_scale: torch.Tensor) -> QTensor:
    xb = _blocks(x, spec.block).float()
    gs = 1.0 / input_scale  # SFScaleVal
    amax = xb.abs().amax(dim=-1)
    sf_value = gs * (amax * (1.0 / E2M1_MAX))
    sf = sf_value.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)  # __nv_fp8_e4m3 saturates
    sf_f = sf.float()
    out_scale = torch.where(sf_f != 0, 1.0 / (sf_f * (1.0 / gs)), torch.zeros_like(sf_f))
    codes = _element_codes(xb * out_scale.unsqueeze(-1), spec).reshape(x.shape)
    return QTensor(spec.name, tuple(x.shape), pack_nibbles(codes), scales=sf,
                   global_scale=input_scale)


def _encode_nvfp4(x: torch.Tensor, spec: CodecSpec, global_scale: torch.Tensor | None) -> QTensor:
    g = nvfp4_global_scale(x) if global_scale is None else global_scale.float()
    if spec.nvfp4_order == "modelopt_weight":
        return _encode_nvfp4_weight(x, spec, g)
    return _encode_nvfp4_activation(x, spec, g)


def _decode_nvfp4(q: QTensor, spec: CodecSpec) -> torch.Tensor:
    assert spec.element is not None and q.scales is not None and q.global_scale is not None
    values = _blocks(decode_packed(q.codes, spec.element), spec.block)
    if spec.nvfp4_order == "modelopt_weight":
        per_block = q.scales.float() * q.global_scale  # modelopt: scale · scale_2, then · value
        return (values * per_block.unsqueeze(-1)).reshape(q.shape)
    per_block = q.scales.float().unsqueeze(-1)
    return (values * per_block * q.global_scale).reshape(q.shape)


# ---------------------------------------------------------------------------------------------
# The table

Encoder = Callable[[torch.Tensor, "CodecSpec", "torch.Tensor | None"], QTensor]
Decoder = Callable[[QTensor, "CodecSpec"], torch.Tensor]
SCHEMES: dict[str, tuple[Encoder, Decoder]] = {
    "cast": (_encode_cast, _decode_cast),
    "fp8": (_encode_fp8, _decode_fp8),
    "mx": (_encode_mx, _decode_mx),
    "nvfp4": (_encode_nvfp4, _decode_nvfp4),
}


# ---------------------------------------------------------------------------------------------
# Value-level twins of the hot-path activation codecs


def _fake_fp8_act(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    y = (x.float() * (1.0 / scale)).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn).float() * scale


def _fake_nvfp4_act(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """The values of `_encode_nvfp4_activation` then `_decode_nvfp4`, in their order of
    operations: SF = E4M3(gs · (amax · fl(1/6))), elements |x| · 1/(SF · 1/gs) rounded to E2M1
    (`e2m1_round_`) with x's sign, then · SF · input_scale. The block amax is a max pool (exact);
    |x| is computed once and worked on in place."""
    xb = _blocks(x, 16).float()
    m = xb.abs()
    gs = 1.0 / input_scale
    amax = F.max_pool1d(m.reshape(1, -1, x.shape[-1]), 16).reshape(m.shape[:-1])
    sf = (gs * (amax * (1.0 / E2M1_MAX))).clamp_(max=E4M3_MAX)
    sf = sf.to(torch.float8_e4m3fn).float()
    out_scale = torch.where(sf != 0, 1.0 / (sf * (1.0 / gs)), 0.0)
    q = e2m1_round_(m.mul_(out_scale.unsqueeze(-1))).copysign_(xb)
    return q.mul_(sf.unsqueeze(-1)).mul_(input_scale).reshape(x.shape)


FAKE_QUANT: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "fp8-act": _fake_fp8_act,
    "nvfp4-act": _fake_nvfp4_act,
}
