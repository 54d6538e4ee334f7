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
"""

from __future__ import annotations

import torch

from mismatch.quantize.accumulate import Accumulation, KSlices, accumulate_matmul, resolve
from mismatch.quantize.errors import QuantizeError

from .runtime import KernelError, use_triton

__all__ = ["accumulate_gemm", "accumulate_gemm_torch", "accumulate_gemm_triton"]


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


def accumulate_gemm(a: torch.Tensor, b: torch.Tensor | KSlices, acc: Accumulation | str, *,
                    backend: str = "auto") -> torch.Tensor:
    """Dispatch: the Triton kernel for CUDA tensors when Triton is installed, else the torch
    model. backend: auto | torch | triton."""
    b_values = b.values if isinstance(b, KSlices) else b
    fn = accumulate_gemm_triton if use_triton(backend, a, b_values) else accumulate_gemm_torch
    return fn(a, b, acc)
