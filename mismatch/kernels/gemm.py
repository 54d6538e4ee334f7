"""A GEMM with the accumulation model of quantize/accumulate.py, at GPU speed.

`accumulate_gemm_torch` is quantize.accumulate.accumulate_matmul itself (the CPU path, held bit
for bit to the model's plain `accumulate_matmul_reference`); its right operand may be a
prepared `KSlices` (a weight cut into MMA slices once). `accumulate_gemm_triton` runs the same
model tiled over [BLOCK_M, BLOCK_N] outputs: per K-slice of `mma_k` elements one float64 tl.dot
(exact for inputs on an FP8 grid: 32 products of 4-bit significands fit float64's 53 bits, as
the reference's float64 einsum relies on), the slice added into the limited accumulator
(float64, then its mantissa truncated to `acc_mbits` bits by clearing low bits, or rounded to
FP32 for the FP32 model), promoted into an FP32 total every `promote_every` elements. The
kernel agrees with the reference bit for bit whenever each slice sum is exact in float64 (FP8
and, in practice, BF16 inputs of moderate range); otherwise the two float64 sums may round
differently in the last place.

On CPU, E4M3 activations against E4M3 weights (a prepared `KSlices` whose `e4m3` is set) run
the native kernel (native.py, `MISMATCH_NATIVE`): the same model in C, one pass per GEMM, bit
for bit the torch model's results (every sum is exact, so neither order nor FMA changes a bit).
`accumulate_gemm_grouped` runs several GEMMs of one shape, each with its own right operand and
rows (a fused-MoE stage's experts), in one call.
"""

from __future__ import annotations

import torch

from mismatch.quantize.accumulate import (Accumulation, KSlices, accumulate_matmul,
                                          accumulate_matmul_batched, resolve)
from mismatch.quantize.errors import QuantizeError

from . import native
from .runtime import KernelError, use_triton

__all__ = ["accumulate_gemm", "accumulate_gemm_torch", "accumulate_gemm_triton",
           "accumulate_gemm_native", "accumulate_gemm_grouped"]


def accumulate_gemm_torch(a: torch.Tensor, b: torch.Tensor | KSlices,
                          acc: Accumulation | str) -> torch.Tensor:
    """The model in torch: a [M, K] @ b [K, N] (or its KSlices) → [M, N] float32 accumulated
    as `acc` describes."""
    return accumulate_matmul(a, b, acc)


@torch.no_grad()
def accumulate_gemm_triton(a: torch.Tensor, b: torch.Tensor | KSlices, acc: Accumulation | str,
                           *, block_m: int = 16, block_n: int = 16) -> torch.Tensor:
    """The Triton kernel; same arguments and results as the reference. `acc.mma_k` must be a
    power of two >= 16 (tl.dot's smallest tile)."""
    acc = resolve(acc)
    if isinstance(b, KSlices):
        b = b.matrix()
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise QuantizeError(f"accumulate_matmul needs [M, K] @ [K, N], got {tuple(a.shape)} "
                            f"@ {tuple(b.shape)}")
    if acc.mma_k < 16 or acc.mma_k & (acc.mma_k - 1):
        raise KernelError(f"the Triton GEMM needs mma_k a power of two >= 16, got {acc.mma_k}")
    from ._tl_gemm import launch

    return launch(a, b, acc, block_m, block_n)


def _native_fits(a: torch.Tensor, bs: list, acc: Accumulation) -> bool:
    """Whether the native kernel computes these GEMMs: E4M3 elements on CPU against prepared
    E4M3 weights cut for this accumulation, and the library built."""
    return (a.dtype == torch.float8_e4m3fn and a.device.type == "cpu" and a.ndim == 2
            and all(isinstance(b, KSlices) and b.e4m3 and b.values.dtype == torch.bfloat16
                    and b.values.shape[1] == acc.mma_k and b.k == a.shape[1]
                    and b.values.device.type == "cpu" for b in bs)
            and len({b.values.shape for b in bs}) == 1 and native.available())


