"""Accelerator profiles: what a sampler on a given GPU actually computes for a given precision.

`resolve(gpu, dtype, kv_cache)` turns a user's (GPU, precision) into a `NumericsSpec`: which codec
the weights are stored in, what the activations are quantized to before the GEMM (if anything),
the accumulation model of the GEMM, the KV-cache format and the attention kernel family. The facts
come from the serving stacks' own documentation (vLLM's "Supported Hardware" table for
quantization, docs.vllm.ai/en/latest/features/quantization/supported_hardware.html, and its Marlin
kernels; NVIDIA's "Introducing NVFP4 for Efficient and Accurate Low-Precision Inference", 2025)
and from DeepSeek-V3's account of Hopper FP8 accumulation (arXiv:2412.19437, §3.3.2):

- A100 (sm80) has no tensor cores below BF16/FP16: an FP8 or NVFP4/MXFP4 checkpoint runs as a
  Marlin weight-only kernel (weights dequantized to BF16 in registers, activations BF16).
- H100/H200 (sm90) run FP8 natively (W8A8); per-tensor FP8 GEMMs use "fast accumulation"
  (no FP32 promotion). FP4 checkpoints run as Marlin W4A16.
- B200/B300 (sm100) run FP8, NVFP4 and MXFP4 natively; NVFP4 W4A4 quantizes activations in
  dynamic 16-element blocks (the serving kernel's order).
- RTX PRO 6000 (sm120) runs FP8 and FP4 natively.

`--dtype` names the precision the sampler serves in: `nvfp4` is W4A4 NVFP4 (Blackwell only);
`w4a16-nvfp4` keeps activations in BF16; `fp8` is an FP8 checkpoint, W8A8 where the GPU has FP8
tensor cores and Marlin W8A16 where it does not; `mxfp4` is W4A4 MXFP4 on Blackwell and Marlin
W4A16 elsewhere. A pair no kernel serves (A100 + nvfp4) is an error that lists what that GPU can run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from mismatch.quantize.precisions import KV_CACHE_CODECS, PRECISIONS
from mismatch.registry import add_once

__all__ = ["GPUS", "register_gpu", "DTYPES", "KV_CACHES", "TRAINER_DTYPES", "LM_HEADS",
           "GpuProfile", "NumericsSpec", "ProfileError", "resolve", "trainer_spec", "table",
           "TRAINER", "local_gpu", "local_profile", "check_local_gpu"]

AttentionKernel = Literal["fa2", "fa3", "flashinfer", "trtllm", "reference"]


class ProfileError(ValueError):
    """An unknown GPU or precision, or a pair no kernel serves."""


@dataclass(frozen=True, kw_only=True)
class GpuProfile:
    """One accelerator: its architecture and the kernels a sampler uses on it."""

    name: str
    """CLI name."""
    arch: str
    """Compute capability family."""
    native: frozenset[str]
    """Low-precision element formats its tensor cores take as GEMM operands."""
    attention: AttentionKernel
    """The attention kernel family serving stacks pick on it."""
    cuda_names: tuple[str, ...]
    """Substrings of `torch.cuda.get_device_name()` that identify it (for measured mode)."""
    gemm_accumulation: tuple[tuple[str, str], ...] = ()
    """(precision, mismatch.quantize.accumulate preset) where its W*A* GEMMs do not accumulate in
    plain FP32 on this GPU's serving kernels; every other GEMM sums in FP32."""

    def accumulation(self, precision: str) -> str:
        """The accumulation preset of `precision`'s W*A* GEMMs on this GPU."""
        return dict(self.gemm_accumulation).get(precision, "fp32")

    @property
    def capability_major(self) -> int:
        """CUDA compute capability major version of the arch (sm90 → 9; B300's sm103 → 10)."""
        return int(self.arch[2:-1])


GPUS: dict[str, GpuProfile] = {}


def register_gpu(g: GpuProfile) -> GpuProfile:
    """Add a GPU profile; a name may be registered once."""
    return add_once(GPUS, g.name, g, "gpu profile")


# Hopper's per-tensor FP8 GEMMs (cuBLAS / CUTLASS with use_fast_accum) never promote their
# partial sums to FP32; block-scaled FP8 kernels promote every 128 K-elements (DeepSeek-V3,
# arXiv:2412.19437, §3.3.2, "Increasing Accumulation Precision").
_HOPPER_FAST = (("fp8", "hopper-fp8-fast"),)

