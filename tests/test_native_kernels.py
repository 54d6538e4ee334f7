"""The native CPU kernels (mismatch/kernels/native.py) bit for bit against the torch code they
replace, their dispatch, and their build (cache, errors, the off switch).

They need a C compiler; this machine has one (gcc), and a machine without one skips them with
the reason — the torch code then runs everywhere (the `auto` mode's fallback, tested below with
a compiler that does not exist)."""

from __future__ import annotations

import functools
import os
import shutil
import time

import pytest
import torch

from mismatch.kernels import KernelError, native
from mismatch.kernels.bf16_gemm import _cpu_flags as cpu_flags
from mismatch.kernels.gemm import (accumulate_gemm, accumulate_gemm_grouped,
                                   accumulate_gemm_native)
from mismatch.quantize.accumulate import (ACCUMULATIONS, Accumulation, KSlices,
                                          accumulate_matmul, accumulate_matmul_reference)

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the native kernels cannot be built here")

PRESETS = sorted(ACCUMULATIONS) + ["t7-promote64"]


def _acc(name: str) -> Accumulation:
    if name == "t7-promote64":  # a register of 7 bits promoted every two slices
        return Accumulation(name=name, acc_mbits=7, promote_every=64)
    return ACCUMULATIONS[name]


def _e4m3(g, *shape, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).clamp(-448, 448).to(torch.float8_e4m3fn)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


@pytest.fixture(autouse=True)
def _fresh_library(monkeypatch):
    """Each test reads MISMATCH_NATIVE anew (the library is chosen once per process)."""
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    native.library.cache_clear()
    yield
    native.library.cache_clear()


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("m,k,n", [(1, 128, 256), (5, 128, 128), (37, 300, 50), (3, 17, 5),
                                   (8, 640, 33), (64, 128, 384), (0, 64, 16), (4, 32, 0)])
def test_the_native_gemm_is_the_torch_model_bit_for_bit(name, m, k, n):
    """Every row tail (1–3 rows), column tail, short last slice and empty shape, every register
    model; wide ranges (|a| up to 448, products on the whole E4M3 exponent range)."""
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    acc = _acc(name)
    a = _e4m3(g, m, k, scale=60.0)
    b = KSlices.of(_e4m3(g, k, n, scale=4.0).to(torch.bfloat16), acc.mma_k)
    assert b.e4m3
    got = accumulate_gemm_native(a, b, acc)
    assert torch.equal(_bits(got), _bits(accumulate_matmul(a, b, acc)))
    if m * k * n and m * k * n < 2e5:
        ref = accumulate_matmul_reference(a.float(), b.matrix().float(), acc)
        assert torch.equal(_bits(got), _bits(ref))


def test_special_values_nan_signed_zero_subnormal_and_extremes():
    """E4M3's NaN code, −0, its subnormals and ±448 in both operands; sums that cancel to ±0."""
    acc = ACCUMULATIONS["hopper-fp8-fast"]
    specials = torch.tensor([float("nan"), -0.0, 0.0, 2.0**-9, -(2.0**-9), 448.0, -448.0,
                             2.0**-6, 1.0, -1.0])
    g = torch.Generator().manual_seed(3)
    a = _e4m3(g, 12, 64, scale=8.0)
    a[:, :10] = specials.to(torch.float8_e4m3fn)
    a[5] = specials[1].to(torch.float8_e4m3fn)  # a row of −0: every output +0
    a[6, :] = torch.tensor(1.0).to(torch.float8_e4m3fn)
    bv = _e4m3(g, 64, 20, scale=2.0)
    bv[:9, 3] = specials[1:].to(torch.float8_e4m3fn)  # NaN-free: a NaN weight is not on the grid
    bv[:, 4] = torch.tensor(-1.0).to(torch.float8_e4m3fn)  # row 6 · column 4 = −64 exactly
    b = KSlices.of(bv, acc.mma_k)
    got = accumulate_gemm_native(a, b, acc)
    ref = accumulate_matmul(a, b, acc)
    assert torch.equal(got.isnan(), ref.isnan()) and got[0].isnan().all()
    fin = ~ref.isnan()
    assert torch.equal(_bits(got)[fin], _bits(ref)[fin])
    assert got[6, 4].item() == -64.0
    assert torch.equal(_bits(got[5]), torch.zeros(20, dtype=torch.int32))  # +0, not −0


