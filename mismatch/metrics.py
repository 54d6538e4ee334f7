"""Sampler–trainer divergence metrics: pure tensor functions over per-token records.

Dims: B sequences, T positions, V vocabulary, K candidates. On tokens y drawn from the sampler μ
and re-scored by the trainer π, the per-token log-ratio is

    r = log π(y) − log μ(y)          (trainer_logprobs − sampler_logprobs)

and the usual estimators of KL(μ‖π) are (Schulman, "Approximating KL divergence", 2020):

    k1 = −r           unbiased, high variance, can be negative per token
    k2 = r² / 2       biased, low variance
    k3 = e^r − 1 − r  unbiased and ≥ 0; what most RL frameworks log as "mismatch KL"

The importance ratio w = e^r is what off-policy corrections weigh tokens by; masked importance
sampling (MIS, the IcePop range) zeroes tokens with w outside [0.5, 5], so the share outside
that range is the fraction of the batch the correction throws away. Effective sample size is
(Σw)² / (n Σw²) ∈ (0, 1]. `exact_kl` computes KL(μ‖π) over the whole vocabulary when both sides'
logits are known, in row and vocabulary chunks so that no [T, V] float32 tensor ever exists.

Every function takes a `mask` [B, T] (nonzero = a completion token to count) and returns 0-dim
or per-sequence tensors. A token counts when its mask is set and both log-probs are finite:
whatever a masked position holds (NaN, ±inf) changes no figure by a single bit, and a NaN or ±inf
at an unmasked one is left out of the figures and counted (`nonfinite_tokens`, in
`divergence_summary`), never dropped silently. Figures match torch's own (torch.quantile's
interpolation included) bit for bit or to float64 rounding; docs/metrics.md.
"""

from __future__ import annotations

import numpy as np
import torch

from .bootstrap import bootstrap_ci
from .exact_kl import exact_kl, second_order
from .quantiles import _quantiles_np
from .ratios import MAX_LOG_RATIO, MIS_HIGH, MIS_LOW  # the MIS band and the log-ratio clamp

__all__ = [
    "MIS_LOW",
    "MIS_HIGH",
    "MAX_LOG_RATIO",
    "log_ratio",
    "kl_estimators",
    "ratio_stats",
    "logprob_diff_stats",
    "per_sequence",
    "exact_kl",
    "second_order",
    "top1_agreement",
    "divergence_summary",
    "bootstrap_ci",
    "masked_quantiles",
    "k_estimators",
    "nonfinite_tokens",
]

_INF = float("inf")
_NAN = float("nan")


def _check(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
           mask: torch.Tensor) -> None:
    if trainer_logprobs.shape != sampler_logprobs.shape or mask.shape != trainer_logprobs.shape:
        raise ValueError(f"shape mismatch: trainer {tuple(trainer_logprobs.shape)}, sampler "
                         f"{tuple(sampler_logprobs.shape)}, mask {tuple(mask.shape)}")


def log_ratio(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor) -> torch.Tensor:
    """[B, T] → r = log π − log μ in float64 (the inputs are float32 log-probs; float64 keeps
    the difference of two nearly equal numbers exact)."""
    return trainer_logprobs.double() - sampler_logprobs.double()


# ---- the CPU path --------------------------------------------------------------------------
# On CPU tensors the figures are computed by numpy on views of the tensors' memory. torch's eager
# CPU kernels allocate a fresh [B, T] temporary per operation, and at 64 × 4096 float64 the page
# faults of those allocations cost more than the arithmetic; numpy's loops, masked reductions
# (boolean compress, then work on the n counted tokens only) and vectorized sort
# (numpy/numpy@v2.0.0 numpy/_core/src/npysort/x86_simd_qsort.dispatch.cpp) make each figure 2–6×
# cheaper here (scripts/bench_metrics.py). Same figures to float64 rounding (sums in another
# order, another libm's exp/expm1), quantiles bit for bit; tests/test_metrics.py runs both paths
# against each other. Other devices keep the torch path.
_NUMPY_ON_CPU = True


def _host(*tensors: torch.Tensor) -> bool:
    """Whether these tensors' figures are computed with numpy (all of them on the CPU)."""
    return _NUMPY_ON_CPU and all(t.device.type == "cpu" for t in tensors)


