"""The ladder: add the sources one at a time, in the study's order, and attribute the total.

The study's trainer runs BF16 on B200 (`--trainer-gpu`); its homogeneous samplers "match the
trainer's accelerator and precision, so only kernels and staleness separate them". So the rungs
are:

    L0  kernels        a sampler on the trainer's GPU at the trainer's precision: the decode
                       path and that GPU's attention kernels, batched as sampled
    L1  + precision    the same GPU serving the target checkpoint's formats (weights,
                       activations, KV cache) as it natively would
    L2  + accelerator  the target GPU serving that checkpoint its own way (its attention family,
                       its GEMM accumulation, Marlin weight-only where it lacks the tensor cores)
                       — the full target sampler, so L2 is the total

and each source alone:

    kernels alone      = L0 against the trainer
    precision alone    the trainer's teacher-forced forward with the L1 formats
    accelerator alone  the trainer-precision sampler moved from the trainer's GPU to the target
                       GPU (L0 against the same sampler on the target GPU): an accelerator
                       cannot run without kernels, so its own cost is measured from L0

Each rung's increment is its KL minus the rung before; `interaction` = total − Σ alone: how far
the sources are from adding up (negative when they partly cancel). KL figures are the exact
full-vocabulary KL per token with 95% sequence-bootstrap intervals.
"""

from __future__ import annotations

from mismatch.profiles import NumericsSpec, ProfileError, resolve

from .base import SourceResult, Variant, with_spec
from .context import ProbeContext
from .paired import PairedProbe
from .source_figures import LadderFigures, LadderRung

RUNGS = ("L0 kernels", "L1 + precision", "L2 + accelerator")


def checkpoint_on_trainer_gpu(ctx: ProbeContext) -> NumericsSpec:
    """The target checkpoint's formats as the trainer's GPU (`--trainer-gpu`) serves them; where
    it cannot, the target's own formats with that GPU's attention and FP32 accumulation."""
    tg = ctx.cfg.trainer_gpu
    try:
        return ctx.as_sampler(resolve(tg, ctx.spec.dtype, ctx.spec.kv_cache))
    except ProfileError:
        return with_spec(ctx.spec, attention=resolve(tg, ctx.trainer.dtype).attention,
                         accumulation="fp32")


class LadderProbe(PairedProbe):
    name = "ladder"
    headline_name = "L2 + accelerator"

    def __init__(self, ctx: ProbeContext) -> None:
        # the rungs are sampler deployments: they carry the sampler side's LM head
        trainer_on_gpu = ctx.as_sampler(ctx.cfg.trainer_gpu_numerics)
        formats = checkpoint_on_trainer_gpu(ctx)
        self.formats = formats
        l0 = Variant(spec=trainer_on_gpu, attention=True, path="decode")
        l1 = Variant(spec=formats, attention=True, path="decode")
        target_kernels = Variant(spec=with_spec(ctx.trainer, attention=ctx.spec.attention,
                                                lm_head=ctx.spec.lm_head),
                                 attention=True, path="decode")
        ref = ctx.reference
        pairs = {
            "L0 kernels": (ref, l0),
            "L1 + precision": (ref, l1),
            "L2 + accelerator": (ref, ctx.sampler),
            "kernels alone": (ref, l0),
            "precision alone": (ref, Variant(spec=formats)),
            "accelerator alone": (l0, target_kernels),
        }
        super().__init__(ctx, pairs)

    def finish(self) -> SourceResult:
        parts = self.summaries()
        rungs = []
        previous = 0.0
        for name in RUNGS:
            kl = parts[name].kl_exact
            rungs.append(LadderRung(rung=name, kl_exact=kl, increment=kl - previous,
                                    kl_exact_ci95=parts[name].kl_exact_ci95))
            previous = kl
        alone = {k.split()[0]: parts[k].kl_exact for k in
                 ("kernels alone", "precision alone", "accelerator alone")}
        total = parts["L2 + accelerator"].kl_exact
        interaction = total - sum(alone.values())
        figures = LadderFigures(rungs=rungs, alone=alone, total_kl_exact=total,
                                interaction=interaction,
                                interaction_fraction=interaction / total if total > 0 else 0.0,
                                trainer_gpu=self.ctx.cfg.trainer_gpu,
                                l1_formats=self.formats.kernel_path)
        notes = [f"L0/L1 run on the trainer's GPU ({self.ctx.cfg.trainer_gpu}); L1 serves the "
                 f"target formats as it would ({self.formats.kernel_path}); L2 is the target "
                 f"sampler ({self.ctx.spec.label}: {self.ctx.spec.kernel_path}).",
                 f"Interaction = total − Σ alone = {interaction:.3e} "
                 f"({figures.interaction_fraction:+.0%} of the total)."]
        return SourceResult(name=self.name, headline=parts["L2 + accelerator"],
                            parts=parts, extra=figures.to_json(), notes=notes,
                            log_ratio=self.tallies["L2 + accelerator"].log_ratio())
