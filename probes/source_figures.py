"""Typed records of the source probes' own figures (`SourceResult.extra`).

A source probe's block in results.json holds, after its headline summary and `applies`, figures
of its own: the ladder's rungs, the accelerator's per-GPU and fleet figures, routing's flip rates,
staleness by lag, the sampling probe's top-p figures. The probe builds one of these records and
stores `to_json()` as its `extra` (the same keys, in the same order, as results.json lists them);
a reader gets the record back with `Record.of(source_result)` (None where the source is missing,
does not apply, or is a bare summary) instead of reading the dict by key. No torch here.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any

__all__ = ["AcceleratorFigures", "FleetWeighted", "LadderFigures", "LadderRung",
           "RoutingFlips", "SamplingFigures", "StalenessByLag"]


def _json(value: Any) -> Any:
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, list):
        return [_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    return value


class _Figures:
    """to_json / from_json / of for a frozen dataclass of JSON figures: fields in results.json's
    order; a field whose default is None is left out of the JSON while it is None."""

    def to_json(self) -> dict[str, Any]:
        return {f.name: _json(v) for f in fields(self)  # type: ignore[arg-type]
                if (v := getattr(self, f.name)) is not None or f.default is not None}

    @classmethod
    def from_json(cls, d: dict[str, Any]):
        """The record's figures out of a source's block (its other keys are not read)."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})  # type: ignore

    @classmethod
    def _required(cls) -> list[str]:
        return [f.name for f in fields(cls)  # type: ignore[arg-type]
                if f.default is MISSING and f.default_factory is MISSING]

    @classmethod
    def of(cls, src: Any):
        """The record of a source's result (a SourceResult: its `extra`); None where `src` is
        None, a bare summary, or lacks this record's figures (a source that does not apply)."""
        extra = getattr(src, "extra", None)
        if not isinstance(extra, dict) or any(k not in extra for k in cls._required()):
            return None
        return cls.from_json(extra)


@dataclass(frozen=True)
class LadderRung(_Figures):
    """One rung of the ladder: its exact KL against the trainer and its increment."""

    rung: str
    kl_exact: float
    increment: float
    """This rung's KL minus the rung before's."""
    kl_exact_ci95: list[float]


@dataclass(frozen=True)
class LadderFigures(_Figures):
    """The ladder's own figures: the rungs, each source alone, and their interaction."""

    rungs: list[LadderRung]
    alone: dict[str, float]
    """Source → exact KL of that source alone."""
    total_kl_exact: float
    interaction: float
    """Total − Σ alone."""
    interaction_fraction: float
    """The interaction over the total (0 where the total is 0)."""
    trainer_gpu: str
    l1_formats: str
    """What L1 (the target checkpoint on the trainer's GPU) runs."""

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LadderFigures:
        rungs = [r if isinstance(r, LadderRung) else LadderRung.from_json(r)
                 for r in d["rungs"]]
        return super().from_json(dict(d, rungs=rungs))


@dataclass(frozen=True)
class FleetWeighted(_Figures):
    """The capacity-weighted fleet: share-weighted sums of the groups' figures and bounds."""

    kl_exact: float
    kl_k3: float
    abs_logprob_diff_mean: float
    mis_masked_fraction: float
    kl_exact_ci95: list[float]
    kl_k3_ci95: list[float]


@dataclass(frozen=True)
class AcceleratorFigures(_Figures):
    """The accelerator probe's own figures: per GPU, and the study's mixed fleet."""

    kl_exact_by_gpu: dict[str, float]
    fleet_shares: dict[str, float]
    """Group ("gpu-dtype") → its share of the fleet's capacity."""
    fleet_weighted: FleetWeighted
    cannot_serve: dict[str, str]
    """GPU → why it cannot serve the checkpoint."""
    kernel_path_by_gpu: dict[str, str]

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AcceleratorFigures:
        w = d["fleet_weighted"]
        return super().from_json(dict(d, fleet_weighted=w if isinstance(w, FleetWeighted)
                                      else FleetWeighted.from_json(w)))


@dataclass(frozen=True)
class RoutingFlips(_Figures):
    """MoE routing: how often the sampler's and the trainer's routers disagree, and the KL with
    and without routing replay."""

    flip_rate_by_layer: list[float]
    flip_rate_mean: float
    flip_rate_any_layer: float
    """Share of routed positions with a flip in at least one MoE layer."""
    flip_rate_any_layer_completion: float
    positions: int
    kl_exact_no_replay: float
    kl_exact_replay: float
    kl_k3_no_replay: float
    kl_k3_replay: float
    routing_kl_share: float
    """KL without replay − KL with replay."""
    routing_kl_share_fraction: float


@dataclass(frozen=True)
class StalenessByLag(_Figures):
    """The staleness probe's figures per lag (keys: the lag as a string, as in JSON)."""

    kl_k3_by_lag: dict[str, float]
    kl_exact_by_lag: dict[str, float]
    kl_exact_ci95_by_lag: dict[str, list[float]]
    tokens_by_lag: dict[str, int]
    lr: float | None
    """None: not known (checkpoints trained elsewhere)."""
    steps: int
    source: str
    bf16_changed_fraction_by_step: list[float]
    bf16_changed_fraction_vs_trainer_by_lag: dict[str, float]
    mean_reward_by_step: list[float]
    informative_groups_by_step: list[int] | None = None
    """Generated steps: groups with a reward spread, per step."""

    @property
    def lags(self) -> list[int]:
        """The lags measured, ascending."""
        return sorted(int(k) for k in self.kl_exact_by_lag)

    def kl_exact_at(self, lag: int) -> float:
        return self.kl_exact_by_lag[str(lag)]


@dataclass(frozen=True)
class SamplingFigures(_Figures):
    """The sampling probe's top-p figures."""

    top_p: float
    sampler_mass_outside: float
    outside_trainer_top_p_fraction: float
    trainer_mass_on_support: float
    processed_minus_raw_mean: float
    """Processed minus raw log-prob per token, nats."""
    bias_bound: float
    """−log top_p: the largest processed − raw can be."""
    tokens: int | None = None
    """Tokens compared (read back from results.json it is the headline's)."""
