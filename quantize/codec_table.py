"""The codec table: what each block-scaled codec stores, and in which order it computes.

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
                 rule of NVIDIA's kernels (cuBLAS "D block quantization"; torchao RCEIL). Exact
                 here: the exponent comes from the float's bits, never from a rounded log2. (A block
                 with amax near FP32's max decodes to inf: 4 · 2^126 is not an FP32 number.)
  mxfp4-modelopt what modelopt 0.47's MXFP4 export writes (modelopt/torch/quantization/qtensor/
                 mxfp4_tensor.py): exponent = ceil(float32 log2(amax/6)), elements rounded with
                 ties toward zero (0.75→0.5, 1.75→1.5, 3.5→3), and zero stored as 0x8 (−0).
NVFP4 (16 E2M1 elements share one E4M3 scale; one FP32 scale per tensor)
  nvfp4          weights in modelopt's order (modelopt 0.47, nvfp4_tensor.py):
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

This module is the table, as data and without torch (the serving precisions, the GPU profiles and
the command line read it without loading torch); codecs.py holds the public entry points (encode,
decode, fake_quant) and re-exports it, each scheme's arithmetic is in schemes.py, the storage
layout (QTensor, nibble packing) in qtensor.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from mismatch.registry import add_once

from .errors import QuantizeError
from .format_table import E2M1, E2M1_MAX, E4M3, E4M3_MAX, E5M2, FloatFormat, SignRule

if TYPE_CHECKING:
    import torch

__all__ = ["CodecSpec", "CODECS", "register", "get_codec", "NVFP4_GLOBAL_DIVISOR"]

NVFP4_GLOBAL_DIVISOR = E2M1_MAX * E4M3_MAX  # 2688: the global scale maps the tensor amax to 6·448

Scheme = Literal["cast", "fp8", "mx", "nvfp4"]
Granularity = Literal["tensor", "channel", "block", "group"]
ScaleApply = Literal["divide_in_input_dtype", "divide_f32", "multiply_reciprocal_f32"]
MXScaleRule = Literal["floor", "rceil", "modelopt"]
NVFP4Order = Literal["modelopt_weight", "kernel_activation"]


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
    cast_dtype_name: str | None = None
    """Name of the torch dtype a plain cast codec stores (`cast_dtype`)."""
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
        if self.scheme == "cast" and self.cast_dtype_name is None:
            raise ValueError(f"codec {self.name}: a cast codec needs cast_dtype_name")
        if self.scheme != "cast" and self.element is None:
            raise ValueError(f"codec {self.name}: scheme {self.scheme} needs an element format")
        if self.scheme in ("mx", "nvfp4") and self.block <= 0:
            raise ValueError(f"codec {self.name}: scheme {self.scheme} needs a block size")
        if self.block < 0 or self.block_rows < 1:
            raise ValueError(f"codec {self.name}: bad block {self.block_rows}x{self.block}")

    @property
    def cast_dtype(self) -> torch.dtype | None:
        """Storage dtype of a plain cast codec."""
        if self.cast_dtype_name is None:
            return None
        import torch

        return getattr(torch, self.cast_dtype_name)

    @property
    def scale_format(self) -> str:
        """What the scales are stored as and what one covers (for `mismatch formats`)."""
        if self.scheme == "cast":
            return "none"
        if self.scheme == "mx":
            return f"E8M0 per {self.block}"
        if self.scheme == "nvfp4":
            return f"E4M3 per {self.block} + FP32 per tensor"
        cover = {"tensor": "tensor", "channel": "row", "group": f"1x{self.block} group",
                 "block": f"{self.block_rows}x{self.block} block"}[self.granularity]
        return f"FP32 per {cover}"

    @property
    def scale_divisor(self) -> float | None:
        """The per-tensor FP32 scale of a codec that has one is amax / scale_divisor (FP8: the
        element's largest finite value; NVFP4: 6 · 448, the largest code times the largest
        block scale); None where no scale covers the whole tensor."""
        if self.scheme == "nvfp4":
            return NVFP4_GLOBAL_DIVISOR
        if self.scheme == "fp8" and self.granularity == "tensor":
            assert self.element is not None
            return self.element.max_finite
        return None


CODECS: dict[str, CodecSpec] = {}


def register(spec: CodecSpec) -> CodecSpec:
    """Add a codec to the table; a name may be registered once."""
    return add_once(CODECS, spec.name, spec, "codec")


for _spec in (
    CodecSpec(name="bf16", scheme="cast", cast_dtype_name="bfloat16",
              description="BF16 cast (round to nearest even)"),
    CodecSpec(name="fp16", scheme="cast", cast_dtype_name="float16",
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
        raise QuantizeError(f"unknown format {name!r}; valid formats: "
                            f"{', '.join(CODECS)}") from None
