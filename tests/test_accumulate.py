"""The GEMM accumulation model against a scalar float64 loop written here, and the fast path
(`accumulate_matmul`) bit for bit against the plain one (`accumulate_matmul_reference`)."""

from __future__ import annotations

import math

import pytest
import torch

from mismatch.quantize import QuantizeError, fake_quant
from mismatch.quantize.accumulate import (ACCUMULATIONS, Accumulation, KSlices, accumulate_matmul,
                                 accumulate_matmul_batched, accumulate_matmul_reference, resolve,
                                 truncate_mantissa)


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
    x = torch.tensor([1.0 + 2**-10 + 2**-14, -(1.0 + 2**-10 + 2**-14), 0.0, 3.0],
                     dtype=torch.float64)
    assert truncate_mantissa(x, 10).tolist() == [1.0 + 2**-10, -(1.0 + 2**-10), 0.0, 3.0]


def test_error_ordering_at_k4096():
    """No promotion > promotion every 128 > FP32 accumulator (DeepSeek-V3 technical report,
    arXiv:2412.19437, §3.3.2: ~14-bit accumulation gives a maximum relative error of nearly 2%
    at K = 4096 on H800; this model's errors at K = 4096 are asserted below)."""
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


# ------------------------------------------------------------ fast path against the reference

def _bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Same dtype, shape and bit patterns (−0 and +0 differ)."""
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(
        x.view(torch.int32), y.view(torch.int32))


def _fp8_values(shape, g, spread: float = 8.0) -> torch.Tensor:
    """E4M3 element values (no scale): the GEMM inputs of an FP8 W8A8 layer."""
    return (torch.randn(shape, generator=g) * spread).to(torch.float8_e4m3fn).float()


def _fp16_values(shape, g) -> torch.Tensor:
    """FP16 values off the FP8 grid (11 significant bits), magnitudes in [2^-6, 2^4] or zero,
    so that every partial sum the model forms stays exact in float64 (the condition under
    which any two float64 GEMMs agree): products are multiples of 2^-32 below 2^8."""
    x = (torch.randn(shape, generator=g) * 2).clamp(-15.0, 15.0).half()
    x[x.abs() < 2**-6] = 0
    return x


_SHAPES = [(1, 576, 1536), (1, 1000, 3), (8, 1536, 576), (3, 31, 5), (2, 33, 4), (1, 1, 1),
           (19, 300, 23), (40, 4096, 24), (5, 130, 70), (0, 64, 8), (4, 64, 0)]


@pytest.mark.parametrize("mkn", _SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("acc", list(ACCUMULATIONS))
def test_fast_path_is_bit_exact_to_the_reference_on_fp8_values(mkn, acc):
    """Ragged K (not a multiple of 32), decode (M = 1), empty outputs, all three presets; the
    prepared operand (KSlices, stored in bfloat16) and the plain matrix give the same bits."""
    m, k, n = mkn
    g = torch.Generator().manual_seed(m * 131 + k * 7 + n)
    a, b = _fp8_values((m, k), g), _fp8_values((k, n), g)
    ref = accumulate_matmul_reference(a, b, acc)
    prepared = KSlices.of(b, 32)
    assert prepared.values.dtype == torch.bfloat16  # E4M3 values are exact in bfloat16
    assert _bits_equal(accumulate_matmul(a, b, acc), ref)
    assert _bits_equal(accumulate_matmul(a, prepared, acc), ref)
    # a transposed (strided) weight view and FP16/BF16 storage of the same values
    assert _bits_equal(accumulate_matmul(a.half(), b.t().contiguous().t().bfloat16(), acc), ref)


@pytest.mark.parametrize("mkn", [(1, 576, 64), (7, 100, 9), (16, 1024, 32)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("acc", list(ACCUMULATIONS))
def test_fast_path_is_bit_exact_to_the_reference_on_fp16_values(mkn, acc):
    m, k, n = mkn
    g = torch.Generator().manual_seed(k)
    a, b = _fp16_values((m, k), g), _fp16_values((k, n), g)
    prepared = KSlices.of(b, 32)
    assert prepared.values.dtype == torch.float32  # FP16 values are not all exact in bfloat16
    ref = accumulate_matmul_reference(a, b, acc)
    assert _bits_equal(accumulate_matmul(a, prepared, acc), ref)
    assert _bits_equal(accumulate_matmul(a, b, acc), ref)


@pytest.mark.parametrize("acc", [Accumulation(name="a", acc_mbits=4, promote_every=64, mma_k=16),
                                 Accumulation(name="b", acc_mbits=23, promote_every=None, mma_k=8),
                                 Accumulation(name="c", acc_mbits=None, promote_every=96)])
def test_fast_path_custom_accumulations(acc):
    """Other slice lengths, promotion periods and register widths, wide value ranges (spread 64:
    many saturated and subnormal E4M3 values), and the widening buffer's chunking (N large)."""
    g = torch.Generator().manual_seed(5)
    for m, k, n in [(3, 500, 5), (2, 200, 9000)]:
        a, b = _fp8_values((m, k), g, 64.0), _fp8_values((k, n), g, 64.0)
        assert _bits_equal(accumulate_matmul(a, KSlices.of(b, acc.mma_k), acc),
                           accumulate_matmul_reference(a, b, acc))


