"""The policy-gradient loss of the corrected asynchronous trainer (the reference study's arms,
docs/study.md; their registry, `ARMS`, is arms.py's, re-exported here).

Dims: B sequences, T positions, K candidates per position, G groups of n samples. The sampler μ
drew token y at each position; the trainer re-scores it as π(y). Every arm minimizes

    loss = −(1/N) Σ_{valid b,t} A_b · objective_{b,t}          N = number of valid tokens

— a token-level mean: every valid token weighs the same whatever its sequence's length (the
DAPO / Dr. GRPO choice; a per-sequence mean would favour short completions). A token is *valid*
when its mask is 1 and its sampler log-prob is finite: a NaN / ±inf log μ (a sampler that failed
to report, a token it could not have drawn) leaves both the sum and N, and is counted in the
metric `nonfinite_tokens` (as is a NaN / ±inf log π at a masked-in token, which stays in the loss:
the loss turns non-finite and the trainer skips the step). Whatever a masked-out position holds,
NaN or ±inf on any side, the loss, its gradient and every metric are the same bit for bit: every
such value is replaced with `torch.where` before any arithmetic. Tokens that MIS zeroes stay
valid: they count in N with weight 0, as IcePop does.

The objective, with ratio x = π_y/μ_y and a token weight w(x) chosen by the arm
(w = 1; MIS / IcePop w(x) = x·1[x ∈ [low, high]]; truncated IS w(x) = min(x, C)):

    plain            sg(w(x)) · log π_y                       (grpo, mis, icepop, tis, topp)
    score-centered   sg(w(x)) · log π_y − Σ_{v∈H} sg(μ_v·w(π_v/μ_v) − α·π_v) · log π_v

Score centering (SC) subtracts the sampler-expected score Σ_v μ_v w_v ∇log π_v, so a constant
advantage has zero expected update under μ. H is the sampler's top-k candidate set; the tail
outside H is modeled as π rescaled to μ's tail mass, ρ = (1 − Σ_H μ)/(1 − Σ_H π), whose expected
score −Σ_H π_v ∇log π_v · ρ·w(1/ρ) folds into α = ρ·w(1/ρ). When π = μ, ρ = 1, α = w(1) and every
candidate coefficient μ_v·w(1) − w(1)·π_v vanishes: SC reduces to REINFORCE.

Top-p with mask replay: the sampler drew from its nucleus S (a subset of the K candidates, given
as `support_mask`), so both sides are renormalized over exactly S, π̃ = π/Σ_S π and μ̃ = μ/Σ_S μ,
and the arm runs on (π̃, μ̃). The gradient of log π̃_y flows through the normalizer. Under μ̃ the
candidates cover the whole distribution, so in `sc+mis+topp` the tail is empty and α = 0.

Inputs are the trainer's full-vocabulary log-probs gathered at y and at the candidates (the
caller owns the [B, T, V] logits; this function never sees V). Detached coefficients (ratios,
ρ, α) are computed in float64 — they are [B, T, K], cheap — then cast to the compute dtype
(float32, or float64 when the inputs are). Metrics are 0-dim tensors; nothing calls `.item()`.
"""

from __future__ import annotations

import numpy as np
import torch

from mismatch.metrics import MAX_LOG_RATIO, k_estimators, masked_quantiles
from mismatch.metrics import (_clamped_np, _f64, _finite, _host, _k_np, _ndarray, _outside_np,
                              _quantiles_np)

from .arms import ARMS, Arm, arm_named

__all__ = ["Arm", "ARMS", "arm_named", "policy_loss", "group_advantages", "renormalize_over_support",
           "sc_tail_ratio"]

