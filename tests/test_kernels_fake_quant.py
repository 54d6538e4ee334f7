"""Fake-quant and accumulation-GEMM kernels: bit-exact against quantize/ under Triton's CPU
interpreter (TRITON_INTERPRET=1, set before anything imports triton).

"Bit-exact" is checked on bit patterns (int32 views), so −0 vs +0 counts as a difference. The
interpreter has no bfloat16: BF16 inputs are compared through the dispatcher's exact widening to
FP32 (the reference widens the same way), and the final cast back is torch's own.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from mismatch.kernels import KERNEL_CODECS, KernelError, fake_quant, fake_quant_torch  # noqa: E402
from mismatch.quantize import QuantizeError  # noqa: E402

pytest.importorskip("triton", reason="Triton is not installed (pip install 'mismatch[gpu]')")

from mismatch.kernels import accumulate_gemm_torch, accumulate_gemm_triton  # noqa: E402
from mismatch.kernels import fake_quant_triton  # noqa: E402

# the interpreter evaluates both sides of every tl.where with numpy, which warns on the side
# that is discarded (a division by a zero scale)
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

# codecs whose scale comes from the data only, and those that also take a per-tensor scale
_STATIC = {"fp8-act", "nvfp4-act", "nvfp4"}


def _bit_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    """How `a` and `b` differ in dtype, shape or bits ("" when they are the same)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
    va, vb = a.float().view(torch.int32), b.float().view(torch.int32)
    both_nan = torch.isnan(a) & torch.isnan(b)  # NaN payloads are not compared
    diff = int(((va != vb) & ~both_nan).sum())
    return f"{diff} of {a.numel()} elements differ in their bits" if diff else ""


def _every_finite_bf16() -> torch.Tensor:
    """All 65,280 finite BF16 values (both zeros, subnormals, max normal), shuffled: [680, 96]."""
    codes = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = codes[torch.isfinite(codes)]
    g = torch.Generator().manual_seed(0)
    return x[torch.randperm(x.numel(), generator=g)].reshape(680, 96)


def _edge_block() -> torch.Tensor:
    """Named edge cases in FP32, 4 rows of 96: zeros of both signs, FP32 subnormals, E4M3 and
    E2M1 saturation, ties, and rows whose amax is itself subnormal or zero (per-token FP8 of a
    row whose amax/448 underflows to 0 gives the reference NaN for its zeros; the kernel too)."""
    tiny = torch.finfo(torch.float32).tiny
    row0 = torch.tensor([0.0, -0.0, 1e-45, -1e-45, tiny, -tiny, 448.0, -448.0, 464.0, 480.0,
                         1e30, -1e30, 0.75, 1.75, 3.5, -0.25, 5.0, 6.0, 7.0, -2.5] * 4 +
                        [0.5] * 16)
    row1 = torch.tensor([1e-45 * (i % 7) * (-1) ** i for i in range(96)])  # subnormal amax
    row2 = torch.zeros(96)
    row2[5] = -0.0
    row3 = torch.linspace(-6.5, 6.5, 96) * 2.0 ** -120  # scaled into the E8M0 floor
    return torch.stack([row0, row1, row2, row3])


def _cases(codec: str):
    g = torch.Generator().manual_seed(1)
    ragged = torch.randn(37, 160, generator=g) * torch.logspace(-4, 4, 160)  # 37 rows: ragged
    scales = [None] if codec not in _STATIC else [None, torch.tensor(0.0123), torch.tensor(3.7)]
    for x in (ragged, _edge_block(), _every_finite_bf16().float()):
        for s in scales:
            yield x, s


@pytest.mark.parametrize("codec", list(KERNEL_CODECS))
def test_kernel_is_bit_exact_to_the_codecs(codec):
    for x, s in _cases(codec):
        if codec == "fp8-act" and s is None and x.abs().max() > 1e30:
            s = torch.tensor(1.0)  # amax/448 of 3e38 would flush everything else to zero
        assert not _bit_diff(fake_quant_triton(x, codec, global_scale=s),
                             fake_quant_torch(x, codec, global_scale=s)), (codec, s)


@pytest.mark.parametrize("codec", ["fp8-act", "nvfp4-act", "mxfp4-rceil", "fp8-channel"])
def test_kernel_keeps_input_dtype(codec):
    """FP16 and BF16 inputs (the interpreter sees them widened to FP32, exactly) come back in
    their own dtype, bit-identical to the reference's."""
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float16, torch.bfloat16):
        x = (torch.randn(9, 64, generator=g) * 3).to(dtype)
        s = torch.tensor(0.05) if codec in _STATIC else None
        got = fake_quant_triton(x, codec, global_scale=s)
        assert got.dtype == dtype
        want = fake_quant_torch(x, codec, global_scale=s)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_bad_input_is_one_line():
    with pytest.raises(KernelError, match="no fake-quant kernel for codec 'fp8-block128'"):
        fake_quant_triton(torch.zeros(128, 128), "fp8-block128")
    with pytest.raises(QuantizeError, match="not divisible by the block size 16"):
        fake_quant_triton(torch.zeros(2, 24), "nvfp4-act", global_scale=torch.tensor(1.0))
    with pytest.raises(QuantizeError, match="non-finite"):
        fake_quant_triton(torch.tensor([[1.0, float("nan")] * 8]), "nvfp4")
    with pytest.raises(KernelError, match="positive and finite"):
        fake_quant_triton(torch.ones(1, 16), "nvfp4-act", global_scale=torch.tensor(0.0))
    # the dispatcher runs the reference on CPU tensors and for codecs without a kernel
    x = torch.randn(128, 128)
    assert torch.equal(fake_quant(x, "fp8-block128"), fake_quant_torch(x, "fp8-block128"))


