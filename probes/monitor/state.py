"""The collapse monitor's state machine: one record per training step in, debounced alerts out.

The reference study's collapse signature (docs/study.md, docs/monitor-rules.md):
the training reward falls, the sampler–trainer KL grows 3× or more, and most episodes end on
repeated format errors (three replies in a row without a tool call end the episode; at the
collapsed checkpoint 62% did). `CollapseMonitor.update(record)` takes one training step's metrics
— any of the native signals (`signals.SIGNALS`) and/or the raw `episodes`, from which it
computes each episode's end reason and the format-error share itself (endings.py) — and returns
the alerts that step raised.

How a signal is judged (every number below is a `MonitorConfig` / `SignalRule` field, rules.py):

- **Baseline.** The median of a signal's `baseline_steps` observations after its first
  `warmup_steps` (the 4th to the 13th by default), then frozen: a collapse that creeps up over
  many steps is still measured against the healthy start, and the median ignores a spike inside
  the window.
  `MonitorConfig.baselines` sets one instead (e.g. the KL `mismatch qualify` measured, or a
  known-good run's: baselines.py), and the signal is judged from its first step. The reward's
  reference is its running peak.
- **Level** (normal / warning / critical) of each step, from the rule's kind (`rules.judge`).
  `smooth_steps` > 1 compares the median of the last few values (the reward's batch mean is
  noisy). The reward's peak is the running maximum of a longer median (`peak_steps`, 10): the
  best of a long run's many short medians is its luckiest stretch, not a level it held.
- **The KL's probe floor.** A KL below `probe_margin` (5) × the KL a probe of the same sampler
  shows at the same weights is judged normal whatever its ratio to the baseline: at that level it
  is the sampler's numerics, which move with the policy (the study's on-policy controls: a KL of
  1e-5 grew 7× as the policy sharpened, nothing wrong). The probe is `MonitorConfig.kl_probe`,
  or the run's first record when it says it was sampled at the trainer's weights (staleness 0).
- **Counts** (`nonfinite_tokens`) need no baseline: the first step with a positive count is a
  warning at once, the second before the signal re-arms is critical.
- **Sustained.** A warning fires after `warning_steps` (2) consecutive evaluations at warning or
  above, a critical alert after `critical_steps` (3) at critical: a one-step spike never alerts.
- **Corroboration.** The signature is a conjunction: a signature signal (KL, format errors,
  reward) sustained at warning goes critical while another signature signal is sustained at
  warning too (its last evaluation within `corroborate_within` steps). Two independent signals
  out of their normal range at once are the evidence a single one needs 3× for. When the loss
  masks tokens (`masked_loss`: MIS), the masked share stands in the signature for the KL: the
  update takes no gradient from the tokens the KL grows on, and what it feels is how many it
  loses.
- **Debounced.** One alert per severity per episode of trouble (a warning, then at most one
  critical; a jump straight to critical raises the critical alone); the signal re-arms after
  `rearm_steps` (10) consecutive evaluations back at normal.

Missing signals are not evaluated; NaN, infinite and non-numeric values are skipped and counted
(`counts`). Steps may arrive in several records (frameworks that log rollout and train metrics
on separate lines): each signal keeps its own history.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from typing import Any, Iterable, Mapping, Sequence

from mismatch.probes.monitor.endings import episode_summary
from mismatch.probes.monitor.rules import (CRITICAL, NORMAL, WARNING, MonitorConfig, SignalRule,
                                           judge)
from mismatch.probes.monitor.signals import (SIGNALS, STALENESS_FIELDS, Alert, Sink, as_number,
                                             native_record)
from mismatch.step_record import StepRecord

__all__ = ["CollapseMonitor"]

_SEVERITY = {WARNING: "warning", CRITICAL: "critical"}


class _Track:
    """One signal's history: smoothing window, baseline, level, and its debouncing state."""

    __slots__ = ("rule", "seen", "base", "baseline", "window", "peak", "peak_window", "level",
                 "score",
                 "value", "smoothed", "last_eval", "state", "run_warn", "run_crit", "calm",
                 "hits")

    def __init__(self, rule: SignalRule | None, baseline: float | None) -> None:
        self.rule = rule
        self.seen = 0
        self.base: list[float] = []
        self.baseline = baseline
        self.window: deque[float] = deque(maxlen=rule.smooth_steps if rule else 1)
        self.peak: float | None = baseline if rule and rule.kind == "drop" else None
        self.peak_window: deque[float] | None = (
            deque(maxlen=rule.peak_steps) if rule and rule.kind == "drop" and rule.peak_steps
            else None)
        """drop rules with `peak_steps`: the values whose median is the peak's candidate."""
        self.level = NORMAL
        self.score = math.nan
        self.value: float | None = None
        self.smoothed = math.nan
        self.last_eval: int | None = None
        self.state = NORMAL
        self.run_warn = self.run_crit = self.calm = 0
        self.hits = 0
        """count rules: steps with a positive value since the signal was last clear."""

    def reference(self) -> float | None:
        """What the value is compared against: the running peak (drop) or the baseline."""
        return self.peak if self.rule is not None and self.rule.kind == "drop" else self.baseline