@pytest.mark.parametrize("name", PRESETS)
def test_grouped_is_each_gemm_times_its_scale(name):
    """A fused-MoE stage: experts with 0–13 rows each, one call, each output scaled once."""
    g = torch.Generator().manual_seed(11)
    acc = _acc(name)
    rows = [3, 0, 13, 1, 7, 2, 5, 4]
    xs = [_e4m3(g, r, 128, scale=30.0) for r in rows]
    bs = [KSlices.of(_e4m3(g, 128, 96).to(torch.bfloat16), acc.mma_k) for _ in rows]
    scales = [torch.rand((), generator=g) * 1e-3 + 1e-5 for _ in rows]
    got = accumulate_gemm_grouped(xs, bs, acc, scales)
    torch_path = accumulate_gemm_grouped(xs, bs, acc, scales, backend="torch")
    for x, b, s, y, t in zip(xs, bs, scales, got, torch_path):
        want = accumulate_matmul(x, b, acc) * s
        assert torch.equal(_bits(y), _bits(want)) and torch.equal(_bits(t), _bits(want))
    unscaled = accumulate_gemm_grouped(xs, bs, acc)
    for x, b, y in zip(xs, bs, unscaled):
        assert torch.equal(_bits(y), _bits(accumulate_matmul(x, b, acc)))


