"""Serving precisions: what a name like `nvfp4` or `fp8` means in codecs, one row each.

A precision is what a sampler serves a checkpoint in (`--dtype`), or a format the precision probe
studies. Its row says which codec the weights' values come from, which codec activations are
quantized with when a GEMM takes both operands in the low format (W*A*), which tensor-core operand
format that GEMM needs, and which codec a modelopt checkpoint of it stores. Everything else is
read from the codec table (codec_table.py), never restated:

    precision     weights       activations   tensor cores  block  weight scales          ckpt
    bf16, fp16    cast          (compute)     -             -      none                   -
    fp8           fp8           fp8-act       fp8           0      FP32 per tensor        fp8
    fp8-block128  fp8-block128  fp8-group128  fp8           128    FP32 per 128x128 block -
    w4a16-nvfp4   w4a16-nvfp4   (BF16)        -             16     E4M3 per 16 + FP32     same
    nvfp4         nvfp4         nvfp4-act     nvfp4         16     E4M3 per 16 + FP32     nvfp4
    mxfp4         mxfp4-rceil   mxfp4-rceil   mxfp4         32     E8M0 per 32            modelopt

A static activation scale is the calibrated amax divided by the activation codec's
`scale_divisor` (448 for FP8 per tensor, 6 · 448 for NVFP4); codecs without a per-tensor scale
(MXFP4's E8M0 blocks, FP8's 1×128 groups) scale each block dynamically. MXFP4 checkpoints (ckpt) store
modelopt's own exponent rule (codec `mxfp4-modelopt`); the serving kernels' values follow RCEIL.

The KV cache has its own small table, `KV_CACHE_CODECS`: BF16 (the compute dtype) or FP8 with the
per-tensor activation codec (scale 1.0, as engines default).

Which GPU runs which precision natively, and how its GEMMs accumulate, is per GPU:
mismatch.profiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mismatch.registry import add_once

from .codec_table import CodecSpec, get_codec

__all__ = ["Precision", "PRECISIONS", "register_precision", "KV_CACHE_CODECS"]


@dataclass(frozen=True, kw_only=True)
class Precision:
    """One serving precision, in codecs."""

    name: str
    """Name on the command line (`--dtype`) and in reports."""
    compute_dtype: Literal["bf16", "fp16"]
    """Dtype of activations between kernels."""
    weight_codec: str
    """Codec whose values the served weights take (a plain cast for bf16/fp16)."""
    activation_codec: str | None = None
    """Codec of the activations in a W*A* GEMM (None: weight-only, activations stay in the
    compute dtype)."""
    tensor_cores: str | None = None
    """Operand format a GPU's tensor cores must take to run the W*A* GEMM (a `GpuProfile.native`
    entry); None: no low-precision tensor cores needed."""
    checkpoint_codec: str | None = None
    """Codec of a modelopt checkpoint's weight storage, byte-exact with its export (None: no
    checkpoint format)."""
    served: bool = True
    """A `--dtype` a sampler profile resolves (False: studied by the precision probe only)."""

    def __post_init__(self) -> None:
        for codec in (self.weight_codec, self.activation_codec, self.checkpoint_codec):
            if codec is not None:
                get_codec(codec)  # an unknown codec fails here, naming the valid ones
        if (self.activation_codec is None) != (self.tensor_cores is None) and not self.is_cast:
            raise ValueError(f"precision {self.name}: a W*A* GEMM needs both an activation codec "
                             f"and its tensor-core format")

    @property
    def weight(self) -> CodecSpec:
        return get_codec(self.weight_codec)

    @property
    def is_cast(self) -> bool:
        """The weights are a plain cast: the compute dtype itself (bf16, fp16)."""
        return self.weight.scheme == "cast"

    @property
    def block(self) -> int:
        """Weight elements along K that share one scale (0: per tensor or no scale)."""
        return self.weight.block

    @property
    def scale_format(self) -> str:
        """What the weight scales are stored as and what one covers."""
        return self.weight.scale_format

    @property
    def activation_scale_divisor(self) -> float | None:
        """A static activation scale is the calibrated amax divided by this (None: the
        activations are scaled per block, dynamically, or not quantized)."""
        if self.activation_codec is None:
            return None
        return get_codec(self.activation_codec).scale_divisor


PRECISIONS: dict[str, Precision] = {}


def register_precision(p: Precision) -> Precision:
    """Add a precision to the table; a name may be registered once."""
    return add_once(PRECISIONS, p.name, p, "precision")


for _p in (
    Precision(name="bf16", compute_dtype="bf16", weight_codec="bf16"),
    Precision(name="fp16", compute_dtype="fp16", weight_codec="fp16"),
    Precision(name="fp8", compute_dtype="bf16", weight_codec="fp8", activation_codec="fp8-act",
              tensor_cores="fp8", checkpoint_codec="fp8"),
    Precision(name="fp8-block128", compute_dtype="bf16", weight_codec="fp8-block128",
              activation_codec="fp8-group128", tensor_cores="fp8", served=False),
    Precision(name="w4a16-nvfp4", compute_dtype="bf16", weight_codec="w4a16-nvfp4",
              checkpoint_codec="w4a16-nvfp4"),
    Precision(name="nvfp4", compute_dtype="bf16", weight_codec="nvfp4",
              activation_codec="nvfp4-act", tensor_cores="nvfp4", checkpoint_codec="nvfp4"),
    Precision(name="mxfp4", compute_dtype="bf16", weight_codec="mxfp4-rceil",
              activation_codec="mxfp4-rceil", tensor_cores="mxfp4",
              checkpoint_codec="mxfp4-modelopt"),
):
    register_precision(_p)


KV_CACHE_CODECS: dict[str, str | None] = {"bf16": None, "fp8": "fp8-act"}
"""KV-cache format → the codec its entries are stored in (None: the compute dtype)."""
