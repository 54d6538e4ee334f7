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
sequences (`kl_exact_ci95`), as the source probes report it (mismatch.probes.tally.Tally). The token
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
for. Without CUDA everything is emulated.

The probe is the source probes' pipeline (mismatch.probes.runner.run_batches on a
mismatch.probes.context.ProbeContext) with one batch probe, `SplitProbe`; the pipeline's own
total is the `total` column. Unlike the source probes, every batch samples with the same seed
and the trainer side may run transformer-engine's linear layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from mismatch.profiles import check_local_gpu, local_gpu, trainer_spec
from mismatch.probes.base import Variant
from mismatch.probes.config import ProbeConfig
from mismatch.probes.context import ProbeContext
from mismatch.probes.errors import ProbeError
from mismatch.probes.paired import PairedProbe
from mismatch.probes.runner import run_batches
from mismatch.probes.summary import ProbeSummary
from mismatch.probes.tally import Tally
from mismatch.records import Rollout
from mismatch.runtime import torch_threads

__all__ = ["ProbeConfig", "ProbeError", "ProbeResult", "SplitProbe", "run_probe",
           "completion_slice", "SOURCES_REPORTED", "SPLIT"]

SOURCES_REPORTED = ("precision", "accelerator")
SPLIT = {"total": ("trainer", "sampler"), "precision": ("trainer", "precision"),
         "accelerator": ("precision", "sampler")}
"""Column → (reference π, other μ): each column is KL(μ ‖ π) between two configurations."""
REFERENCES = {"sampler vs fp32": ("fp32", "sampler"), "trainer vs fp32": ("fp32", "trainer")}
"""--fp32-reference's columns: each side against an FP32 forward of the same tokens."""


class SplitProbe(PairedProbe):
    """The precision and accelerator columns (the pipeline tallies the total itself)."""

    name = "split"
    headline_name = "precision"

    def __init__(self, ctx: ProbeContext) -> None:
        configurations = {"trainer": ctx.reference, "sampler": ctx.sampler,
                          "precision": Variant(spec=ctx.spec),
                          "fp32": Variant(spec=trainer_spec("fp32"))}
        pairs = {**{name: SPLIT[name] for name in SOURCES_REPORTED},
                 **(REFERENCES if ctx.cfg.fp32_reference else {})}
        super().__init__(ctx, {name: (configurations[a], configurations[b])
                               for name, (a, b) in pairs.items()})


@dataclass
class ProbeResult:
    """Everything the probe measured, plus the raw per-token arrays for plots."""

    record: ProbeSummary
    log_ratio_total: torch.Tensor = field(repr=False)
    per_position: dict[str, list[float]] = field(repr=False)

    @property
    def summary(self) -> dict:
        """results.json's body (ProbeSummary.to_json)."""
        return self.record.to_json()


def run_probe(cfg: ProbeConfig, progress: Callable[[int, int], None] | None = None) -> ProbeResult:
    """Run the probe; `progress(done, total)` is called after each batch."""
    from mismatch.engines.te import check_te

    spec = cfg.sampler_numerics
    measured = check_local_gpu(spec.gpu, local_gpu(), cfg.emulate)
    check_te(cfg.trainer_kernels)
    ctx = ProbeContext(cfg, None if progress is None else lambda _label, d, t: progress(d, t),
                       measured=measured, seed_per_batch=False)
    with torch_threads(ctx.threads):
        split = SplitProbe(ctx)
        tallies = {"total": run_batches(ctx, [split]).total, **split.tallies}
        columns = {name: tallies[name].summary(cfg.seed) for name in SPLIT}
        references = {name: tallies[name].summary(cfg.seed)
                      for name in REFERENCES if name in tallies}
    # the token estimators hold where the tokens were drawn from μ itself
    columns = {name: replace(col, k_estimators_valid=SPLIT[name][1] == "sampler")
               for name, col in columns.items()}
    references = {name: replace(col, k_estimators_valid=REFERENCES[name][1] == "sampler")
                  for name, col in references.items()}
    summary = ProbeSummary(
        gpu=spec.gpu, dtype=spec.dtype, kv_cache=spec.kv_cache,
        trainer_dtype=ctx.trainer.dtype, trainer_kernels=cfg.trainer_kernels,
        lm_head=ctx.lm_heads(),
        mode=ctx.mode, model=str(cfg.model) if cfg.model else "embedded",
        kernel_path=spec.kernel_path, attention=spec.attention,
        prompts=len(ctx.prompts), tokens=tallies["total"].tokens, total=columns["total"],
        sources={name: columns[name] for name in SOURCES_REPORTED},
        references=references or None)
    per_pos = {name: _per_position(tallies[name]) for name in SPLIT}
    return ProbeResult(record=summary, log_ratio_total=tallies["total"].log_ratio(),
                       per_position=per_pos)


def completion_slice(x: torch.Tensor, rollout: Rollout, width: int) -> torch.Tensor:
    """The completion part [B, width] (zero-padded): the positions after the padded prompt."""
    part = x[:, rollout.prompt_width:]
    out = torch.zeros(x.shape[0], width, dtype=x.dtype)
    out[:, :part.shape[1]] = part[:, :width]
    return out


def _per_position(tally: Tally) -> list[float]:
    """Mean exact KL at each completion position (NaN where no sequence reaches it)."""
    exact, mask = torch.cat(tally.exact), torch.cat(tally.mask).double()
    n = mask.sum(0)
    return [float(v) if c > 0 else math.nan
            for v, c in zip(exact.sum(0) / n.clamp_min(1), n)]
