"""Element formats, exhaustively: every code, every BF16 bit pattern, named edge cases.

References are written here in plain float64 Python (the format definitions from the OCP FP8 /
MX v1.0 specs), or are torch's own casts where torch has the dtype.
"""

from __future__ import annotations

import math

import pytest
import torch

from mismatch.quantize.formats import (
    E2M1,
    E4M3,
    E5M2,
    FORMATS,
    decode_codes,
    e8m0_decode,
    e8m0_from_exponent,
    encode_codes,
    get_format,
    round_to_format,
)

# Spec definitions, independent of quantize/formats.py: (ebits, mbits, bias, has_inf, nan_rule)
_SPEC = {
    "e2m1": (2, 1, 1, False, "none"),  # OCP MX v1.0 §5.3.3: no inf, no NaN
    "e4m3": (4, 3, 7, False, "all_ones"),  # OCP FP8: S.1111.111 is NaN, no inf
    "e5m2": (5, 2, 15, True, "ieee"),  # OCP FP8: IEEE-like
}


def _reference_value(code: int, name: str) -> float:
    ebits, mbits, bias, has_inf, nan_rule = _SPEC[name]
    sign = -1.0 if (code >> (ebits + mbits)) & 1 else 1.0
    exp = (code >> mbits) & ((1 << ebits) - 1)
    man = code & ((1 << mbits) - 1)
    if nan_rule == "all_ones" and exp == (1 << ebits) - 1 and man == (1 << mbits) - 1:
        return math.nan
    if nan_rule == "ieee" and exp == (1 << ebits) - 1:
        return sign * math.inf if man == 0 else math.nan
    if exp == 0:
        return sign * man * 2.0 ** (1 - bias - mbits)
    return sign * (1 + man * 2.0**-mbits) * 2.0 ** (exp - bias)


