"""Sampling under a variant's numerics: emulated through the engine's generate on CPU, or, for
the measured target sampler, on the local GPU with its own kernels."""

from __future__ import annotations

import contextlib

import torch

from mismatch.profiles import NumericsSpec
from mismatch.records import Rollout

from .base import Variant
from .models import ModelPair

__all__ = ["generate", "generate_measured"]


def generate(pair: ModelPair, variant: Variant, prompts: list[list[int]], params, scales: dict,
             *, forced: torch.Tensor | None = None) -> Rollout:
    """Sample (or, with `forced`, replay) completions under `variant` (decode path), emulated."""
    from mismatch.engines.generation import generate as engine_generate
    from mismatch.engines.numerics import apply_numerics

    spec = variant.spec
    model = pair.model(spec.compute_dtype)
    with apply_numerics(model, spec, scales, kernels=variant.attention):
        return engine_generate(model, prompts, params, pad_id=pair.pad_id,
                               eos_ids=pair.eos_ids, label=spec.label, mode="emulated",
                               with_routing=pair.is_moe, forced=forced, keep_full=True)


def generate_measured(pair: ModelPair, prompts: list[list[int]], params,
                      scales: dict) -> Rollout:
    """The target sampler on the local GPU (the model visits CUDA for the call); `scales` are
    calibrated on CPU, as for the emulated sampler."""
    from mismatch.engines.generation import generate as engine_generate

    spec = pair.sampler
    model = pair.model(spec.compute_dtype)
    model.cuda()
    try:
        with _sampler_numerics(model, spec, scales):
            return engine_generate(model, prompts, params, pad_id=pair.pad_id,
                                   eos_ids=pair.eos_ids, label=spec.label, mode="measured",
                                   with_routing=pair.is_moe, keep_full=True)
    finally:
        model.cpu()


def _sampler_numerics(model: torch.nn.Module, spec: NumericsSpec, scales: dict):
    """The numerics a measured sampler runs on the local GPU (model already on CUDA): none for
    BF16/FP16 (the GPU's own kernels; an FP8 KV cache stored as such), torch._scaled_mm for FP8
    W8A8 where the GPU has FP8 tensor cores, else the formats through the emulator's GEMMs and
    the Triton kernels on the GPU; attention is torch SDPA."""
    from mismatch.engines.hf_attention import fp8_kv_cache
    from mismatch.engines.numerics import apply_numerics

    if spec.weight_codec is None and spec.activation_codec is None:
        return contextlib.nullcontext() if spec.kv_codec is None else fp8_kv_cache(model)
    return apply_numerics(model, spec, scales, kernels=False,
                          native_fp8=spec.weight_codec == "fp8" and
                          spec.activation_codec == "fp8-act")
