"""Block-scaled codecs: encode to the real storage (codes + scales), decode back.

A codec is one row of `CODECS`: an element format (formats.py), a scaling scheme, and the exact
order of operations of the software that produces or consumes that storage. Orders matter: two
encoders that agree on the format but divide by a scale in another precision disagree on a few
percent of elements, and every mismatch figure downstream inherits that. The rows:

FP8 (E4M3 unless named)
  fp8            per-tensor weight scale amax/448, as modelopt exports it: w / scale is computed in
                 the weight's dtype (a 0-dim FP32 scale does not promote a BF16 tensor), then cast.
  fp8-act        per-tensor activation scale, as vLLM's `scaled_fp8_quant` kernel applies it:
                 float32(x) · float32(1 / scale), clamp ±448, cast.
  fp8-channel    one scale per row (weights: output channel; activations: token), FP32 division.
  fp8-block128   128×128 weight blocks (DeepSeek-V3 style), FP32 division.
  fp8-group128   1×128 activation groups along the last dim (DeepSeek-V3 style), FP32 division.
  fp8-e5m2       per-tensor E5M2, FP32 division (overflow becomes inf, as in torch's cast).
MXFP4 (OCP Microscaling v1.0: 32 E2M1 elements share one E8M0 power-of-two scale)
  mxfp4          the OCP rule: scale exponent = floor(log2 amax) − 2 (emax of E2M1), elements RNE,
                 saturating at ±6 (torchao ScaleCalculationMode.FLOOR).
  mxfp4-rceil    scale = amax/6 rounded up to a power of two — the `cvt.rp.satfinite.ue8m0x2.f32`
                 rule of NVIDIA's kernels (cuBLAS "D block quantization"; torchao RCEIL). Exact here:
                 the exponent comes from the float's bits, never from a rounded log2. (A block
                 with amax near FP32's max decodes to inf: 4 · 2^126 is not an FP32 number.)
  mxfp4-modelopt what modelopt 0.47's MXFP4 export writes (modelopt/torch/quantization/qtensor/
                 mxfp4_tensor.py): exponent = ceil(float32 log2(amax/6)), elements rounded with
                 ties toward zero (0.75→0.5, 1.75→1.5, 3.5→3), and zero stored as 0x8 (−0).
NVFP4 (16 E2M1 elements share one E4M3 scale; one FP32 scale per tensor)
  nvfp4          weights in modelopt's order (NUMERICS.md §1.1; nvfp4_tensor.py):
                 s2 = amax/(6·448); s = amax_block/(6·s2), 0→1, clamp [2⁻⁹, 448], to E4M3;
                 q = E2M1(x / (float(s)·s2)), RNE; sign bit only for x < 0.
  w4a16-nvfp4    the same weight storage (W4A16: activations stay BF16; Marlin on Hopper/Ampere).
  nvfp4-act      activations in the serving kernels' order (vLLM csrc/quantization/fp4/
                 nvfp4_quant_kernels.cu, `cvt_warp_fp16_to_fp4`): gs = 1/input_scale;
                 SF = E4M3(gs · (amax_block · (1/6))); q = E2M1(x · 1/(float(SF) · (1/gs))), RNE.
                 The GEMM multiplies back by input_scale, so decode = q · SF · input_scale.
Casts
  bf16, fp16     plain dtype casts (round to nearest even); storage is the cast tensor.

Decoding always returns exact float32 products (code value · scale, then · global scale, in that
order, as modelopt's dequantizers do) and casts to the requested dtype once at the end.

Non-finite input is refused (`QuantizeError` naming the count and first position): an E2M1 or
E8M0-scaled block has no way to carry inf, and a NaN in a checkpoint is corruption, not data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

from .errors import QuantizeError
from .formats import (
    E2M1,
    E2M1_MAX,
    E4M3,
    E4M3_MAX,
    E5M2,
    E8M0_BIAS,
    FloatFormat,
    SignRule,
    decode_codes,
    decode_packed,
    e8m0_decode,
    e8m0_from_exponent,
    encode_codes,
    sign_mask,
    threshold_codes,
)

__all__ = ["CodecSpec", "QTensor", "CODECS", "get_codec", "encode", "decode", "fake_quant",
           "pack_nibbles", "unpack_nibbles", "QuantizeError"]

Scheme = Literal["cast", "fp8", "mx", "nvfp4"]
Granularity = Literal["tensor", "channel", "block", "group"]
ScaleApply = Literal["divide_in_input_dtype", "divide_f32", "multiply_reciprocal_f32"]
MXScaleRule = Literal["floor", "rceil", "modelopt"]
NVFP4Order = Literal["modelopt_weight", "kernel_activation"]

NVFP4_SCALE_MIN = 2.0**-9  # modelopt clamps block scales here: the smallest E4M3 subnormal
_NVFP4_GLOBAL = E2M1_MAX * E4M3_MAX  # 2688: the global scale maps the tensor amax to 6·448


@dataclass(frozen=True, kw_only=True)
class CodecSpec:
    """One codec: element format, scaling scheme, and order of operations."""

    name: str
    """Codec name used on the command line and in checkpoints' metadata."""
    scheme: Scheme
    """Which encoder family implements it."""
    description: str
    """One line for `mismatch formats`."""
    element: FloatFormat | None = None
    """Element format of the codes (None for plain casts)."""
    cast_dtype: torch.dtype | None = None
    """Storage dtype of a plain cast codec."""
    block: int = 0
    """Elements along the last dim that share one scale (0: no blocking along K)."""
    block_rows: int = 1
    """Rows that share one scale (128 for 128×128 weight blocks)."""
    granularity: Granularity = "tensor"
    """FP8: what one scale covers."""
    scale_apply: ScaleApply = "divide_f32"
    """FP8: how the scale is applied before the cast."""
    mx_scale_rule: MXScaleRule = "floor"
    """MX: how the shared E8M0 exponent is chosen."""
    ties: Literal["even", "toward_zero"] = "even"
    """Element rounding of ties."""
    sign_rule: SignRule = "ieee"
    """When an element code gets its sign bit: signbit(x) (ieee), x < 0, or x <= 0."""
    nvfp4_order: NVFP4Order = "modelopt_weight"
    """NVFP4: modelopt's weight order or the serving kernel's activation order."""

    def __post_init__(self) -> None:
        if self.scheme == "cast" and self.cast_dtype is None:
            raise ValueError(f"codec {self.name}: a cast codec needs cast_dtype")
        if self.scheme != "cast" and self.element is None:
            raise ValueError(f"codec {self.name}: scheme {self.scheme} needs an element format")
        if self.scheme in ("mx", "nvfp4") and self.block <= 0:
            raise ValueError(f"codec {self.name}: scheme {self.scheme} needs a block size")
        if self.block < 0 or self.block_rows < 1:
            raise ValueError(f"codec {self.name}: bad block {self.block_rows}x{self.block}")