def _native(a: torch.Tensor, rows: list[int], bs: list[KSlices], acc: Accumulation,
            scales: torch.Tensor | None) -> torch.Tensor:
    promote = 0 if acc.promote_every is None else acc.promote_every // acc.mma_k
    s, mk, n = bs[0].values.shape
    return native.accumulate_grouped(a, rows, [b.values.view(s * mk, n) for b in bs],
                                     acc.acc_mbits, promote, acc.mma_k, a.shape[1], scales)


def accumulate_gemm_native(a: torch.Tensor, b: KSlices, acc: Accumulation | str) -> torch.Tensor:
    """The native CPU kernel: a [M, K] float8_e4m3fn @ b (KSlices of E4M3 values) → [M, N]
    float32, the torch model's results bit for bit."""
    acc = resolve(acc)
    if not _native_fits(a, [b], acc):
        raise KernelError("the native accumulation GEMM takes float8_e4m3fn activations on CPU "
                          "and a KSlices of E4M3 values cut for the accumulation's mma_k (and a "
                          "built library: MISMATCH_NATIVE)")
    return _native(a, [a.shape[0]], [b], acc, None)


def accumulate_gemm(a: torch.Tensor, b: torch.Tensor | KSlices, acc: Accumulation | str, *,
                    backend: str = "auto") -> torch.Tensor:
    """Dispatch: the Triton kernel for CUDA tensors when Triton is installed; on CPU the native
    kernel where it applies (E4M3 inputs, above); else the torch model. backend: auto | torch |
    triton."""
    b_values = b.values if isinstance(b, KSlices) else b
    if use_triton(backend, a, b_values):
        return accumulate_gemm_triton(a, b, acc)
    if backend == "auto" and isinstance(b, KSlices) and _native_fits(a, [b], resolve(acc)):
        return accumulate_gemm_native(a, b, acc)
    return accumulate_gemm_torch(a, b, acc)


def accumulate_gemm_grouped(xs: list[torch.Tensor], bs: list[KSlices], acc: Accumulation | str,
                            scales: list[torch.Tensor] | None = None, *,
                            backend: str = "auto") -> list[torch.Tensor]:
    """Several accumulation-model GEMMs of one shape in one call: xs[j] [M_j, K] against bs[j]
    ([K, N] KSlices, all cut alike) → [M_j, N] float32 each, multiplied by scales[j] (a float32
    scalar tensor: one rounding) where given — `accumulate_gemm(xs[j], bs[j], acc) * scales[j]`
    bit for bit. On CPU with E4M3 inputs, the native kernel over all rows at once, no padding;
    else one batched torch GEMM over rows zero-padded to the longest (accumulate_matmul_batched,
    the same bits). backend: auto | torch."""
    acc = resolve(acc)
    if backend not in ("auto", "torch"):
        raise KernelError(f"accumulate_gemm_grouped: backend {backend!r}; valid: auto, torch")
    if not xs or len(xs) != len(bs) or (scales is not None and len(scales) != len(xs)):
        raise KernelError(f"accumulate_gemm_grouped needs one right operand (and scale) per "
                          f"input, got {len(xs)} inputs and {len(bs)} operands")
    rows = [x.shape[0] for x in xs]
    if backend == "auto" and xs[0].dtype == torch.float8_e4m3fn and \
            all(x.dtype == xs[0].dtype for x in xs) and native.available():
        a = torch.cat(xs)
        if _native_fits(a, bs, acc):
            s = None if scales is None else torch.stack([t.reshape(()) for t in scales]).float()
            return list(_native(a, rows, bs, acc, s).split(rows))
    a = torch.zeros(len(xs), max(rows), xs[0].shape[1], dtype=torch.float64,
                    device=xs[0].device)
    for j, x in enumerate(xs):  # rows zero-padded to the longest
        a[j, :rows[j]] = x
    y = accumulate_matmul_batched(a, bs, acc)
    return [y[j, :n] if scales is None else y[j, :n] * scales[j] for j, n in enumerate(rows)]
