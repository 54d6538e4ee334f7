"""An accumulation model for low-precision GEMMs (Hopper FP8 "fast accumulation" and friends).

A tensor-core MMA sums a short slice of K (here `mma_k` elements) exactly and adds it into an
accumulator register that does not keep a full FP32 mantissa: on Hopper FP8 it keeps about 14
significant bits (DeepSeek-V3 technical report, §3.3.2, "Increasing Accumulation Precision").
Careful kernels copy the partial sum into an FP32 register every 128 K-elements ("promotion",
as DeepGEMM and CUTLASS's FP8 "non-fast-accum" kernels do); per-tensor "fast accumulation"
kernels never do, so the error grows with K.

The model, per output element:

    acc = 0 (limited precision), total = 0 (FP32)
    for each slice of `mma_k` products along K:
        acc = truncate(acc + exact_sum(slice), acc_mbits)     # round toward zero
        every `promote_every` elements: total = fp32(total + acc); acc = 0
    result = fp32(total + acc)

`acc_mbits=None` keeps an FP32 accumulator (the BF16/FP16 GEMM model: products exact, sums in
FP32), which differs from a float64 matmul only by FP32 rounding of the slice partial sums.
Vectorized over M and N; the loop runs over K / mma_k slices, never over elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import QuantizeError

__all__ = ["Accumulation", "ACCUMULATIONS", "truncate_mantissa", "accumulate_matmul"]


@dataclass(frozen=True, kw_only=True)
class Accumulation:
    """How a GEMM accumulates along K."""

    name: str
    """Preset name."""
    acc_mbits: int | None
    """Explicit mantissa bits the accumulator keeps (None: a full FP32 accumulator)."""
    promote_every: int | None
    """K elements between promotions of the partial sum to FP32 (None: never)."""
    mma_k: int = 32
    """K elements one MMA instruction sums exactly before touching the accumulator."""

    def __post_init__(self) -> None:
        if self.acc_mbits is not None and not 1 <= self.acc_mbits <= 23:
            raise ValueError(f"acc_mbits must be in [1, 23] or None, got {self.acc_mbits}")
        if self.mma_k < 1:
            raise ValueError(f"mma_k must be >= 1, got {self.mma_k}")
        if self.promote_every is not None and (self.promote_every < self.mma_k
                                               or self.promote_every % self.mma_k):
            raise ValueError(f"promote_every ({self.promote_every}) must be a positive multiple "
                             f"of mma_k ({self.mma_k})")


ACCUMULATIONS: dict[str, Accumulation] = {
    a.name: a
    for a in (
        Accumulation(name="fp32", acc_mbits=None, promote_every=None),
        # ~14 significant bits = 13 explicit mantissa bits (DeepSeek-V3 report, §3.3.2)
        Accumulation(name="hopper-fp8-fast", acc_mbits=13, promote_every=None),
        Accumulation(name="hopper-fp8-promote128", acc_mbits=13, promote_every=128),
    )
}


def truncate_mantissa(x: torch.Tensor, mbits: int) -> torch.Tensor:
    """Round toward zero to `mbits` explicit mantissa bits (float64 in, float64 out).

    Clears the low 52 − mbits bits of each float64's mantissa field: for normal numbers (every
    value an accumulator of FP8 products holds) that is exactly ldexp(trunc(m·2^(mbits+1)) /
    2^(mbits+1), e) with x = m·2^e, in one integer op instead of four float passes."""
    if not 0 <= mbits <= 52:
        raise QuantizeError(f"mbits must be in [0, 52], got {mbits}")
    if x.dtype != torch.float64:
        raise QuantizeError(f"truncate_mantissa works on float64, got {x.dtype}")
    keep = ~((1 << (52 - mbits)) - 1)
    return (x.contiguous().view(torch.int64) & keep).view(torch.float64)


def accumulate_matmul(a: torch.Tensor, b: torch.Tensor, acc: Accumulation | str) -> torch.Tensor:
    """a: [M, K], b: [K, N] (values already in the low-precision grid, any float dtype)
    → [M, N] float32, accumulated as `acc` describes."""
    if isinstance(acc, str):
        if acc not in ACCUMULATIONS:
            raise QuantizeError(f"unknown accumulation {acc!r}; valid: {', '.join(ACCUMULATIONS)}")
        acc = ACCUMULATIONS[acc]
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise QuantizeError(f"accumulate_matmul needs [M, K] @ [K, N], got {tuple(a.shape)} "
                            f"@ {tuple(b.shape)}")
    a64, b64 = a.double(), b.double()
    m, k = a64.shape
    n = b64.shape[1]
    mk = acc.mma_k
    slices = -(-k // mk)
    if k % mk:  # zero-pad K to whole MMA slices: zero products add exactly nothing
        a64 = torch.nn.functional.pad(a64, (0, slices * mk - k))
        b64 = torch.nn.functional.pad(b64, (0, 0, 0, slices * mk - k))
    # every slice's sum at once, [S, M, N]; exact for FP8 inputs (float64 holds 32 such products)
    sums = torch.einsum("msk,skn->smn", a64.view(m, slices, mk), b64.view(slices, mk, n))
    partial = torch.zeros(m, n, dtype=torch.float64, device=a.device)  # limited accumulator
    total = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    since_promotion = 0
    for i in range(slices):
        if acc.acc_mbits is None:
            partial = (partial + sums[i]).float().double()  # an FP32 register
        else:
            partial = truncate_mantissa(partial + sums[i], acc.acc_mbits)
        since_promotion += min(mk, k - i * mk)
        if acc.promote_every is not None and since_promotion >= acc.promote_every:
            total = total + partial.float()
            partial.zero_()
            since_promotion = 0
    return total + partial.float()
