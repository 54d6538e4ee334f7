"""BF16 matrix products at FP32 speed on CPUs without fast BF16.

The numerics. A BF16 GEMM here means what a GPU tensor core computes: the products of BF16
inputs, each exact in FP32 (an 8-bit by 8-bit significand product fits FP32's 24 bits), summed
in FP32, the result rounded once to BF16 (round to nearest even). oneDNN computes the same on a
CPU with AVX-512-BF16 or AMX (`vdpbf16ps`, `tdpbf16ps`: FP32 accumulation of BF16 products).
Without them, torch 2.13's BF16 GEMM is a slow path: 1 GFLOP/s against 87 GFLOP/s in FP32 on an
AVX2-only AMD EPYC core; 13–15 against 54 GFLOP/s on an AVX-512 core without AVX-512-BF16 (the
embedded model's shapes, one thread).

`bf16_gemms()` is a context manager that, where the CPU's BF16 GEMM is slow, computes every BF16
matrix product on CPU tensors inside it — `mm`, `addmm`, `bmm`, `baddbmm`, `mv`, `addmv` and the
MoE's `_grouped_mm`, forward and backward alike (it sits below autograd, so the backward's GEMMs
go through it too) — as the FP32 GEMM of the same BF16 values, rounded to BF16. The inputs are
exactly representable in FP32, so that is the definition above with another summation order:
on the embedded model's shapes 99.99% of the outputs equal torch's native BF16 GEMM and the
correctly rounded float64 product, the rest differ by one BF16 unit in the last place
(tests/test_bf16_gemm.py checks it against float64 per shape). Everything else (attention,
elementwise work, FP32 and FP16 products, CUDA tensors) runs as it would.

Attention. Inside `bf16_gemms`, torch's CPU flash attention of BF16 tensors (the kernel SDPA
takes for causal, unmasked attention: the trainer's step and the scorer; GQA included) runs
likewise: the FP32 kernel on the BF16 values of q, k and v, its output rounded once to BF16, its
log-sum-exp kept in FP32; the backward reads the BF16 output as autograd saved it and rounds each
gradient once. torch's BF16 kernel instead computes its score blocks with BF16 GEMMs and rounds
the softmax probabilities to BF16 before multiplying them by V (as FlashAttention-2 does on a
GPU); the FP32 kernel keeps them in FP32, so it is closer to the float64 attention, not farther
(tests/test_bf16_gemm.py: relative error 1.6–1.9e-3 against up to 4.6e-3 for the gradients at
the trainer's shape, where one BF16 rounding is 2⁻⁹ ≈ 2e-3). On an AVX-512 core with
AVX-512-BF16 it is 1.2× faster; where BF16 GEMMs take torch's fallback path, 3.6–3.9×
(scripts/bench_bf16_gemm.py). A call with an explicit mask (the scorer's left-padded rows) is
left alone unless the block asks for it (`masked=True`: the trainer's step, whose rows continue
from a shared prompt's keys under a mask), as is the module path below (its decode loops run
the engine's own attention).

The choice, once per process: `MISMATCH_BF16_GEMM=native` keeps torch's kernels, `fp32` always
reroutes, `auto` (the default) reroutes unless the CPU has AVX-512-BF16 or AMX-BF16 (Linux's
/proc/cpuinfo flags; elsewhere a one-off micro-benchmark of both paths decides) and oneDNN is not
capped below them (`ONEDNN_MAX_CPU_ISA=AVX2`, with `ATEN_CPU_CAPABILITY=avx2`, makes a CPU with
AVX-512-BF16 compute BF16 GEMMs as slowly as an AVX2-only one: 0.8 GFLOP/s at 1024³ on an AMD
EPYC core; the benchmarks use it to measure that case).

The cost: a Python dispatch per tensor operation inside the block (~20–40 µs each). A training
step or a scoring pass pays it back many times over; they use `bf16_gemms` (the trainer's step,
the scorer). A decode loop calls a small forward per token, so the engine and calibration use
`bf16_module_gemms`: the same numerics, patched into the model's `nn.Linear` modules and fused
MoE experts for the block, with no dispatch per operation.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["BF16_GEMM_ENV", "BF16_GEMM_MODES", "bf16_gemm_policy", "cpu_has_fast_bf16",
           "bf16_gemms", "bf16_module_gemms", "FP32Accumulation", "calls_per_second"]

BF16_GEMM_ENV = "MISMATCH_BF16_GEMM"
BF16_GEMM_MODES = ("auto", "fp32", "native")
FAST_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""CPU flags (Linux /proc/cpuinfo names) under which oneDNN runs BF16 GEMMs natively."""