def _all_bf16() -> torch.Tensor:
    """Every BF16 bit pattern, as float32 (exact)."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.float().view(torch.int32), b.float().view(torch.int32))


@pytest.mark.parametrize("name", list(_SPEC))
def test_every_code_decodes_to_the_spec_value(name):
    fmt = get_format(name)
    codes = torch.arange(fmt.n_codes, dtype=torch.uint8)
    got = decode_codes(codes, fmt).double()
    ref = torch.tensor([_reference_value(c, name) for c in range(fmt.n_codes)], dtype=torch.float64)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    assert torch.equal(got[ok], ref[ok])
    assert torch.equal(torch.signbit(got[ok]), torch.signbit(ref[ok]))  # ±0 kept apart


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_every_fp8_code_matches_torch_dtype(fmt):
    codes = torch.arange(256, dtype=torch.uint8)
    ours = decode_codes(codes, fmt)
    torchs = codes.view(fmt.torch_dtype).float()
    assert torch.equal(torch.isnan(ours), torch.isnan(torchs))
    ok = ~torch.isnan(torchs)
    assert _same_bits(ours[ok], torchs[ok])


@pytest.mark.parametrize("name", list(_SPEC))
def test_every_code_round_trips(name):
    fmt = get_format(name)
    codes = torch.arange(fmt.n_codes, dtype=torch.uint8)
    values = decode_codes(codes, fmt)
    back = encode_codes(values, fmt)
    finite_or_inf = ~torch.isnan(values)
    assert torch.equal(back[finite_or_inf], codes[finite_or_inf])
    if fmt.nan_code is not None:  # every NaN code comes back as the canonical NaN
        assert torch.equal(back[~finite_or_inf] & (fmt.sign_bit - 1),
                           torch.full_like(back[~finite_or_inf], fmt.nan_code))


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_every_bf16_pattern_matches_torch_cast(fmt):
    x = _all_bf16()
    finite = ~torch.isnan(x)
    # torch 2.13 saturates E4M3; older releases gave NaN on overflow, so clamp as engines do.
    src = x.clamp(-fmt.max_finite, fmt.max_finite) if fmt.overflow == "saturate" else x
    torch_codes = src.to(fmt.torch_dtype).view(torch.uint8)
    our_codes = encode_codes(x, fmt)
    diff = (our_codes != torch_codes) & finite
    assert int(diff.sum()) == 0, f"{int(diff.sum())} of 65536 patterns differ, e.g. {x[diff][:4]}"
    our_values = round_to_format(x, fmt)
    assert _same_bits(our_values[finite], torch_codes.view(fmt.torch_dtype).float()[finite])
    assert bool(torch.isnan(our_values[~finite]).all())


def _reference_round(v: float, fmt_name: str, ties: str) -> float:
    """Nearest representable value by brute force over the code table, in float64."""
    ebits, mbits, *_ = _SPEC[fmt_name]
    n = 1 << (ebits + mbits)
    table = [(_reference_value(c, fmt_name), c) for c in range(n)]  # non-negative codes
    table = [(val, c) for val, c in table if math.isfinite(val)]
    mag = abs(v)
    top = max(val for val, _ in table)
    if mag >= top:
        best = top
    else:
        dists = sorted((abs(mag - val), val, c) for val, c in table)
        d0, val0, c0 = dists[0]
        tied = [(val, c) for d, val, c in dists if d == d0]
        if len(tied) > 1:
            if ties == "even":
                best = [val for val, c in tied if c % 2 == 0][0]
            else:
                best = min(val for val, _ in tied)
        else:
            best = val0
    return math.copysign(best, v)


@pytest.mark.parametrize("ties", ["even", "toward_zero"])
def test_every_bf16_pattern_to_e2m1_matches_float64_reference(ties):
    x = _all_bf16()
    x = x[torch.isfinite(x)]
    got = round_to_format(x, E2M1, ties=ties).double()
    # The reference is brute force over 8 magnitudes; evaluate it on the distinct magnitudes.
    mags = torch.unique(x.abs().double())
    ref_of = {m: _reference_round(m, "e2m1", ties) for m in mags.tolist()}
    ref = torch.tensor([ref_of[abs(v)] for v in x.double().tolist()], dtype=torch.float64)
    ref = torch.copysign(ref, x.double())
    assert torch.equal(got, ref)
    assert torch.equal(torch.signbit(got), torch.signbit(ref))


def test_e8m0_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    got = e8m0_decode(codes).double()
    for b in range(255):
        assert got[b].item() == 2.0 ** (b - 127), b
    assert math.isnan(got[255].item())
    # the exponent → byte map inverts decode on the finite range and clamps outside it
    exps = torch.arange(-127, 128)
    assert torch.equal(e8m0_from_exponent(exps), torch.arange(255, dtype=torch.uint8))
    assert e8m0_from_exponent(torch.tensor([-500, 500])).tolist() == [0, 254]


# name: (format, input, expected value, ties)
EDGE_CASES = {
    "e2m1 tie 0.25 to even 0": (E2M1, 0.25, 0.0, "even"),
    "e2m1 tie 0.75 to even 1.0": (E2M1, 0.75, 1.0, "even"),
    "e2m1 tie 1.25 to even 1.0": (E2M1, 1.25, 1.0, "even"),
    "e2m1 tie 1.75 to even 2.0": (E2M1, 1.75, 2.0, "even"),
    "e2m1 tie 2.5 to even 2.0": (E2M1, 2.5, 2.0, "even"),
    "e2m1 tie 3.5 to even 4.0": (E2M1, 3.5, 4.0, "even"),
    "e2m1 tie 5 to even 4.0": (E2M1, 5.0, 4.0, "even"),
    "e2m1 tie 0.75 toward zero": (E2M1, 0.75, 0.5, "toward_zero"),
    "e2m1 tie 1.75 toward zero": (E2M1, 1.75, 1.5, "toward_zero"),
    "e2m1 tie 3.5 toward zero": (E2M1, 3.5, 3.0, "toward_zero"),
    "e2m1 negative tie -3.5": (E2M1, -3.5, -4.0, "even"),
    "e2m1 saturates 7": (E2M1, 7.0, 6.0, "even"),
    "e2m1 saturates 1e30": (E2M1, 1e30, 6.0, "even"),
    "e2m1 saturates +inf": (E2M1, math.inf, 6.0, "even"),
    "e2m1 subnormal 0.5": (E2M1, 0.5, 0.5, "even"),
    "e2m1 just above tie 0.7500001": (E2M1, 0.7500001, 1.0, "toward_zero"),
    "e4m3 max normal 448": (E4M3, 448.0, 448.0, "even"),
    "e4m3 tie above max 464 saturates": (E4M3, 464.0, 448.0, "even"),
    "e4m3 overflow 1e6 saturates": (E4M3, 1e6, 448.0, "even"),
    "e4m3 -inf saturates": (E4M3, -math.inf, -448.0, "even"),
    "e4m3 min subnormal 2^-9": (E4M3, 2.0**-9, 2.0**-9, "even"),
    "e4m3 half min subnormal ties to 0": (E4M3, 2.0**-10, 0.0, "even"),
    "e4m3 1.5 x half subnormal rounds up": (E4M3, 1.5 * 2.0**-10, 2.0**-9, "even"),
    "e4m3 min normal 2^-6": (E4M3, 2.0**-6, 2.0**-6, "even"),
    "e4m3 tie 17 to even 16": (E4M3, 17.0, 16.0, "even"),
    "e4m3 tie 19 to even 20": (E4M3, 19.0, 20.0, "even"),
    "e5m2 max normal 57344": (E5M2, 57344.0, 57344.0, "even"),
    "e5m2 below overflow tie 61439": (E5M2, 61439.0, 57344.0, "even"),
    "e5m2 overflow tie 61440 to inf": (E5M2, 61440.0, math.inf, "even"),
    "e5m2 inf stays inf": (E5M2, -math.inf, -math.inf, "even"),
    "e5m2 min subnormal 2^-16": (E5M2, 2.0**-16, 2.0**-16, "even"),
}


@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_named_edge_cases(case):
    fmt, value, expected, ties = EDGE_CASES[case]
    got = round_to_format(torch.tensor([value], dtype=torch.float32), fmt, ties=ties).item()
    assert got == expected, f"{case}: {value} -> {got}, expected {expected}"


@pytest.mark.parametrize("fmt", [E2M1, E4M3, E5M2], ids=lambda f: f.name)
def test_signed_zero_and_nan(fmt):
    zeros = torch.tensor([0.0, -0.0, 1e-30, -1e-30])
    codes = encode_codes(zeros, fmt).tolist()
    assert codes == [0, fmt.sign_bit, 0, fmt.sign_bit]  # IEEE: sign survives rounding to 0
    nan = torch.tensor([math.nan])
    if fmt.nan_code is None:
        with pytest.raises(ValueError, match="no NaN code"):
            encode_codes(nan, fmt)
    else:
        assert encode_codes(nan, fmt).item() == fmt.nan_code
        assert math.isnan(round_to_format(nan, fmt).item())


def test_e4m3_nan_and_e5m2_inf_codes():
    assert encode_codes(torch.tensor([math.inf, -math.inf]), E5M2).tolist() == [0x7C, 0xFC]
    assert encode_codes(torch.tensor([math.inf]), E4M3).item() == 0x7E  # saturates to 448


def test_registry_refuses_unknown_and_lists_valid():
    with pytest.raises(ValueError, match="valid: e2m1, e4m3, e5m2"):
        get_format("e3m3")
    assert set(FORMATS) == {"e2m1", "e4m3", "e5m2"}


@pytest.mark.parametrize("ties", ["even", "toward_zero"])
@pytest.mark.parametrize("fmt", [E2M1, E4M3, E5M2], ids=lambda f: f.name)
def test_three_encoders_agree_on_every_bf16_pattern(fmt, ties):
    """encode_codes has a cast path (FP8), a threshold path (4-bit) and an arithmetic path;
    each must give the same magnitude code for every finite BF16 value below overflow."""
    from mismatch.quantize.formats import _magnitude_codes_arith, threshold_codes

    x = _all_bf16()
    x = x[torch.isfinite(x) & (x.abs() < fmt.max_finite * 1.0625)]  # keep clear of inf overflow
    arith = _magnitude_codes_arith(x.abs(), fmt, ties)
    thresh = threshold_codes(x.abs(), fmt, ties)
    assert torch.equal(arith, thresh)
    public = encode_codes(x, fmt, ties=ties) & (fmt.sign_bit - 1)
    assert torch.equal(public, arith)


@pytest.mark.parametrize("rule,expected", [("ieee", [0, 8, 0, 8, 8]), ("negative", [0, 0, 0, 8, 8]),
                                           ("nonpositive", [8, 8, 0, 8, 8])])
def test_sign_rules_on_zeros(rule, expected):
    x = torch.tensor([0.0, -0.0, 0.1, -0.1, -1.0])
    assert (encode_codes(x, E2M1, sign=rule) & 0x8).tolist() == expected


def test_decode_packed_matches_unpacked_lookup():
    from mismatch.quantize.qtensor import unpack_nibbles
    from mismatch.quantize.formats import decode_packed

    every = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    assert torch.equal(decode_packed(every, E2M1), decode_codes(unpack_nibbles(every), E2M1))


def _e2m1_reference(m: torch.Tensor) -> torch.Tensor:
    """float64 reference: the nearest E2M1 magnitude, ties to the even code, saturating at 6."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    dist = (m.double().clamp(max=7.0).unsqueeze(-1) - grid).abs()  # above 5: 6
    best = dist.min(dim=-1, keepdim=True).values
    tied = dist == best  # one or two codes at the least distance
    code = torch.where(tied[..., 1:] & tied[..., :-1], torch.arange(1, 8), -1)  # a tie's upper code
    upper = code.max(dim=-1).values
    first = tied.to(torch.int8).argmax(dim=-1)
    pick = torch.where((upper >= 0) & (upper % 2 == 0), upper, first)
    return grid[pick].float()