@dataclass(frozen=True)
class QTensor:
    """A tensor in a codec's real storage.

    codes: uint8. FP4 codecs pack two codes per byte, the even element in the low nibble:
        [..., K/2]. FP8 codecs hold one byte per element: [..., K]. Cast codecs hold the cast
        tensor itself (bf16/fp16) [..., K].
    scales: per-block scales, or None. FP8: float32 with one entry per tensor / row / block /
        group. MXFP4: uint8 E8M0 [..., K/32]. NVFP4: float8_e4m3fn [..., K/16].
    global_scale: NVFP4's float32 per-tensor scale (0-dim, or [E, 1, 1] for stacked experts);
        None otherwise.
    """

    codec: str
    shape: tuple[int, ...]
    codes: torch.Tensor
    scales: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None

    def nbytes(self) -> int:
        """Bytes of the storage (codes + scales + global scale)."""
        total = self.codes.numel() * self.codes.element_size()
        for t in (self.scales, self.global_scale):
            if t is not None:
                total += t.numel() * t.element_size()
        return total


# ---------------------------------------------------------------------------------------------
# Helpers


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 codes < 16 → [..., K/2] uint8, even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 → [..., K] uint8 codes (inverse of pack_nibbles)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def _check_input(x: torch.Tensor, spec: CodecSpec, validate: bool) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise QuantizeError(f"codec {spec.name}: needs a floating-point tensor, got {got}")
    if x.ndim == 0:
        raise QuantizeError(f"codec {spec.name}: needs at least one dimension, got a scalar")
    if spec.block and x.shape[-1] % spec.block:
        raise QuantizeError(
            f"codec {spec.name}: last dimension of shape {tuple(x.shape)} is not divisible by the "
            f"block size {spec.block}; pad it or exclude this tensor from quantization")
    if spec.block_rows > 1 and (x.ndim < 2 or x.shape[-2] % spec.block_rows):
        raise QuantizeError(
            f"codec {spec.name}: shape {tuple(x.shape)} does not tile into "
            f"{spec.block_rows}x{spec.block} blocks; both of the last two dimensions must divide")
    if validate:
        bad = ~torch.isfinite(x)
        n_bad = int(bad.sum())
        if n_bad:
            first = tuple(int(i) for i in bad.nonzero()[0])
            raise QuantizeError(
                f"codec {spec.name}: input has {n_bad} non-finite value(s) (first at index "
                f"{first}); fix or drop them before quantizing — NaN/inf cannot be encoded")


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
        scale = torch.where(amax > 0, amax / fmt.max_finite, torch.ones_like(amax))
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
        descale = amax / E2M1_MAX
        m, e = torch.frexp(descale)  # ceil(log2 descale) = e − 1 when descale is a power of 2
        exp = e.to(torch.int32) - (m == 0.5).to(torch.int32)
    else:  # modelopt 0.47: ceil(float32 log2(amax / 6)), floored at −127
        descale = amax / E2M1_MAX
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


