"""Run the requested source probes (and the ladder) on one context, and gather their results."""

from __future__ import annotations

import math
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
    i = 0
    ci = {"target": cfg.ci_target, "met": None, "unmet": []}
    while i < len(ctx.batches):
        batch = ctx.sample_batch(i)
        ctx.compare(total, ctx.reference, ctx.sampler, batch)
        for probe in batch_probes:
            if probe.batches_needed is None or i < probe.batches_needed:
                probe.on_batch(batch)
        i += 1
        ctx.progress("sampling and scoring", i, len(ctx.batches))
        if i == len(ctx.batches) and cfg.ci_target > 0:
            ci["unmet"] = _unmet(total, batch_probes, cfg)
            ci["met"] = not ci["unmet"]
            if ci["unmet"]:
                ctx.extend_prompts(8 * cfg.batch_size)  # check again after 8 more batches
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
        "ci_target": ci,
        "sources": {name: r.to_json() for name, r in results.items() if name != "ladder"},
    }
    if "ladder" in results:
        summary["ladder"] = results["ladder"].to_json()
    return SourcesRun(summary=summary, results=results, log_ratio_total=total.log_ratio())


def _unmet(total: Tally, probes: list, cfg) -> list[str]:
    """Names of headline comparisons whose interval is still wider than --ci-target."""
    from .base import NOISE_FLOOR

    out = []
    for name, tally in [("total", total)] + [(p.name, p.headline) for p in probes
                                             if p.batches_needed is None]:
        s = tally.summary(cfg.seed, n_boot=400)
        rel = s.get("kl_exact_ci_rel", math.inf)
        if s.get("kl_exact", 0.0) >= NOISE_FLOOR and not rel < cfg.ci_target:
            out.append(name)
    return out
