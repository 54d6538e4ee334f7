"""Element number formats: one table, one rounding rule, exact code tables.

Every low-precision element format this project emulates is a small IEEE-like binary float
described by four numbers — exponent bits, mantissa bits, bias, and what happens past the largest
finite value — plus the codes it reserves for inf and NaN. `FORMATS` holds them as data
(format_table.py, without torch; re-exported here); the functions below work for any entry, so
adding a format is adding a row, not a branch.

Rounding (`round_to_format`) is exact for float32 input, vectorized, with no loop over elements:

    e     = max(floor(log2|x|), emin)          # frexp: exact, no log2 rounding error
    q     = 2^(e - mbits)                      # the spacing of representable values at |x|
    |x̂|  = round(|x| / q) · q                 # |x|/q is exact (division by a power of two)

`round` is round-half-to-even (IEEE RNE, what the hardware `cvt.rn` instructions and torch's
casts do) or, as a named option, round-half-toward-zero, which is what modelopt 0.47's MXFP4
weight export does (its `cast_fp4` counts strictly-greater bounds, so 0.75 → 0.5, 1.75 → 1.5,
3.5 → 3). Results past the largest finite value saturate (`overflow="saturate"`: E4M3FN, E2M1,
as the OCP/NVIDIA conversions with `.satfinite` do) or become ±inf (`overflow="inf"`: E5M2,
as torch's cast does).

Codes: `sign << (ebits + mbits) | biased_exponent << mbits | mantissa`. `decode_codes` is a
lookup into a table built by the same formula in float64, so every code is tested exhaustively
against a float64 reference (tests/test_formats.py).

E8M0 (the MX shared scale) has no sign and no mantissa: a byte b means 2^(b − 127), and
0xFF is NaN. It is handled by `e8m0_decode` / `e8m0_from_exponent`.
"""

from __future__ import annotations

import math

import torch

from .format_table import (
    E2M1,
    E2M1_MAX,
    E4M3,
    E4M3_MAX,
    E5M2,
    E5M2_MAX,
    E8M0_BIAS,
    E8M0_NAN,
    FORMATS,
    FloatFormat,
    SignRule,
    Ties,
    get_format,
)

__all__ = [
    "FloatFormat",
    "FORMATS",
    "E2M1",
    "E4M3",
    "E5M2",
    "E2M1_MAX",
    "E4M3_MAX",
    "E5M2_MAX",
    "E8M0_BIAS",
    "E8M0_NAN",
    "get_format",
    "div_scalar",
    "round_to_format",
    "encode_codes",
    "threshold_codes",
    "e2m1_round_",
    "sign_mask",
    "SignRule",
    "decode_codes",
    "decode_packed",
    "code_table",
    "e8m0_decode",
    "e8m0_from_exponent",
]

