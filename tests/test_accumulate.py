"""The GEMM accumulation model against a scalar float64 loop written here."""

from __future__ import annotations

import math

import pytest
import torch

from quantize import QuantizeError, fake_quant
from quantize.accumulate import ACCUMULATIONS, Accumulation, accumulate_matmul, truncate_mantissa


def _truncate(v: float, mbits: int) -> float:
    if v == 0.0 or not math.isfinite(v):
        return v
    m, e = math.frexp(v)
    step = 2.0 ** (mbits + 1)
    return math.ldexp(math.trunc(m * step) / step, e)


def _reference(a, b, mbits, promote_every, mma_k):
    """One output element at a time, one K slice at a time, plainly."""
    m, k = len(a), len(a[0])
    n = len(b[0])
    out = [[0.0] * n for _ in range(m)]
    for i in range(m):
        for j in range(n):
            partial, total, since = 0.0, 0.0, 0
            for k0 in range(0, k, mma_k):
                s = math.fsum(a[i][kk] * b[kk][j] for kk in range(k0, min(k0 + mma_k, k)))
                partial = _truncate(partial + s, mbits)
                since += min(k0 + mma_k, k) - k0
                if promote_every and since >= promote_every:
                    total = float(torch.tensor(total + partial, dtype=torch.float32))
                    partial, since = 0.0, 0
            out[i][j] = float(torch.tensor(total, dtype=torch.float32) +
                              torch.tensor(partial, dtype=torch.float32))
    return torch.tensor(out, dtype=torch.float32)


@pytest.mark.parametrize("mbits,promote", [(13, None), (13, 64), (7, 32), (4, None)])
def test_matches_scalar_reference(mbits, promote):
    g = torch.Generator().manual_seed(0)
    a = fake_quant(torch.randn(3, 256, generator=g), "fp8-act")
    b = fake_quant(torch.randn(256, 2, generator=g), "fp8-channel")
    acc = Accumulation(name="t", acc_mbits=mbits, promote_every=promote)
    got = accumulate_matmul(a, b, acc)
    ref = _reference(a.double().tolist(), b.double().tolist(), mbits, promote, 32)
    assert torch.equal(got, ref)


def test_truncation_rounds_toward_zero():
    x = torch.tensor([1.0 + 2**-10 + 2**-14, -(1.0 + 2**-10 + 2**-14), 0.0, 3.0], dtype=torch.float64)
    assert truncate_mantissa(x, 10).tolist() == [1.0 + 2**-10, -(1.0 + 2**-10), 0.0, 3.0]


def test_error_ordering_at_k4096():
    """No promotion > promotion every 128 > FP32 accumulator (NUMERICS.md §2 measured 3.4e-3,
    1.3e-4 and 9.5e-8 relative error with this model at K = 4096)."""
    g = torch.Generator().manual_seed(1)
    a = fake_quant(torch.randn(16, 4096, generator=g), "fp8-act")
    b = fake_quant(torch.randn(4096, 16, generator=g), "fp8-channel")
    ref = a.double() @ b.double()
    err = {name: ((accumulate_matmul(a, b, name).double() - ref).norm() / ref.norm()).item()
           for name in ACCUMULATIONS}
    assert err["hopper-fp8-fast"] > 10 * err["hopper-fp8-promote128"] > 10 * err["fp32"]
    assert 1e-3 < err["hopper-fp8-fast"] < 1e-2
    assert err["fp32"] < 1e-6


def test_bad_configs():
    with pytest.raises(ValueError, match="multiple of mma_k"):
        Accumulation(name="x", acc_mbits=13, promote_every=100)
    with pytest.raises(ValueError, match="acc_mbits"):
        Accumulation(name="x", acc_mbits=30, promote_every=None)
    with pytest.raises(QuantizeError, match="valid: fp32, hopper-fp8-fast"):
        accumulate_matmul(torch.zeros(2, 2), torch.zeros(2, 2), "tf32")
    with pytest.raises(QuantizeError, match=r"\[M, K\] @ \[K, N\]"):
        accumulate_matmul(torch.zeros(2, 3), torch.zeros(2, 2), "fp32")


def test_truncate_mantissa_bit_mask_equals_frexp_trunc_on_random_normals():
    """The integer mask is the float definition: ldexp(trunc(m·2^(b+1)) / 2^(b+1), e)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-60, 60, (20000,), generator=g).double())
    x[:3] = torch.tensor([0.0, -0.0, 1.0], dtype=torch.float64)
    for mbits in (0, 7, 13, 23, 52):
        m, e = torch.frexp(x)
        step = float(2 ** (mbits + 1))
        reference = torch.ldexp(torch.trunc(m * step) / step, e)
        assert torch.equal(truncate_mantissa(x, mbits), reference), mbits
