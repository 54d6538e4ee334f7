"""The one probe pipeline: sample the target sampler once per batch, tally the total (trainer vs
sampler) and feed every batch probe, draw more prompts while --ci-target is unmet, then run the
standalone probes. `mismatch probe` without --sources is this pipeline with one batch probe, the
quick probe's split (mismatch.app.probe); with --sources, `run_sources`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from mismatch.runtime import torch_threads

from . import SOURCES, load_source
from .base import SourceResult
from .context import ProbeContext
from .summary import CITarget, ProbeSummary
from .tally import NOISE_FLOOR, Tally

__all__ = ["run_batches", "run_sources", "SourcesRun", "BatchesRun"]


@dataclass
class BatchesRun:
    """The total's tally over every batch and the --ci-target outcome."""

    total: Tally
    ci: CITarget
    """--ci-target's outcome."""


@dataclass
class SourcesRun:
    """The run's summary record, each source's result, and the total's per-token log-ratios."""

    record: ProbeSummary
    results: dict[str, SourceResult] = field(repr=False)
    log_ratio_total: torch.Tensor = field(repr=False)

    @property
    def summary(self) -> dict:
        """results.json's body (ProbeSummary.to_json)."""
        return self.record.to_json()


def run_batches(ctx: ProbeContext, probes: list, *, ci_target: float = 0.0) -> BatchesRun:
    """Sample every batch of `ctx` with the target sampler; tally trainer vs sampler and give
    each batch probe the batches it needs. With `ci_target` > 0, once the batches are done and a
    headline's interval is still too wide, draw 8 batches more of held-out prompts and check
    again (until met or --max-prompts). Call under the context's thread count."""
    total = Tally()
    i = 0
    met: bool | None = None
    unmet: list[str] = []
    while i < len(ctx.batches):
        batch = ctx.sample_batch(i)
        ctx.compare(total, ctx.reference, ctx.sampler, batch)
        for probe in probes:
            if probe.batches_needed is None or i < probe.batches_needed:
                probe.on_batch(batch)
        i += 1
        ctx.progress("sampling and scoring", i, len(ctx.batches))
        if i == len(ctx.batches) and ci_target > 0:
            unmet = _unmet(total, probes, ci_target, ctx.cfg.seed)
            met = not unmet
            if unmet:
                ctx.extend_prompts(8 * ctx.cfg.batch_size)
    return BatchesRun(total=total, ci=CITarget(target=ci_target, met=met, unmet=unmet))


def run_sources(cfg, progress: Callable[[str, int, int], None] | None = None, *,
                standalone_inputs: Mapping[str, dict] | None = None) -> SourcesRun:
    """The requested source probes (and the ladder) of `cfg`. `progress(label, done, total)` is
    called as work proceeds. `standalone_inputs[name]`: keyword arguments the application layer
    wires into a standalone probe beside the context (the staleness probe's checkpoint ladder)."""
    from .ladder import LadderProbe

    if not cfg.sources and not cfg.ladder:
        raise ValueError("no sources to probe: pass --sources a,b,...|all and/or --ladder")
    ctx = ProbeContext(cfg, progress)
    with torch_threads(ctx.threads):
        batch_probes = [load_source(n)(ctx) for n in cfg.sources if SOURCES[n].kind == "batch"]
        if cfg.ladder:
            batch_probes.append(LadderProbe(ctx))
        run = run_batches(ctx, batch_probes, ci_target=cfg.ci_target)
        results: dict[str, SourceResult] = {p.name: p.finish() for p in batch_probes}
        for name in cfg.sources:
            if SOURCES[name].kind == "standalone":
                kwargs = (standalone_inputs or {}).get(name, {})
                results[name] = load_source(name)(ctx, **kwargs)
        total = run.total.summary(cfg.seed)
    spec = ctx.spec
    summary = ProbeSummary(
        gpu=spec.gpu, dtype=spec.dtype, kv_cache=spec.kv_cache,
        trainer_dtype=ctx.trainer.dtype, trainer_gpu=cfg.trainer_gpu, mode="emulated",
        lm_head=ctx.lm_heads(),
        model=str(cfg.model) if cfg.model else "embedded",
        kernel_path=spec.kernel_path, attention=spec.attention,
        prompts=len(ctx.prompts), tokens=run.total.tokens, total=total, ci_target=run.ci,
        sources={name: r for name, r in results.items() if name != "ladder"},
        ladder=results.get("ladder"))
    return SourcesRun(record=summary, results=results, log_ratio_total=run.total.log_ratio())


def _unmet(total: Tally, probes: list, ci_target: float, seed: int) -> list[str]:
    """Names of headline comparisons whose interval is still wider than `ci_target`."""
    out = []
    for name, tally in [("total", total)] + [(p.name, p.headline) for p in probes
                                             if p.batches_needed is None]:
        s = tally.summary(seed, n_boot=400)
        rel = math.inf if s.kl_exact_ci_rel is None else s.kl_exact_ci_rel
        if (s.kl_exact or 0.0) >= NOISE_FLOOR and not rel < ci_target:
            out.append(name)
    return out
