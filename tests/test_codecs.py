"""Block codecs against independent references: plain float64/float32 Python written here,
modelopt's own quantizers, and torchao's MX reference (optional packages skip with a reason)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mismatch.quantize import CODECS, QuantizeError, decode, encode, fake_quant
from mismatch.quantize.qtensor import pack_nibbles, unpack_nibbles

E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e2m1_rne(v: float) -> int:
    """Magnitude index of the nearest E2M1 value, ties to the even index, saturating."""
    mag = abs(v)
    if mag >= 6.0:
        return 7
    dists = [abs(mag - e) for e in E2M1_VALUES]
    best = min(dists)
    idx = [i for i, d in enumerate(dists) if d == best]
    return idx[0] if len(idx) == 1 else [i for i in idx if i % 2 == 0][0]


def _e4m3_rne(v: float) -> float:
    """Nearest E4M3FN value (ties to even mantissa), saturating at 448; plain float64."""
    values = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            values.append((m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    mag = min(abs(v), 448.0)
    best = min(values, key=lambda c: (abs(mag - c), (values.index(c) % 2)))
    return math.copysign(best, v)


def _rand(shape, seed, dtype=torch.bfloat16, spread=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if spread:  # rows of very different magnitudes, as real weights have
        x = x * torch.exp(torch.randn(shape[:-1] + (1,), generator=g) * 2)
    return x.to(dtype)


# ------------------------------------------------------------------ independent references


def test_mxfp4_ocp_floor_matches_plain_reference():
    x = _rand((8, 64), seed=1)
    q = encode(x, "mxfp4")
    codes = unpack_nibbles(q.codes).reshape(8, 2, 32)
    xs = x.double().reshape(8, 2, 32)
    for r in range(8):
        for b in range(2):
            block = xs[r, b].tolist()
            amax = max(abs(v) for v in block)
            exp = math.frexp(amax)[1] - 1 - 2  # floor(log2 amax) − emax(E2M1)
            assert q.scales[r, b].item() == exp + 127
            for i, v in enumerate(block):
                idx = _e2m1_rne(v / 2.0**exp)
                sign = 8 if math.copysign(1, v) < 0 else 0
                assert codes[r, b, i].item() == sign | idx, (r, b, i, v)


def test_nvfp4_activation_kernel_order_matches_plain_float32_reference():
    x = _rand((4, 32), seed=2)
    input_scale = torch.tensor(float(x.float().abs().max()) / 2688.0 * 0.9)  # a calibrated-ish scale
    q = encode(x, "nvfp4-act", global_scale=input_scale)
    codes = unpack_nibbles(q.codes).reshape(4, 2, 16)
    f32 = np.float32
    s_in = f32(input_scale.item())
    gs = f32(1) / s_in
    for r in range(4):
        for b in range(2):
            block = [f32(v) for v in x.float().reshape(4, 2, 16)[r, b].tolist()]
            amax = max(abs(v) for v in block)
            sf = _e4m3_rne(float(gs * (amax * (f32(1) / f32(6)))))
            assert q.scales[r, b].float().item() == sf
            out_scale = f32(1) / (f32(sf) * (f32(1) / gs)) if sf != 0 else f32(0)
            for i, v in enumerate(block):
                scaled = float(v * out_scale)
                sign = 8 if math.copysign(1, scaled) < 0 else 0
                assert codes[r, b, i].item() == sign | _e2m1_rne(scaled), (r, b, i)
    # decode: q · SF · input_scale
    dec = decode(q)
    vals = torch.tensor(E2M1_VALUES + [-v for v in E2M1_VALUES])[unpack_nibbles(q.codes).long()]
    ref = vals.reshape(4, 2, 16) * q.scales.float().unsqueeze(-1) * input_scale
    assert torch.equal(dec, ref.reshape(4, 32))


def test_fp8_granularities_match_plain_reference():
    x = _rand((256, 256), seed=3)
    xf = x.float()
    # per-channel: one scale per row, amax / 448, float32 division
    q = encode(x, "fp8-channel")
    scale = xf.abs().amax(-1, keepdim=True) / 448.0
    assert torch.equal(q.scales, scale)
    ref = (xf / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(q.codes, ref)
    # 128x128 blocks
    q = encode(x, "fp8-block128")
    assert q.scales.shape == (2, 2)
    for i in range(2):
        for j in range(2):
            tile = xf[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            s = tile.abs().max() / 448.0
            assert q.scales[i, j] == s
            ref = (tile / s).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
            assert torch.equal(q.codes[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128], ref)
    # 1x128 groups
    q = encode(x, "fp8-group128")
    assert q.scales.shape == (256, 2)
    assert torch.equal(q.scales[:, 1], xf[:, 128:].abs().amax(-1) / 448.0)
    # per-tensor, modelopt order: the division happens in BF16
    q = encode(x, "fp8")
    s = xf.abs().max() / 448.0
    assert torch.equal(q.codes, (x / s).to(torch.float8_e4m3fn).view(torch.uint8))
    assert (x / s).dtype == torch.bfloat16


def test_fp8_division_order_matters():
    """The per-tensor BF16-division order (modelopt) and FP32 division differ on real data —
    the reason the codec table names the order (the share of codes that differ is asserted
    below)."""
    x = _rand((512, 512), seed=4)
    s = x.float().abs().max() / 448.0
    bf16_div = (x / s).to(torch.float8_e4m3fn).view(torch.uint8)
    f32_div = (x.float() / s).to(torch.float8_e4m3fn).view(torch.uint8)
    frac = (bf16_div != f32_div).float().mean().item()
    assert 0.001 < frac < 0.1, frac


# ------------------------------------------------------------------ modelopt and torchao


@pytest.mark.parametrize("seed", range(4))
def test_nvfp4_and_mxfp4_match_modelopt_quantizers(seed):
    qt = pytest.importorskip("modelopt.torch.quantization.qtensor",
                             reason="nvidia-modelopt not installed (pip install -e '.[quantize]')")
    x = _rand((96, 256), seed=seed)
    x[0, :16] = 0.0  # an all-zero block: modelopt sets its scale to 1.0
    x[1, 3] = -0.0
    ref_q, ref_s, ref_s2 = qt.NVFP4QTensor.quantize(x, 16)
    ours = encode(x, "nvfp4")
    assert int((ref_q._quantized_data != ours.codes).sum()) == 0
    assert torch.equal(ref_s.view(torch.uint8), ours.scales.view(torch.uint8))
    assert torch.equal(ref_s2.float(), ours.global_scale)
    ref_q, ref_e = qt.MXFP4QTensor.quantize(x, 32)
    ours = encode(x, "mxfp4-modelopt")
    assert int((ref_q._quantized_data != ours.codes).sum()) == 0
    assert torch.equal(ref_e.reshape(ours.scales.shape), ours.scales)


def test_fp8_matches_modelopt_weight_cast():
    qu = pytest.importorskip("modelopt.torch.export.quant_utils",
                             reason="nvidia-modelopt not installed (pip install -e '.[quantize]')")
    x = _rand((128, 256), seed=7)
    scale = x.float().abs().max() / 448.0
    ref = qu.to_quantized_weight(x, scale, "fp8")
    assert torch.equal(ref.view(torch.uint8), encode(x, "fp8").codes)


@pytest.mark.parametrize("mode", ["FLOOR", "RCEIL"])
@pytest.mark.parametrize("seed", range(3))
def test_mxfp4_matches_torchao(mode, seed):
    pytest.importorskip("torchao", reason="torchao not installed (pip install -e '.[quantize]')")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    x = _rand((64, 512), seed=seed)
    scales, data = to_mx(x, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode[mode])
    ours = encode(x, "mxfp4" if mode == "FLOOR" else "mxfp4-rceil")
    assert torch.equal(data.view(torch.uint8), ours.codes)
    assert torch.equal(scales.view(torch.uint8).reshape(ours.scales.shape), ours.scales)


def test_rceil_exponent_is_exact_where_float_log2_is_not():
    """amax/6 one ulp above 2^k must round up to 2^(k+1): the hardware `cvt.rp` rule. A float32
    log2 rounds log2(2^k·(1+2^-23)) down to k for k ≥ 4, which is why the codec reads bits."""
    for k in (4, 10, 20):
        descale = np.float32(2.0**k) * np.float32(1 + 2.0**-23)
        x = torch.zeros(1, 32)
        x[0, 0] = float(np.float32(descale) * np.float32(6))
        descale32 = x[0, 0] / 6.0  # what the codec computes
        expected = math.ceil(math.log2(float(descale32)))  # float64 log2 is exact enough here
        assert encode(x, "mxfp4-rceil").scales.item() == expected + 127
        assert encode(x, "mxfp4-modelopt").scales.item() == k + 127  # float log2: one binade low


# ------------------------------------------------------------------ edge blocks and properties


EDGE_BLOCKS = {
    "all zero": torch.zeros(2, 32),
    "tiny": torch.full((2, 32), 1e-30),
    "one spike": torch.cat([torch.full((2, 31), 1e-3), torch.full((2, 1), 300.0)], dim=1),
    "huge": torch.full((2, 32), 1e38),
    "mixed signs": torch.linspace(-6, 6, 64).reshape(2, 32),
}


@pytest.mark.parametrize("block", list(EDGE_BLOCKS))
@pytest.mark.parametrize("codec", ["mxfp4", "mxfp4-rceil", "nvfp4", "nvfp4-act", "fp8-channel"])
def test_edge_blocks_decode_finite_and_close(block, codec):
    x = EDGE_BLOCKS[block].to(torch.bfloat16)
    y = decode(encode(x, codec))
    assert bool(torch.isfinite(y).all()), f"{codec} on {block}: non-finite decode"
    # every decoded block keeps its largest element within the format's relative step
    rel = ((y - x.float()).abs().amax() / x.float().abs().amax().clamp_min(1e-38)).item()
    bound = 0.07 if codec.startswith("fp8") else 0.26  # E4M3: 2^-4 step; E2M1 near 6: 4→6 gap/2
    if block == "tiny" and codec == "nvfp4":
        bound = 1.0  # global scale underflows the E4M3 block-scale floor 2^-9 (modelopt clamps)
    assert rel <= bound, f"{codec} on {block}: relative error {rel}"


def test_rceil_near_float32_max_overflows_on_decode_but_floor_does_not():
    """Documented edge: a block whose amax is near FP32's max gets an RCEIL scale of 2^126 and an
    element that rounds up to 4, so the decoded value 2^128 is not an FP32 number. The OCP floor
    rule picks 2^125 and stays finite. No real weight or activation lives there."""
    x = torch.full((1, 32), 3.3e38).to(torch.bfloat16)
    assert bool(torch.isinf(decode(encode(x, "mxfp4-rceil"))).all())
    assert bool(torch.isfinite(decode(encode(x, "mxfp4"))).all())


def test_all_zero_blocks_storage():
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    assert encode(x, "mxfp4").scales.tolist() == [[0]] * 4  # E8M0 2^-127
    q = encode(x, "nvfp4")
    assert bool((q.scales.float() == 1.0).all())  # modelopt: zero block scale → 1.0
    assert bool((q.codes == 0).all())
    assert bool((encode(x, "mxfp4-modelopt").codes == 0x88).all())  # modelopt stores −0


@pytest.mark.parametrize("codec", ["mxfp4", "mxfp4-rceil", "fp8-channel", "fp8-block128", "bf16"])
def test_fake_quant_is_idempotent(codec):
    x = _rand((128, 256), seed=11)
    once = fake_quant(x.float(), codec)
    assert torch.equal(fake_quant(once, codec), once)


def test_stacked_experts_with_per_expert_global_scale():
    w = _rand((4, 32, 64), seed=12)
    s2 = w.float().abs().amax(dim=(-2, -1), keepdim=True) / 2688.0  # [E, 1, 1]
    stacked = encode(w, "nvfp4", global_scale=s2)
    for e in range(4):
        alone = encode(w[e], "nvfp4")
        assert torch.equal(stacked.codes[e], alone.codes)
        assert torch.equal(stacked.scales[e].view(torch.uint8), alone.scales.view(torch.uint8))
    assert torch.equal(decode(stacked)[2], decode(encode(w[2], "nvfp4")))


def test_pack_unpack_every_byte():
    every = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    assert torch.equal(pack_nibbles(unpack_nibbles(every)), every)
    assert unpack_nibbles(torch.tensor([0x21], dtype=torch.uint8)).tolist() == [1, 2]  # low first


def test_storage_sizes_are_real():
    x = _rand((64, 256), seed=13)
    assert encode(x, "nvfp4").nbytes() == 64 * 128 + 64 * 16 + 4
    assert encode(x, "mxfp4").nbytes() == 64 * 128 + 64 * 8
    assert encode(x, "fp8").nbytes() == 64 * 256 + 4


# ------------------------------------------------------------------ bad input


def test_unknown_codec_lists_valid_ones():
    with pytest.raises(QuantizeError, match="valid formats: bf16, fp16, fp8"):
        encode(torch.zeros(16), "fp3")


@pytest.mark.parametrize("codec,block", [("nvfp4", 16), ("mxfp4", 32), ("fp8-group128", 128)])
def test_indivisible_last_dimension_names_shape_and_block(codec, block):
    with pytest.raises(QuantizeError, match=rf"shape \(4, 40\).*block size {block}"):
        encode(torch.zeros(4, 40), codec)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("codec", ["nvfp4", "mxfp4", "fp8"])
def test_non_finite_input_is_refused_with_position(bad, codec):
    x = torch.zeros(4, 32)
    x[2, 5] = bad
    with pytest.raises(QuantizeError, match=r"1 non-finite value\(s\) \(first at index \(2, 5\)\)"):
        encode(x, codec)


def test_codec_table_is_data():
    assert len(CODECS) == len(set(CODECS))
    from mismatch.quantize.codecs import CodecSpec, register

    with pytest.raises(ValueError, match="registered twice"):
        register(CodecSpec(name="nvfp4", scheme="cast", cast_dtype_name="float16", description=""))


def test_all_zero_tensor_round_trips_and_bad_global_scale_is_refused():
    z = torch.zeros(3, 32)
    for codec in ("nvfp4", "nvfp4-act", "mxfp4", "fp8", "fp8-channel"):
        assert torch.equal(decode(encode(z, codec)), z), codec
    with pytest.raises(QuantizeError, match="global_scale must be positive and finite"):
        encode(torch.ones(2, 16), "nvfp4-act", global_scale=torch.tensor(0.0))


@pytest.mark.parametrize("codec", ["fp8-act", "nvfp4-act"])
@pytest.mark.parametrize("seed", range(3))
def test_direct_fake_quant_equals_decode_of_encode(codec, seed):
    x = _rand((33, 256), seed=seed)
    x[0, :16] = 0  # an all-zero block
    x[1, 5] = -0.0
    scale = torch.tensor(float(x.float().abs().max()) / (448.0 if codec == "fp8-act" else 2688.0))
    for s in (scale, scale * 0.25, scale * 8):  # calibrated scales below and above this amax
        ref = decode(encode(x, codec, global_scale=s), x.dtype)
        assert torch.equal(fake_quant(x, codec, global_scale=s), ref)
    big = _rand((300, 256), seed=seed, dtype=torch.float32)  # the large-tensor encode path
    ref = decode(encode(big, codec, global_scale=scale), torch.float32)
    assert torch.equal(fake_quant(big, codec, global_scale=scale), ref)


def test_direct_nvfp4_activation_is_bit_identical_at_the_edges():
    """fake_quant's nvfp4-act twin equals decode∘encode in every bit (the sign of zero too) on
    blocks that meet each branch: a zero block, a -0.0 element, a block whose E4M3 scale rounds
    to 0 (tiny values), blocks whose scale saturates at 448 (a small calibrated scale), an
    infinite element (saturates to 6 · scale), and elements on E2M1 midpoints."""
    x = _rand((64, 128), seed=7, dtype=torch.float32)
    x[0, :16] = 0.0
    x[1, 3] = -0.0
    x[2, :16] = 1e-30
    x[3, 16:32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25,
                                -2.5, -3.5, -5.0, 6.0, -7.0, 0.0])
    x[4, 5] = math.inf
    x[5, 7] = -math.inf
    for s in (torch.tensor(1.0 / 2688.0), torch.tensor(1e-6), torch.tensor(3.0)):
        ref = decode(encode(x, "nvfp4-act", global_scale=s, validate=False), torch.float32)
        got = fake_quant(x, "nvfp4-act", global_scale=s, validate=False)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), s
    assert torch.signbit(got[1, 3]) and got[4, 5] > 0 and got[5, 7] < 0


def test_precision_table_reads_its_codecs():
    """Each precision's block, scale format and activation-scale divisor are its codecs' own;
    a precision name registers once."""
    from mismatch.quantize.precisions import KV_CACHE_CODECS, PRECISIONS, register_precision

    assert list(PRECISIONS) == ["bf16", "fp16", "fp8", "fp8-block128", "w4a16-nvfp4", "nvfp4",
                                "mxfp4"]
    assert {n: p.block for n, p in PRECISIONS.items()} == {
        "bf16": 0, "fp16": 0, "fp8": 0, "fp8-block128": 128, "w4a16-nvfp4": 16, "nvfp4": 16,
        "mxfp4": 32}
    assert PRECISIONS["fp8"].activation_scale_divisor == 448.0
    assert PRECISIONS["nvfp4"].activation_scale_divisor == 6.0 * 448.0
    for name in ("mxfp4", "fp8-block128", "w4a16-nvfp4", "bf16"):  # dynamic blocks, or none
        assert PRECISIONS[name].activation_scale_divisor is None
    assert PRECISIONS["fp8-block128"].scale_format == "FP32 per 128x128 block"
    assert PRECISIONS["nvfp4"].scale_format == "E4M3 per 16 + FP32 per tensor"
    assert PRECISIONS["mxfp4"].scale_format == "E8M0 per 32"
    assert [n for n, p in PRECISIONS.items() if p.is_cast] == ["bf16", "fp16"]
    assert KV_CACHE_CODECS == {"bf16": None, "fp8": "fp8-act"}
    with pytest.raises(ValueError, match="registered twice"):
        register_precision(PRECISIONS["fp8"])


def test_checkpoint_formats_take_their_codec_from_the_precision():
    from mismatch.quantize.checkpoint_formats import CHECKPOINT_FORMATS

    assert {n: (f.codec, f.block) for n, f in CHECKPOINT_FORMATS.items()} == {
        "fp8": ("fp8", 0), "nvfp4": ("nvfp4", 16), "w4a16-nvfp4": ("w4a16-nvfp4", 16),
        "mxfp4": ("mxfp4-modelopt", 32)}
