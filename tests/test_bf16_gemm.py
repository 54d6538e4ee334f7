"""BF16 GEMMs as FP32 GEMMs of BF16 values (mismatch.kernels.bf16_gemm): the definition against
float64, every rerouted op, forward and backward, and the per-process policy."""

from __future__ import annotations

import pytest
import torch

import mismatch.kernels.bf16_gemm as bg
from mismatch.kernels.bf16_gemm import (BF16_GEMM_ENV, FP32Accumulation, bf16_gemm_policy,
                                         bf16_gemms, bf16_module_gemms)

BF = torch.bfloat16
ULP_BF16 = 2.0 ** -7  # spacing of BF16 values in [1, 2): 8 significand bits


def _bf(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(BF)


def _check_rounded(out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor, k: int) -> None:
    """`out` (BF16) is the float64 product `ref` rounded to BF16, but for the rare output whose
    FP32 sum fell on the other side of a rounding boundary. The bound: one BF16 unit in the last
    place of the result, plus FP32's summation error over K terms, γ_K · Σ|a·b| with
    γ_K = K · 2⁻²⁴ (`magnitude` = Σ|a·b|, float64; Higham, Accuracy and Stability of Numerical
    Algorithms, §3.1)."""
    assert out.dtype == BF and out.shape == ref.shape
    rounded = ref.to(BF)
    equal = (out == rounded).double().mean().item()
    assert equal >= 0.999, f"only {equal:.5f} of the outputs are the correctly rounded product"
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30)))) * ULP_BF16
    bound = ulp + k * 2.0 ** -24 * magnitude
    assert bool(((out.double() - ref).abs() <= bound).all())


def _ref(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None):
    """(a @ b [+ c], |a| @ |b| [+ |c|]) in float64."""
    ref, mag = a.double() @ b.double(), a.double().abs() @ b.double().abs()
    if c is not None:
        ref, mag = ref + c.double(), mag + c.double().abs()
    return ref, mag


SHAPES = [(128, 256, 256), (512, 64, 512), (300, 128, 768), (7, 128, 8)]
"""[M, K, N]: the embedded model's projections, its MoE slices, the output head, a router."""


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_mm_and_addmm_are_the_rounded_float64_product(m, k, n):
    a, b, bias = _bf(m, k), _bf(k, n, seed=1), _bf(n, seed=2)
    with bf16_gemms("fp32") as rerouted:
        assert rerouted
        out = a @ b
        out_bias = torch.nn.functional.linear(a, b.t().contiguous(), bias)
    _check_rounded(out, *_ref(a, b), k)
    _check_rounded(out_bias, *_ref(a, b, bias), k)


def test_batched_vector_and_grouped_products_are_rerouted_and_rounded():
    a, b = _bf(4, 64, 128), _bf(4, 128, 32, seed=1)
    c = _bf(4, 64, 32, seed=2)
    offs = torch.tensor([50, 50, 130, 200], dtype=torch.int32)  # one empty group
    x, w = _bf(200, 128, seed=4), _bf(4, 128, 64, seed=5)
    with bf16_gemms("fp32"):
        bmm = torch.bmm(a, b)
        baddbmm = torch.baddbmm(c, a, b)
        mv = torch.mv(a[0].t().contiguous(), _bf(64, seed=6))
        addmv = torch.addmv(_bf(128, seed=7), b[0], _bf(32, seed=8))
        grouped = torch._grouped_mm(x, w, offs=offs)
    _check_rounded(bmm, *_ref(a, b), 128)
    _check_rounded(baddbmm, *_ref(a, b, c), 128)
    _check_rounded(mv, *_ref(a[0].t(), _bf(64, seed=6)), 64)
    _check_rounded(addmv, *_ref(b[0], _bf(32, seed=8), _bf(128, seed=7)), 32)
    starts = [0, *offs[:-1].tolist()]
    parts = [_ref(x[s:e], w[g]) for g, (s, e) in enumerate(zip(starts, offs.tolist()))]
    _check_rounded(grouped, torch.cat([r for r, _ in parts]), torch.cat([m for _, m in parts]), 128)


