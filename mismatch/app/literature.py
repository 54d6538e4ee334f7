"""The source probes' figures against the published magnitudes and orderings they check
(the "Against the literature" table of `mismatch probe --sources`' report)."""

from __future__ import annotations

from dataclasses import dataclass

from mismatch.probes.base import SourceResult
from mismatch.probes.kl_summary import KLSummary
from mismatch.probes.source_figures import RoutingFlips, SamplingFigures, StalenessByLag
from mismatch.probes.summary import ProbeSummary, as_record

__all__ = ["LiteratureCheck", "literature_checks", "source_extra"]


@dataclass(frozen=True)
class LiteratureCheck:
    """One source's figure against a published magnitude or ordering."""

    source: str
    published: str
    """What the literature reports."""
    ours: str
    """The figure here, formatted."""
    holds: bool
    why: str = ""
    """Where it does not hold: what differs here."""

    def to_json(self) -> dict:
        return {"source": self.source, "published": self.published, "ours": self.ours,
                "holds": self.holds, "why": self.why}


def _kl(src: KLSummary | SourceResult | None, key: str = "kl_exact"):
    return src.figure(key) if src is not None else None


def source_extra(src: KLSummary | SourceResult | None) -> dict:
    """A source's own figures (none for a bare summary or a missing source)."""
    return src.extra if isinstance(src, SourceResult) else {}


def literature_checks(summary: ProbeSummary | dict) -> list[LiteratureCheck]:
    """Each source's figure against the published magnitude or ordering that its check names,
    `why` saying what differs where it does not hold."""
    rec = as_record(summary)
    src = rec.sources
    out: list[LiteratureCheck] = []

    def add(source, published, ours, holds, why=""):
        out.append(LiteratureCheck(source=source, published=published, ours=ours,
                                   holds=bool(holds), why="" if holds else why))

    k, p = src.get("kernels"), src.get("precision")
    if _kl(k) is not None:
        add("kernels", "KL ~1e-3 at the same precision (large models, long contexts)",
            f"{_kl(k):.2e}", 1e-4 <= _kl(k) <= 1e-2,
            "more than 10× off: a 2M-parameter model with 4 layers and ~150-token contexts "
            "accumulates far less reduction-order error than a 235B model over 32k tokens")
    if _kl(k) is not None and _kl(p) is not None and rec.dtype not in ("bf16",):
        add("kernels vs precision", "a low-precision format costs more than the kernels",
            f"{_kl(p):.2e} vs {_kl(k):.2e}", _kl(p) > _kl(k),
            "the kernels' share is larger here: the target's attention and decode path "
            "dominate on short contexts where the format's error is small")
    grid = p.parts if isinstance(p, SourceResult) else {}
    if all(f"{f} W+A" in grid for f in ("fp8", "nvfp4")):
        a, b = grid["nvfp4 W+A"].kl_exact, grid["fp8 W+A"].kl_exact
        add("precision", "NVFP4 W4A4 > FP8 W8A8 (fewer bits)",
            f"{a:.2e} vs {b:.2e}", a > b, "the intervals overlap on this many tokens")
    if all(f"fp8 {st}" in grid for st in ("W+A", "W+A+KV")):
        a, b = grid["fp8 W+A+KV"].kl_exact, grid["fp8 W+A"].kl_exact
        add("precision", "an FP8 KV cache adds mismatch", f"{a:.2e} vs {b:.2e}", a > b,
            "the FP8 KV row is within noise of the row without it")
    r = RoutingFlips.of(src.get("routing"))
    if r is not None and r.flip_rate_by_layer:
        add("routing", "~10% of router decisions differ per layer",
            f"{r.flip_rate_mean:.1%}", 1 / 30 <= r.flip_rate_mean <= 0.3,
            "more than 3× off: the embedded model has 8 experts with top-2 routing and ~150-token "
            "contexts; its routers' margins are wider than a 128-expert model's after 32k tokens")
        n_layers = len(r.flip_rate_by_layer)
        add("routing", "94% of tokens flip in ≥1 of 48 layers; with p per layer, "
            "1 − (1 − p)^L", f"{r.flip_rate_any_layer:.1%} over {n_layers} layers",
            abs(r.flip_rate_any_layer - (1 - (1 - r.flip_rate_mean) ** n_layers)) < 0.1
            or r.flip_rate_any_layer > 0.9,
            "flips in different layers are correlated on this model")
        share = r.routing_kl_share_fraction
        add("routing", "routing replay removes about half the KL (1.5e-3 → 7.5e-4)",
            f"{r.kl_exact_no_replay:.2e} → {r.kl_exact_replay:.2e} ({share:.0%} removed)",
            0.25 <= share <= 0.75,
            "replay removes a different share here: routing flips are rarer on this model "
            "(see the flip rate), so less of the mismatch runs through them")
    st = StalenessByLag.of(src.get("staleness"))
    if st is not None and st.kl_exact_by_lag:
        lags = st.lags
        first = st.kl_exact_at(lags[1]) if len(lags) > 1 else 0.0
        last = st.kl_exact_at(lags[-1])
        add("staleness", "KL grows with staleness (0.002 at 0 → ~0.01 at ~2 steps)",
            f"{first:.2e} at 1 → {last:.2e} at {lags[-1]}", last > first > 0,
            "the steps barely moved the BF16 weights at this learning rate")
    sa = SamplingFigures.of(src.get("sampling"))
    if sa is not None:
        add("sampling", f"processed − raw ≤ −log p = {sa.bias_bound:.3f} nats/token",
            f"{sa.processed_minus_raw_mean:.4f}",
            0 <= sa.processed_minus_raw_mean <= sa.bias_bound + 1e-9,
            "the bound is violated: a bug")
    rt = source_extra(src.get("retokenization"))
    if "changed_episode_fraction" in rt:
        add("retokenization", "stock Qwen3 template: 100/100 multi-turn rollouts diverge",
            f"{rt['changed_episode_fraction']:.0%} of episodes",
            rt["changed_episode_fraction"] >= 0.5,
            "few episodes here reach a second turn with earlier reasoning to strip")
    return out