def test_e2m1_round_matches_the_code_table_around_every_midpoint():
    """The value-level E2M1 rounding (one integer add and one float add and subtract) equals a
    float64 nearest-value reference and threshold_codes' decoded values, bit for bit, on every
    finite non-negative BF16 value, on the float32 neighbours of every midpoint and E2M1 value,
    on 2^20 random float32 magnitudes, on zero and subnormals, and on +inf (saturates to 6)."""
    from mismatch.quantize.formats import e2m1_round_, threshold_codes

    ax = _all_bf16().abs()
    points = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0,
                           6.0, 7.0, 8.0, 1e-45, 1e-38, 2.0 ** -126])
    near, up, down = [points], points, points
    for _ in range(3):  # up to three float32 steps either side
        up = torch.nextafter(up, torch.tensor(math.inf))
        down = torch.nextafter(down, torch.tensor(0.0))
        near += [up, down]
    g = torch.Generator().manual_seed(0)
    rand = torch.rand(2**20, generator=g) * 9.0
    m = torch.cat([ax[torch.isfinite(ax)], *near, rand, torch.tensor([0.0, 1e30, 3.4e38])])
    got = e2m1_round_(m.clone())
    assert _same_bits(got, _e2m1_reference(m))
    assert _same_bits(got, decode_codes(threshold_codes(m, E2M1), E2M1))
    assert e2m1_round_(torch.tensor([math.inf])).item() == 6.0
    assert math.isnan(e2m1_round_(torch.tensor([math.nan])).item())


@pytest.mark.parametrize("ties", ["even", "toward_zero"])
def test_bucketize_and_compare_paths_agree_on_every_bf16_pattern(ties):
    """threshold_codes takes one bucketize call below 8192 elements and a sum of compares above;
    both must give the same code for every finite BF16 magnitude."""
    from mismatch.quantize.formats import threshold_codes

    ax = _all_bf16().abs()
    ax = ax[torch.isfinite(ax)]
    whole = threshold_codes(ax, E2M1, ties)  # compare path (65k elements)
    pieces = torch.cat([threshold_codes(c, E2M1, ties) for c in ax.split(4096)])  # bucketize
    assert torch.equal(whole, pieces)