def _ndarray(x: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as an ndarray sharing its memory (detached); bfloat16 and float16
    are widened to float32 first, exactly."""
    if x.dtype in (torch.bfloat16, torch.float16):
        x = x.float()
    return x.numpy(force=True)


def _mask_ndarray(mask: torch.Tensor) -> np.ndarray:
    """mask != 0 as a bool ndarray (the tensor's own memory when it is bool already)."""
    return _ndarray(mask) if mask.dtype == torch.bool else _ndarray(mask) != 0


def _finite(x: torch.Tensor) -> torch.Tensor:
    """isfinite(x) as a bool tensor: numpy's one pass on the CPU, `|x| < inf` elsewhere (torch's
    isfinite takes three)."""
    if _host(x):
        return torch.from_numpy(np.isfinite(_ndarray(x)))
    return x.abs() < _INF


def _f64(x) -> torch.Tensor:
    return torch.tensor(float(x), dtype=torch.float64)


@np.errstate(all="ignore")  # inf − inf at a NaN / ±inf log-prob: left out through `counted`
def _tokens_np(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
               mask: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The CPU path's _counted: (r, counted, m) as ndarrays, r = log π − log μ in float64 (the
    same bits as log_ratio) at every position, read only where `counted` (mask set and r finite;
    positions outside it hold anything, NaN included)."""
    _check(trainer_logprobs, sampler_logprobs, mask)
    r = np.subtract(_ndarray(trainer_logprobs), _ndarray(sampler_logprobs), dtype=np.float64)
    m = _mask_ndarray(mask)
    counted = np.isfinite(r)
    counted &= m
    return r, counted, m


def _counted(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
             mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(r zeroed wherever a token is not counted, counted [B, T] bool, mask [B, T] bool).

    A token counts when its mask is set and both log-probs are finite (r is finite exactly
    then: a float64 difference of float32 numbers cannot overflow). Everything else is replaced
    by 0 with `torch.where` *before* any arithmetic — `x * mask` would keep a NaN (NaN · 0 =
    NaN), as verl's masked_sum notes (volcengine/verl@v0.9.1 verl/utils/torch_functional.py) —
    so whatever a masked position holds, the figures are the same bit for bit.
    `|r| < inf` is isfinite in one pass (torch.isfinite is three)."""
    _check(trainer_logprobs, sampler_logprobs, mask)
    m = mask if mask.dtype == torch.bool else mask != 0
    r = log_ratio(trainer_logprobs, sampler_logprobs)
    counted = m & (r.abs() < _INF)
    return torch.where(counted, r, 0.0), counted, m


def masked_quantiles(x: torch.Tensor, valid: torch.Tensor, q: tuple[float, ...]) -> torch.Tensor:
    """torch.quantile(x[valid], q) (linear interpolation), equal to it bit for bit, faster.

    torch.quantile sorts with torch.sort (a stable sort carrying indices: ~20× numpy's on CPU);
    only the order statistics at floor and ceil of q·(n − 1) matter, and they are the same
    whatever finds them. On CPU numpy finds them in the n valid values (a selection for one
    rank and its successor, numpy's vectorized sort for more); elsewhere torch.sort sorts, the
    uncounted entries made +inf so that they rank after every counted one. The interpolation is
    torch.quantile's own: ranks q·(n − 1) in x's dtype, weights rank − floor(rank), `lerp`
    (pytorch/pytorch@v2.5.0 aten/src/ATen/native/Sorting.cpp, quantile_compute).
    x: finite where `valid`. Returns [len(q)] of x's dtype (NaN when nothing is valid)."""
    if _host(x, valid):
        return _quantiles_np(_ndarray(x)[_mask_ndarray(valid)], q, x.dtype)
    n = int(valid.sum())
    if n == 0:
        return torch.full((len(q),), float("nan"), dtype=x.dtype, device=x.device)
    ordered = torch.where(valid, x.detach(), _INF).reshape(-1).sort().values
    ranks = torch.tensor(q, dtype=x.dtype, device=x.device) * (n - 1)   # in x's dtype
    below = ranks.long()
    return torch.lerp(ordered[below], ordered[ranks.ceil().long()], ranks - below)


def k_estimators(r: torch.Tensor, n: torch.Tensor) -> dict[str, torch.Tensor]:
    """k1, k2, k3 means of a float64 log-ratio `r` that is 0 at every uncounted token (those
    then add exactly 0 to each sum) over its `n` counted tokens; r is clamped to ±20 first."""
    r = r.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    n = n.clamp_min(1).to(torch.float64)
    return {"kl_k1": -r.sum() / n, "kl_k2": (r * r).sum() * 0.5 / n,
            "kl_k3": (torch.expm1(r) - r).sum() / n}


def _clamped_np(rr: np.ndarray) -> np.ndarray:
    """The counted log-ratios (a fresh 1-D ndarray) clamped to ±20, in place."""
    return np.clip(rr, -MAX_LOG_RATIO, MAX_LOG_RATIO, out=rr)


def _k_np(rc: np.ndarray, keys=("kl_k1", "kl_k2", "kl_k3")) -> dict[str, torch.Tensor]:
    """k_estimators over the counted tokens' clamped log-ratios `rc` (1-D ndarray)."""
    n = max(rc.size, 1)
    out = {}
    if "kl_k1" in keys:
        out["kl_k1"] = _f64(-rc.sum() / n)
    if "kl_k2" in keys:
        out["kl_k2"] = _f64(np.dot(rc, rc) * 0.5 / n)
    if "kl_k3" in keys:
        k3 = np.expm1(rc)
        k3 -= rc
        out["kl_k3"] = _f64(k3.sum() / n)
    return out


def kl_estimators(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                  mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Means of k1, k2, k3 over the counted tokens (mask set, both log-probs finite). Inputs
    [B, T]; outputs 0-dim float64 (0 when no token counts)."""
    if _host(trainer_logprobs, sampler_logprobs, mask):
        r, counted, _ = _tokens_np(trainer_logprobs, sampler_logprobs, mask)
        return _k_np(_clamped_np(r[counted]))
    r, counted, _ = _counted(trainer_logprobs, sampler_logprobs, mask)
    return k_estimators(r, counted.sum())


_RATIO_KEYS = ("ratio_mean", "ratio_p01", "ratio_p50", "ratio_p99", "mis_masked_fraction", "ess",
               "ratio_outside_10pct")
_DIFF_KEYS = ("abs_logprob_diff_mean", "abs_logprob_diff_p99", "abs_logprob_diff_max",
              "abs_prob_diff_max", "token_multiplicative_error", "logprob_diff_rms",
              "logprob_diff_sd", "logprob_rel_rms")
BAND_10PCT = (0.9, 1.1)
"""The ratio band published trainer-vs-sampler comparisons count tokens outside of
(huggingface/trl issue #6789, verl issue #6280): `ratio_outside_10pct`."""


def _nans(keys) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(_NAN, dtype=torch.float64) for k in keys}


def _ratio_stats(r, counted, n: int, low: float, high: float) -> dict[str, torch.Tensor]:
    if n == 0:
        return _nans(_RATIO_KEYS)
    w = torch.exp(r.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))               # 1 where uncounted
    wz = torch.where(counted, w, 0.0)
    s1, s2 = wz.sum(), (wz * wz).sum()
    q = masked_quantiles(w, counted, (0.01, 0.5, 0.99))
    outside = (((w < low) | (w > high)) & counted).sum().to(torch.float64)
    band = (((w < BAND_10PCT[0]) | (w > BAND_10PCT[1])) & counted).sum().to(torch.float64)
    return {"ratio_mean": s1 / n, "ratio_p01": q[0], "ratio_p50": q[1], "ratio_p99": q[2],
            "mis_masked_fraction": outside / n, "ess": s1 * s1 / (n * s2),
            "ratio_outside_10pct": band / n}


def _outside_np(w: np.ndarray, low: float, high: float) -> int:
    out = w < low
    out |= w > high
    return int(np.count_nonzero(out))


def _ratio_np(rc: np.ndarray, low: float, high: float) -> dict[str, torch.Tensor]:
    """_ratio_stats over the counted tokens' clamped log-ratios `rc` (1-D ndarray)."""
    n = rc.size
    if n == 0:
        return _nans(_RATIO_KEYS)
    w = np.exp(rc)
    s1, s2 = float(w.sum()), float(np.dot(w, w))
    outside = _outside_np(w, low, high)
    band = _outside_np(w, *BAND_10PCT)
    q = _quantiles_np(w, (0.01, 0.5, 0.99), torch.float64)                 # reorders w
    return {"ratio_mean": _f64(s1 / n), "ratio_p01": q[0], "ratio_p50": q[1], "ratio_p99": q[2],
            "mis_masked_fraction": _f64(outside / n), "ess": _f64(s1 * s1 / (n * s2)),
            "ratio_outside_10pct": _f64(band / n)}


def ratio_stats(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                mask: torch.Tensor, low: float = MIS_LOW, high: float = MIS_HIGH
                ) -> dict[str, torch.Tensor]:
    """Importance ratio w = π/μ over the counted tokens: mean, p01/p50/p99, share outside
    [low, high] (MIS-masked fraction), normalized effective sample size."""
    if _host(trainer_logprobs, sampler_logprobs, mask):
        r, counted, _ = _tokens_np(trainer_logprobs, sampler_logprobs, mask)
        return _ratio_np(_clamped_np(r[counted]), low, high)
    r, counted, _ = _counted(trainer_logprobs, sampler_logprobs, mask)
    return _ratio_stats(r, counted, int(counted.sum()), low, high)


def _diff_stats(r, counted, n: int, trainer_logprobs, sampler_logprobs):
    if n == 0:
        return _nans(_DIFF_KEYS)
    d = r.abs()                                                             # 0 where uncounted
    dp = (trainer_logprobs.double().exp() - sampler_logprobs.double().exp()).abs()
    mult = torch.where(counted, d.clamp(max=MAX_LOG_RATIO).exp(), 0.0)
    rd = r.double()
    mean = rd.sum() / n
    ref_sq = torch.where(counted, trainer_logprobs.double(), 0.0).square().sum()
    rel = torch.where(ref_sq > 0, ((rd * rd).sum() / ref_sq).sqrt(), _NAN)
    return {"logprob_diff_rms": ((rd * rd).sum() / n).sqrt(),
            "logprob_rel_rms": rel,
            "logprob_diff_sd": (torch.where(counted, rd - mean, 0.0).square().sum() / n).sqrt(),
            "abs_logprob_diff_mean": d.sum() / n,
            "token_multiplicative_error": mult.sum() / n,
            "abs_logprob_diff_p99": masked_quantiles(d, counted, (0.99,))[0],
            "abs_logprob_diff_max": d.max(),
            "abs_prob_diff_max": torch.where(counted, dp, 0.0).max()}


def _diff_np(rr: np.ndarray, t: np.ndarray, s: np.ndarray) -> dict[str, torch.Tensor]:
    """_diff_stats over the counted tokens: their log-ratios `rr` and log-probs `t`, `s` (1-D)."""
    n = rr.size
    if n == 0:
        return _nans(_DIFF_KEYS)
    rd = rr.astype(np.float64)
    rms = float(np.sqrt(np.dot(rd, rd) / n))
    td = t.astype(np.float64)
    ref_sq = float(np.dot(td, td))
    rel = float(np.sqrt(np.dot(rd, rd) / ref_sq)) if ref_sq > 0 else _NAN
    sd = float(np.sqrt(np.square(rd - rd.sum() / n).sum() / n))
    d = np.abs(rr)
    mean, top = float(d.sum()), float(d.max())
    mult = np.minimum(d, MAX_LOG_RATIO)
    mult = float(np.exp(mult, out=mult).sum())
    dp = np.exp(t, dtype=np.float64)
    dp -= np.exp(s, dtype=np.float64)
    return {"logprob_diff_rms": _f64(rms), "logprob_diff_sd": _f64(sd),
            "logprob_rel_rms": _f64(rel),
            "abs_logprob_diff_mean": _f64(mean / n),
            "token_multiplicative_error": _f64(mult / n),
            "abs_logprob_diff_p99": _quantiles_np(d, (0.99,), torch.float64)[0],  # reorders d
            "abs_logprob_diff_max": _f64(top),
            "abs_prob_diff_max": _f64(np.abs(dp, out=dp).max())}


def logprob_diff_stats(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                       mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """|Δ log p| mean / p99 / max, |Δ p| max, and the token multiplicative error mean e^|Δ log p|
    (NVIDIA's "Run High-Throughput Reinforcement Learning Training with End-to-End FP8 Precision",
    NVIDIA Technical Blog, tracks it per recipe) over counted tokens; the RMS of Δ log p and its
    standard deviation (population), in nats, as trainer-vs-sampler comparisons publish them
    (ServiceNow/Fast-LLM PR #525, huggingface/trl issue #6789); and the RMS of Δ log p relative
    to the RMS of the reference's (the trainer's) log p, Fast-LLM's "RMS rel" (NaN when every
    counted reference log-prob is 0)."""
    if _host(trainer_logprobs, sampler_logprobs, mask):
        r, counted, _ = _tokens_np(trainer_logprobs, sampler_logprobs, mask)
        return _diff_np(r[counted], _ndarray(trainer_logprobs)[counted],
                        _ndarray(sampler_logprobs)[counted])
    r, counted, _ = _counted(trainer_logprobs, sampler_logprobs, mask)
    return _diff_stats(r, counted, int(counted.sum()), trainer_logprobs, sampler_logprobs)


def per_sequence(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                 mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per sequence [B]: sum of r over its counted tokens (the sequence-level log importance
    ratio) and the geometric mean ratio exp(mean r)."""
    if _host(trainer_logprobs, sampler_logprobs, mask):
        r, counted, _ = _tokens_np(trainer_logprobs, sampler_logprobs, mask)
        np.copyto(r, 0.0, where=~counted)
        s = np.asarray(r.sum(-1))
        per_n = np.maximum(np.count_nonzero(counted, axis=-1), 1)
        return {"seq_log_ratio_sum": torch.from_numpy(s),
                "seq_ratio_geomean": torch.from_numpy(np.asarray(np.exp(s / per_n)))}
    r, counted, _ = _counted(trainer_logprobs, sampler_logprobs, mask)
    s = r.sum(-1)
    return {"seq_log_ratio_sum": s, "seq_ratio_geomean": torch.exp(s / counted.sum(-1)
                                                                   .clamp_min(1))}


def nonfinite_tokens(mask: torch.Tensor, *logprobs: torch.Tensor) -> torch.Tensor:
    """How many positions with `mask` set hold a NaN or ±inf in any of `logprobs` (all [B, T]):
    the tokens every figure here leaves out. 0-dim int64."""
    m = mask if mask.dtype == torch.bool else mask != 0
    bad = torch.zeros_like(m)
    for lp in logprobs:
        bad |= ~_finite(lp)
    return (m & bad).sum()


def top1_agreement(sampler_top1: torch.Tensor, trainer_top1: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
    """Share of masked positions where both sides' most likely token is the same. Ids [B, T]."""
    m = mask if mask.dtype == torch.bool else mask != 0
    same = (sampler_top1 == trainer_top1) & m
    return same.sum().to(torch.float64) / m.sum().clamp_min(1)


def divergence_summary(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                       mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """All token-level figures in one dict of 0-dim float64 tensors: `tokens` (mask set),
    `nonfinite_tokens` (mask set but a log-prob NaN or ±inf: left out of every figure and
    counted here, never dropped silently) and the figures over the counted rest."""
    if _host(trainer_logprobs, sampler_logprobs, mask):
        r, counted, m = _tokens_np(trainer_logprobs, sampler_logprobs, mask)
        tokens, n = int(np.count_nonzero(m)), int(np.count_nonzero(counted))
        out = {"tokens": _f64(tokens), "nonfinite_tokens": _f64(tokens - n)}
        rr = r[counted]
        rc = _clamped_np(rr.copy())
        out.update(_k_np(rc))
        out.update(_ratio_np(rc, MIS_LOW, MIS_HIGH))
        out.update(_diff_np(rr, _ndarray(trainer_logprobs)[counted],
                            _ndarray(sampler_logprobs)[counted]))
        return out
    r, counted, m = _counted(trainer_logprobs, sampler_logprobs, mask)
    n = counted.sum()
    tokens = m.sum()
    out = {"tokens": tokens.to(torch.float64),
           "nonfinite_tokens": (tokens - n).to(torch.float64)}
    out.update(k_estimators(r, n))
    n = int(n)
    out.update(_ratio_stats(r, counted, n, MIS_LOW, MIS_HIGH))
    out.update(_diff_stats(r, counted, n, trainer_logprobs, sampler_logprobs))
    return out