def _nvfp4_global(x: torch.Tensor) -> torch.Tensor:
    """modelopt's per-tensor scale: amax (in x's dtype, exact) / (6 · 448) in float32.

    An all-zero tensor would get 0 and then 0/0 block scales (modelopt 0.47 writes NaN scales and
    code 7 there); we store 1.0 instead, so all-zero tensors round-trip to zeros.
    """
    s2 = x.abs().amax().float() / _NVFP4_GLOBAL
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
    g = _nvfp4_global(x) if global_scale is None else global_scale.float()
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

Encoder = Callable[[torch.Tensor, CodecSpec, "torch.Tensor | None"], QTensor]
Decoder = Callable[[QTensor, CodecSpec], torch.Tensor]
_SCHEMES: dict[str, tuple[Encoder, Decoder]] = {
    "cast": (_encode_cast, _decode_cast),
    "fp8": (_encode_fp8, _decode_fp8),
    "mx": (_encode_mx, _decode_mx),
    "nvfp4": (_encode_nvfp4, _decode_nvfp4),
}

CODECS: dict[str, CodecSpec] = {}


def register(spec: CodecSpec) -> CodecSpec:
    """Add a codec to the table; a name may be registered once."""
    if spec.name in CODECS:
        raise ValueError(f"codec {spec.name!r} registered twice")
    CODECS[spec.name] = spec
    return spec


for _spec in (
    CodecSpec(name="bf16", scheme="cast", cast_dtype=torch.bfloat16,
              description="BF16 cast (round to nearest even)"),
    CodecSpec(name="fp16", scheme="cast", cast_dtype=torch.float16,
              description="FP16 cast (round to nearest even, overflow to inf)"),
    CodecSpec(name="fp8", scheme="fp8", element=E4M3, granularity="tensor",
              scale_apply="divide_in_input_dtype",
              description="FP8 E4M3 per-tensor weights, modelopt export order"),
    CodecSpec(name="fp8-act", scheme="fp8", element=E4M3, granularity="tensor",
              scale_apply="multiply_reciprocal_f32",
              description="FP8 E4M3 per-tensor activations, serving-kernel order"),
    CodecSpec(name="fp8-channel", scheme="fp8", element=E4M3, granularity="channel",
              description="FP8 E4M3, one scale per row (channel / token)"),
    CodecSpec(name="fp8-block128", scheme="fp8", element=E4M3, granularity="block",
              block=128, block_rows=128, description="FP8 E4M3, 128x128 weight blocks"),
    CodecSpec(name="fp8-group128", scheme="fp8", element=E4M3, granularity="group",
              block=128, description="FP8 E4M3, 1x128 activation groups"),
    CodecSpec(name="fp8-e5m2", scheme="fp8", element=E5M2, granularity="tensor",
              description="FP8 E5M2 per-tensor"),
    CodecSpec(name="mxfp4", scheme="mx", element=E2M1, block=32, mx_scale_rule="floor",
              description="MXFP4, OCP rule (floor exponent), E8M0 scale per 32"),
    CodecSpec(name="mxfp4-rceil", scheme="mx", element=E2M1, block=32, mx_scale_rule="rceil",
              description="MXFP4, RCEIL scale (NVIDIA kernels), E8M0 scale per 32"),
    CodecSpec(name="mxfp4-modelopt", scheme="mx", element=E2M1, block=32,
              mx_scale_rule="modelopt", ties="toward_zero", sign_rule="nonpositive",
              description="MXFP4 exactly as modelopt 0.47 exports it"),
    CodecSpec(name="nvfp4", scheme="nvfp4", element=E2M1, block=16, sign_rule="negative",
              description="NVFP4 weights, modelopt order (E4M3 per 16 + FP32 global)"),
    CodecSpec(name="w4a16-nvfp4", scheme="nvfp4", element=E2M1, block=16, sign_rule="negative",
              description="NVFP4 weight storage for W4A16 (activations stay BF16)"),
    CodecSpec(name="nvfp4-act", scheme="nvfp4", element=E2M1, block=16,
              nvfp4_order="kernel_activation",
              description="NVFP4 activations, serving-kernel order (dynamic per-16 scales)"),
):
    register(_spec)