def test_the_fp32_path_is_what_it_says_bit_for_bit():
    """Rerouted = the FP32 GEMM of the same values, rounded once to BF16 (the definition);
    FP32 and FP16 products inside the block are untouched."""
    a, b = _bf(96, 128), _bf(128, 80, seed=1)
    with bf16_gemms("fp32"):
        out = a @ b
        f32 = a.float() @ b.float()
        f16 = a.half() @ b.half()
    assert torch.equal(out, (a.float() @ b.float()).to(BF))
    assert torch.equal(f32, a.float() @ b.float())
    assert torch.equal(f16, a.half() @ b.half())


def test_the_backward_gemms_go_through_it_too():
    """The mode sits below autograd: the gradients' GEMMs are FP32 GEMMs of BF16 values."""
    x = _bf(64, 128).requires_grad_()
    w = _bf(32, 128, seed=1).requires_grad_()
    g = _bf(64, 32, seed=2)
    calls = []

    class Spy(FP32Accumulation):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in bg._GEMMS:
                calls.append(func)
            return super().__torch_dispatch__(func, types, args, kwargs)

    with Spy():
        y = torch.nn.functional.linear(x, w)
        forward = len(calls)
        y.backward(g)
    assert forward == 1 and len(calls) == 3  # y = x wᵀ; dx = g w; dw = gᵀ x
    assert torch.equal(x.grad, (g.float() @ w.detach().float()).to(BF))
    assert torch.equal(w.grad, (g.float().t() @ x.detach().float()).to(BF))


def test_a_model_step_under_either_policy_is_equally_close_to_float64():
    """Forward and backward of a BF16 linear stack: the rerouted and the native path are each
    within BF16 rounding of the float64 computation (a different summation order only)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.SiLU(), torch.nn.Linear(256, 64))
    x = torch.randn(200, 128)
    ref = net.double()(x.double())
    ref.square().mean().backward()
    ref_grads = [p.grad.clone() for p in net.parameters()]
    errs = {}
    for policy in ("fp32", "native"):
        bnet = net.to(BF)
        bnet.zero_grad(set_to_none=True)
        with bf16_gemms(policy):
            out = bnet(x.to(BF))
            out.float().square().mean().backward()
        errs[policy] = [((p.grad.double() - r).norm() / r.norm()).item()
                        for p, r in zip(bnet.parameters(), ref_grads)]
        assert ((out.double() - ref).norm() / ref.norm()).item() < 0.02
        net = net.double()
    for e32, enat in zip(errs["fp32"], errs["native"]):
        assert e32 < 0.03 and enat < 0.03
        assert e32 < 2 * enat + 1e-3  # no worse than torch's own kernels


def _attention(q, k, v, g, policy=None, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    with bf16_gemms(policy or "native"):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        out.backward(g)
    return out.detach(), q.grad, k.grad, v.grad


def test_flash_attention_is_the_fp32_kernel_of_bf16_values_forward_and_backward():
    """Rerouted CPU flash attention (SDPA's causal, unmasked path; the trainer's, GQA included) =
    the FP32 kernel on the same values, each output and gradient rounded once to BF16, the
    backward reading the output as autograd saved it (BF16) — bit for bit; and against float64
    each is within BF16 rounding (relative error ≤ 2.5e-3, 2⁻⁹ ≈ 1.95e-3 being one rounding) and
    no farther than torch's own BF16 kernel."""
    q, k, v = _bf(3, 4, 97, 32), _bf(3, 2, 97, 32, seed=1), _bf(3, 2, 97, 32, seed=2)
    g = _bf(3, 4, 97, 32, seed=3)
    fp32 = _attention(q, k, v, g, "fp32", is_causal=True)
    aten = torch.ops.aten
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q.float(), k.float(), v.float(),
                                                                0.0, True)
    grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g.float(), q.float(), k.float(), v.float(), out.to(BF).float(), lse, 0.0, True)
    for got, want in zip(fp32, (out, *grads)):
        assert got.dtype == BF and torch.equal(got, want.to(BF))
    ref = _attention(q.double(), k.double(), v.double(), g.double(), is_causal=True)
    native = _attention(q, k, v, g, "native", is_causal=True)
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), fp32, native, ref):
        err = ((a.double() - r).norm() / r.norm()).item()
        err_native = ((b.double() - r).norm() / r.norm()).item()
        assert err < 2.5e-3 and err <= err_native * 1.05, (name, err, err_native)


