"""Block-scaled codecs: encode to the real storage (codes + scales), decode back.

A codec is one row of `CODECS` (codec_table.py, re-exported here: each row's element format,
scaling scheme and exact order of operations, as data): `encode` writes the storage (codes +
scales) a producer of that codec writes, `decode` reads it back, `fake_quant` gives the values a
kernel using the codec computes with.

Decoding always returns exact float32 products (code value · scale, then · global scale, in that
order, as modelopt's dequantizers do) and casts to the requested dtype once at the end.

Non-finite input is refused (`QuantizeError` naming the count and first position): an E2M1 or
E8M0-scaled block has no way to carry inf, and a NaN in a checkpoint is corruption, not data.

Each scheme's arithmetic is in schemes.py, the storage layout (QTensor, nibble packing) in
qtensor.py.
"""

from __future__ import annotations

import torch

from .codec_table import CODECS, CodecSpec, get_codec, register
from .errors import QuantizeError
from .qtensor import QTensor
from .schemes import FAKE_QUANT, SCHEMES

__all__ = ["CodecSpec", "CODECS", "register", "get_codec", "check_input", "encode", "decode",
           "fake_quant"]


def check_input(x: torch.Tensor, spec: CodecSpec, validate: bool) -> None:
    """Refuse what `spec` cannot encode (QuantizeError naming the bad value): a non-float or
    0-dim tensor, a shape that does not tile into its blocks, and (with `validate`) NaN/inf."""
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
    check_input(x, spec, validate)
    if global_scale is not None and validate and not bool((global_scale > 0).all()
                                                          & torch.isfinite(global_scale).all()):
        raise QuantizeError(f"codec {spec.name}: global_scale must be positive and finite, "
                            f"got {global_scale.flatten()[:4].tolist()}")
    return SCHEMES[spec.scheme][0](x, spec, global_scale)


def decode(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode storage to values [...shape] in `dtype` (exact float32 first, one final cast)."""
    spec = get_codec(q.codec)
    return SCHEMES[spec.scheme][1](q, spec).to(dtype)


def fake_quant(x: torch.Tensor, codec: str | CodecSpec, *,
               global_scale: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """decode(encode(x)) in x's dtype: the values a kernel using this codec would compute with.

    Activation codecs on the emulators' hot path have a direct value-level twin (no codes, no
    packing) that tests hold bit-identical to decode∘encode.
    """
    spec = get_codec(codec)
    direct = FAKE_QUANT.get(spec.name)
    if direct is not None and global_scale is not None:
        check_input(x, spec, validate)
        return direct(x, global_scale.float()).to(x.dtype)
    return decode(encode(x, spec, global_scale=global_scale, validate=validate), x.dtype)