def get_codec(name: str | CodecSpec) -> CodecSpec:
    if isinstance(name, CodecSpec):
        return name
    try:
        return CODECS[name]
    except KeyError:
        raise QuantizeError(f"unknown format {name!r}; valid formats: {', '.join(CODECS)}") from None


def encode(x: torch.Tensor, codec: str | CodecSpec, *, global_scale: torch.Tensor | None = None,
           validate: bool = True) -> QTensor:
    """Encode x: [..., K] float into the codec's storage.

    global_scale: FP8 — use this scale (static, e.g. a calibrated input_scale) instead of amax;
        NVFP4 — the FP32 per-tensor scale (weight_scale_2 for weights, input_scale for
        activations), 0-dim, or [E, 1, 1] for stacked experts [E, N, K]; default: computed
        from x as modelopt does (amax / (6·448)).
    validate: check for non-finite input (one reduction); disable only where input is known good.
    """
    spec = get_codec(codec)
    _check_input(x, spec, validate)
    if global_scale is not None and validate and not bool((global_scale > 0).all()
                                                          & torch.isfinite(global_scale).all()):
        raise QuantizeError(f"codec {spec.name}: global_scale must be positive and finite, "
                            f"got {global_scale.flatten()[:4].tolist()}")
    return _SCHEMES[spec.scheme][0](x, spec, global_scale)


def decode(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode storage to values [...shape] in `dtype` (exact float32 first, one final cast)."""
    spec = get_codec(q.codec)
    return _SCHEMES[spec.scheme][1](q, spec).to(dtype)


def fake_quant(x: torch.Tensor, codec: str | CodecSpec, *,
               global_scale: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """decode(encode(x)) in x's dtype: the values a kernel using this codec would compute with.

    Activation codecs on the emulators' hot path have a direct value-level twin (no codes, no
    packing) that tests hold bit-identical to decode∘encode.
    """
    spec = get_codec(codec)
    direct = _FAKE.get(spec.name)
    if direct is not None and global_scale is not None:
        _check_input(x, spec, validate)
        return direct(x, global_scale.float()).to(x.dtype)
    return decode(encode(x, spec, global_scale=global_scale, validate=validate), x.dtype)


def _fake_fp8_act(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    y = (x.float() * (1.0 / scale)).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn).float() * scale


_E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _fake_nvfp4_act(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    xb = _blocks(x, 16).float()
    gs = 1.0 / input_scale
    sf = (gs * (xb.abs().amax(dim=-1) * (1.0 / E2M1_MAX))).clamp(max=E4M3_MAX)
    sf = sf.to(torch.float8_e4m3fn).float()
    out_scale = torch.where(sf != 0, 1.0 / (sf * (1.0 / gs)), torch.zeros_like(sf))
    scaled = xb * out_scale.unsqueeze(-1)
    idx = threshold_codes(scaled.abs(), E2M1).long()
    values = torch.copysign(_E2M1_MAGNITUDES.to(x.device)[idx], scaled)
    return (values * sf.unsqueeze(-1) * input_scale).reshape(x.shape)


_FAKE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "fp8-act": _fake_fp8_act,
    "nvfp4-act": _fake_nvfp4_act,
}