def test_fast_path_fp32_register_rounds_each_slice():
    """The FP32 register's rounding is visible: large and small slice sums alternate so that the
    float64 sum is not an FP32 value, and the fast path rounds it exactly as the reference."""
    # after slice 1 the register holds 48 (FP32 spacing 2^-18); slice 2 adds 2.25 · 2^-18
    a = torch.tensor([[1.0] * 32 + [3 * 2.0**-24] * 32 + [1.0] * 32], dtype=torch.float32)
    b = torch.full((96, 1), 1.5)
    ref = accumulate_matmul_reference(a, b, "fp32")
    assert _bits_equal(accumulate_matmul(a, b, "fp32"), ref)
    assert float(ref) != float(a.double() @ b.double())  # the register rounded something


@pytest.mark.parametrize("acc", list(ACCUMULATIONS))
def test_fast_path_signed_zeros(acc):
    """Products of −0 (zero activations, negative weights) and sums that cancel give +0, as the
    reference's zero-initialized registers do (bit patterns, so −0 would count as a difference)."""
    a = torch.tensor([[0.0] * 40, [1.0, -1.0] * 20, [-0.0] * 40])
    b = -torch.ones(40, 3)
    ref = accumulate_matmul_reference(a, b, acc)
    assert _bits_equal(accumulate_matmul(a, b, acc), ref)
    assert _bits_equal(ref, torch.zeros(3, 3))


def test_prepared_operand_checks():
    b = torch.ones(40, 3)
    prepared = KSlices.of(b, 32)
    assert prepared.shape == (40, 3) and prepared.values.shape == (2, 32, 3)
    assert torch.equal(prepared.matrix(), b.bfloat16())
    assert float(prepared.values[1, 8:].abs().sum()) == 0.0  # zero padding
    with pytest.raises(QuantizeError, match="mma_k=16"):
        accumulate_matmul(torch.ones(2, 40), prepared,
                          Accumulation(name="x", acc_mbits=13, promote_every=None, mma_k=16))
    with pytest.raises(QuantizeError, match=r"\[M, K\] @ \[K, N\]"):
        accumulate_matmul(torch.ones(2, 41), prepared, "fp32")
    assert KSlices.of(torch.tensor([[1.0 + 2**-20]]), 32).values.dtype == torch.float32
    assert KSlices.of(torch.tensor([[1.0 + 2**-40]], dtype=torch.float64),
                      32).values.dtype == torch.float64


@pytest.mark.parametrize("acc", list(ACCUMULATIONS) + [
    Accumulation(name="c", acc_mbits=None, promote_every=96),
    Accumulation(name="d", acc_mbits=4, promote_every=64, mma_k=16)])
