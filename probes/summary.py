"""The record a probe run ends with: what was compared, on what, and the KL figures.

`ProbeSummary` is built by the quick probe (`mismatch.app.probe.run_probe`) and by the sources
runner (`mismatch.probes.runner.run_sources`); `to_json()` is results.json, the contract that
`mismatch qualify`, the reports and users' scripts read. The two runs share the header and differ
in a few optional keys, which `to_json()` leaves out where a run has none; `from_json()` reads
a results.json back.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

__all__ = ["ProbeSummary"]


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
    total: dict[str, Any]
    """KL(sampler ‖ trainer): Tally.summary of the whole comparison."""
    sources: dict[str, Any]
    """Per source (or split column): its summary."""
    trainer_kernels: str | None = None
    """What the trainer's linear layers run on (the quick probe)."""
    trainer_gpu: str | None = None
    """The GPU the trainer side is emulated on (the sources runner)."""
    ci_target: dict[str, Any] | None = None
    """--ci-target: {"target", "met", "unmet"} (the sources runner)."""
    ladder: dict[str, Any] | None = None
    """The cumulative ladder of sources, where asked for (--ladder)."""
    references: dict[str, Any] | None = None
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
                    "tokens": self.tokens, "total": self.total})
        if self.ci_target is not None:
            out["ci_target"] = self.ci_target
        out["sources"] = self.sources
        if self.references is not None:
            out["references"] = self.references
        if self.ladder is not None:
            out["ladder"] = self.ladder
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
        try:
            return cls(**body)
        except TypeError as exc:  # a required key missing
            raise ValueError(f"results.json: {exc}") from None
