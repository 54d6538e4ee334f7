"""precision: what each number format costs, stage by stage, with the kernels held at the reference.

For each format the sampler's weights, then also its activations, then also its KV cache are put
in that format; everything else is the trainer's teacher-forced forward (reference attention, FP32
GEMM sums). Each stage is compared with the trainer on the shared tokens:

    format        W (weights only)          + A (activations)              + KV
    fp16          weights rounded to FP16   the whole forward in FP16      + FP8 KV cache
    fp8           FP8 per-tensor            W8A8 per-tensor (static scale)  + FP8 KV cache
    fp8-block128  128×128 weight blocks     + 1×128 activation groups       + FP8 KV cache
    mxfp4         MXFP4 (RCEIL scales)      W4A4 MXFP4                      + FP8 KV cache
    nvfp4         NVFP4 (modelopt order)    W4A4, dynamic 16-blocks         + FP8 KV cache
    w4a16-nvfp4   NVFP4 weights             (activations stay BF16: no A)   + FP8 KV cache

Where the target GPU accumulates a format's GEMMs in its own way it is used: FP8 W8A8 per-tensor
on Hopper (sm90) runs the fast-accumulation model (quantize/accumulate.py); elsewhere, and for
block-scaled FP8 (whose kernels promote to FP32 every 128 K-elements: DeepSeek-V3,
arXiv:2412.19437, §3.3.2), the sums are FP32. The headline is the target configuration's own formats (`--dtype`, `--kv-cache`), on every
prompt; the grid of formats and stages runs on the first `--subset-prompts`.
"""

from __future__ import annotations

import math

from mismatch.profiles import GPUS, NumericsSpec
from mismatch.quantize.precisions import KV_CACHE_CODECS, PRECISIONS

from .base import Batch, SourceResult, Variant, with_spec
from .context import ProbeContext
from .tally import Tally

FORMATS = ("fp16", "fp8", "fp8-block128", "mxfp4", "nvfp4", "w4a16-nvfp4")
STAGES = ("W", "W+A", "W+A+KV")


def stage_spec(base: NumericsSpec, fmt: str, stage: str, gpu: str) -> NumericsSpec | None:
    """The trainer spec `base` with `fmt` (a mismatch.quantize.precisions row) applied up to
    `stage`; None where the stage does not exist (W4A16 has no activation stage)."""
    p = PRECISIONS[fmt]
    if stage == "W+A" and p.activation_codec is None and not p.is_cast:
        return None
    spec = with_spec(base, weight_codec=p.weight_codec, dtype=fmt)
    if stage in ("W+A", "W+A+KV"):
        if p.is_cast:  # the whole forward in the cast dtype
            spec = with_spec(spec, compute_dtype=p.compute_dtype, weight_codec=None)
        elif p.activation_codec is not None:
            spec = with_spec(spec, activation_codec=p.activation_codec,
                             accumulation=GPUS[gpu].accumulation(fmt))
    if stage == "W+A+KV":
        spec = with_spec(spec, kv_codec=KV_CACHE_CODECS["fp8"], kv_cache="fp8")
    return spec


class PrecisionProbe:
    name = "precision"

    def __init__(self, ctx: ProbeContext) -> None:
        self.ctx = ctx
        self.variants: dict[str, Variant] = {}
        for fmt in FORMATS:
            for stage in STAGES:
                spec = stage_spec(ctx.trainer, fmt, stage, ctx.spec.gpu)
                if spec is not None:
                    self.variants[f"{fmt} {stage}"] = Variant(spec=spec)
        # the target's own formats, teacher-forced with the reference kernels
        own = with_spec(ctx.spec, attention="reference")
        self.variants["target"] = Variant(spec=own)
        self.tallies = {name: Tally() for name in self.variants}
        self.batches_needed: int | None = None  # every batch, extensions included
        self.grid_batches = math.ceil(ctx.cfg.subset_prompts / ctx.cfg.batch_size)

    def on_batch(self, batch: Batch) -> None:
        """The headline on every batch; the format × stage grid on the first --subset-prompts."""
        for name, variant in self.variants.items():
            if name == "target" or batch.index < self.grid_batches:
                self.ctx.compare(self.tallies[name], self.ctx.reference, variant, batch)

    @property
    def headline(self) -> Tally:
        """The comparison whose interval --ci-target watches."""
        return self.tallies["target"]

    def finish(self) -> SourceResult:
        seed = self.ctx.cfg.seed
        parts = {name: t.summary(seed) for name, t in self.tallies.items()}
        headline = parts.pop("target")
        s = self.ctx.spec
        notes = [f"Headline: the target's own formats ({s.dtype}, KV {s.kv_cache}: "
                 f"{s.kernel_path}) on the reference kernels. Rows: each format applied to "
                 f"weights, then activations, then the KV cache.",
                 "FP8 W8A8 rows use Hopper's fast accumulation when the target GPU is sm90; "
                 "block-scaled FP8 and all other rows sum in FP32. FP8 activations of the "
                 "128-block rows use dynamic 1×128 groups (zero-padded where K < 128).",
                 f"Grid rows: the first {self.tallies['fp8 W'].tokens} completion tokens "
                 f"(--subset-prompts {self.ctx.cfg.subset_prompts})."]
        return SourceResult(name=self.name, headline=headline, parts=parts, notes=notes,
                            log_ratio=self.tallies["target"].log_ratio())
