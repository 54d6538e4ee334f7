"""One probe per mismatch source, and the ladder that attributes the total (`mismatch probe
--sources a,b,...|all [--ladder]`).

Each probe changes exactly one factor between two configurations and scores the same tokens under
both (base.py; context.py evaluates the configurations, tally.py compares them, runner.py runs
the probes). `SOURCES` is the registry: name → how to run it. Batch probes share the target
sampler's rollouts batch by batch (and each configuration's evaluation of them); standalone
probes draw their own data (staleness measures a checkpoint ladder, retokenization runs
multi-turn episodes, sampling draws with top-p).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = ["SOURCES", "Source", "parse_sources", "load_source"]


@dataclass(frozen=True)
class Source:
    """One mismatch source's probe."""

    name: str
    module: str
    """Module under probes/ that implements it."""
    attr: str
    """A BatchProbe class (kind "batch") or a run(ctx) function (kind "standalone")."""
    kind: str
    description: str


SOURCES: dict[str, Source] = {s.name: s for s in (
    Source("kernels", "mismatch.probes.kernels", "KernelsProbe", "batch",
           "same precision: batch composition, decode path, attention tiling, split-K, router"),
    Source("precision", "mismatch.probes.precision", "PrecisionProbe", "batch",
           "weights, + activations, + KV cache for FP16, FP8, MXFP4, NVFP4, W4A16"),
    Source("accelerator", "mismatch.probes.accelerator", "AcceleratorProbe", "batch",
           "the checkpoint on each GPU, and the study's mixed fleet"),
    Source("routing", "mismatch.probes.routing", "RoutingProbe", "batch",
           "MoE expert flips per layer; KL with and without routing replay"),
    Source("staleness", "mismatch.probes.staleness", "run", "standalone",
           "a sampler k AdamW steps behind the trainer, k = 0..8"),
    Source("retokenization", "mismatch.probes.retokenization", "run", "standalone",
           "decode→re-encode round trips; multi-turn chat-template re-rendering"),
    Source("sampling", "mismatch.probes.sampling", "run", "standalone",
           "top-p support mismatch; raw vs processed log-probs"),
)}


def parse_sources(text: str | None) -> tuple[str, ...]:
    """"a,b" or "all" → names in registry order; unknown names are a one-line error."""
    if text is None or not text.strip():
        return ()
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if "all" in names:
        return tuple(SOURCES)
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        raise ValueError(f"unknown source {unknown[0]!r}; valid: {', '.join(SOURCES)} or all")
    return tuple(n for n in SOURCES if n in names)


def load_source(name: str):
    """The class or function implementing source `name`."""
    source = SOURCES[name]
    return getattr(importlib.import_module(source.module), source.attr)
