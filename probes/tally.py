"""Token-level comparison of two configurations on the same tokens, accumulated batch by batch.

Every comparison reports, besides the token-level estimators of mismatch/metrics.py, the exact
full-vocabulary KL(μ‖π) at each sampled position (`kl_exact`): it needs no sampling of the
compared distributions, so its spread over positions is far smaller than k3's and its 95%
interval (a bootstrap over whole sequences: tokens of a sequence are correlated; scipy's BCa
bootstrap) is the one the ladder and the bars are drawn with. Direction: `reference` plays the
trainer π, `other` the sampler μ.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from mismatch.metrics import MAX_LOG_RATIO, bootstrap_ci, divergence_summary, exact_kl, log_ratio

from .base import Evaluation
from .kl_summary import KLSummary

__all__ = ["Tally", "KLSummary", "SUMMARY_KEYS", "NOISE_FLOOR", "CI_REL_TARGET"]

SUMMARY_KEYS = ("kl_k3", "kl_k1", "kl_k2", "abs_logprob_diff_mean", "abs_logprob_diff_p99",
                "abs_logprob_diff_max", "token_multiplicative_error", "mis_masked_fraction",
                "ratio_mean", "ess", "logprob_diff_rms", "logprob_diff_sd", "logprob_rel_rms",
                "ratio_outside_10pct")
NOISE_FLOOR = 1e-7
"""nats/token: exact KL below this is at the resolution of FP32 log-probs on these models; the
interval target does not apply there."""
CI_REL_TARGET = 0.2
"""A figure above the noise floor should have a 95% half-width under 20% of its value."""


class Tally:
    """Token-level comparison of two configurations, accumulated batch by batch."""

    def __init__(self) -> None:
        self.reference: list[torch.Tensor] = []
        self.other: list[torch.Tensor] = []
        self.mask: list[torch.Tensor] = []
        self.exact: list[torch.Tensor] = []

    def add(self, reference: Evaluation | torch.Tensor, other: Evaluation | torch.Tensor,
            mask: torch.Tensor, exact: torch.Tensor | None = None) -> None:
        """Add [B, W] token log-probs (or Evaluations, which also give exact KL; or pass the
        per-position exact KL [B, W] computed elsewhere as `exact`)."""
        ref_lp = reference.logprobs if isinstance(reference, Evaluation) else reference
        oth_lp = other.logprobs if isinstance(other, Evaluation) else other
        if ref_lp.shape != oth_lp.shape or ref_lp.shape != mask.shape:
            raise ValueError(f"tally shapes differ: {tuple(ref_lp.shape)}, "
                             f"{tuple(oth_lp.shape)}, mask {tuple(mask.shape)}")
        self.reference.append(ref_lp.float())
        self.other.append(oth_lp.float())
        self.mask.append(mask.float())
        # torch.where, not a product with the mask: NaN · 0 is NaN
        if exact is not None:
            self.exact.append(torch.where(mask.bool(), exact.double(), 0.0))
        elif isinstance(reference, Evaluation) and isinstance(other, Evaluation):
            b, w, v = other.full.shape
            kl = exact_kl(other.full.reshape(b * w, v), reference.full.reshape(b * w, v))
            self.exact.append(torch.where(mask.bool(), kl.view(b, w), 0.0))

    @property
    def tokens(self) -> int:
        return int(sum(float(m.sum()) for m in self.mask))

    def log_ratio(self) -> torch.Tensor:
        """Per-token log π − log μ of every counted token (for histograms)."""
        out = [log_ratio(r, o)[m.bool()] for r, o, m in zip(self.reference, self.other, self.mask)]
        return torch.cat(out).float() if out else torch.zeros(0)

    def summary(self, seed: int = 0, n_boot: int = 1000) -> KLSummary:
        """The SUMMARY_KEYS figures, `tokens`, `nonfinite_tokens` (masked-in tokens with a NaN
        or ±inf log-prob or exact KL: counted here, left out of every figure), `kl_exact` and
        both 95% intervals."""
        if not self.mask or self.tokens == 0:
            raise ValueError("nothing to summarize: no completion tokens were compared")
        r, o, m = torch.cat(self.reference), torch.cat(self.other), torch.cat(self.mask)
        s = {k: float(v) for k, v in divergence_summary(r, o, m).items()}
        tokens = int(s.pop("tokens"))
        figures = {k: s[k] for k in SUMMARY_KEYS}
        # the counted tokens: masked in, both log-probs (and the exact KL, where known) finite;
        # the rest of the masked-in ones are nonfinite_tokens, left out of every figure
        lr = log_ratio(r, o)
        counted = m.bool() & (lr.abs() < math.inf)
        ex = torch.cat(self.exact) if self.exact else None
        if ex is not None:
            counted &= ex.abs() < math.inf
            ex = torch.where(counted, ex, 0.0)
        lr = torch.where(counted, lr, 0.0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        k3 = torch.expm1(lr) - lr                                   # 0 where not counted
        per_n = counted.sum(-1).double()
        keep = per_n > 0
        base = KLSummary(**figures, tokens=tokens, nonfinite_tokens=tokens - int(counted.sum()),
                         kl_k3_ci95=bootstrap_ci(k3.sum(-1)[keep], per_n[keep], seed, n_boot))
        if ex is None:
            return base
        kl = float(ex.sum() / per_n.sum())
        ci = bootstrap_ci(ex.sum(-1)[keep], per_n[keep], seed, n_boot)
        rel = (ci[1] - ci[0]) / 2 / kl if kl > 0 else 0.0
        met = bool(kl < NOISE_FLOOR or rel < CI_REL_TARGET)
        # the half-width shrinks as 1/sqrt(sequences): what the target would take
        needed = (int(math.ceil(int(keep.sum()) * (rel / CI_REL_TARGET) ** 2))
                  if not met and math.isfinite(rel) else None)
        return replace(base, kl_exact=kl, kl_exact_ci95=ci, kl_exact_ci_rel=rel,
                       ci_target_met=met, sequences_for_ci_target=needed)