def test_masked_attention_is_left_to_torch():
    """An explicit mask takes SDPA's other path, which the mode leaves as it is."""
    q, k, v = _bf(2, 4, 40, 32), _bf(2, 2, 40, 32, seed=1), _bf(2, 2, 40, 32, seed=2)
    g = _bf(2, 4, 40, 32, seed=3)
    mask = torch.ones(40, 40, dtype=torch.bool).tril()
    mask[:, :3] = False
    mask[:3, 0] = True
    for got, want in zip(_attention(q, k, v, g, "fp32", attn_mask=mask),
                         _attention(q, k, v, g, "native", attn_mask=mask)):
        assert torch.equal(got, want)


def test_masked_attention_when_asked_is_the_fp32_kernel_too():
    """With `masked=True` (the trainer's step: a suffix of 30 queries on a shared prompt's keys,
    40 in all, under a bottom-right causal mask) the masked call is rerouted like the causal
    one: the FP32 kernel on the same values, each output rounded once, bit for bit; within BF16
    rounding of float64 and no farther than torch's BF16 kernel."""
    q, k, v = _bf(3, 4, 30, 32), _bf(3, 2, 40, 32, seed=1), _bf(3, 2, 40, 32, seed=2)
    g = _bf(3, 4, 30, 32, seed=3)
    mask = torch.ones(30, 40, dtype=torch.bool).tril(diagonal=10)

    def run(q, k, v, g, policy, masked=True):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        with bf16_gemms(policy, masked=masked):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                   enable_gqa=True)
            out.backward(g)
        return out.detach(), q.grad, k.grad, v.grad

    fp32 = run(q, k, v, g, "fp32")
    aten = torch.ops.aten  # SDPA hands the kernel the mask as additive, in the query's dtype
    additive = torch.zeros(30, 40).masked_fill(~mask, float("-inf"))
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        q.float(), k.float(), v.float(), 0.0, False, attn_mask=additive)
    grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g.float(), q.float(), k.float(), v.float(), out.to(BF).float(), lse, 0.0, False,
        attn_mask=additive)
    for got, want in zip(fp32, (out, *grads)):
        assert got.dtype == BF and torch.equal(got, want.to(BF))
    ref = run(q.double(), k.double(), v.double(), g.double(), "native")
    native = run(q, k, v, g, "native")
    unasked = run(q, k, v, g, "fp32", masked=False)
    assert all(torch.equal(a, b) for a, b in zip(unasked, native))
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), fp32, native, ref):
        err = ((a.double() - r).norm() / r.norm()).item()
        err_native = ((b.double() - r).norm() / r.norm()).item()
        assert err < 2.5e-3 and err <= err_native * 1.05, (name, err, err_native)


def test_nested_blocks_and_native_policy():
    a, b = _bf(8, 16), _bf(16, 8, seed=1)
    with bf16_gemms("native") as rerouted:
        assert not rerouted
    with bf16_gemms("fp32"):
        with bf16_gemms("fp32") as inner:
            assert inner and bg._active()
            out = a @ b
        assert bg._active()
    assert not bg._active()
    assert torch.equal(out, (a.float() @ b.float()).to(BF))