def test_batched_equals_one_gemm_per_operand(acc):
    """The batched GEMM (a fused MoE layer's experts at once) gives each batch the bits of its
    own `accumulate_matmul`, rows zero-padded to the longest included; ragged K, an empty M."""
    g = torch.Generator().manual_seed(11)
    mk = resolve(acc).mma_k
    for nb, m, k, n in [(8, 5, 128, 256), (3, 1, 100, 7), (2, 17, 70, 33), (4, 0, 64, 8)]:
        a = _fp8_values((nb, m, k), g, 16.0)
        bs = [KSlices.of(_fp8_values((k, n), g, 16.0), mk) for _ in range(nb)]
        out = accumulate_matmul_batched(a, bs, acc)
        assert out.shape == (nb, m, n) and out.dtype == torch.float32
        for j in range(nb):
            assert _bits_equal(out[j], accumulate_matmul(a[j], bs[j], acc))
            assert _bits_equal(out[j], accumulate_matmul_reference(a[j], bs[j].matrix().float(),
                                                                   acc))
    with pytest.raises(QuantizeError, match="one shape"):
        accumulate_matmul_batched(torch.ones(2, 3, 64), [KSlices.of(torch.ones(64, 4), mk),
                                                         KSlices.of(torch.ones(64, 5), mk)], acc)
    with pytest.raises(QuantizeError, match="B operands"):
        accumulate_matmul_batched(torch.ones(3, 64), [KSlices.of(torch.ones(64, 4), mk)], acc)


# ------------------------------------------- the emulator's FP8 GEMMs against per-linear ones

@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("accumulation", ["hopper-fp8-fast", "hopper-fp8-promote128"])
def test_emulated_fp8_gemms_equal_per_linear_reference(kind, accumulation, tiny_qwen3_dir,
                                                       tiny_moe_dir, monkeypatch):
    """An FP8 W8A8 model's logits, with the emulator's fused q/k/v and gate/up GEMMs, one
    activation quantization per MoE stage and prepared weights, equal bit for bit those of the
    plain per-linear path: encode, decode the codes, `accumulate_matmul_reference` on each
    linear's (and each expert's) own rows, scale."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from mismatch.engines.numerics import _Emulator, apply_numerics, calibrate
    from mismatch.engines.served_weights import build_table
    from mismatch.profiles import resolve as resolve_spec
    from mismatch.quantize import encode
    from mismatch.quantize.formats import decode_codes, get_format

    path = tiny_qwen3_dir if kind == "dense" else tiny_moe_dir
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    spec = dataclasses.replace(resolve_spec("h100", "fp8"), accumulation=accumulation)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    scales = calibrate(model, spec, [(ids[:1], mask[:1])])
    table = build_table(model, spec)
    assert all(e.group_slices is not None for e in table.values())
    assert any(e.cols[0] > 0 for e in table.values())  # fused groups exist

    def logits():
        with torch.no_grad(), apply_numerics(model, spec, scales):
            return model(input_ids=ids, attention_mask=mask).logits.float()

    fast = logits()
    plain_gemm = _Emulator.gemm

    def per_linear_gemm(self, x2, entry, xq=None, source=None):
        if entry.group_slices is None or self.amax is not None:
            return plain_gemm(self, x2, entry, xq, source)
        q = encode(x2, self.spec.activation_codec, global_scale=self.act_scales[entry.act_key],
                   validate=False)
        elems = decode_codes(q.codes, get_format("e4m3"))
        lo, hi = entry.cols
        weight = entry.group_slices.matrix()[:, lo:hi].float()  # this linear's [K, N]
        y = accumulate_matmul_reference(elems, weight, self.spec.accumulation)
        return y * (q.scales * entry.weight_scale)

    monkeypatch.setattr(_Emulator, "gemm", per_linear_gemm)
    monkeypatch.setattr(_Emulator, "batched", lambda self: False)  # each expert its own rows
    reference = logits()
    assert _bits_equal(fast, reference)
    with torch.no_grad():
        assert not torch.equal(model(input_ids=ids, attention_mask=mask).logits.float(), fast)