class CollapseMonitor:
    """Streaming collapse detector; see the module docstring for how signals are judged.

        monitor = CollapseMonitor(sinks=[TerminalSink()])
        for step in training:
            alerts = monitor.update({"step": step, "reward": r, "kl": k3, "episodes": eps})

    Every alert goes to each sink's `emit`; after each update each sink's `observe` gets
    `values()` and `baselines()`. `alerts` holds every alert so far, `counts` what was skipped.
    """

    def __init__(self, config: MonitorConfig | None = None, sinks: Iterable[Sink] = ()) -> None:
        self.config = config or MonitorConfig()
        self.sinks: list[Sink] = list(sinks)
        self.alerts: list[Alert] = []
        self.counts: Counter[str] = Counter()
        """records, episodes; skipped: nan, non_numeric, missing_step, bad_episodes."""
        self.last_end_reasons: Counter[str] = Counter()
        """End reasons of the episodes of the last record that carried some."""
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.kl_probe: float | None = self.config.kl_probe
        """The probe KL under the KL's floor (config, or the run's first same-weights record)."""
        self._probe_looked = self.config.kl_probe is not None
        cfg = self.config
        self._tracks = {s: _Track(cfg.rules.get(s), cfg.baselines.get(s)) for s in SIGNALS}

    # -- the public surface -------------------------------------------------------------------

    def update(self, record: Mapping[str, Any] | StepRecord) -> list[Alert]:
        """Feed one training step's record — a native record (a mapping) or a `mismatch train`
        step's `StepRecord` —; returns the alerts it raised (also sent to sinks)."""
        if isinstance(record, StepRecord):
            record = native_record(record)
        step = self._step_of(record)
        self.counts["records"] += 1
        values = self.read(record)
        if not self._probe_looked and "kl" in values:
            self._probe_looked = True  # only the first record with a KL can be the probe
            if self.config.probe_from_first_step and _same_weights(record):
                self.kl_probe = values["kl"]
        judged = []
        for signal, value in values.items():
            t = self._tracks[signal]
            self._observe(t, step, value)
            if t.last_eval == step:
                self._count(t)
                judged.append(signal)
        fired: list[Alert] = []
        for signal in judged:  # after every signal of the record has been counted
            alert = self._fire(signal, step)
            if alert is not None:
                fired.append(alert)
        self.alerts.extend(fired)
        for sink in self.sinks:
            for alert in fired:
                sink.emit(alert)
        if self.sinks:
            current, base = self.values(), self.baselines()
            for sink in self.sinks:
                sink.observe(step, current, base)
        return fired

    def values(self) -> dict[str, float | None]:
        """The latest value of every signal (None where none has been seen)."""
        return {s: t.value for s, t in self._tracks.items()}

    def baselines(self) -> dict[str, float | None]:
        """Every signal's reference: its baseline, the reward's running peak; None until known."""
        return {s: t.reference() for s, t in self._tracks.items()}

    def close(self) -> None:
        """Close every sink."""
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> CollapseMonitor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reading a record ---------------------------------------------------------------------

    def _step_of(self, record: Mapping[str, Any]) -> int:
        raw = as_number(record.get("step"))
        step = int(raw) if raw is not None and math.isfinite(raw) else None
        if step is None:
            self.counts["missing_step"] += 1
            step = 0 if self.last_step is None else self.last_step + 1
        if self.first_step is None:
            self.first_step = step
        self.last_step = step
        return step

    def read(self, record: Mapping[str, Any]) -> dict[str, float]:
        """The signal values `record` holds, stated or derived from its `episodes` (a stated one
        wins); counts what was skipped and keeps the episodes' end reasons. Judges nothing."""
        values: dict[str, float] = {}
        for signal in SIGNALS:
            if signal in record:
                x = _finite(record[signal], self.counts)
                if x is not None:
                    values[signal] = x
        episodes = record.get("episodes")
        if episodes is not None:
            summary = episode_summary(episodes, max_format_errors=self.config.max_format_errors,
                                      max_turns=self.config.max_turns)
            self.counts["episodes"] += summary["episodes"]
            self.counts["bad_episodes"] += summary["bad"]
            if summary["episodes"]:
                self.last_end_reasons = Counter(summary["end_reasons"])
                # a signal the record states outright wins over the one derived from episodes
                values.setdefault("format_error_rate", summary["format_error_rate"])
                if summary["reward"] is not None:
                    values.setdefault("reward", summary["reward"])
        return values

    # -- judging ------------------------------------------------------------------------------

    def _observe(self, t: _Track, step: int, value: float) -> None:
        """Record a value; update baseline / peak; set the step's level (before corroboration)."""
        cfg, rule = self.config, t.rule
        t.value = value
        t.seen += 1
        t.level = NORMAL
        if rule is None:
            return
        if rule.kind == "count":
            t.hits += value > 0
            t.smoothed, t.last_eval = value, step
            if value > 0:
                t.level, t.score = judge(rule, t.hits, None)
            return
        t.window.append(value)
        if t.peak_window is not None:
            t.peak_window.append(value)
        if len(t.window) < t.window.maxlen:
            return
        x = t.window[0] if t.window.maxlen == 1 else statistics.median(t.window)
        t.smoothed = x
        if rule.kind == "drop":
            if t.seen <= cfg.warmup_steps and t.baseline is None:
                return
            level = x if t.peak_window is None else (
                statistics.median(t.peak_window)
                if len(t.peak_window) == t.peak_window.maxlen else None)
            if level is not None:
                t.peak = level if t.peak is None else max(t.peak, level)
            if t.baseline is None and t.seen <= cfg.warmup_steps + cfg.baseline_steps:
                return
        elif t.baseline is None:
            if t.seen > cfg.warmup_steps:
                t.base.append(value)
                if len(t.base) == cfg.baseline_steps:
                    t.baseline = statistics.median(t.base)
            return
        t.last_eval = step
        floor = (self.config.probe_margin * self.kl_probe
                 if t is self._tracks["kl"] and self.kl_probe is not None else None)
        t.level, t.score = judge(rule, x, t.reference(), floor)

    def _count(self, t: _Track) -> None:
        """Consecutive evaluations at warning+, at critical, at normal; re-arm after calm."""
        t.run_warn = t.run_warn + 1 if t.level >= WARNING else 0
        t.run_crit = t.run_crit + 1 if t.level >= CRITICAL else 0
        t.calm = t.calm + 1 if t.level == NORMAL else 0
        if t.state != NORMAL and t.calm >= self.config.rearm_steps:
            t.state = NORMAL
            t.hits = 0

    def _fire(self, signal: str, step: int) -> Alert | None:
        """At most one alert: critical when sustained at critical, or when sustained at warning
        together with another signature signal sustained at warning (corroborated); warning when
        sustained at warning — held while the signal sits at critical and may still go critical,
        so a jump straight to critical raises the critical alert alone. Each severity fires once
        until the signal re-arms."""
        t, cfg = self._tracks[signal], self.config
        # a count is evidence at once: no sustained level to wait for
        need_warn, need_crit = ((1, 1) if t.rule is not None and t.rule.kind == "count"
                                else (cfg.warning_steps, cfg.critical_steps))
        partners: list[str] = []
        signature = cfg.signature_signals()
        if cfg.corroborate and signal in signature and t.run_warn >= cfg.warning_steps:
            partners = [o for o in signature if o != signal
                        and self._tracks[o].run_warn >= cfg.warning_steps
                        and self._tracks[o].last_eval is not None
                        and step - self._tracks[o].last_eval <= cfg.corroborate_within]
        held = t.level == CRITICAL and t.run_crit < need_crit  # may go critical next
        if (t.run_crit >= need_crit or partners) and t.state < CRITICAL:
            t.state = CRITICAL
        elif t.run_warn >= need_warn and t.state < WARNING and not held:
            t.state = WARNING
        else:
            return None
        steps = t.run_crit if t.state == CRITICAL and not partners else t.run_warn
        return Alert(step=step, signal=signal, severity=_SEVERITY[t.state], value=t.smoothed,
                     baseline=t.reference(), message=_message(signal, t, steps, partners))