def div_scalar(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """t / divisor, correctly rounded on every device. torch's CUDA division by a Python (CPU)
    scalar multiplies by fl(1/divisor) instead ("may lose one bit of precision":
    aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu, pytorch v2.11.0), so `amax / 448` differs
    by an ulp between CPU and CUDA for some amax; a divisor tensor on t's device takes the true
    division on both, as the Triton kernels' div_rn does. (modelopt calibrating on a GPU gets the
    reciprocal product: at most one ulp of a scale, which a checkpoint carries as data.)"""
    return t / torch.full((), divisor, dtype=t.dtype, device=t.device)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact 2^exponent in float32 for an integer tensor (ldexp never rounds in range)."""
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)


def round_to_format(x: torch.Tensor, fmt: FloatFormat, *, ties: Ties = "even") -> torch.Tensor:
    """Round float32 values to the nearest value representable in `fmt`.

    x: [...] float32 (other float dtypes are upcast exactly). Returns [...] float32 holding
    exactly representable values of `fmt`; NaN stays NaN, ±inf saturates or stays ±inf
    according to `fmt.overflow`; the sign of zero follows the input (IEEE).
    """
    if not x.is_floating_point():
        raise TypeError(f"round_to_format needs a float tensor, got {x.dtype}")
    x = x.float()
    ax = x.abs()
    _, e_frexp = torch.frexp(ax)  # ax = m * 2^e_frexp with m in [0.5, 1)
    e = torch.clamp(e_frexp.to(torch.int32) - 1, min=fmt.emin)  # floor(log2 ax), >= emin
    quantum = _pow2(e - fmt.mbits)
    scaled = ax / quantum  # exact: quantum is a power of two within float32's normal range
    if ties == "even":
        rounded = torch.round(scaled)  # torch.round is round-half-to-even
    elif ties == "toward_zero":
        rounded = torch.ceil(scaled - 0.5)
    else:
        raise ValueError(f"ties must be 'even' or 'toward_zero', got {ties!r}")
    mag = rounded * quantum
    if fmt.overflow == "saturate":
        mag = torch.clamp(mag, max=fmt.max_finite)  # also maps +inf to max_finite
    else:
        mag = torch.where(mag > fmt.max_finite, torch.full_like(mag, math.inf), mag)
    out = torch.copysign(mag, x)
    return torch.where(torch.isnan(x), x, out)


def sign_mask(x: torch.Tensor, rule: SignRule) -> torch.Tensor:
    """Which elements get the sign bit: signbit(x) (IEEE), x < 0 (modelopt NVFP4: an exact −0.0
    encodes as +0), or x <= 0 (modelopt MXFP4: both zeros encode as −0)."""
    if rule == "ieee":
        return torch.signbit(x)
    if rule == "negative":
        return x < 0
    if rule == "nonpositive":
        return x <= 0
    raise ValueError(f"sign rule must be 'ieee', 'negative' or 'nonpositive', got {rule!r}")


def encode_codes(x: torch.Tensor, fmt: FloatFormat, *, ties: Ties = "even",
                 sign: SignRule = "ieee", check_nan: bool = True) -> torch.Tensor:
    """Round float values to `fmt` and return their codes as uint8 (one code per element).

    Three implementations, chosen by the format's data, all tested to agree bit for bit on every
    BF16 pattern: torch's own cast where torch has the dtype (FP8), a sum of threshold tests for
    4-bit formats (E2M1: seven compares, no gather), and the exact frexp arithmetic otherwise.
    sign: see `sign_mask`. Raises ValueError on NaN for a format without a NaN code, unless
    check_nan is False (the caller has validated its input).
    """
    x = x if x.dtype == torch.float32 else x.float()
    if fmt.nan_code is None and check_nan:
        nan = torch.isnan(x)
        if bool(nan.any()):
            raise ValueError(f"{fmt.name} has no NaN code; input holds {int(nan.sum())} NaN value(s)")
    if fmt.torch_dtype is not None and ties == "even":
        src = x.clamp(-fmt.max_finite, fmt.max_finite) if fmt.overflow == "saturate" else x
        codes = src.to(fmt.torch_dtype).view(torch.uint8)
        if sign == "ieee":
            return codes
        return _with_sign(codes & (fmt.sign_bit - 1), x, fmt, sign)
    if fmt.bits <= 4:
        return _with_sign(threshold_codes(x.abs(), fmt, ties), x, fmt, sign)
    return _with_sign(_magnitude_codes_arith(x.abs(), fmt, ties), x, fmt, sign)


def _with_sign(magnitude: torch.Tensor, x: torch.Tensor, fmt: FloatFormat,
               sign: SignRule) -> torch.Tensor:
    neg = sign_mask(x, sign)
    if fmt.nan_code is not None:  # a NaN keeps its canonical (positive) code
        neg = neg & ~torch.isnan(x)
    return magnitude | (neg.to(torch.uint8) << (fmt.ebits + fmt.mbits))


_THRESHOLDS: dict[tuple[str, str], list[tuple[float, bool]]] = {}


def _thresholds(fmt: FloatFormat, ties: Ties) -> list[tuple[float, bool]]:
    """(midpoint, inclusive) between consecutive finite magnitudes of `fmt`, in code order.

    A magnitude m rounds past a midpoint t when m > t, or when m == t and the tie goes up:
    RNE sends a tie up when the upper code is even; ties toward zero never go up.
    """
    key = (fmt.name, ties)
    if key not in _THRESHOLDS:
        mags = [_code_value(c, fmt) for c in range(fmt.sign_bit)]
        out = []
        for c in range(1, len(mags)):
            if not math.isfinite(mags[c]):
                break
            mid = (mags[c - 1] + mags[c]) / 2  # exact in float32 for formats of <= 8 bits
            out.append((mid, ties == "even" and c % 2 == 0))
        _THRESHOLDS[key] = out
    return _THRESHOLDS[key]


_BUCKETIZE_BELOW = 8192  # elements: below, one bucketize call beats 2·(thresholds) passes (measured crossover on CPU)
_BOUNDARIES: dict[tuple[str, str, torch.device], torch.Tensor] = {}


def _boundaries(fmt: FloatFormat, ties: Ties, device: torch.device) -> torch.Tensor:
    """Midpoints as float32 boundaries for `bucketize(right=False)`, which counts b < ax: an
    inclusive midpoint t is replaced by the next float32 below it, so b < ax ⟺ ax ≥ t."""
    key = (fmt.name, ties, device)
    if key not in _BOUNDARIES:
        mids = torch.tensor([m for m, _ in _thresholds(fmt, ties)], dtype=torch.float32)
        inclusive = torch.tensor([inc for _, inc in _thresholds(fmt, ties)])
        below = torch.nextafter(mids, torch.zeros_like(mids))
        _BOUNDARIES[key] = torch.where(inclusive, below, mids).to(device)
    return _BOUNDARIES[key]


def threshold_codes(ax: torch.Tensor, fmt: FloatFormat, ties: Ties = "even") -> torch.Tensor:
    """Magnitude codes [...] uint8 of |x| values ax [...] (float32, no NaN) for a small format:
    the number of midpoints each value rounds past. Saturates at the largest finite code.

    Small tensors take one `bucketize`; large ones a sum of compares, which vectorizes better."""
    if ax.numel() < _BUCKETIZE_BELOW:
        return torch.bucketize(ax, _boundaries(fmt, ties, ax.device), out_int32=True).to(torch.uint8)
    code = torch.zeros(ax.shape, dtype=torch.uint8, device=ax.device)
    for mid, inclusive in _thresholds(fmt, ties):
        code += (ax >= mid) if inclusive else (ax > mid)
    return code


_F32_EXPONENT = 0x7F800000
_E2M1_MAGIC_MIN = (22 + 127) << 23  # float32 bits of 2^22 = 0.5 · 2^23: E2M1's quantum below 1


def e2m1_round_(m: torch.Tensor) -> torch.Tensor:
    """Round float32 magnitudes m [...] (contiguous, ≥ 0) in place to E2M1 values, nearest with
    ties to even, saturating at 6: the values `threshold_codes(m, E2M1)` decodes to, without
    codes, compares or a table.

    E2M1's quantum u is 0.5 below 2 (0, 0.5, 1, 1.5), 1 in [2, 4) (2, 3), 2 in [4, 6] (4, 6).
    Clamping to 6 first is saturation (every magnitude above 6 rounds to 6 or past it). Then
    u = max(2^(e−1), 0.5) for m in [2^e, 2^(e+1)), c = u · 2^23 is built from m's exponent bits
    by one integer add, and (m + c) − c rounds m to a multiple of u: m + c lies in [c, 2c), whose
    float32 spacing is u, with ties to the even multiple k·u (c / u = 2^23 is even), and within
    each range k and the E2M1 code have the same parity, so a tie goes to the even code. NaN
    stays NaN (threshold_codes has no NaN to take). Exact on every float32 input: tests hold it
    to the code table around every midpoint."""
    m.clamp_(max=E2M1_MAX)
    c = (m.view(torch.int32) & _F32_EXPONENT).add_(22 << 23).clamp_(min=_E2M1_MAGIC_MIN)
    c = c.view(torch.float32)
    return m.add_(c).sub_(c)


def _magnitude_codes_arith(ax: torch.Tensor, fmt: FloatFormat, ties: Ties) -> torch.Tensor:
    """Magnitude codes by exact arithmetic (the general path, any format of <= 8 bits)."""
    mag = round_to_format(ax, fmt, ties=ties)
    _, e_frexp = torch.frexp(mag)
    e = e_frexp.to(torch.int32) - 1
    normal = (e >= fmt.emin) & (mag > 0)
    biased = torch.where(normal, e + fmt.bias, torch.zeros_like(e))
    exp_for_quantum = torch.where(normal, e, torch.full_like(e, fmt.emin))
    mant = (mag / _pow2(exp_for_quantum - fmt.mbits)).to(torch.int32)  # exact integer
    mant = torch.where(normal, mant - (1 << fmt.mbits), mant)
    code = (biased << fmt.mbits) | mant
    if fmt.inf_code is not None:
        code = torch.where(torch.isinf(mag), torch.full_like(code, fmt.inf_code), code)
    if fmt.nan_code is not None:
        code = torch.where(torch.isnan(mag), torch.full_like(code, fmt.nan_code), code)
    return code.to(torch.uint8)


def _code_value(code: int, fmt: FloatFormat) -> float:
    """Value of one code, by the format's definition, in float64 (the reference)."""
    sign = -1.0 if code & fmt.sign_bit else 1.0
    mag_code = code & (fmt.sign_bit - 1)
    if fmt.nan_code is not None and mag_code == fmt.nan_code:
        return math.nan
    if fmt.inf_code is not None and mag_code == fmt.inf_code:
        return sign * math.inf
    if fmt.inf_code is not None and mag_code > fmt.inf_code:
        return math.nan  # IEEE-style: all-ones exponent with nonzero mantissa
    biased = mag_code >> fmt.mbits
    mant = mag_code & ((1 << fmt.mbits) - 1)
    if biased == 0:
        return sign * mant * 2.0 ** (fmt.emin - fmt.mbits)
    return sign * (1.0 + mant / (1 << fmt.mbits)) * 2.0 ** (biased - fmt.bias)


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def code_table(fmt: FloatFormat, device: torch.device | str = "cpu") -> torch.Tensor:
    """[2^bits] float32: the value of every code of `fmt`."""
    device = torch.device(device)
    key = (fmt.name, device)
    if key not in _TABLES:
        values = [_code_value(c, fmt) for c in range(fmt.n_codes)]
        _TABLES[key] = torch.tensor(values, dtype=torch.float64).to(torch.float32).to(device)
    return _TABLES[key]


def decode_codes(codes: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """uint8 codes [...] → float32 values [...] (exact)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"decode_codes needs uint8 codes, got {codes.dtype}")
    return code_table(fmt, codes.device)[codes.long()]


_PAIR_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def decode_packed(packed: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """[..., K/2] uint8 bytes holding two 4-bit codes (even element in the low nibble)
    → [..., K] float32 values. One gather per byte from a 256×2 table."""
    if fmt.bits != 4:
        raise ValueError(f"decode_packed needs a 4-bit format, got {fmt.name} ({fmt.bits} bits)")
    if packed.dtype != torch.uint8:
        raise TypeError(f"decode_packed needs uint8 bytes, got {packed.dtype}")
    key = (fmt.name, packed.device)
    if key not in _PAIR_TABLES:
        single = code_table(fmt, packed.device)
        byte = torch.arange(256, device=packed.device)
        _PAIR_TABLES[key] = torch.stack((single[byte & 0x0F], single[byte >> 4]), dim=-1)
    pairs = torch.index_select(_PAIR_TABLES[key], 0, packed.reshape(-1).to(torch.int32))
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 bytes [...] → float32 2^(b−127) [...]; 0xFF → NaN; 0x00 → 2^-127 (subnormal)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"e8m0_decode needs uint8 codes, got {codes.dtype}")
    values = _pow2(codes.to(torch.int32) - E8M0_BIAS)
    return torch.where(codes == E8M0_NAN, torch.full_like(values, math.nan), values)


def e8m0_from_exponent(exponent: torch.Tensor) -> torch.Tensor:
    """Unbiased integer exponent [...] → E8M0 byte [...], clamped to the finite range [-127, 127]."""
    return (torch.clamp(exponent.to(torch.int32), -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)