def test_policy_from_the_environment_and_the_cpu(monkeypatch):
    monkeypatch.setenv(BF16_GEMM_ENV, "native")
    assert bf16_gemm_policy() == "native"
    monkeypatch.setenv(BF16_GEMM_ENV, "FP32")
    assert bf16_gemm_policy() == "fp32"
    monkeypatch.setenv(BF16_GEMM_ENV, "fast")
    with pytest.raises(ValueError, match="auto, fp32, native"):
        bf16_gemm_policy()
    with pytest.raises(ValueError, match="policy"):
        with bf16_gemms("bf16"):
            pass
    monkeypatch.setenv(BF16_GEMM_ENV, "auto")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)  # the flags alone decide (below)
    for flags, policy in (({"avx2", "fma"}, "fp32"), ({"avx512f", "avx512_bf16"}, "native"),
                          ({"avx512f", "amx_bf16", "amx_tile"}, "native"),
                          ({"avx512f", "avx512bw"}, "fp32")):
        bg.cpu_has_fast_bf16.cache_clear()
        monkeypatch.setattr(bg, "_cpu_flags", lambda flags=flags: flags)
        assert bf16_gemm_policy() == policy
    bg.cpu_has_fast_bf16.cache_clear()
    monkeypatch.setattr(bg, "_cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    for isa, policy in (("avx2", "fp32"), ("AVX512_CORE", "fp32"), ("AVX512_CORE_BF16", "native"),
                        ("ALL", "native")):  # oneDNN capped below its BF16 instructions: slow
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
        bg.cpu_has_fast_bf16.cache_clear()
        assert bf16_gemm_policy() == policy, isa
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    bg.cpu_has_fast_bf16.cache_clear()
    monkeypatch.setattr(bg, "_cpu_flags", lambda: None)  # no /proc/cpuinfo: measure
    monkeypatch.setattr(bg, "_benchmark_prefers_native", lambda: True)
    assert bf16_gemm_policy() == "native"
    bg.cpu_has_fast_bf16.cache_clear()


def test_the_micro_benchmark_runs():
    assert isinstance(bg._benchmark_prefers_native(size=32, seconds=0.005), bool)


def test_the_module_path_equals_the_dispatch_path_on_the_embedded_model():
    """bf16_module_gemms (no dispatch per op, for decode loops) computes what bf16_gemms does,
    bit for bit, and leaves the model as it found it; a module already carrying its own
    forward (the numerics emulation's) is not touched."""
    from mismatch.zoo import load_model

    model = load_model(dtype="bfloat16").eval()
    ids = torch.randint(3, 500, (3, 17), generator=torch.Generator().manual_seed(0))
    # a forward of its own, in FP32 (no BF16 GEMM for either path to reroute: the dispatch path
    # would reroute a BF16 one and the module path leave it, which differ where torch's BF16
    # GEMM rounds otherwise, as its fallback on a CPU without AVX-512-BF16 does)
    own = model.lm_head.forward = lambda x: torch.nn.functional.linear(
        x.float(), model.lm_head.weight.float()).to(x.dtype)
    with torch.no_grad():
        with bf16_gemms("fp32", attention=False):  # the module path leaves attention alone
            ref = model(input_ids=ids).logits
        with bf16_module_gemms(model, "fp32") as rerouted:
            assert rerouted
            assert model.lm_head.forward is own
            patched = [m for m in model.modules() if "forward" in vars(m)]
            out = model(input_ids=ids).logits
    assert len(patched) > 8  # projections and fused experts of 4 layers
    assert torch.equal(out, ref)
    assert [m for m in model.modules() if "forward" in vars(m)] == [model.lm_head]
    del model.lm_head.forward
    with bf16_module_gemms(model, "native") as rerouted:
        assert not rerouted and not any("forward" in vars(m) for m in model.modules())