_aten = torch.ops.aten
_BF16 = torch.bfloat16


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo, or None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        return None
    return None


def calls_per_second(fn, seconds: float) -> float:
    """How many times a second `fn()` runs, over `seconds` after one warm-up call."""
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - t0)


def _benchmark_prefers_native(size: int = 256, seconds: float = 0.05) -> bool:
    """Whether torch's native BF16 GEMM beats FP32 on this CPU (one-thread micro-benchmark)."""
    a = torch.randn(size, size).to(_BF16)
    b = torch.randn(size, size).to(_BF16)
    native = calls_per_second(lambda: a @ b, seconds)
    fp32 = calls_per_second(lambda: (a.float() @ b.float()).to(_BF16), seconds)
    return native >= fp32


SLOW_BF16_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                  "AVX512_CORE_VNNI")
"""`ONEDNN_MAX_CPU_ISA` caps under which oneDNN has no BF16 dot-product instructions to use
(the ISA names of oneDNN's "CPU Dispatcher Control" guide): torch's BF16 GEMM then takes its
slow path whatever the CPU has."""


@functools.lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """Whether this CPU runs BF16 GEMMs natively fast (AVX-512-BF16 or AMX-BF16, and oneDNN not
    capped below them by `ONEDNN_MAX_CPU_ISA`)."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper() in SLOW_BF16_ISAS:
        return False
    flags = _cpu_flags()
    if flags is not None:
        return any(f in flags for f in FAST_BF16_FLAGS)
    return _benchmark_prefers_native()


def bf16_gemm_policy() -> str:
    """'fp32' or 'native': how BF16 GEMMs on CPU run in this process (see the module's doc)."""
    mode = os.environ.get(BF16_GEMM_ENV, "auto").strip().lower() or "auto"
    if mode not in BF16_GEMM_MODES:
        raise ValueError(f"{BF16_GEMM_ENV}={mode!r}: use one of {', '.join(BF16_GEMM_MODES)}")
    if mode == "auto":
        return "native" if cpu_has_fast_bf16() else "fp32"
    return mode


def _policy(policy: str | None, who: str) -> str:
    """`policy`, or this process's when None; ValueError unless 'fp32' or 'native'."""
    policy = bf16_gemm_policy() if policy is None else policy
    if policy not in ("fp32", "native"):
        raise ValueError(f"{who}: policy {policy!r} is not 'fp32' or 'native'")
    return policy


def _up(x):
    return x.float() if isinstance(x, torch.Tensor) and x.dtype == _BF16 else x


_FLASH = _aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_ATTENTION = {_FLASH: 3, _FLASH_BACKWARD: 5}
"""torch's CPU flash attention (SDPA's causal and unmasked path), forward and backward → how many
leading arguments are BF16 tensors (the backward's logsumexp, the 6th, is FP32 already)."""

_GEMMS = {_aten.mm.default: 2, _aten.bmm.default: 2, _aten.mv.default: 2,
          _aten.addmm.default: 3, _aten.baddbmm.default: 3, _aten.addmv.default: 3,
          _aten._grouped_mm.default: 2}
"""The rerouted ATen GEMMs → how many leading arguments are the operands."""


def _is_bf16_cpu(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == _BF16 and t.device.type == "cpu"


def _bf16_cpu(ts) -> bool:
    return all(_is_bf16_cpu(t) for t in ts)


def _fp32_attention(func, args, kwargs, masked: bool):
    """CPU flash attention of BF16 tensors as the FP32 kernel on their values: each BF16 output
    (the forward's output; the backward's gradients) rounded once to BF16, the FP32 logsumexp
    kept (module docstring, "Attention"). A call with a mask only when `masked` (a BF16 additive
    mask widened to FP32 with the rest, a boolean one as it is)."""
    n = _ATTENTION[func]
    if (kwargs.get("attn_mask") is not None and not masked) or not _bf16_cpu(args[:n]):
        return func(*args, **kwargs)
    out = func(*[_up(a) for a in args[:n]], *args[n:], **{k: _up(v) for k, v in kwargs.items()})
    if func is _FLASH:
        return out[0].to(_BF16), out[1]
    return tuple(g.to(_BF16) for g in out)


class FP32Accumulation(TorchDispatchMode):
    """Inside: a BF16 GEMM on CPU tensors runs as the FP32 GEMM of its values, rounded to BF16;
    so does torch's CPU flash attention, forward and backward (unless `attention=False`; a
    masked call only with `masked=True`)."""

    def __init__(self, attention: bool = True, masked: bool = False) -> None:
        super().__init__()
        self.attention, self.masked = attention, masked

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.attention and func in _ATTENTION:
            return _fp32_attention(func, args, kwargs, self.masked)
        n = _GEMMS.get(func)
        if n is not None and kwargs.get("out_dtype") in (None, _BF16):
            operands = args[:n]
            if _bf16_cpu(t for t in operands if t is not None):
                out = func(*[_up(a) for a in args], **{k: _up(v) for k, v in kwargs.items()})
                return out.to(_BF16)
        return func(*args, **kwargs)


@contextlib.contextmanager
def bf16_gemms(policy: str | None = None, *, attention: bool = True,
               masked: bool = False) -> Iterator[bool]:
    """Run the block's BF16 CPU GEMMs (and, with `attention`, its CPU flash attention; with
    `masked`, its masked calls too) in FP32 on BF16 values where the CPU's BF16 GEMM is slow
    (`policy`: 'fp32' or 'native'; default `bf16_gemm_policy()`). Yields whether it reroutes.
    Nested use is free: an enclosing block already rerouting is kept."""
    policy = _policy(policy, "bf16_gemms")
    if policy == "native" or _active():
        yield policy == "fp32"
        return
    with FP32Accumulation(attention, masked):
        yield True


def _active() -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(m, FP32Accumulation) for m in _get_current_dispatch_mode_stack())


def _fp32_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != _BF16:
        return F.linear(x, module.weight, module.bias)
    bias = None if module.bias is None else module.bias.float()
    return F.linear(x.float(), module.weight.float(), bias).to(_BF16)


def _under_mode(forward, *args, **kwargs):
    with FP32Accumulation():
        return forward(*args, **kwargs)


@contextlib.contextmanager
def bf16_module_gemms(model: torch.nn.Module, policy: str | None = None) -> Iterator[bool]:
    """The same numerics as `bf16_gemms`, for a no-grad forward called many times (a decode
    loop), without a dispatch per tensor operation: for the block, each BF16 `nn.Linear` of
    `model` runs as the FP32 linear of its values rounded to BF16, and each module holding 3-D
    BF16 expert weights (a fused MoE) runs its forward under `FP32Accumulation`. Modules that
    already carry an instance-level forward (the numerics emulation's) are left alone. Yields
    whether it reroutes."""
    policy = _policy(policy, "bf16_module_gemms")
    if policy == "native" or _active():
        yield policy == "fp32"
        return
    patched: list[torch.nn.Module] = []
    try:
        for mod in model.modules():
            if "forward" in vars(mod):
                continue
            if isinstance(mod, torch.nn.Linear):
                if _is_bf16_cpu(mod.weight):
                    mod.forward = functools.partial(_fp32_linear, mod)
                    patched.append(mod)
            elif any(p.dim() == 3 and _is_bf16_cpu(p) for p in mod.parameters(recurse=False)):
                mod.forward = functools.partial(_under_mode, type(mod).forward.__get__(mod))
                patched.append(mod)
        yield True
    finally:
        for mod in patched:
            del mod.forward
