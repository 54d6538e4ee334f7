"""A training step's record, built: the trainer's metrics (`StepMetrics`), the batch's units and
the pipeline's timing and health → `mismatch.step_record.StepRecord`, the line `run` appends to
out/metrics.jsonl (its schema lives there, without torch, for every reader).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import torch

from mismatch.step_record import StepRecord

from .batch import Batch, Unit

__all__ = ["StepMetrics", "StepRecord", "step_record"]


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """What one `Trainer.step` measured of its batch (floats; the KL figures and the loss's
    metrics over the sampled tokens whose sampler log-prob is finite)."""

    kl: float
    """KL(μ‖π) k3 estimate over the sampled tokens."""
    kl_k1: float
    mis_masked_fraction: float
    """Share of valid tokens whose ratio π/μ is outside the arm's MIS band."""
    ratio_p05: float
    ratio_p50: float
    ratio_p95: float
    entropy: float
    """Mean trainer entropy at the sampled tokens."""
    group_kl: dict[str, float]
    """KL k3 per sampler group."""
    valid_tokens: int
    nonfinite_tokens: int
    """Sampled tokens whose sampler or trainer log-prob is NaN or ±inf (left out of the KL)."""
    sc_tail_ratio: float
    """Mean tail ratio ρ of score centering over the valid tokens."""
    head_mass_sampler: float | None = None
    """Score-centering arms: the sampler's mass on its candidates."""
    support_mass_sampler: float | None = None
    """Top-p arms: the sampler's mass on the replayed support."""
    support_mass_trainer: float | None = None
    """Top-p arms: the trainer's mass on the replayed support."""
    loss: float = float("nan")
    """The batch's loss (a mean over its valid tokens); set by the step after backward."""
    grad_norm: float = float("nan")
    """Global gradient norm before clipping; set by the step."""
    skipped_nonfinite: bool = False
    """The gradient norm was not finite: AdamW did not step."""


def step_record(step: int, units: list[Unit], batch: Batch, m: StepMetrics, *,
                waited: float, train_s: float, wall: float, stale_dropped: int, claimed: int,
                queue_depth: int, backend: str, faults: dict[str, int],
                resumed_discarded_units: int | None = None,
                cost_per_token: dict[str, float] | None = None) -> StepRecord:
    """The record of a step from its units, batch and the trainer's metrics `m`."""
    eps = [ep for u in units for ep in u.episodes]
    ends = Counter(ep.end_reason for ep in eps)
    sampled = int(batch.mask.sum())
    st = batch.staleness[batch.mask]
    by_group: dict[str, list[float]] = defaultdict(list)
    for ep, g in zip(eps, batch.groups):
        by_group[g].append(ep.reward)
    gen: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # [tokens, seconds]
    for u in units:
        gen[u.group][0] += sum(sum(ep.sampled_mask) for ep in u.episodes)
        gen[u.group][1] += u.seconds
    return StepRecord(
        step=step,
        reward=sum(ep.reward for ep in eps) / len(eps),
        kl=m.kl, kl_k1=m.kl_k1, nonfinite_tokens=m.nonfinite_tokens,
        format_error_rate=ends["format_errors"] / len(eps),
        mis_masked_fraction=m.mis_masked_fraction,
        sc_tail_ratio=m.sc_tail_ratio,
        entropy=m.entropy,
        grad_norm=m.grad_norm,
        staleness_mean=float(st.mean()) if st.numel() else 0.0,
        staleness_max=int(st.max()) if st.numel() else 0,
        staleness_tokens={str(int(k)): int(v) for k, v in
                          zip(*torch.unique(st, return_counts=True))},
        tokens_per_s=sampled / wall if wall > 0 else None,
        response_length=sampled / len(eps),
        group_kl=m.group_kl,
        group_reward={g: sum(v) / len(v) for g, v in sorted(by_group.items())},
        group_tokens_per_s={g: tok / sec if sec > 0 else None
                            for g, (tok, sec) in sorted(gen.items())},
        group_tokens={g: int(tok) for g, (tok, _sec) in sorted(gen.items())},
        end_reasons=dict(sorted(ends.items())),
        loss=m.loss,
        ratio_p05=m.ratio_p05, ratio_p50=m.ratio_p50, ratio_p95=m.ratio_p95,
        n_episodes=len(eps), sampled_tokens=sampled,
        units=[u.index for u in units], units_claimed=claimed,
        stale_units_dropped=stale_dropped,
        step_seconds=wall, trainer_wait_seconds=waited, train_seconds=train_s,
        trainer_idle_share=waited / wall if wall > 0 else None,
        head_mass_sampler=m.head_mass_sampler,
        support_mass_sampler=m.support_mass_sampler,
        support_mass_trainer=m.support_mass_trainer,
        skipped_nonfinite_grad=m.skipped_nonfinite,
        queue_depth=queue_depth, backend=backend,
        sampler_restarts=faults["sampler_restarts"], requeued_units=faults["requeued_units"],
        resumed_discarded_units=resumed_discarded_units,
        sampling_cost_usd=None if not cost_per_token or set(gen) - set(cost_per_token)
        else float(sum(tok * cost_per_token[g] for g, (tok, _s) in gen.items())))
