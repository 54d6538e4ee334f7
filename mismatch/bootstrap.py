"""Confidence intervals of a per-token figure, resampling whole sequences."""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

__all__ = ["bootstrap_ci"]


def bootstrap_ci(sums: torch.Tensor, counts: torch.Tensor, seed: int = 0,
                 n_boot: int = 1000) -> list[float]:
    """95% BCa bootstrap interval (scipy.stats.bootstrap) of Σsums / Σcounts, resampling whole
    sequences: the tokens of one sequence share a context and are not independent."""
    from scipy.stats import bootstrap

    if counts.numel() < 2:
        return [math.nan, math.nan]
    x, n = sums.double().numpy(), counts.double().numpy()
    if float(abs(x).max()) == 0:
        return [0.0, 0.0]

    def ratio(a, b, axis=-1):
        return a.sum(axis=axis) / b.sum(axis=axis)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # degenerate resamples (all-equal data) are fine here
        res = bootstrap((x, n), ratio, paired=True, vectorized=True, n_resamples=n_boot,
                        confidence_level=0.95, method="BCa",
                        rng=np.random.default_rng(seed))
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if not (math.isfinite(lo) and math.isfinite(hi)):  # BCa undefined: fall back to percentile
        res = bootstrap((x, n), ratio, paired=True, vectorized=True, n_resamples=n_boot,
                        confidence_level=0.95, method="percentile",
                        rng=np.random.default_rng(seed))
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return [lo, hi]
