"""A training step's record: the line `mismatch train` appends to out/metrics.jsonl after every
optimizer step, in the collapse monitor's native format (mismatch.probes.monitor.SIGNALS), so
`mismatch monitor out/metrics.jsonl` reads a run's log as it reads any framework's.

The schema alone, without torch: the trainer builds a record (mismatch.train.record.step_record),
and every reader goes through it: the run report, the study's run summaries, the collapse
monitor (`CollapseMonitor.update` takes a record; its native format reads a metrics.jsonl line
that is one through `StepRecord.from_json`). `StepRecord.to_json()` is the JSON object, its
keys in the order of the fields; the optional fields (None, or False for the non-finite flag)
are left out, as a step without them never had them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["StepRecord", "read_steps"]

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
    def from_json(cls, d: dict[str, Any]) -> StepRecord:
        """A metrics.jsonl object back as a record. Logs written before `nonfinite_tokens` and
        `group_tokens` existed read with None there (not logged, not zero); any other missing
        key, or one this record does not have, is a ValueError naming it."""
        unknown = sorted(set(d) - _FIELD_NAMES)
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


_FIELD_NAMES = frozenset(f.name for f in fields(StepRecord))
"""The schema's keys, for `from_json` (it runs on every line of every log read)."""


def read_steps(path: Path) -> list[StepRecord]:
    """The records of a metrics.jsonl, in order. A torn last line (a kill mid-write) is dropped;
    any other line that is not a step record is a ValueError naming the file and the line."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # torn by a kill mid-write
            raise ValueError(f"{path}:{number} is not JSON; the run directory is damaged") \
                from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{number} is not a JSON object; the run directory is "
                             "damaged")
        try:
            out.append(StepRecord.from_json(obj))
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
    return out
