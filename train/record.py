"""A training step's record: the line `run` appends to out/metrics.jsonl after every optimizer
step, in the collapse monitor's native format (mismatch.probes.monitor.SIGNALS), so `mismatch monitor
out/metrics.jsonl` reads a run's log as it reads any framework's.

`StepRecord.to_json()` is the JSON object, its keys in the order of the fields; the optional
fields (None, or False for the non-finite flag) are left out, as a step without them never had
them. `StepRecord.from_json` reads a line back (the study's run summaries go through it); the
monitor reads the JSON itself, as it reads any framework's log.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, fields
from typing import Any

import torch

from .batch import Batch, Unit

__all__ = ["StepRecord"]

_ADDED_LATER = ("nonfinite_tokens", "group_tokens")
"""Fields older logs lack: `from_json` reads them as None."""
_OPTIONAL = ("head_mass_sampler", "support_mass_sampler", "support_mass_trainer",
             "skipped_nonfinite_grad", "resumed_discarded_units", "sampling_cost_usd")


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One optimizer step: its batch, the trainer's numerics, the pipeline's timing and health."""

    step: int
    """Optimizer steps completed."""
    reward: float
    """Mean reward of the batch's episodes."""
    kl: float
    """KL(μ‖π) k3 estimate over the sampled tokens (sampler μ, trainer π)."""
    kl_k1: float
    """The k1 estimate of the same KL."""
    nonfinite_tokens: int
    """Sampled tokens whose sampler or trainer log-prob is NaN or ±inf: left out of the KL
    figures (and, on the sampler's side, of the loss), counted here, never dropped silently."""
    format_error_rate: float
    """Share of episodes that ended on format errors."""
    mis_masked_fraction: float
    """Share of valid tokens whose ratio π/μ is outside the arm's MIS band."""
    sc_tail_ratio: float
    """Mean tail ratio ρ of score centering over the valid tokens."""
    entropy: float
    """Mean trainer entropy at the sampled tokens."""
    grad_norm: float
    """Global gradient norm before clipping."""
    staleness_mean: float
    """Mean staleness of the sampled tokens, in optimizer steps."""
    staleness_max: int
    staleness_tokens: dict[str, int]
    """Sampled tokens per staleness value."""
    tokens_per_s: float | None
    """Sampled tokens over the step's wall time."""
    response_length: float
    """Sampled tokens per episode."""
    group_kl: dict[str, float]
    """KL k3 per sampler group."""
    group_reward: dict[str, float]
    group_tokens_per_s: dict[str, float | None]
    """Per group: tokens sampled over the seconds its samplers spent generating them."""
    group_tokens: dict[str, int]
    """Per group: tokens its samplers sampled for this step's episodes."""
    end_reasons: dict[str, int]
    loss: float
    ratio_p05: float
    ratio_p50: float
    ratio_p95: float
    n_episodes: int
    sampled_tokens: int
    units: list[int]
    """The units of the batch, by number."""
    units_claimed: int
    """Units claimed so far (the pipeline's cursor)."""
    stale_units_dropped: int
    """Units discarded for exceeding the staleness bound."""
    step_seconds: float
    trainer_wait_seconds: float
    train_seconds: float
    trainer_idle_share: float | None
    head_mass_sampler: float | None = None
    """Score centering: the sampler's mass on its candidates."""
    support_mass_sampler: float | None = None
    """Top-p arms: the sampler's mass on the replayed support."""
    support_mass_trainer: float | None = None
    """Top-p arms: the trainer's mass on the replayed support."""
    skipped_nonfinite_grad: bool = False
    """The gradient norm was not finite: AdamW did not step."""
    queue_depth: int
    """Finished units waiting in the queue when the trainer took its batch."""
    backend: str
    sampler_restarts: int
    requeued_units: int
    resumed_discarded_units: int | None = None
    """On the first step after a resume: units claimed after the checkpoint, regenerated."""
    sampling_cost_usd: float | None = None
    """What sampling this step's tokens cost on the fleet's GPUs: Σ over groups of tokens ×
    price per GPU-hour / (3600 × tokens/s per GPU), serverless billing. Only for a fleet file
    whose every group gives its price and throughput (`mismatch plan`'s fleet.toml)."""

    @classmethod
    def of(cls, step: int, units: list[Unit], batch: Batch, m: dict[str, Any], *,
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
        return cls(
            step=step,
            reward=sum(ep.reward for ep in eps) / len(eps),
            kl=m["kl"], kl_k1=m["kl_k1"], nonfinite_tokens=m["nonfinite_tokens"],
            format_error_rate=ends.get("format_errors", 0) / len(eps),
            mis_masked_fraction=m["mis_masked_fraction"],
            sc_tail_ratio=m["sc_tail_ratio"],
            entropy=m["entropy"],
            grad_norm=m["grad_norm"],
            staleness_mean=float(st.mean()) if st.numel() else 0.0,
            staleness_max=int(st.max()) if st.numel() else 0,
            staleness_tokens={str(int(k)): int(v) for k, v in
                              zip(*torch.unique(st, return_counts=True))},
            tokens_per_s=sampled / wall if wall > 0 else None,
            response_length=sampled / len(eps),
            group_kl=m["group_kl"],
            group_reward={g: sum(v) / len(v) for g, v in sorted(by_group.items())},
            group_tokens_per_s={g: tok / sec if sec > 0 else None
                                for g, (tok, sec) in sorted(gen.items())},
            group_tokens={g: int(tok) for g, (tok, _sec) in sorted(gen.items())},
            end_reasons=dict(sorted(ends.items())),
            loss=m["loss"],
            ratio_p05=m["ratio_p05"], ratio_p50=m["ratio_p50"], ratio_p95=m["ratio_p95"],
            n_episodes=len(eps), sampled_tokens=sampled,
            units=[u.index for u in units], units_claimed=claimed,
            stale_units_dropped=stale_dropped,
            step_seconds=wall, trainer_wait_seconds=waited, train_seconds=train_s,
            trainer_idle_share=waited / wall if wall > 0 else None,
            head_mass_sampler=m.get("head_mass_sampler"),
            support_mass_sampler=m.get("support_mass_sampler"),
            support_mass_trainer=m.get("support_mass_trainer"),
            skipped_nonfinite_grad=bool(m.get("skipped_nonfinite")),
            queue_depth=queue_depth, backend=backend,
            sampler_restarts=faults["sampler_restarts"], requeued_units=faults["requeued_units"],
            resumed_discarded_units=resumed_discarded_units,
            sampling_cost_usd=None if not cost_per_token or set(gen) - set(cost_per_token)
            else float(sum(tok * cost_per_token[g] for g, (tok, _s) in gen.items())))

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StepRecord:
        """A metrics.jsonl object back as a record. Logs written before `nonfinite_tokens` and
        `group_tokens` existed read with None there (not logged, not zero); any other missing
        key, or one this record does not have, is a ValueError naming it."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"metrics record of step {d.get('step')}: unknown keys {unknown}")
        values = {**dict.fromkeys(_ADDED_LATER), **d}
        try:
            return cls(**values)
        except TypeError as exc:  # a required field missing
            raise ValueError(f"metrics record of step {d.get('step')}: {exc}") from None

    def to_json(self) -> dict[str, Any]:
        """The metrics.jsonl object: every field in order, the optional ones only when set."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _OPTIONAL and (value is None or value is False):
                continue
            out[f.name] = value
        return out
