"""The vocabulary every source probe shares: a configuration of the model (`Variant`), what it
says about one batch's sampled tokens (`Evaluation`), the batch itself (`Batch`), and what a probe
hands back (`SourceResult`).

A probe changes exactly one factor between two configurations and scores the *same* tokens under
both. The tokens come from the target sampler (the `--gpu/--dtype` configuration, KV-cache decode
path, its kernel family), one rollout per batch, shared by all probes; every other variant either
re-scores them teacher-forced (`path="teacher"`) or replays them through the KV-cache decode path
(`path="decode"`, tokens fed instead of sampled). The run context (context.py) evaluates them and
caches evaluations per batch by `Variant.key()`, so two probes that need the same configuration
(or two GPUs that compute alike, such as H100 and H200) pay for it once; tallies (tally.py)
compare two variants token by token. Direction: `reference` plays the trainer π, `other` the
sampler μ.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from mismatch.profiles import NumericsSpec
from mismatch.records import Rollout

from .kl_summary import KLSummary

__all__ = ["Variant", "Evaluation", "Batch", "SourceResult", "pad_width", "with_spec",
           "TORCH_DTYPES"]

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""Compute dtype name → torch dtype of the model copies the probes load."""


@dataclass(frozen=True, kw_only=True)
class Variant:
    """One configuration of the model that can score a batch's tokens."""

    spec: NumericsSpec
    """Formats, GEMM accumulation, KV cache, split-K, router precision, attention family."""
    attention: bool = False
    """Run `spec.attention`'s tiled kernel (True) or the reference attention (torch SDPA)."""
    path: Literal["teacher", "decode", "reprefill"] = "teacher"
    """Teacher-forced forward over whole sequences, the sampler's KV-cache decode path, or that
    path with each completion split into two turns at its midpoint and the second turn's
    context prefilled again (a server without prefix caching) instead of kept from decoding."""
    alone: bool = False
    """Score each sequence as a batch of one (teacher path), not with the batch's others."""
    replay: bool = False
    """MoE routing replay: routers forced to the experts the batch's sampler chose."""
    linears: str = "torch"
    """What the linear layers run on (teacher path): "torch", the reference GEMM model, or a
    transformer-engine recipe (mismatch.engines.te.TRAINER_KERNELS; the model visits CUDA)."""

    def key(self) -> tuple:
        numerics = self.spec.numerics_key()
        if not self.attention:  # the family does not matter under the reference attention
            numerics = numerics[:5] + ("reference",) + numerics[6:]
        return (numerics, self.attention, self.path, self.alone, self.replay,
                self.linears)


@dataclass
class Evaluation:
    """What one variant says about one batch's completion positions."""

    logprobs: torch.Tensor
    """[B, W] float32 log-probs of the sampled tokens (0 past each completion)."""
    full: torch.Tensor
    """[B, W, V] float32 whole log-softmax at each completion position."""
    routing: torch.Tensor | None = None
    """[B, T, L, k] experts per MoE layer over the whole sequence (-1: not recorded)."""


@dataclass
class Batch:
    """One batch of prompts, the target sampler's rollout of them, and cached evaluations."""

    index: int
    prompts: list[list[int]]
    rollout: Rollout
    mask: torch.Tensor
    """[B, W] float32 completion mask."""
    cache: dict = field(default_factory=dict, repr=False)


def pad_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """[B, n, ...] → [B, width, ...], zero-padded (or cut)."""
    out = torch.zeros((x.shape[0], width) + tuple(x.shape[2:]), dtype=x.dtype)
    n = min(width, x.shape[1])
    out[:, :n] = x[:, :n]
    return out


_RESERVED = ("applies", "parts", "notes")


@dataclass(frozen=True)
class SourceResult:
    """What one source probe found."""

    name: str
    headline: KLSummary | None
    """Summary (Tally.summary) of the source's main comparison; None where it does not apply."""
    parts: dict[str, KLSummary] = field(default_factory=dict)
    """Sub-factor name → summary."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Source-specific figures (JSON-ready), e.g. routing.flip_rate_any_layer."""
    notes: list[str] = field(default_factory=list)
    """Sentences for the report: what was compared, and why a figure looks as it does."""
    log_ratio: torch.Tensor | None = field(default=None, repr=False)
    """Per-token log-ratios of the main comparison (histogram)."""

    @property
    def applies(self) -> bool:
        """Whether the source applies to this model (a dense model has no routers to flip)."""
        return self.headline is not None or bool(self.parts) or bool(self.extra)

    def figure(self, name: str) -> Any:
        """The headline's figure `name`, else the source-specific one; None where absent."""
        value = self.headline.figure(name) if self.headline is not None else None
        return self.extra.get(name) if value is None else value

    def to_json(self) -> dict:
        out: dict = self.headline.to_json() if self.headline is not None else {}
        out["applies"] = self.applies
        out.update(self.extra)
        out["parts"] = {k: v.to_json() for k, v in self.parts.items()}
        out["notes"] = self.notes
        return out

    @classmethod
    def from_json(cls, name: str, d: dict[str, Any]) -> SourceResult:
        """A source's block of results.json back (its log-ratios are not kept there): the
        summary figures before `applies` are the headline, the other keys its own figures."""
        keys = list(d)
        cut = keys.index("applies") if "applies" in keys else 0
        head = {k: d[k] for k in keys[:cut] if KLSummary.figure_name(k)}
        extra = {k: v for k, v in d.items() if k not in head and k not in _RESERVED}
        return cls(name=name, headline=KLSummary.from_json(head) if head else None,
                   parts={k: KLSummary.from_json(v) for k, v in (d.get("parts") or {}).items()},
                   extra=extra, notes=list(d.get("notes") or []))


def with_spec(spec: NumericsSpec, **changes) -> NumericsSpec:
    """A copy of `spec` with fields changed (a dataclasses.replace that reads better here)."""
    return replace(spec, **changes)