def _same_weights(record: Mapping[str, Any]) -> bool:
    """Whether the record says its episodes were sampled at the weights it trains (staleness 0)."""
    for key in STALENESS_FIELDS:
        if key in record:
            return as_number(record[key]) == 0
    return False


def _finite(x: Any, counts: Counter[str]) -> float | None:
    """x as a float if it is a finite number; otherwise count why not and return None."""
    if x is None:
        return None
    value = as_number(x)
    if value is None:
        counts["non_numeric"] += 1
    elif not math.isfinite(value):
        counts["nan"] += 1
        value = None
    return value


def _message(signal: str, t: _Track, steps: int, partners: Sequence[str]) -> str:
    rule, x, ref, score = t.rule, t.smoothed, t.reference(), t.score
    assert rule is not None
    if rule.kind == "count":
        nth = {1: "first", 2: "second", 3: "third"}.get(t.hits, f"{t.hits}th")
        text = (f"{signal}: {x:.0f} at this step, the {nth} step with any since the signal was "
                f"last clear")
        return f"{text}; {rule.hint}" if rule.hint else text
    assert ref is not None
    lasting = f"for {steps} step{'s' if steps != 1 else ''}"
    if rule.kind == "share":
        text = (f"{x:.0%} of episodes ended on repeated format errors {lasting} "
                f"(baseline {ref:.0%})")
    elif rule.kind == "drop":
        text = f"{signal} {x:.4g} is {score:.0%} below its peak {ref:.4g} {lasting}"
    elif rule.kind == "fall":
        text = f"{signal} {x:.4g} fell to {score:.2f}x its baseline {ref:.4g} {lasting}"
    else:
        text = f"{signal} {x:.4g} is {score:.1f}x its baseline {ref:.4g} {lasting}"
    if partners:
        moved = {"reward": "reward falling", "kl": "kl growing",
                 "format_error_rate": "format errors rising",
                 "mis_masked_fraction": "MIS masking more tokens"}
        text += (f", with {' and '.join(moved.get(p, p) for p in partners)} too: the collapse "
                 "signature")
    return f"{text}; {rule.hint}" if rule.hint else text