# ------------------------------------------------------------------------- accumulation GEMM

def _fp8_grid(shape, g) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * 8).to(torch.float8_e4m3fn).float()


@pytest.mark.parametrize("mkn", [(19, 300, 23), (16, 256, 16), (3, 40, 5), (1, 1000, 2)])
@pytest.mark.parametrize("acc", ["fp32", "hopper-fp8-fast", "hopper-fp8-promote128"])
def test_gemm_is_bit_exact_to_the_accumulation_model(mkn, acc):
    m, k, n = mkn
    g = torch.Generator().manual_seed(m * 7 + k)
    a, b = _fp8_grid((m, k), g), _fp8_grid((k, n), g)
    assert not _bit_diff(accumulate_gemm_triton(a, b, acc), accumulate_gemm_torch(a, b, acc))


def test_gemm_models_differ_and_bf16_inputs_agree():
    """The model matters (fast accumulation loses bits against FP32), and BF16-grid inputs whose
    slice sums are exact in float64 agree bit for bit too; strided (transposed) inputs work."""
    from mismatch.quantize.accumulate import Accumulation

    g = torch.Generator().manual_seed(3)
    a, b = _fp8_grid((8, 2048), g), _fp8_grid((2048, 8), g)
    fast = accumulate_gemm_triton(a, b, "hopper-fp8-fast")
    exact = a.double() @ b.double()
    assert float(((fast - exact).abs() / exact.abs()).median()) > 1e-5
    a16 = torch.randn(17, 200, generator=g).bfloat16()
    b16 = torch.randn(23, 200, generator=g).bfloat16().t()  # a strided [K, N] view
    assert not _bit_diff(accumulate_gemm_triton(a16, b16, "fp32"),
                         accumulate_gemm_torch(a16, b16, "fp32"))
    # FP16 inputs (FP8-grid values are exact in FP16): the kernel widens them exactly
    assert not _bit_diff(accumulate_gemm_triton(a.half(), b.half(), "hopper-fp8-promote128"),
                         accumulate_gemm_torch(a.half(), b.half(), "hopper-fp8-promote128"))
    custom = Accumulation(name="x", acc_mbits=10, promote_every=64, mma_k=16)
    assert not _bit_diff(accumulate_gemm_triton(a, b, custom),
                         accumulate_gemm_torch(a, b, custom))
    with pytest.raises(KernelError, match="mma_k a power of two"):
        accumulate_gemm_triton(a, b, Accumulation(name="y", acc_mbits=10, promote_every=None,
                                                  mma_k=8))


def test_reference_scales_are_correctly_rounded_divisions():
    """Every scale the reference derives from an amax by a constant (per-tensor and per-row FP8
    amax / 448, MX RCEIL amax / 6, NVFP4 amax / 2688) is the correctly rounded FP32 quotient, as
    the kernel's div_rn is, on every device: torch's CUDA `tensor / python_float` is a multiply by
    fl(1/d), which differs by an ulp for many amax (below: the amax where it does, checked
    against float64)."""
    from mismatch.quantize.formats import div_scalar
    from mismatch.quantize.schemes import NVFP4_GLOBAL_DIVISOR, nvfp4_global_scale

    g = torch.Generator().manual_seed(7)
    amax = (torch.rand(20000, generator=g) * 2.0 ** torch.randint(-20, 20, (20000,),
                                                                  generator=g)).float()
    for d in (448.0, 6.0, NVFP4_GLOBAL_DIVISOR):
        exact = (amax.double() / d).float()  # one rounding of the exact quotient
        recip = amax * torch.tensor(1.0 / d, dtype=torch.float32)  # CUDA's scalar path
        assert int((recip != exact).sum()) > 0, d  # the two paths do differ on these amax
        assert torch.equal(div_scalar(amax, d), exact), d
    rows = amax[:4096].reshape(64, 64)
    q = fake_quant_torch(rows, "fp8-channel")
    scale = (rows.abs().amax(-1, keepdim=True).double() / 448.0).float()
    assert torch.equal(q, fake_quant_torch(rows / scale, "fp8-act",
                                           global_scale=torch.ones(1)) * scale)
    assert torch.equal(nvfp4_global_scale(amax), (amax.max().double() / 2688.0).float())


@pytest.mark.gpu
def test_kernels_are_bit_exact_on_cuda(tmp_path):
    """On a CUDA device every fake-quant codec's compiled kernel equals the reference in bits on
    [2048 x 8192] FP32 inputs spanning six decades (a fresh process: TRITON_INTERPRET unset)."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import torch\n"
        "from mismatch.kernels import KERNEL_CODECS, fake_quant_torch, fake_quant_triton\n"
        "g = torch.Generator(device='cuda').manual_seed(1)\n"
        "x = torch.randn(2048, 8192, device='cuda', generator=g) * torch.logspace("
        "-3, 3, 8192, device='cuda')\n"
        "bad = []\n"
        "for codec in KERNEL_CODECS:\n"
        "    s = torch.tensor(0.05, device='cuda') if codec in ('fp8-act', 'nvfp4-act') "
        "else None\n"
        "    a = fake_quant_triton(x, codec, global_scale=s).view(torch.int32)\n"
        "    b = fake_quant_torch(x, codec, global_scale=s).view(torch.int32)\n"
        "    n = int((a != b).sum())\n"
        "    print(codec, n)\n"
        "    bad += [codec] if n else []\n"
        "raise SystemExit(1 if bad else 0)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
