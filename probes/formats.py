"""Framework adapters: each RL framework's own metric names → the monitor's native signals.

One JSON object per line in, one native record (`{"step": ..., "<signal>": value, ...,
"episodes": [...]}`) out. An adapter lists, for each signal, candidate fields in order of
preference: the first one present in the line is used. A candidate may be

- a field name: `"critic/score/mean"`;
- a sum of fields, `"a+b"` (present when all are): slime's masked fraction is logged in halves;
- a glob, `"train/agg/effective/*/reward/mean"`: the mean of all matching fields (prime-rl logs
  one series per agent).

Where the KL the framework logs is not a KL but a proxy that grows with the mismatch (mean
|Δ log p| or |Δ p| between sampler and trainer), the adapter says so: the KL rule is a ratio to
the run's own baseline, so a proxy that scales with the mismatch is judged the same way, but its
absolute value is not a KL. Each mapping cites the file that logs the field (repository @ commit
read, path). `--map signal=field` (`with_map`) replaces a signal's candidates.

A field the framework logs under the native name is picked up as the last candidate of the
signals no framework logs itself (format_error_rate, sc_tail_ratio): log them yourself, with the
native names, and any adapter reads them.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from probes.alerts import SIGNALS

__all__ = ["Adapter", "ADAPTERS", "get_adapter", "parse_map"]

_NATIVE_ONLY = {"format_error_rate": ("format_error_rate",), "sc_tail_ratio": ("sc_tail_ratio",)}


@dataclass(frozen=True, kw_only=True)
class Adapter:
    """How to read one framework's metrics lines."""

    name: str
    fields: Mapping[str, tuple[str, ...]]
    """signal → candidate fields, first present wins (see the module docstring)."""
    step: tuple[str, ...] = ("step",)
    """Candidate fields of the training step."""
    envelope: tuple[str, ...] = ()
    """Keys whose dict value holds the metrics (merged into the line before lookup)."""
    event_type: str | None = None
    """If set, lines with a different `type` field are other events and are skipped."""
    description: str = ""
    """What the lines look like, in a few words."""

    def __post_init__(self) -> None:
        unknown = [s for s in self.fields if s not in SIGNALS]
        if unknown:
            raise ValueError(f"adapter {self.name}: unknown signal {unknown[0]!r}")

    def with_map(self, overrides: Mapping[str, str]) -> Adapter:
        """This adapter with `signal → field` overrides (`step` sets the step field)."""
        fields = dict(self.fields)
        step = self.step
        for signal, name in overrides.items():
            if signal == "step":
                step = (name,)
            else:
                fields[signal] = (name,)
        return replace(self, fields=fields, step=step)

    def record(self, line: Mapping[str, Any]) -> dict[str, Any] | None:
        """The native record of one parsed line, or None for a line that is another event.

        Values are passed through as found (NaN, strings): the monitor counts what it skips.
        A line without a step field gets `"step": None`.
        """
        if self.event_type is not None and line.get("type", self.event_type) != self.event_type:
            return None
        flat: Mapping[str, Any] = line
        if self.envelope and any(isinstance(line.get(k), Mapping) for k in self.envelope):
            merged = {k: v for k, v in line.items() if k not in self.envelope}
            for key in self.envelope:
                inner = line.get(key)
                if isinstance(inner, Mapping):
                    merged.update(inner)
            flat = merged
        out: dict[str, Any] = {"step": None}
        for name in self.step:
            if name in flat:
                out["step"] = flat[name]
                break
        for signal, candidates in self.fields.items():
            for candidate in candidates:
                found, value = _lookup(flat, candidate)
                if found:
                    out[signal] = value
                    break
        if "episodes" in flat:
            out["episodes"] = flat["episodes"]
        return out


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def _lookup(flat: Mapping[str, Any], candidate: str) -> tuple[bool, Any]:
    """(present, value) of one candidate: a field, a `+` sum of fields or a `*` glob mean."""
    if "*" in candidate:
        matches = [flat[k] for k in flat if fnmatch.fnmatchcase(k, candidate)]
        if not matches:
            return False, None
        numbers = [n for n in map(_number, matches) if n is not None]
        return True, (sum(numbers) / len(numbers) if numbers else matches[0])
    if "+" in candidate and candidate not in flat:
        parts = candidate.split("+")
        if not all(p in flat for p in parts):
            return False, None
        numbers = [_number(flat[p]) for p in parts]
        bad = [flat[p] for p, n in zip(parts, numbers) if n is None]
        return True, (bad[0] if bad else sum(numbers))
    if candidate in flat:
        return True, flat[candidate]
    return False, None


_SLIME_MASKED = ("train/mis_tis_mask_fraction_low+train/mis_tis_mask_fraction_high",
                 "train/mis_rs_mask_fraction_low+train/mis_rs_mask_fraction_high",
                 "train/tis_clipfrac")