for _g in (
    GpuProfile(name="a100", arch="sm80", native=frozenset(), attention="fa2",
               cuda_names=("A100",)),
    GpuProfile(name="h100", arch="sm90", native=frozenset({"fp8"}), attention="fa3",
               cuda_names=("H100",), gemm_accumulation=_HOPPER_FAST),
    GpuProfile(name="h200", arch="sm90", native=frozenset({"fp8"}), attention="fa3",
               cuda_names=("H200",), gemm_accumulation=_HOPPER_FAST),
    GpuProfile(name="b200", arch="sm100", native=frozenset({"fp8", "nvfp4", "mxfp4"}),
               attention="trtllm", cuda_names=("B200",)),
    GpuProfile(name="b300", arch="sm100", native=frozenset({"fp8", "nvfp4", "mxfp4"}),
               attention="trtllm", cuda_names=("B300",)),
    GpuProfile(name="rtx-pro-6000", arch="sm120", native=frozenset({"fp8", "nvfp4", "mxfp4"}),
               attention="flashinfer", cuda_names=("RTX PRO 6000",)),
):
    register_gpu(_g)

DTYPES = tuple(name for name, p in PRECISIONS.items() if p.served)


def local_gpu() -> tuple[str, tuple[int, int]] | None:
    """(name, compute capability) of CUDA device 0, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0), tuple(torch.cuda.get_device_capability(0))


def local_profile(local: tuple[str, tuple[int, int]]) -> str | None:
    """The profile whose name and compute capability match the local GPU, if any."""
    name, (major, _minor) = local
    for g in GPUS.values():
        if any(n in name for n in g.cuda_names) and g.capability_major == major:
            return g.name
    return None


def check_local_gpu(gpu: str, local: tuple[str, tuple[int, int]] | None, emulate: bool) -> bool:
    """Whether a sampler named `gpu` runs measured here. Without CUDA, or with `emulate`, it is
    emulated; on a CUDA machine the local GPU must be `gpu` by name and compute capability, or
    this raises a ProfileError (pass --emulate to emulate another GPU on this one)."""
    g = GPUS[_need(gpu, GPUS, "gpu")]
    if local is None or emulate:
        return False
    name, (major, minor) = local
    if any(n in name for n in g.cuda_names) and g.capability_major == major:
        return True
    here = local_profile(local)
    hint = f"--gpu {here}" if here else "a GPU that is profiled here"
    raise ProfileError(f"--gpu {g.name} ({'/'.join(g.cuda_names)}, {g.arch}) is not this "
                       f"machine's GPU ({name}, sm{major}{minor}); pass --emulate to emulate "
                       f"{g.name} on it, or {hint} to measure")


KV_CACHES = tuple(KV_CACHE_CODECS)


@dataclass(frozen=True, kw_only=True)
class NumericsSpec:
    """Everything that decides a sampler's (or trainer's) numerics."""

    gpu: str
    """GPU profile name ("cpu-reference" for the trainer side)."""
    dtype: str
    """Serving precision as the user named it."""
    kv_cache: str
    """KV-cache storage: "bf16" (the compute dtype) or "fp8"."""
    compute_dtype: Literal["bf16", "fp16", "fp32"]
    """Dtype of activations between kernels."""
    weight_codec: str | None
    """quantize/ codec the weights are stored in (None: the compute dtype itself)."""
    activation_codec: str | None
    """codec activations are quantized to before each linear layer (None: none, W*A16)."""
    accumulation: str
    """mismatch.quantize.accumulate preset of the low-precision GEMM ("fp32" for BF16/FP16/Marlin)."""
    kv_codec: str | None
    """codec of the KV cache (None: kept in the compute dtype)."""
    attention: AttentionKernel
    """Attention kernel family."""
    kernel_path: str
    """One line saying what runs, for reports."""
    split_k: int = 1
    """K-splits of each emulated GEMM: FP32 partial sums over K/split_k slices, added at the end
    (a split-K or stream-K kernel's reduction order; 1: one pass)."""
    router_dtype: Literal["compute", "fp32"] = "compute"
    """MoE router logits: computed in the compute dtype (Hugging Face and serving engines) or in
    FP32 (trainers that keep the router in FP32, e.g. Megatron's `moe_router_dtype`)."""

    lm_head: Literal["compute", "fp32"] = "compute"
    """The LM head: in the compute dtype (logits rounded to it), or FP32 inputs, weights and
    logits (the mitigation MiniMax-M1 used; mismatch.engines.head)."""

    def numerics_key(self) -> tuple:
        """What decides the numbers (not the names): equal keys compute identical results."""
        return (self.compute_dtype, self.weight_codec, self.activation_codec, self.accumulation,
                self.kv_codec, self.attention, self.split_k, self.router_dtype, self.lm_head)

    @property
    def label(self) -> str:
        kv = f", kv {self.kv_cache}" if self.kv_cache != self.compute_dtype else ""
        head = ", fp32 head" if self.lm_head == "fp32" and self.compute_dtype != "fp32" else ""
        return f"{self.gpu} {self.dtype}{kv}{head}"


# The trainer side: teacher-forced BF16 forward, GEMMs with FP32 accumulation rounded once (as a
# GPU trainer's GEMMs), reference attention (the study's trainer is BF16 Megatron on B200).
TRAINER = NumericsSpec(gpu="trainer", dtype="bf16", kv_cache="bf16", compute_dtype="bf16",
                       weight_codec=None, activation_codec=None, accumulation="fp32",
                       kv_codec=None, attention="reference",
                       kernel_path="BF16 teacher-forced forward (reference attention)")


def _need(name: str, choices, what: str) -> str:
    key = name.lower().replace("_", "-")
    if key not in choices:
        raise ProfileError(f"unknown {what} {name!r}; valid: {', '.join(choices)}")
    return key


def _can_run(gpu: GpuProfile) -> list[str]:
    return [d for d in DTYPES if _serving(gpu, d) is not None]


# Serving kernels per precision: (the W*A* kernel where the GPU's tensor cores take the format,
# the weight-only kernel elsewhere; None where no weight-only kernel serves it).
_KERNEL_PATHS: dict[str, tuple[str | None, str | None]] = {
    "fp8": ("FP8 W8A8 per-tensor", "Marlin W8A16 (FP8 weights dequantized to BF16)"),
    "w4a16-nvfp4": (None, "W4A16 NVFP4 (Marlin / weight-only)"),
    "nvfp4": ("NVFP4 W4A4, dynamic 16-blocks", None),
    "mxfp4": ("MXFP4 W4A4 (RCEIL scales)", "Marlin W4A16 (MXFP4 weights)"),
}


def _serving(gpu: GpuProfile, dtype: str) -> tuple[str, str | None, str | None, str, str] | None:
    """(compute dtype, weight codec, activation codec, accumulation, kernel path), or None when
    no kernel serves `dtype` on `gpu`."""
    p = PRECISIONS[dtype]
    if p.is_cast:
        return p.compute_dtype, None, None, "fp32", f"{dtype.upper()} GEMMs, FP32 accumulate"
    native_path, weight_only_path = _KERNEL_PATHS[dtype]
    if p.activation_codec is not None and p.tensor_cores in gpu.native:
        acc = gpu.accumulation(dtype)
        note = " with fast accumulation" if acc != "fp32" else ""
        return p.compute_dtype, p.weight_codec, p.activation_codec, acc, f"{native_path}{note}"
    if weight_only_path is None:
        return None
    return p.compute_dtype, p.weight_codec, None, "fp32", weight_only_path


_WHY_NOT = {"nvfp4": "NVFP4 W4A4 needs Blackwell FP4 tensor cores"}


def resolve(gpu: str, dtype: str, kv_cache: str | None = None) -> NumericsSpec:
    """The sampler numerics of (gpu, dtype[, kv_cache]); kv_cache defaults to the compute dtype."""
    g = GPUS[_need(gpu, GPUS, "gpu")]
    d = _need(dtype, DTYPES, "dtype")
    serving = _serving(g, d)
    if serving is None:
        raise ProfileError(f"{g.name} cannot run {d}: {_WHY_NOT.get(d, 'no kernel serves it')}; "
                           f"{g.name} can run: {', '.join(_can_run(g))}")
    compute, wcodec, acodec, acc, path = serving
    kv = compute if kv_cache is None else _need(kv_cache, KV_CACHES, "kv cache")
    if kv == "bf16" and compute == "fp16":
        kv = "fp16"
    return NumericsSpec(gpu=g.name, dtype=d, kv_cache=kv, compute_dtype=compute,  # type: ignore[arg-type]
                        weight_codec=wcodec, activation_codec=acodec, accumulation=acc,
                        kv_codec=KV_CACHE_CODECS.get(kv), attention=g.attention,
                        kernel_path=path + (", FP8 KV cache" if kv == "fp8" else ""))


TRAINER_DTYPES = ("bf16", "fp16", "fp32")
"""The trainer side's compute dtypes: BF16 (the default), FP16, or FP32 (a reference)."""

LM_HEADS = ("compute", "fp32")
"""The LM head's precisions (`NumericsSpec.lm_head`): the side's compute dtype, or FP32."""


def trainer_spec(dtype: str = "bf16", lm_head: str = "compute") -> NumericsSpec:
    """The trainer side in BF16 (default), FP16 or FP32, its LM head in the compute dtype or in
    FP32 (`lm_head`)."""
    d = _need(dtype, TRAINER_DTYPES, "trainer dtype")
    h = _need(lm_head, LM_HEADS, "LM head dtype")
    head = ", FP32 LM head" if h == "fp32" and d != "fp32" else ""
    return replace(TRAINER, dtype=d, kv_cache=d, compute_dtype=d,  # type: ignore[arg-type]
                   lm_head=h,  # type: ignore[arg-type]
                   kernel_path=f"{d.upper()} teacher-forced forward (reference attention){head}")


def table() -> list[NumericsSpec | tuple[str, str, str]]:
    """Every (gpu, dtype) pair: the spec, or (gpu, dtype, reason) where it cannot run."""
    rows: list[NumericsSpec | tuple[str, str, str]] = []
    for g in GPUS:
        for d in DTYPES:
            try:
                rows.append(resolve(g, d))
            except ProfileError as exc:
                rows.append((g, d, str(exc).split(";")[0]))
    return rows
