"""`mismatch probe`: sample with an emulated (or real) sampler, re-score with the trainer, attribute.

For a (GPU, precision) the probe builds three configurations of the same model on the same
prompts and compares them on the same sampled tokens:

    trainer     BF16 (or --trainer-dtype) teacher-forced forward, reference kernels: GEMMs with
                exact products and FP32 sums rounded once (what a GPU trainer's GEMMs do,
                whatever CPU kernel torch would pick), torch SDPA attention
    precision   teacher-forced, reference kernels, but the sampler's formats: weights decoded
                from their real storage, activations and KV cache quantized as the GPU does
    sampler     the full sampler: KV-cache decode path, the GPU's attention kernel family and
                GEMM accumulation, and the formats

    total        = KL(sampler ‖ trainer)
    precision    = KL(precision ‖ trainer)      what the formats alone cost
    accelerator  = KL(sampler ‖ precision)      what the GPU's kernels add on top

Each column's headline is the exact full-vocabulary KL of its pair of configurations at the
positions the sampler visited (`kl_exact`, from the three configurations' whole log-softmax rows,
reduced to [B, W] batch by batch; mismatch.metrics.exact_kl), with a 95% bootstrap interval over
sequences (`kl_exact_ci95`), as the source probes report it (probes.base.Tally). The token
estimators k1/k2/k3, the importance ratios and ESS stay as secondary figures; they estimate
KL(μ‖π) only on tokens drawn from μ, which holds for `total` and `accelerator` (μ is the sampler)
but not for `precision` (μ is the precision configuration, which drew no tokens): there they are
flagged `k_estimators_valid: false`. KL is not additive: precision + accelerator need not equal
the total, and one source can exceed the total when the other partly cancels it.

Figures are labeled `emulated` unless the sampler ran on the named GPU itself (`measured`). On a
CUDA machine the local GPU must be the named one (name and compute capability) unless
`emulate` is set; measured samplers run the GPU's own kernels: cuBLAS BF16/FP16 GEMMs and torch
SDPA attention, FP8 W8A8 GEMMs through torch._scaled_mm on GPUs with FP8 tensor cores, and the
Triton fake-quant / accumulation kernels (mismatch.kernels) for the formats torch has no GEMM
for. Without CUDA everything is emulated, as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from mismatch.metrics import exact_kl
from mismatch.profiles import NumericsSpec, check_local_gpu, local_gpu, resolve, trainer_spec
from mismatch.probes.config import ProbeConfig, ProbeError
from mismatch.records import Rollout
from mismatch.zoo.prompts import eos_ids, load_prompts

__all__ = ["ProbeConfig", "ProbeError", "run_probe", "exact_split",
           "SOURCES_REPORTED", "SPLIT"]

SOURCES_REPORTED = ("precision", "accelerator")
SPLIT = {"total": ("trainer", "sampler"), "precision": ("trainer", "precision"),
         "accelerator": ("precision", "sampler")}
"""Column → (reference π, other μ): each column is KL(μ ‖ π) between two configurations."""


_SMALL_MODEL = 50_000_000  # parameters: below this, one intra-op thread is fastest


def _sampler_numerics(model: torch.nn.Module, spec: NumericsSpec, scales: dict):
    """The numerics a measured sampler runs on the local GPU (model already on CUDA): none for
    BF16/FP16 (the GPU's own kernels; an FP8 KV cache stored as such), torch._scaled_mm for FP8
    W8A8 where the GPU has FP8 tensor cores, else the formats through the emulator's GEMMs and
    the Triton kernels on the GPU; attention is torch SDPA."""
    import contextlib

    from mismatch.engines.numerics import apply_numerics, fp8_kv_cache

    if spec.weight_codec is None and spec.activation_codec is None:
        return contextlib.nullcontext() if spec.kv_codec is None else fp8_kv_cache(model)
    return apply_numerics(model, spec, scales, kernels=False,
                          native_fp8=spec.weight_codec == "fp8" and
                          spec.activation_codec == "fp8-act")


@dataclass
class ProbeResult:
    """Everything the probe measured, plus the raw per-token arrays for plots."""

    summary: dict
    log_ratio_total: torch.Tensor = field(repr=False)
    per_position: dict[str, list[float]] = field(repr=False)


def run_probe(cfg: ProbeConfig, progress: Callable[[int, int], None] | None = None) -> ProbeResult:
    """Run the probe; `progress(done, total)` is called after each batch."""
    from mismatch.engines.numerics import apply_numerics, calibrate
    from mismatch.engines.sampler import SamplingParams, generate
    from mismatch.engines.scorer import score
    from mismatch.engines.te import check_te
    from mismatch.zoo import load_model, load_tokenizer
    from mismatch.probes.base import Tally

    spec = resolve(cfg.gpu, cfg.dtype, cfg.kv_cache)
    trainer = trainer_spec(cfg.trainer_dtype)
    measured = check_local_gpu(spec.gpu, local_gpu(), cfg.emulate)
    check_te(cfg.trainer_kernels)
    tokenizer = load_tokenizer(cfg.model)
    prompts = load_prompts(tokenizer, cfg.prompts, cfg.n_prompts)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}
    from transformers import AutoConfig

    from mismatch.zoo import check_model_dir

    config = AutoConfig.from_pretrained(check_model_dir(cfg.model, tokenizer=False),
                                        local_files_only=True)
    limit = getattr(config, "max_position_embeddings", None)
    longest = max(len(p) for p in prompts)
    if limit is not None and longest + cfg.max_new_tokens > limit:
        raise ProbeError(f"a prompt of {longest} tokens plus --max-new-tokens "
                         f"{cfg.max_new_tokens} exceeds the model's context of {limit}; "
                         f"shorten the prompts or lower --max-new-tokens")
    trainer_model = load_model(cfg.model, dtype=torch_dtype[trainer.compute_dtype])
    n_params = sum(p.numel() for p in trainer_model.parameters())
    threads = cfg.threads if cfg.threads is not None else (1 if n_params < _SMALL_MODEL else None)
    if threads is not None:
        torch.set_num_threads(threads)
    sampler_model = trainer_model if spec.compute_dtype == trainer.compute_dtype else \
        load_model(cfg.model, dtype=torch_dtype[spec.compute_dtype])
    mode = "measured" if measured else "emulated"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = eos_ids(tokenizer, trainer_model)
    calib = [(torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long)) for p in prompts[:8]]
    scales = calibrate(sampler_model, spec, calib)
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                            seed=cfg.seed)
    batches = [prompts[i:i + cfg.batch_size] for i in range(0, len(prompts), cfg.batch_size)]
    tallies = {name: Tally() for name in SPLIT}
    width = cfg.max_new_tokens
    for i, batch in enumerate(batches):
        if measured:
            sampler_model.cuda()
            try:
                with _sampler_numerics(sampler_model, spec, scales):
                    rollout = generate(sampler_model, batch, params, pad_id=pad_id,
                                       eos_ids=eos, label=spec.label, mode=mode,
                                       keep_full=True)
            finally:
                sampler_model.cpu()
        else:
            with apply_numerics(sampler_model, spec, scales):
                rollout = generate(sampler_model, batch, params, pad_id=pad_id, eos_ids=eos,
                                   label=spec.label, mode=mode, keep_full=True)
        pw = rollout.prompt_width
        trainer_scores = _trainer_scores(trainer_model, trainer, rollout, cfg.trainer_kernels,
                                         full_from=pw)
        with apply_numerics(sampler_model, spec, scales, kernels=False):
            precision_scores = score(sampler_model, rollout, with_routing=False, full_from=pw)
        lp = {"trainer": trainer_scores.logprobs, "precision": precision_scores.logprobs,
              "sampler": rollout.sampler_logprobs}
        full = {"trainer": trainer_scores.full_logprobs,
                "precision": precision_scores.full_logprobs,
                "sampler": rollout.full_logprobs}
        rollout.full_logprobs = None  # the [B, n, V] rows never outlive their batch
        del trainer_scores, precision_scores
        exact = exact_split(full, width)  # [B, W] each
        del full  # the [B, n, V] rows never outlive their batch
        mask = _completion_slice(rollout.completion_mask, rollout, width)
        for name, (ref, other) in SPLIT.items():
            tallies[name].add(_completion_slice(lp[ref], rollout, width),
                              _completion_slice(lp[other], rollout, width), mask,
                              exact=exact[name])
        if progress:
            progress(i + 1, len(batches))
    columns = {name: tally.summary(cfg.seed) for name, tally in tallies.items()}
    for name, col in columns.items():
        col["k_estimators_valid"] = SPLIT[name][1] == "sampler"  # tokens drawn from μ itself
    summary = {
        "gpu": spec.gpu, "dtype": spec.dtype, "kv_cache": spec.kv_cache,
        "trainer_dtype": trainer.dtype, "trainer_kernels": cfg.trainer_kernels, "mode": mode,
        "model": str(cfg.model) if cfg.model else "embedded",
        "kernel_path": spec.kernel_path, "attention": spec.attention,
        "prompts": len(prompts), "tokens": tallies["total"].tokens,
        "total": columns["total"],
        "sources": {name: columns[name] for name in SOURCES_REPORTED},
    }
    per_pos = {name: _per_position(tally) for name, tally in tallies.items()}
    return ProbeResult(summary=summary, log_ratio_total=tallies["total"].log_ratio(),
                       per_position=per_pos)


def exact_split(full: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """Per-position exact KL(μ ‖ π) [B, width] float64 of each SPLIT column, from the
    configurations' whole log-softmax rows at the completion positions, `full[name]` [B, n, V]
    (name: trainer, precision, sampler); zero-padded past n. Peak extra memory: exact_kl's tiles."""
    out = {}
    for name, (ref, other) in SPLIT.items():
        b, n, v = full[other].shape
        if full[ref].shape != (b, n, v):
            raise ValueError(f"{ref} rows {tuple(full[ref].shape)} and {other} rows "
                             f"{tuple(full[other].shape)} differ")
        kl = exact_kl(full[other].reshape(b * n, v), full[ref].reshape(b * n, v)).view(b, n)
        out[name] = torch.zeros(b, width, dtype=torch.float64)
        out[name][:, :min(n, width)] = kl[:, :width]
    return out


def _trainer_scores(model: torch.nn.Module, trainer: NumericsSpec, rollout: Rollout,
                    kernels: str, full_from: int):
    """The trainer side's scores: the reference GEMM model on CPU, or transformer-engine's
    linear layers on the local GPU (the model visits CUDA for the call)."""
    from mismatch.engines.numerics import apply_numerics
    from mismatch.engines.scorer import score
    from mismatch.engines.te import te_linears

    if kernels == "torch":
        with apply_numerics(model, trainer, kernels=False):
            return score(model, rollout, with_routing=False, full_from=full_from)
    model.cuda()
    try:
        with te_linears(model, kernels):
            return score(model, rollout, with_routing=False, full_from=full_from)
    finally:
        model.cpu()


def _completion_slice(x: torch.Tensor, rollout: Rollout, width: int) -> torch.Tensor:
    """The completion part [B, width] (zero-padded): the positions after the padded prompt."""
    part = x[:, rollout.prompt_width:]
    out = torch.zeros(x.shape[0], width, dtype=x.dtype)
    out[:, :part.shape[1]] = part[:, :width]
    return out


def _per_position(tally) -> list[float]:
    """Mean exact KL at each completion position (NaN where no sequence reaches it)."""
    exact, mask = torch.cat(tally.exact), torch.cat(tally.mask).double()
    n = mask.sum(0)
    return [float(v) if c > 0 else math.nan
            for v, c in zip(exact.sum(0) / n.clamp_min(1), n)]
