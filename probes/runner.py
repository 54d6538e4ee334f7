"""Run the requested source probes (and the ladder) on one context, and gather their results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from . import SOURCES, load_source
from .base import ProbeContext, SourceResult, Tally

__all__ = ["run_sources", "SourcesRun"]


@dataclass
class SourcesRun:
    """The run's JSON summary, each source's result, and the total's per-token log-ratios."""

    summary: dict
    results: dict[str, SourceResult] = field(repr=False)
    log_ratio_total: torch.Tensor = field(repr=False)


def run_sources(cfg, progress: Callable[[str, int, int], None] | None = None) -> SourcesRun:
    """Sample with the target sampler once per batch, feed every batch probe, then run the
    standalone probes. `progress(label, done, total)` is called as work proceeds."""
    from .ladder import LadderProbe

    if not cfg.sources and not cfg.ladder:
        raise ValueError("no sources to probe: pass --sources a,b,...|all and/or --ladder")
    ctx = ProbeContext(cfg, progress)
    batch_probes = [load_source(n)(ctx) for n in cfg.sources if SOURCES[n].kind == "batch"]
    if cfg.ladder:
        batch_probes.append(LadderProbe(ctx))
    total = Tally()
    n = len(ctx.batches)
    for i in range(n):
        batch = ctx.sample_batch(i)
        ctx.compare(total, ctx.reference, ctx.sampler, batch)
        for probe in batch_probes:
            if i < probe.batches_needed:
                probe.on_batch(batch)
        ctx.progress("sampling and scoring", i + 1, n)
    results: dict[str, SourceResult] = {p.name: p.finish() for p in batch_probes}
    for name in cfg.sources:
        if SOURCES[name].kind == "standalone":
            results[name] = load_source(name)(ctx)
    spec = ctx.spec
    summary = {
        "gpu": spec.gpu, "dtype": spec.dtype, "kv_cache": spec.kv_cache,
        "trainer_dtype": ctx.trainer.dtype, "trainer_gpu": cfg.trainer_gpu, "mode": "emulated",
        "model": str(cfg.model) if cfg.model else "embedded",
        "kernel_path": spec.kernel_path, "attention": spec.attention,
        "prompts": len(ctx.prompts), "tokens": total.tokens,
        "total": total.summary(cfg.seed),
        "sources": {name: r.to_json() for name, r in results.items() if name != "ladder"},
    }
    if "ladder" in results:
        summary["ladder"] = results["ladder"].to_json()
    return SourcesRun(summary=summary, results=results, log_ratio_total=total.log_ratio())