_INF = float("inf")
_MIN_TAIL_MASS = 1e-6  # a tail below this is float noise: no tail (α = 0, ρ reported as 0);
#                        it also floors 1 − Σ_H π so that ρ stays ≤ 1e6
_QUANTILES = (0.05, 0.5, 0.95)


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """rewards [G, n] → advantages [G, n] = r − mean over the group (no std normalization)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [G, n], got shape {tuple(rewards.shape)}")
    return rewards - rewards.mean(dim=-1, keepdim=True)


def renormalize_over_support(cand_logprobs: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """[B, T, K] log-probs, [B, T, K] bool → log-probs renormalized over the support (−inf
    outside it; rows with an empty support come back all −inf). Differentiable."""
    log_z = _log_normalizer(cand_logprobs, support)
    return torch.where(support, cand_logprobs - log_z.unsqueeze(-1), float("-inf"))


def _log_normalizer(cand_logprobs: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    # Rows with an empty support get logsumexp(0…0) instead of logsumexp(−inf…) so that the
    # backward pass never sees NaN; callers drop those rows.
    has_any = support.any(dim=-1, keepdim=True)
    x = torch.where(support, cand_logprobs, float("-inf"))
    x = torch.where(has_any, x, torch.zeros_like(x))
    return torch.where(has_any.squeeze(-1), torch.logsumexp(x, dim=-1), float("-inf"))


def _tail_ratio(head_mu: torch.Tensor, head_pi: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """ρ = (1 − Σ_H μ)/(1 − Σ_H π) per position (0 where μ has no tail), and where it has one."""
    tail_mu = (1 - head_mu).clamp_min(0)
    tail_pi = (1 - head_pi).clamp_min(_MIN_TAIL_MASS)
    has_tail = tail_mu > _MIN_TAIL_MASS
    return torch.where(has_tail, tail_mu / tail_pi, 0), has_tail


def sc_tail_ratio(cand_logp: torch.Tensor, cand_sampler_logp: torch.Tensor,
                  valid: torch.Tensor) -> float:
    """Mean ρ over `valid` positions of [B, T, K] candidate log-probs (non-finite sampler
    entries are padding), as score centering computes it; for arms that do not center."""
    have = torch.isfinite(cand_sampler_logp) & valid[..., None]
    mu = torch.where(have, cand_sampler_logp.double().exp(), 0).sum(-1)
    pi = torch.where(have, cand_logp.double().exp(), 0).sum(-1)
    rho, _ = _tail_ratio(mu, pi)
    return float(rho[valid].mean()) if valid.any() else float("nan")


def _token_weight(ratio: torch.Tensor, kind: str, low: float, high: float,
                  cap: float) -> torch.Tensor:
    if kind == "one":
        return torch.ones_like(ratio)
    if kind == "mis":
        return ratio * ((ratio >= low) & (ratio <= high)).to(ratio.dtype)
    return ratio.clamp_max(cap)


def _ratio(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor) -> torch.Tensor:
    r = trainer_logprobs.detach().double() - sampler_logprobs.detach().double()
    return torch.exp(r.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    # torch.where, not x * m: a NaN outside the mask would survive the product (NaN · 0 = NaN)
    return torch.where(m, x, 0).sum() / m.sum().clamp_min(1).to(x.dtype)


def _check(logp, sampler_logp, advantages, mask, arm, cand_logp, cand_sampler_logp,
           support_mask) -> None:
    if not isinstance(arm, Arm):
        raise TypeError(f"arm must be an Arm (ARMS[name]), got {arm!r}")
    if logp.dim() != 2 or sampler_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(f"logp, sampler_logp, mask must all be [B, T]: got {tuple(logp.shape)}, "
                         f"{tuple(sampler_logp.shape)}, {tuple(mask.shape)}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages must be [B] or [B, T] with B, T = {tuple(logp.shape)}, "
                         f"got {tuple(advantages.shape)}")
    needed = {"cand_logp": cand_logp, "cand_sampler_logp": cand_sampler_logp}
    if arm.top_p:
        needed["support_mask"] = support_mask
    if arm.centered or arm.top_p:
        missing = [k for k, v in needed.items() if v is None]
        if missing:
            raise ValueError(f"arm {arm.name!r} needs {', '.join(missing)}")
        shapes = {k: tuple(v.shape) for k, v in needed.items()}
        if any(len(s) != 3 or s[:2] != tuple(logp.shape) for s in shapes.values()) \
                or len(set(shapes.values())) != 1:
            raise ValueError(f"candidate tensors must be [B, T, K] with B, T = "
                             f"{tuple(logp.shape)}, got {shapes}")


def policy_loss(logp: torch.Tensor, sampler_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, arm: Arm, cand_logp: torch.Tensor | None = None,
                cand_sampler_logp: torch.Tensor | None = None,
                support_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one arm (module docstring) and its metrics.

    arm: the correction (ARMS[name], or a `dataclasses.replace` of one with another MIS band or
    TIS cap).
    logp: [B, T] trainer log π(y), differentiable. sampler_logp: [B, T] sampler log μ(y).
    advantages: [B] or [B, T]. mask: [B, T], 1 = a completion token.
    cand_logp: [B, T, K] trainer log π at the sampler's candidates, differentiable;
    cand_sampler_logp: [B, T, K] sampler log μ there, non-finite = padding (SC and top-p arms).
    support_mask: [B, T, K] bool, the candidates in the sampler's top-p set (top-p arms).
    Returns (0-dim loss, {name: 0-dim tensor}).
    """
    _check(logp, sampler_logp, advantages, mask, arm, cand_logp, cand_sampler_logp, support_mask)
    dt = torch.promote_types(logp.dtype, torch.float32)
    m = mask.bool()
    host = _host(logp, sampler_logp, m)  # the metrics in numpy (mismatch.metrics, CPU path)
    finite_mu = _finite(sampler_logp)
    finite_pi = _finite(logp.detach())
    nonfinite = (m & ~(finite_mu & finite_pi)).sum()
    valid = m & finite_mu                                                     # (B, T)
    # read only where counted (r below): no masking needed
    slp = sampler_logp.detach().to(dt)
    lp = logp.to(dt)
    metrics: dict[str, torch.Tensor] = {}
    if arm.centered or arm.top_p:
        cand = torch.isfinite(cand_sampler_logp) & valid.unsqueeze(-1)      # (B, T, K)
        clp = torch.where(cand, cand_logp.to(dt), 0)
        cslp = torch.where(cand, cand_sampler_logp.to(dt), 0)
    if arm.top_p:
        cand = cand & support_mask.bool()
        valid = valid & cand.any(dim=-1)
        cand = cand & valid.unsqueeze(-1)
        log_z_trainer = _log_normalizer(clp, cand)
        log_z_sampler = _log_normalizer(cslp, cand)
        metrics["support_mass_trainer"] = _masked_mean(log_z_trainer.detach().exp(), valid)
        metrics["support_mass_sampler"] = _masked_mean(log_z_sampler.exp(), valid)
        lp = lp - torch.where(valid, log_z_trainer, 0)
        slp = slp - torch.where(valid, log_z_sampler, 0)
        clp = torch.where(cand, clp - torch.where(valid, log_z_trainer, 0).unsqueeze(-1), 0)
        cslp = torch.where(cand, cslp - torch.where(valid, log_z_sampler, 0).unsqueeze(-1), 0)
    lp = torch.where(valid, lp, 0)

    def weight(x):
        return _token_weight(x, arm.weight, arm.mis_low, arm.mis_high, arm.tis_cap)

    # the metrics' tokens: valid ones whose log π is finite too (a NaN log π stays in the loss,
    # which turns NaN and the step is skipped; it is counted in nonfinite_tokens)
    counted = valid & finite_pi
    # r = log π − log μ in float64, 0 where not counted; ratio = e^r (r clamped to ±20), 1 there
    if host:
        with np.errstate(all="ignore"):  # inf − inf off the counted tokens
            r = np.subtract(_ndarray(lp), _ndarray(slp), dtype=np.float64)
        counted_np = _ndarray(counted)
        r_counted = r[counted_np]
        if arm.weight != "one":
            np.copyto(r, 0.0, where=~counted_np)
            ratio = torch.from_numpy(np.exp(np.clip(r, -MAX_LOG_RATIO, MAX_LOG_RATIO)))
    else:
        r = torch.where(counted, lp.detach().double() - slp.double(), 0.0)   # (B, T) float64
        ratio = torch.exp(r.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    objective = lp if arm.weight == "one" else weight(ratio).to(dt) * lp    # w = 1: the same bits
    if arm.centered:
        pi = torch.where(cand, clp.detach().double().exp(), 0)               # (B, T, K)
        mu = torch.where(cand, cslp.double().exp(), 0)
        head_mu, head_pi = mu.sum(-1), pi.sum(-1)                            # (B, T)
        rho, has_tail = _tail_ratio(head_mu, head_pi)
        alpha = torch.where(has_tail, rho * weight(1 / torch.where(has_tail, rho, 1)), 0)
        coef = mu * weight(_ratio(clp, cslp)) - alpha.unsqueeze(-1) * pi
        coef = torch.where(cand, coef, 0).to(dt)
        objective = objective - (coef * clp).sum(-1)
        metrics.update(sc_tail_ratio=_masked_mean(rho, valid),
                       head_mass_sampler=_masked_mean(head_mu, valid),
                       head_mass_trainer=_masked_mean(head_pi, valid))
    adv = advantages.to(dt)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv
    n_valid = valid.sum()
    loss = -(torch.where(valid, adv * objective, 0)).sum() / n_valid.clamp_min(1).to(dt)

    if host:  # the same figures over the counted tokens alone
        rc = _clamped_np(r_counted)
        kl = _k_np(rc, ("kl_k1", "kl_k3"))
        w = np.exp(rc)
        outside = _f64(_outside_np(w, arm.mis_low, arm.mis_high) / max(w.size, 1))
        q = _quantiles_np(w, _QUANTILES, torch.float64)   # torch.quantile's values, reorders w
    else:
        n_counted = counted.sum()
        kl = k_estimators(r, n_counted)
        outside = ((ratio < arm.mis_low) | (ratio > arm.mis_high)) & counted
        outside = outside.sum().double() / n_counted.clamp_min(1)
        q = masked_quantiles(ratio, counted, _QUANTILES)  # torch.quantile's values
    metrics.update(loss=loss.detach(), valid_tokens=n_valid, nonfinite_tokens=nonfinite,
                   kl_k1=kl["kl_k1"], kl_k3=kl["kl_k3"], mis_masked_fraction=outside,
                   ratio_p05=q[0], ratio_p50=q[1], ratio_p95=q[2])
    return loss, metrics
