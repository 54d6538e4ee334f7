"""Activation fake-quant in the serving kernels' order: FP8, MXFP4, NVFP4, bit-exact.

`fake_quant_torch` is quantize.codecs.fake_quant itself (the bit-exact reference and the CPU
path). `fake_quant_triton` computes the same values in one pass over the tensor, FP32 inside,
with no codes or packing: each row of a [M, B] view is one scale group (B = 16 for NVFP4, 32 for
MXFP4, the whole last dim for per-token FP8, any width for per-tensor FP8). Every rounding is
written out in integer and FP32 arithmetic that is exact on any IEEE machine, so the kernel
agrees with the reference bit for bit rather than to a tolerance:

    round to a grid  e = max(floor(log2 a), emin) from the float's exponent field,
                     a·2^(mbits−e) is exact, round-half-even by (v + 2²³) − 2²³ (exact for
                     0 ≤ v < 2²²), times 2^(e−mbits), then saturate (E4M3 448, E2M1 6)
    divisions        IEEE round-to-nearest (`tl.math.div_rn`; Triton's `/` on FP32 may be
                     approximate on CUDA), FP contraction off (`enable_fp_fusion=False`), so no
                     multiply-add is fused into an FMA the reference does not perform
    E8M0 scales      2^e built from bits, 2^-127 as the FP32 subnormal it is; x / 2^e computed
                     as x · 2^-e, the same correctly rounded real
    zero signs       the sign bit is copied from the scaled value (IEEE codecs), or set only for
                     x < 0 (modelopt's NVFP4 weights): −0 stays −0 where the reference keeps it

Per-tensor reductions (a default FP8 scale, NVFP4's global scale) are taken in torch before the
kernel, as the reference takes them. Codecs and their groups: `KERNEL_CODECS`.
"""

from __future__ import annotations

import torch

from mismatch.quantize.codecs import check_input, fake_quant as _reference, get_codec
from mismatch.quantize.formats import div_scalar
from mismatch.quantize.schemes import nvfp4_global_scale

from . import native
from .runtime import KernelError, use_triton

__all__ = ["KERNEL_CODECS", "fake_quant", "fake_quant_torch", "fake_quant_triton"]

# codec -> the kernel's mode (its branch in _tl_fake_quant.py)
_KERNEL_MODES: dict[str, int] = {
    "fp8-act": 0,       # per-tensor E4M3, x · (1/scale), static or amax/448 scale
    "fp8-channel": 1,   # per-token (per-row) E4M3, x / (amax_row/448)
    "mxfp4": 2,         # OCP MX: E8M0 exponent floor(log2 amax) − 2
    "mxfp4-rceil": 3,   # NVIDIA kernels: E8M0 = amax/6 rounded up to a power of two
    "nvfp4-act": 4,     # serving-kernel activation order, FP32 input_scale
    "nvfp4": 5,         # modelopt weight order, FP32 weight_scale_2
}
# codec -> (kernel mode, scale-group width along the last dim, the codec's block; 0 = the whole
# last dim: a per-row or per-tensor scale)
KERNEL_CODECS: dict[str, tuple[int, int]] = {
    codec: (mode, get_codec(codec).block) for codec, mode in _KERNEL_MODES.items()}


def fake_quant_torch(x: torch.Tensor, codec: str, *, global_scale: torch.Tensor | None = None,
                     validate: bool = True) -> torch.Tensor:
    """The reference: quantize.codecs.fake_quant (decode∘encode, or its value-level twin)."""
    return _reference(x, codec, global_scale=global_scale, validate=validate)


def _scale_for(x: torch.Tensor, codec: str, global_scale: torch.Tensor | None) -> torch.Tensor:
    """The FP32 per-tensor scale the kernel reads (1.0 where the codec has none)."""
    if global_scale is not None:
        if global_scale.numel() != 1:
            raise KernelError(f"codec {codec}: the Triton kernel takes one per-tensor scale, got "
                              f"shape {tuple(global_scale.shape)}")
        if not bool((global_scale > 0).all() & torch.isfinite(global_scale).all()):
            raise KernelError(f"codec {codec}: global_scale must be positive and finite, got "
                              f"{float(global_scale.flatten()[0])}")
        return global_scale.reshape(1).float()
    spec = get_codec(codec)
    if spec.scheme == "nvfp4":
        return nvfp4_global_scale(x).reshape(1)
    if spec.scale_divisor is not None:  # per-tensor FP8: amax / 448
        amax = x.abs().amax().float()
        return torch.where(amax > 0, div_scalar(amax, spec.scale_divisor), torch.ones_like(amax)).reshape(1)
    return torch.ones(1, device=x.device)


@torch.no_grad()
def fake_quant_triton(x: torch.Tensor, codec: str, *, global_scale: torch.Tensor | None = None,
                      validate: bool = True) -> torch.Tensor:
    """x: [..., K] float → [..., K] in x's dtype, bit-identical to the reference. The kernel
    reads x widened to FP32 (exact from BF16/FP16) and writes FP32; the final cast is torch's.
    validate: refuse non-finite input (one reduction), as the reference does."""
    if codec not in KERNEL_CODECS:
        raise KernelError(f"no fake-quant kernel for codec {codec!r}; kernels: "
                          f"{', '.join(KERNEL_CODECS)}")
    check_input(x, get_codec(codec), validate)
    from ._tl_fake_quant import launch

    mode, group = KERNEL_CODECS[codec]
    scale = _scale_for(x, codec, global_scale)
    x32 = x.float().contiguous()
    width = x32.shape[-1] if group == 0 else group
    out = launch(x32.reshape(-1, width) if x32.numel() else x32.reshape(0, max(width, 1)),
                 scale, mode)
    return out.reshape(x.shape).to(x.dtype)


def fake_quant(x: torch.Tensor, codec: str, *, global_scale: torch.Tensor | None = None,
               validate: bool = True, backend: str = "auto") -> torch.Tensor:
    """Dispatch: the Triton kernel for CUDA tensors of a kernel codec when Triton is installed;
    for FP32 CPU tensors of NVFP4 activations with their input scale, the native C kernel
    (native.py, the reference's bits); else the reference. backend: auto | torch | triton."""
    if backend == "auto" and codec not in KERNEL_CODECS:
        backend = "torch"
    if use_triton(backend, x):
        return fake_quant_triton(x, codec, global_scale=global_scale, validate=validate)
    if backend == "auto" and codec == "nvfp4-act" and global_scale is not None and \
            x.dtype == torch.float32 and x.device.type == "cpu" and native.available():
        check_input(x, get_codec(codec), validate)
        return native.fake_nvfp4_act(x, global_scale)
    return fake_quant_torch(x, codec, global_scale=global_scale, validate=validate)
