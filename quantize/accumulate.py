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

Exactness. An E4M3 value is a multiple of 2^-9 (its smallest subnormal) below 448, so a product
of two is a multiple of 2^-18 below 2^18, and a sum of 32 of them a multiple of 2^-18 below
2^23: at most 41 significant bits, inside float64's 53. Every partial sum in every order is
exact, so any float64 GEMM (blocked or not, FMA or not) gives each slice sum exactly. The
register is a multiple of 2^-18 as well (truncation and FP32 rounding keep it on that grid)
and below K · 448², so the register plus a slice's products, added in any order, is exact
too while K < 2^17.

Two implementations, bit-identical (tests/test_accumulate.py holds them so):
`accumulate_matmul_reference` is the model written plainly (one float64 einsum into [S, M, N],
then a loop that allocates new [M, N] tensors at each step); `accumulate_matmul` is the fast
path: one float64 register [M, N] updated in place, per slice one `addmm_` (the register plus
the slice's [M, mma_k] @ [mma_k, N]: exact, so its order does not matter) and one integer
`bitwise_and_` (the truncation), with no [S, M, N] tensor and no allocation per slice. Its right
operand is prepared once (`KSlices`: slices zero-padded, contiguous, stored in the narrowest
exact dtype, bfloat16 for E4M3 values) and widened to float64 a few slices at a time into a
cache-sized buffer: a decode-sized GEMM is bound by reading the weight, and bfloat16 reads a
quarter of float64's bytes. Inputs off the FP8 grid (FP16, BF16) agree bit for bit as long as
the register plus each slice sum is exact in float64; beyond that, the two can round
differently in float64's last place.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from mismatch.registry import add_once

from .errors import QuantizeError

__all__ = ["Accumulation", "ACCUMULATIONS", "register_accumulation", "KSlices", "resolve",
           "truncate_mantissa", "accumulate_matmul", "accumulate_matmul_batched",
           "accumulate_matmul_reference"]


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


ACCUMULATIONS: dict[str, Accumulation] = {}


def register_accumulation(a: Accumulation) -> Accumulation:
    """Add an accumulation preset; a name may be registered once."""
    return add_once(ACCUMULATIONS, a.name, a, "accumulation")


for _a in (
    Accumulation(name="fp32", acc_mbits=None, promote_every=None),
    # ~14 significant bits = 13 explicit mantissa bits (DeepSeek-V3 report, §3.3.2)
    Accumulation(name="hopper-fp8-fast", acc_mbits=13, promote_every=None),
    Accumulation(name="hopper-fp8-promote128", acc_mbits=13, promote_every=128),
):
    register_accumulation(_a)


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


def resolve(acc: Accumulation | str) -> Accumulation:
    """A preset name or an Accumulation → the Accumulation."""
    if isinstance(acc, str):
        if acc not in ACCUMULATIONS:
            raise QuantizeError(f"unknown accumulation {acc!r}; valid: {', '.join(ACCUMULATIONS)}")
        return ACCUMULATIONS[acc]
    return acc


def _check_shapes(a: torch.Tensor, b_shape: tuple[int, ...]) -> None:
    if a.ndim != 2 or len(b_shape) != 2 or a.shape[1] != b_shape[0]:
        raise QuantizeError(f"accumulate_matmul needs [M, K] @ [K, N], got {tuple(a.shape)} "
                            f"@ {tuple(b_shape)}")


@dataclass(frozen=True)
class KSlices:
    """A right-hand GEMM operand b [K, N] cut into MMA slices along K, ready for
    `accumulate_matmul`: `values` [S, mma_k, N], contiguous, K zero-padded to S · mma_k (zero
    products add exactly nothing), in the narrowest of bfloat16 / float32 / float64 that holds
    every value exactly (E4M3 values fit bfloat16: 4 significant bits, exponents 2^-9..2^8).
    Build it once per weight with `KSlices.of`; the GEMM widens it to float64 slice by slice."""

    values: torch.Tensor
    """[S, mma_k, N] bfloat16, float32 or float64."""
    k: int
    """K before padding."""
    e4m3: bool = False
    """Whether every value is an E4M3 value (what the native CPU kernel takes,
    mismatch.kernels.native)."""

    @staticmethod
    def of(b: torch.Tensor, mma_k: int) -> "KSlices":
        """b: [K, N] on a low-precision grid, any float dtype, any strides."""
        if b.ndim != 2:
            raise QuantizeError(f"KSlices needs a [K, N] matrix, got shape {tuple(b.shape)}")
        k, n = b.shape
        s = -(-k // mma_k)
        for dtype in (torch.bfloat16, torch.float32, torch.float64):
            if _holds(dtype, b.dtype) or torch.equal(b.to(dtype).double(), b.double()):
                break
        values = torch.zeros(s * mma_k, n, dtype=dtype, device=b.device)
        values[:k] = b
        # E4M3 values survive a round trip through E4M3 (values past its range, NaN and inf
        # do not: the cast gives NaN or another value)
        e4m3 = b.dtype == torch.float8_e4m3fn or (
            dtype == torch.bfloat16 and
            torch.equal(values.to(torch.float8_e4m3fn).to(dtype), values))
        return KSlices(values.view(s, mma_k, n), k, e4m3)

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of the matrix it holds, [K, N]."""
        return self.k, self.values.shape[2]

    def matrix(self) -> torch.Tensor:
        """The [K, N] matrix (a view, in the stored dtype)."""
        return self.values.view(-1, self.values.shape[2])[:self.k]


def _holds(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Whether every value of float dtype `narrow` is a value of `wide` (no data needed)."""
    if wide == narrow or wide == torch.float64:
        return True
    if wide == torch.float32:
        return narrow in (torch.bfloat16, torch.float16) or narrow.itemsize == 1
    # bfloat16 (8 significant bits, FP32's exponents) holds every 8-bit float format
    return wide == torch.bfloat16 and narrow.itemsize == 1


# Slices of the right operand are widened to float64 a few at a time into a reused buffer of
# at most this many bytes (about an L2 cache): the weight streams from memory in its narrow
# dtype, and the float64 copy the GEMM reads stays in cache.
_WIDEN_BYTES = 1 << 20
_buffers = threading.local()  # one reused widening buffer per thread and device


def _buffer(numel: int, device: torch.device) -> torch.Tensor:
    per_device = getattr(_buffers, "by_device", None)
    if per_device is None:
        per_device = _buffers.by_device = {}
    buf = per_device.get(device)
    if buf is None or buf.numel() < numel:
        buf = per_device[device] = torch.empty(numel, dtype=torch.float64, device=device)
    return buf[:numel]


class _Register:
    """The accumulator of `accumulate_matmul` over a block of outputs: a float64 register
    (truncated in place on its int64 view, or rounded to FP32 each slice) and, where partial sums
    are promoted, the FP32 total."""

    def __init__(self, shape: tuple[int, ...], acc: Accumulation, slices: int,
                 device: torch.device) -> None:
        self.partial = torch.zeros(shape, dtype=torch.float64, device=device)  # the register
        self._bits = self.partial.view(torch.int64)
        self._keep = None if acc.acc_mbits is None else ~((1 << (52 - acc.acc_mbits)) - 1)
        self._fp32 = torch.empty(shape, dtype=torch.float32, device=device) \
            if self._keep is None else None
        self._promote = None if acc.promote_every is None else acc.promote_every // acc.mma_k
        # the FP32 total, needed only where partial sums are promoted into it
        self._total = None if self._promote is None else \
            torch.zeros(shape, dtype=torch.float32, device=device)
        self._slices = slices

    def added(self, i: int) -> None:
        """After slice i's products went into `partial`: the register's rounding, promotion."""
        if self._keep is not None:
            self._bits.bitwise_and_(self._keep)  # truncate_mantissa, in place
        else:  # an FP32 register: round the float64 sum once to FP32
            self._fp32.copy_(self.partial)
            self.partial.copy_(self._fp32)
        # only the last slice can be short, and promoting after it adds what the final add
        # does: promoting after every `promote` whole slices counts as the reference
        if self._promote is not None and (i + 1) % self._promote == 0 and i + 1 < self._slices:
            _promote(self._total, self.partial)
            self.partial.zero_()

    def result(self) -> torch.Tensor:
        if self._total is None:  # the reference's zero total + partial.float(): the register
            return self.partial.add_(0.0).to(torch.float32)  # rounded once, −0 made +0
        _promote(self._total, self.partial)
        return self._total


def _widened(a: torch.Tensor, k_padded: int) -> torch.Tensor:
    """The left operand in float64, its K zero-padded to whole slices (zero-padded slices of b
    meet zero activations)."""
    a64 = a.to(torch.float64)
    k = a.shape[-1]
    return torch.nn.functional.pad(a64, (0, k_padded - k)) if k_padded != k else a64


def accumulate_matmul(a: torch.Tensor, b: torch.Tensor | KSlices,
                      acc: Accumulation | str) -> torch.Tensor:
    """a: [M, K], b: [K, N] or its KSlices (values already on the low-precision grid, any float
    dtype) → [M, N] float32, accumulated as `acc` describes.

    Bit-identical to `accumulate_matmul_reference` whenever `partial + slice sum` is exact in
    float64 (always on the FP8 grid below K = 2^17, see the module docstring): the accumulator
    register [M, N] float64 takes each slice with one in-place `addmm_` (an exact sum needs no
    particular order), then is truncated in place on its int64 view."""
    acc = resolve(acc)
    _check_shapes(a, tuple(b.shape))
    if not isinstance(b, KSlices):
        b = KSlices.of(b, acc.mma_k)
    elif b.values.shape[1] != acc.mma_k:
        raise QuantizeError(f"KSlices cut for mma_k={b.values.shape[1]}, the accumulation "
                            f"{acc.name!r} has mma_k={acc.mma_k}")
    s, mk, n = b.values.shape
    m = a.shape[0]
    if m == 0 or n == 0:
        return torch.zeros(m, n, dtype=torch.float32, device=a.device)
    a64 = _widened(a, s * mk)
    reg = _Register((m, n), acc, s, a.device)
    widen = b.values.dtype != torch.float64
    chunk = max(1, _WIDEN_BYTES // (8 * mk * n)) if widen else s
    buf = _buffer(min(chunk, s) * mk * n, a.device) if widen else None
    for s0 in range(0, s, chunk):
        s1 = min(s, s0 + chunk)
        if widen:
            wide = buf[:(s1 - s0) * mk * n].view(s1 - s0, mk, n)
            wide.copy_(b.values[s0:s1])
        else:
            wide = b.values[s0:s1]
        for i in range(s0, s1):
            reg.partial.addmm_(a64[:, i * mk:(i + 1) * mk], wide[i - s0])
            reg.added(i)
    return reg.result()


def accumulate_matmul_batched(a: torch.Tensor, bs: list[KSlices],
                              acc: Accumulation | str) -> torch.Tensor:
    """Several GEMMs of one shape at once (e.g. a fused MoE layer's experts): a [B, M, K] (rows
    zero-padded to a common M) and B right operands of one shape [K, N] → [B, M, N] float32,
    where [j] is exactly `accumulate_matmul(a[j], bs[j], acc)`: each slice is one batched
    float64 GEMM into the register, whose sums are exact in any order (module docstring), so
    batching changes no bit. One call instead of B saves B − 1 calls' fixed cost, which is what
    a decode step's small expert GEMMs are made of."""
    acc = resolve(acc)
    if a.ndim != 3 or a.shape[0] != len(bs) or not bs:
        raise QuantizeError(f"accumulate_matmul_batched needs [B, M, K] and B operands, got "
                            f"{tuple(a.shape)} and {len(bs)}")
    shape = bs[0].values.shape
    if any(b.values.shape != shape or b.k != a.shape[2] for b in bs) or shape[1] != acc.mma_k:
        raise QuantizeError(f"accumulate_matmul_batched needs operands of one shape [K={a.shape[2]}"
                            f", N] cut for mma_k={acc.mma_k}")
    s, mk, n = shape
    nb, m = a.shape[:2]
    if m == 0 or n == 0:
        return torch.zeros(nb, m, n, dtype=torch.float32, device=a.device)
    a64 = _widened(a, s * mk)
    wide = torch.stack([b.values for b in bs], 1).to(torch.float64)  # [S, B, mma_k, N]
    reg = _Register((nb, m, n), acc, s, a.device)
    for i in range(s):
        reg.partial.baddbmm_(a64[:, :, i * mk:(i + 1) * mk], wide[i])
        reg.added(i)
    return reg.result()


def _promote(total: torch.Tensor, partial: torch.Tensor) -> None:
    """total (float32) += partial (float64), rounded once to FP32 — the reference's
    `total + partial.float()`: partial.float() is exact (at most 24 significant bits, in FP32's
    range), and rounding the exact sum of two FP32 values first to float64 and then to FP32 is
    rounding it once (double rounding is innocuous for + when 53 >= 2·24 + 2: S. A. Figueroa,
    "When is double rounding innocuous?", ACM SIGNUM Newsletter 30(3), 1995). A zero total
    also turns a −0 register into +0, as the reference's zeros do."""
    total.add_(partial)


def accumulate_matmul_reference(a: torch.Tensor, b: torch.Tensor,
                                acc: Accumulation | str) -> torch.Tensor:
    """The model written plainly (and slowly): a [M, K] @ b [K, N] → [M, N] float32, as
    `accumulate_matmul` computes it bit for bit."""
    acc = resolve(acc)
    _check_shapes(a, tuple(b.shape))
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