"""slime and Miles: MIS masked share (mis.py mask(), tis_ or rs_ prefix), then IcePop's."""


def _with_native(fields: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    return {s: fields.get(s, ()) + _NATIVE_ONLY.get(s, ()) for s in SIGNALS
            if fields.get(s) or s in _NATIVE_ONLY}


ADAPTERS: dict[str, Adapter] = {a.name: a for a in (
    Adapter(
        name="native",
        fields={s: (s,) for s in SIGNALS},
        description="this project's field names (probes.alerts.SIGNALS), `step`, `episodes`",
    ),
    # verl: volcengine/verl @ b178a3cd. Its file logger (VERL_FILE_LOGGER_PATH) writes
    # {"step": N, "data": {...}} per step: verl/utils/tracking.py, FileLogger.log.
    Adapter(
        name="verl",
        step=("step", "training/global_step"),
        envelope=("data",),
        fields=_with_native({
            # verl/trainer/ppo/metric_utils.py compute_data_metrics: critic/score/mean is the task
            # score; critic/rewards/mean also carries the KL penalty when use_kl_in_reward is on
            # (equal to it otherwise), so the score comes first.
            "reward": ("critic/score/mean", "critic/rewards/mean"),
            # verl/trainer/ppo/rollout_corr_helper.py compute_offpolicy_metrics: k3 of
            # KL(rollout || training), logged with the "rollout_corr/" prefix; then
            # verl/utils/debug/metrics.py calculate_debug_metrics: mean |p_rollout - p_actor|, a
            # proxy (not a KL) logged when rollout.calculate_log_probs is on. actor/ppo_kl
            # (verl/trainer/ppo/core_algos.py) is the old→new policy drift of the PPO update, the
            # sampler–trainer KL only in bypass mode: --map kl=actor/ppo_kl there.
            "kl": ("rollout_corr/k3_kl", "training/rollout_probs_diff_mean"),
            # verl/workers/actor/dp_actor.py and verl/trainer/ppo/ray_trainer.py: actor/entropy
            "entropy": ("actor/entropy",),
            # verl/trainer/ppo/metric_utils.py compute_data_metrics
            "response_length": ("response_length/mean",),
            # verl/trainer/ppo/rollout_corr_helper.py compute_rollout_rejection_mask: share of
            # tokens the rejection sampling (mask) removed
            "mis_masked_fraction": ("rollout_corr/rollout_rs_masked_fraction",),
        }),
        description="verl's file logger lines {step, data: {...}} or flat metric dicts",
    ),
    # slime: THUDM/slime @ 624b824a. Rollout metrics are logged with step key rollout/step
    # (slime/observability/rollout_metrics.py log_rollout_data; train_metric_utils.py
    # log_rollout_data gathers rollout_data keys as "rollout/<key>"), train metrics with
    # train/step = rollout_id * steps_per_rollout + i (slime/backends/megatron_utils/model.py).
    Adapter(
        name="slime",
        step=("rollout/step", "train/step"),
        fields=_with_native({
            # slime/ray/rollout.py _convert_samples_to_train_data: raw_reward is the task reward;
            # "rewards" are the post-processed (group-normalized) ones, mean ~0 under GRPO.
            "reward": ("rollout/raw_reward",),
            # examples/train_infer_mismatch_helper/mis.py add_ppl_metrics: k3_kl, prefixed mis_
            # and logged as train/ (model.py); then slime/backends/megatron_utils/loss.py
            # policy_loss_function: train_rollout_logprob_abs_diff, mean |Δ log p| (a proxy).
            "kl": ("train/mis_k3_kl", "train/train_rollout_logprob_abs_diff"),
            # loss.py policy_loss_function: entropy_loss is the mean token entropy
            "entropy": ("train/entropy_loss", "rollout/entropy"),
            # rollout_metrics.py compute_metrics_from_samples: response_len/{mean,...}
            "response_length": ("rollout/response_len/mean", "rollout/response_lengths"),
            # mis.py mask(): mask_fraction_low/high with prefix tis_ (tis_mode=mask) or rs_
            # (rejection sampling); loss.py icepop_function: tis_clipfrac is the share of tokens
            # whose weight was zeroed (vanilla TIS: clipped, not masked).
            "mis_masked_fraction": _SLIME_MASKED,
        }),
        description="slime's wandb/tensorboard metric dicts (rollout/..., train/...) as JSON lines",
    ),
    # Miles: radixark/miles @ 31f1ca96 (the study's framework). Its event logger writes
    # {"type": "metric", "metrics": {...}, "rollout_id": ...} lines to events.jsonl
    # (miles/utils/tracking_utils/tracking.py log; miles/utils/audit_utils/event_logger/
    # logger.py, models.py MetricEvent); other event types are skipped.
    Adapter(
        name="miles",
        step=("rollout/step", "train/step", "rollout_id"),
        envelope=("metrics",),
        event_type="metric",
        fields=_with_native({
            # miles/backends/training_utils/log_utils.py gathers rollout data as "rollout/<key>";
            # raw_reward: miles/ray/rollout/train_data_conversion.py
            "reward": ("rollout/raw_reward",),
            # examples/infra_features/train_infer_mismatch_helper/mis.py add_ppl_metrics (k3_kl,
            # prefixed mis_, logged as train/ by log_utils.py log_train_step); then
            # miles/backends/training_utils/loss_hub/losses.py: mean |Δ log p| (a proxy).
            "kl": ("train/mis_k3_kl", "train/train_rollout_logprob_abs_diff"),
            # log_utils.py: "entropy" is a per-rollout mean key; losses.py: entropy_loss
            "entropy": ("rollout/entropy", "train/entropy_loss"),
            # miles/ray/rollout/metrics.py _compute_metrics_from_samples: response_len/
            "response_length": ("rollout/response_len/mean", "rollout/response_lengths"),
            # mis.py mask() (tis_ / rs_ prefixes); loss_hub/corrections.py icepop_function
            "mis_masked_fraction": _SLIME_MASKED,
        }),
        description="Miles events.jsonl metric events, or its metric dicts as JSON lines",
    ),
    # TRL: huggingface/trl @ f2cd5771, trl/trainer/grpo_trainer.py (GRPOTrainer._metrics, logged
    # through transformers' Trainer.log, whose log_history entries carry "step").
    Adapter(
        name="trl",
        step=("step", "global_step"),
        fields=_with_native({
            "reward": ("reward",),
            # sampling/sampling_logp_difference/mean: mean |Δ log p| between the trainer and
            # vLLM's sampled log-probs (a proxy), logged with vllm_importance_sampling_correction.
            # TRL's "kl" is KL(policy || reference model) (beta > 0): policy drift, not the
            # sampler–trainer mismatch, and it starts at 0, so it is not mapped.
            "kl": ("sampling/sampling_logp_difference/mean",),
            "entropy": ("entropy",),
            "response_length": ("completions/mean_length",),
        }),
        description="TRL GRPOTrainer log entries (Trainer.state.log_history, one per line)",
    ),
    # prime-rl: PrimeIntellect-ai/prime-rl @ 559b4477. Its file monitor writes
    # {"step": N, "time": ..., **metrics} (src/prime_rl/monitors/file.py FileMonitor.log_metrics).
    Adapter(
        name="prime-rl",
        step=("step",),
        fields=_with_native({
            # src/prime_rl/orchestrator/orchestrator.py to_wandb(prefix="train/agg") and
            # orchestrator/metrics.py TraceMetrics: one reward series per agent → their mean
            # (effective subset: errored rollouts excluded); then older releases' reward/mean.
            "reward": ("train/agg/effective/*/reward/mean", "reward/mean"),
            # src/prime_rl/trainer/rl/train.py: mismatch_kl/all (k3 of inference vs trainer
            # log-probs, trainer/rl/loss.py compute_importance_ratio_and_mismatch_kl), with
            # /mean from trainer/utils.py compute_stats
            "kl": ("mismatch_kl/all/mean",),
            # src/prime_rl/trainer/rl/train.py: entropy/all
            "entropy": ("entropy/all/mean",),
            # src/prime_rl/trainer/rl/loss.py: is_masked, share of loss tokens masked
            "mis_masked_fraction": ("is_masked/mean",),
            # orchestrator/metrics.py EpisodeMetrics.to_wandb: output tokens per episode
            "response_length": ("train/agg/effective/num_output_tokens/mean",),
        }),
        description="prime-rl file monitor lines {step, time, ...}",
    ),
)}


def parse_map(items: Sequence[str] | None) -> dict[str, str]:
    """["kl=actor/ppo_kl", ...] → {"kl": "actor/ppo_kl"}; a bad item is a one-line ValueError."""
    out: dict[str, str] = {}
    for item in items or ():
        signal, sep, name = item.partition("=")
        signal, name = signal.strip(), name.strip()
        if not sep or not signal or not name:
            raise ValueError(f"--map {item!r} is not SIGNAL=FIELD (e.g. kl=actor/ppo_kl)")
        if signal not in SIGNALS and signal != "step":
            raise ValueError(f"--map {item!r}: unknown signal {signal!r}; signals: step, "
                             f"{', '.join(SIGNALS)}")
        out[signal] = name
    return out


def get_adapter(name: str, mapping: Sequence[str] | None = None) -> Adapter:
    """The adapter `name` with `--map` overrides applied; unknown names are a ValueError."""
    key = name.strip().lower()
    if key not in ADAPTERS:
        raise ValueError(f"unknown format {name!r}; formats: {', '.join(ADAPTERS)}")
    overrides = parse_map(mapping)
    return ADAPTERS[key].with_map(overrides) if overrides else ADAPTERS[key]