def test_dispatch_takes_native_only_where_it_is_exact(monkeypatch):
    """auto: E4M3 × E4M3 KSlices → native; BF16 weights off the E4M3 grid, float32 inputs or a
    plain tensor → the torch model (same results as before, no native call)."""
    calls = []
    real = native.accumulate_grouped
    monkeypatch.setattr(native, "accumulate_grouped",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    acc = ACCUMULATIONS["hopper-fp8-fast"]
    g = torch.Generator().manual_seed(5)
    a = _e4m3(g, 6, 64, scale=10.0)
    on_grid = KSlices.of(_e4m3(g, 64, 32).to(torch.bfloat16), acc.mma_k)
    off_grid = KSlices.of(torch.randn(64, 32, generator=g).to(torch.bfloat16), acc.mma_k)
    assert on_grid.e4m3 and not off_grid.e4m3
    accumulate_gemm(a, on_grid, acc)
    assert len(calls) == 1
    for x, b in ((a, off_grid), (a.float(), on_grid), (a, on_grid.matrix())):
        assert torch.equal(accumulate_gemm(x, b, acc), accumulate_matmul(x, b, acc))
    assert torch.equal(accumulate_gemm(a, on_grid, acc, backend="torch"),
                       accumulate_matmul(a, on_grid, acc))
    assert len(calls) == 1
    with pytest.raises(KernelError, match="E4M3"):
        accumulate_gemm_native(a, off_grid, acc)


def _cpu_flags() -> set[str]:
    return cpu_flags() or set()


@pytest.mark.skipif(not {"avx2", "fma", "bmi2", "movbe"} <= _cpu_flags(),
                    reason="the AVX2 build runs only on a CPU with AVX2 and FMA")
def test_the_avx2_build_computes_the_same_bits(monkeypatch, tmp_path):
    """The library as an AVX2-only CPU builds it (-march=x86-64-v3: vectors of 4 doubles, its
    own tile) gives the torch code's bits too; on an AVX-512 CPU the default build uses
    vectors of 8."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    default = native.library()
    monkeypatch.setenv(native.MARCH_ENV, "x86-64-v3")
    avx2 = native._load()
    assert avx2.mismatch_native_vector_width() == 4
    if "avx512f" in _cpu_flags():
        assert default.mismatch_native_vector_width() == 8
    monkeypatch.setattr(native, "library", functools.cache(lambda: avx2))
    g = torch.Generator().manual_seed(21)
    for name in PRESETS:
        acc = _acc(name)
        rows = [5, 0, 9, 1, 4]
        xs = [_e4m3(g, r, 160, scale=30.0) for r in rows]
        bs = [KSlices.of(_e4m3(g, 160, 37).to(torch.bfloat16), acc.mma_k) for _ in rows]
        for x, b, y in zip(xs, bs, accumulate_gemm_grouped(xs, bs, acc)):
            assert torch.equal(_bits(y), _bits(accumulate_matmul(x, b, acc)))
    x = torch.randn(32, 64, generator=g) * 3
    s = torch.tensor(0.05)
    assert _same(native.fake_nvfp4_act(x, s), _nvfp4_reference(x, s))


def test_off_runs_the_torch_code(monkeypatch):
    monkeypatch.setenv(native.NATIVE_ENV, "off")
    assert not native.available()
    acc = ACCUMULATIONS["hopper-fp8-fast"]
    g = torch.Generator().manual_seed(2)
    xs = [_e4m3(g, 2, 32), _e4m3(g, 3, 32)]
    bs = [KSlices.of(_e4m3(g, 32, 16).to(torch.bfloat16), 32) for _ in xs]
    for x, b, y in zip(xs, bs, accumulate_gemm_grouped(xs, bs, acc)):
        assert torch.equal(y, accumulate_matmul(x, b, acc))


def test_bad_mode_and_missing_compiler_are_one_line_errors(monkeypatch, tmp_path):
    monkeypatch.setenv(native.NATIVE_ENV, "fast")
    with pytest.raises(KernelError, match="MISMATCH_NATIVE='fast': use one of auto, off, on"):
        native.library()
    native.library.cache_clear()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no library built here yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv(native.NATIVE_ENV, "on")
    with pytest.raises(KernelError) as err:
        native.library()
    assert "\n" not in str(err.value) and "MISMATCH_NATIVE=off" in str(err.value)
    native.library.cache_clear()
    monkeypatch.setenv(native.NATIVE_ENV, "auto")  # auto: a warning, then the torch code
    with pytest.warns(RuntimeWarning, match="running the torch code instead"):
        assert native.library() is None
    assert not any(tmp_path.rglob("*.so"))


def test_build_is_cached_and_leaves_no_temporary_files(monkeypatch, tmp_path):
    """A build leaves one finished library, a second process loads it, and a rebuild clears
    what a killed build left behind (an old build directory; a recent one may be another
    process's build in progress and stays)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    where = tmp_path / "mismatch" / "native"
    assert native.library() is not None
    built = sorted(p.name for p in where.iterdir())
    assert len(built) == 1 and built[0].startswith("mismatch_native_") and \
        built[0].endswith(".so")
    lib_path = where / built[0]
    mtime = lib_path.stat().st_mtime_ns
    native.library.cache_clear()
    assert native.library() is not None  # loaded, not rebuilt
    assert lib_path.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in where.iterdir()) == built
    stem = lib_path.name[:-len(".so")]
    stale, running = where / (stem + ".killed"), where / (stem + ".running")
    stale.mkdir()
    running.mkdir()
    old = time.time() - 2 * native._STALE_SECONDS
    os.utime(stale, (old, old))
    lib_path.unlink()
    native.library.cache_clear()
    assert native.library() is not None  # rebuilt
    assert sorted(p.name for p in where.iterdir()) == sorted([built[0], running.name])


def test_wrapper_rejects_mismatched_operands():
    g = torch.Generator().manual_seed(9)
    a = _e4m3(g, 4, 32)
    b = _e4m3(g, 32, 16).to(torch.bfloat16)
    with pytest.raises(KernelError, match="does not split"):
        native.accumulate_grouped(a, [3], [b], 13, 0, 32, 32)
    with pytest.raises(KernelError, match="bfloat16"):
        native.accumulate_grouped(a, [4], [b.float()], 13, 0, 32, 32)
    with pytest.raises(KernelError, match="E4M3 elements"):
        native.accumulate_grouped(a.float(), [4], [b], 13, 0, 32, 32)


# ------------------------------------------------------------------ NVFP4 activation fake-quant


def _nvfp4_reference(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    from mismatch.quantize.schemes import _fake_nvfp4_act
    return _fake_nvfp4_act(x, s)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, NaN where NaN (a NaN's sign and payload aside)."""
    nan = want.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(_bits(got)[~nan], _bits(want)[~nan])


def test_nvfp4_act_block_scales_at_every_e4m3_midpoint():
    """Block amaxes swept over every float32 between E4M3 neighbours' midpoints ± a few ulps
    (the scale's rounding, ties to even, subnormal scales, the 448 clamp) and over the E2M1
    midpoints of the elements (0.25, 0.75, … 5: ties to even, saturation at 6)."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[(e4m3 >= 0) & e4m3.isfinite()].unique()
    mids = (e4m3[:-1] + e4m3[1:]) / 2
    bits = mids.view(torch.int32)
    sweep = torch.cat([(bits + d).view(torch.float32) for d in range(-3, 4)]
                      + [e4m3, torch.tensor([448.0, 460.0, 1e30])])
    # amax · fl(1/6) · gs hits the swept values: input_scale 1/6 · 2^-3 (gs = 48 exactly)
    s = torch.tensor(1 / 48, dtype=torch.float32)
    gs = 1.0 / s
    amax = (sweep / gs.item() * 6.0).float()
    e2m1_mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 0.0, -0.25, -2.5, -5.0])
    blocks = []
    for a in amax.tolist():
        for shift in (0.0, 1e-3):
            row = (e2m1_mids / 6.0 + shift) * a
            blocks.append(torch.cat([torch.tensor([a]), row, torch.tensor([-a, 0.0, -0.0])]))
    x = torch.stack(blocks)
    assert x.shape[1] == 16
    assert _same(native.fake_nvfp4_act(x, s), _nvfp4_reference(x, s))


@pytest.mark.parametrize("seed", range(4))
def test_nvfp4_act_random_and_special_values(seed):
    """Rows over 12 decades, NaN (the whole block NaN), ±inf (saturates), all-zero and −0
    blocks, several input scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 128, generator=g) * torch.exp(torch.randn(64, 1, generator=g) * 4)
    x[3, 5] = float("nan")
    x[7, :16] = 0.0
    x[11, 16:32] = -0.0
    x[9, 20], x[10, 40] = float("inf"), -float("inf")
    for s in (torch.tensor(1e-4), torch.rand((), generator=g), torch.tensor(3.0e2)):
        got, want = native.fake_nvfp4_act(x, s), _nvfp4_reference(x, s)
        assert _same(got, want)
    assert got[3, :16].isnan().all() and not got[3, 16:].isnan().any()


def test_nvfp4_act_dispatch(monkeypatch):
    """kernels.fake_quant takes the native kernel for FP32 CPU tensors with an input scale —
    the reference's values — and keeps refusing NaN when asked to validate."""
    from mismatch.kernels import fake_quant
    from mismatch.quantize import QuantizeError

    calls = []
    real = native.fake_nvfp4_act
    monkeypatch.setattr(native, "fake_nvfp4_act", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(1)
    x, s = torch.randn(4, 32, generator=g), torch.tensor(0.02)
    assert _same(fake_quant(x, "nvfp4-act", global_scale=s, validate=False),
                 _nvfp4_reference(x, s))
    assert len(calls) == 1
    fake_quant(x.bfloat16(), "nvfp4-act", global_scale=s)  # BF16: the reference
    fake_quant(x, "nvfp4-act", global_scale=s, backend="torch")
    assert len(calls) == 1
    x[0, 0] = float("nan")
    with pytest.raises(QuantizeError, match="non-finite"):
        fake_quant(x, "nvfp4-act", global_scale=s)
    with pytest.raises(KernelError, match="multiple of 16"):
        native.fake_nvfp4_act(torch.zeros(2, 8), s)


def _rows_to_rank(g, b: int, v: int, kind: int) -> torch.Tensor:
    """Rows of one kind: log-softmax-like values, many ties, −inf outside a nucleus, NaN, ±0
    only, ±inf with NaN of either sign, all NaN."""
    x = torch.randn(b, v, generator=g) * 3
    if kind == 1:
        x = (x * 2).round() / 2
    elif kind == 2:
        x[x < -0.5] = float("-inf")
    elif kind == 3:
        x[torch.rand(b, v, generator=g) < 0.1] = float("nan")
    elif kind == 4:
        x = torch.where(torch.rand(b, v, generator=g) < 0.5, torch.tensor(0.0), torch.tensor(-0.0))
    elif kind == 5:
        x[torch.rand(b, v, generator=g) < 0.3] = float("inf")
        x[torch.rand(b, v, generator=g) < 0.1] = -float("nan")
    elif kind == 6:
        x = torch.full((b, v), float("nan"))
    return x


@pytest.mark.parametrize("kind", range(7))
def test_ranked_topk_is_the_torch_ranking(kind):
    """The native candidates are the torch code's — the same ids in the same order, the same
    value bits — on ties (lowest ids first), NaN of either sign (first, by id), −0 beside +0
    (tied), ±inf, k from 1 to beyond the row, a decode step's [64, 768] rows with k = 128, and
    a strided view."""
    from mismatch.engines.logits import ranked_topk_torch

    g = torch.Generator().manual_seed(kind)
    shapes = [(1, 1), (3, 2), (5, 17), (4, 300), (64, 768)]
    for b, v in shapes:
        x = _rows_to_rank(g, b, v, kind)
        for k in sorted({1, 2, v // 2 + 1, min(v, 128), v, v + 5}):
            got, want = native.ranked_topk(x, k), ranked_topk_torch(x, k)
            assert torch.equal(got[1], want[1]), (b, v, k)
            assert torch.equal(_bits(got[0]), _bits(want[0])), (b, v, k)
    wide = _rows_to_rank(g, 6, 100, kind)
    view = wide[::2, 10:90]  # rows two apart, a column offset: no copy of the rows
    got, want = native.ranked_topk(view, 9), ranked_topk_torch(view, 9)
    assert torch.equal(got[1], want[1]) and torch.equal(_bits(got[0]), _bits(want[0]))


def test_ranked_topk_dispatch(monkeypatch):
    """engines.logits.ranked_topk takes the native kernel for FP32 CPU matrices outside autograd
    only, and runs the torch code with MISMATCH_NATIVE=off."""
    from mismatch.engines import logits

    calls = []
    real = native.ranked_topk
    monkeypatch.setattr(native, "ranked_topk", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    want = logits.ranked_topk_torch(x, 5)
    got = logits.ranked_topk(x, 5)
    assert len(calls) == 1 and torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    logits.ranked_topk(x.double(), 5)
    logits.ranked_topk(x.requires_grad_(), 5)
    assert len(calls) == 1
    with pytest.raises(KernelError, match="float32 CPU matrix"):
        real(x.detach().double(), 5)
    monkeypatch.setenv(native.NATIVE_ENV, "off")
    native.library.cache_clear()
    assert torch.equal(logits.ranked_topk(x.detach(), 5)[1], want[1]) and len(calls) == 1
