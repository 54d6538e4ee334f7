"""`KLSummary`: what one token-level comparison of two configurations says (Tally.summary).

The record of one comparison, KL(μ‖π) of the sampler-side configuration μ against the
trainer-side π on the same tokens: the token estimators, the exact full-vocabulary KL and the 95%
sequence-bootstrap intervals. `to_json()` is the block results.json holds for it (the `total`, each
source's headline and parts); `from_json()` reads such a block back. A figure a comparison did not
compute (the exact KL without whole log-softmax rows, the ≥ target estimate of the sequences an
interval needs where the target is met) is None and left out of the JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

__all__ = ["KLSummary"]


@dataclass(frozen=True, kw_only=True)
class KLSummary:
    """One comparison's figures; fields in the order results.json lists them."""

    kl_k3: float | None = None
    """k3 estimator of KL(μ‖π), nats/token (valid on tokens drawn from μ)."""
    kl_k1: float | None = None
    kl_k2: float | None = None
    abs_logprob_diff_mean: float | None = None
    abs_logprob_diff_p99: float | None = None
    abs_logprob_diff_max: float | None = None
    token_multiplicative_error: float | None = None
    mis_masked_fraction: float | None = None
    """Share of tokens whose π/μ leaves the MIS range [0.5, 5]."""
    ratio_mean: float | None = None
    ess: float | None = None
    logprob_diff_rms: float | None = None
    logprob_diff_sd: float | None = None
    logprob_rel_rms: float | None = None
    ratio_outside_10pct: float | None = None
    tokens: int | None = None
    """Masked-in completion tokens."""
    nonfinite_tokens: int | None = None
    """Masked-in tokens with a NaN or ±inf log-prob or exact KL, left out of every figure."""
    kl_k3_ci95: list[float] | None = None
    """95% bootstrap interval of kl_k3 over sequences."""
    kl_exact: float | None = None
    """Exact full-vocabulary KL(μ‖π) per sampled position, nats/token."""
    kl_exact_ci95: list[float] | None = None
    kl_exact_ci_rel: float | None = None
    """Half-width of kl_exact_ci95 over kl_exact."""
    ci_target_met: bool | None = None
    sequences_for_ci_target: int | None = None
    """Where the interval target is unmet: the sequences it would take."""
    k_estimators_valid: bool | None = None
    """The quick probe's flag: False where μ drew no tokens (k1/k3/ESS do not apply)."""

    @staticmethod
    def figure_name(name: str) -> bool:
        """Whether `name` is one of the figures a summary holds."""
        return name in _NAMES

    def figure(self, name: str) -> Any:
        """The figure called `name` (a results.json key), None where not computed or unknown."""
        return getattr(self, name, None) if name in _NAMES else None

    def to_json(self) -> dict[str, Any]:
        """The results.json block: every computed figure, in field order."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KLSummary:
        """A results.json block back; a key this record does not know is a ValueError."""
        unknown = sorted(set(d) - _NAMES)
        if unknown:
            raise ValueError(f"KL summary: unknown keys {unknown}")
        return cls(**d)


_NAMES = frozenset(f.name for f in fields(KLSummary))
