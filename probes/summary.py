"""The record a probe run ends with: what was compared, on what, and the KL figures.

`ProbeSummary` is built by the quick probe (`mismatch.app.probe.run_probe`) and by the sources
runner (`mismatch.probes.runner.run_sources`); `to_json()` is results.json, the contract that
`mismatch qualify`, the reports and users' scripts read. The two runs share the header and differ
in a few optional keys, which `to_json()` leaves out where a run has none; `from_json()` reads
a results.json back. Its figures are typed: the total and the quick probe's columns are
`KLSummary` records, the sources runner's sources (and its ladder) `SourceResult`s.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .base import SourceResult
from .kl_summary import KLSummary

__all__ = ["ProbeSummary", "CITarget", "Figures", "as_record", "source_from_json"]


@dataclass(frozen=True)
class CITarget:
    """--ci-target's outcome (the sources runner)."""

    target: float
    """The interval half-width target, a fraction of the figure (0: off)."""
    met: bool | None
    """None where the target is off."""
    unmet: list[str]
    """Headline comparisons whose interval is still too wide."""

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "met": self.met, "unmet": self.unmet}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CITarget:
        return cls(**d)


def source_from_json(name: str, d: dict[str, Any]) -> KLSummary | SourceResult:
    """One entry of results.json's `sources`: a source probe's block (it says whether it
    `applies`) or the quick probe's column (a bare summary)."""
    return SourceResult.from_json(name, d) if "applies" in d else KLSummary.from_json(d)


@dataclass(frozen=True, kw_only=True)
class ProbeSummary:
    """One probe run's results (the body of results.json)."""

    gpu: str
    """Sampler GPU profile."""
    dtype: str
    """Sampler serving precision."""
    kv_cache: str
    """KV-cache storage of the sampler."""
    trainer_dtype: str
    """The trainer side's compute dtype."""
    mode: str
    """"emulated" or "measured"."""
    model: str
    """The model directory, or "embedded"."""
    kernel_path: str
    """What the sampler's linear layers run (the profile's words)."""
    attention: str
    """The sampler's attention kernel family."""
    prompts: int
    """Prompts sampled."""
    tokens: int
    """Completion tokens compared."""
    total: KLSummary
    """KL(sampler ‖ trainer): Tally.summary of the whole comparison."""
    sources: dict[str, KLSummary | SourceResult]
    """Per source: its result (the sources runner), or per split column its summary (the quick
    probe)."""
    trainer_kernels: str | None = None
    """What the trainer's linear layers run on (the quick probe)."""
    trainer_gpu: str | None = None
    """The GPU the trainer side is emulated on (the sources runner)."""
    ci_target: CITarget | None = None
    """--ci-target's outcome (the sources runner)."""
    ladder: SourceResult | None = None
    """The cumulative ladder of sources, where asked for (--ladder)."""
    references: dict[str, KLSummary] | None = None
    """--fp32-reference: {"sampler vs fp32", "trainer vs fp32"} → each side against FP32."""
    lm_head: dict[str, str] | None = None
    """{"sampler", "trainer"} → the LM head's precision, where one side's is FP32 (--lm-head)."""

    def to_json(self) -> dict[str, Any]:
        """results.json: the header, then the figures; optional keys only where set."""
        out: dict[str, Any] = {"gpu": self.gpu, "dtype": self.dtype, "kv_cache": self.kv_cache,
                               "trainer_dtype": self.trainer_dtype}
        if self.trainer_kernels is not None:
            out["trainer_kernels"] = self.trainer_kernels
        if self.trainer_gpu is not None:
            out["trainer_gpu"] = self.trainer_gpu
        if self.lm_head is not None:
            out["lm_head"] = self.lm_head
        out.update({"mode": self.mode, "model": self.model, "kernel_path": self.kernel_path,
                    "attention": self.attention, "prompts": self.prompts,
                    "tokens": self.tokens, "total": self.total.to_json()})
        if self.ci_target is not None:
            out["ci_target"] = self.ci_target.to_json()
        out["sources"] = {k: v.to_json() for k, v in self.sources.items()}
        if self.references is not None:
            out["references"] = {k: v.to_json() for k, v in self.references.items()}
        if self.ladder is not None:
            out["ladder"] = self.ladder.to_json()
        return out


    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ProbeSummary:
        """results.json back as a record (its `command`, which the writer adds beside the
        figures, is not part of it). A key this record does not know is a ValueError naming it."""
        names = {f.name for f in fields(cls)}
        body = {k: v for k, v in d.items() if k != "command"}
        unknown = sorted(set(body) - names)
        if unknown:
            raise ValueError(f"results.json: unknown keys {unknown}")
        typed = {"total": KLSummary.from_json, "ci_target": CITarget.from_json,
                 "sources": lambda d: {k: source_from_json(k, v) for k, v in d.items()},
                 "references": lambda d: {k: KLSummary.from_json(v) for k, v in d.items()},
                 "ladder": lambda d: SourceResult.from_json("ladder", d)}
        body = {k: typed[k](v) if k in typed and v is not None else v for k, v in body.items()}
        try:
            return cls(**body)
        except TypeError as exc:  # a required key missing
            raise ValueError(f"results.json: {exc}") from None


def as_record(summary: ProbeSummary | dict[str, Any]) -> ProbeSummary:
    """`summary` as a record: a results.json body (its `command` aside) is read back."""
    return summary if isinstance(summary, ProbeSummary) else ProbeSummary.from_json(summary)


@dataclass(frozen=True)
class Figures:
    """The figures of a probe summary without its header: what the verdict and the tables
    read (a live server's summary, mismatch.app.qualify_remote, has another header)."""

    total: KLSummary
    sources: dict[str, KLSummary | SourceResult]
    references: dict[str, KLSummary]

    @classmethod
    def of(cls, summary: Figures | ProbeSummary | dict[str, Any]) -> Figures:
        """The figures of a record, or of a results.json body (missing sections: empty)."""
        if isinstance(summary, Figures):
            return summary
        if isinstance(summary, ProbeSummary):
            return cls(summary.total, summary.sources, summary.references or {})
        return cls(total=KLSummary.from_json(summary.get("total") or {}),
                   sources={k: source_from_json(k, v)
                            for k, v in (summary.get("sources") or {}).items()},
                   references={k: KLSummary.from_json(v)
                               for k, v in (summary.get("references") or {}).items()})

    @property
    def columns(self) -> list[tuple[str, KLSummary]]:
        """The total, then each source's headline summary (the quick probe's columns), then the
        --fp32-reference columns; a source without a headline is left out."""
        heads = [(k, self.headline(k)) for k in self.sources]
        return ([("total", self.total)] + [(k, h) for k, h in heads if h is not None]
                + list(self.references.items()))

    def headline(self, name: str) -> KLSummary | None:
        """Source `name`'s headline summary (None where absent or not applying)."""
        s = self.sources.get(name)
        return s.headline if isinstance(s, SourceResult) else s
