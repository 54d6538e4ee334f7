"""The live collapse monitor: one record per training step in, debounced alerts out.

The study's collapse signature (../shared/NUMERICS.md §5, reference/modal-post-mixed-samplers.txt):
the training reward falls, the sampler–trainer KL grows 3× or more, and most episodes end on
repeated format errors (three replies in a row without a tool call end the episode; at the
collapsed checkpoint 62% did). `CollapseMonitor.update(record)` takes one training step's metrics
— any of the native signals (`probes.alerts.SIGNALS`) and/or the raw `episodes`, from which it
computes each episode's end reason and the format-error share itself — and returns the alerts
that step raised.

How a signal is judged (every number below is a `MonitorConfig` / `SignalRule` field):

- **Baseline.** The median of a signal's `baseline_steps` observations after its first
  `warmup_steps` (the 4th to the 13th by default), then frozen: a collapse that creeps up over
  many steps is still measured against the healthy start, and the median ignores a spike inside
  the window.
  `MonitorConfig.baselines` sets one instead (e.g. the KL `mismatch qualify` measured), and the
  signal is judged from its first step. The reward's reference is its running peak.
- **Level** (none / warning / critical) of each step, from the rule's kind: `growth`
  (value / baseline ≥ threshold, and value ≥ `floor`), `fall` (value / baseline ≤ threshold),
  `share` (an absolute share above max(threshold, baseline + `margin`)), `drop` (fall from the
  running peak of the smoothed value, as a fraction of the peak). `smooth_steps` > 1 compares the
  median of the last few values (the reward's batch mean is noisy).
- **Sustained.** A warning fires after `warning_steps` (2) consecutive evaluations at warning or
  above, a critical alert after `critical_steps` (3) at critical: a one-step spike never alerts.
- **Corroboration.** The signature is a conjunction: a signature signal (KL, format errors,
  reward) sustained at warning goes critical while another signature signal is sustained at
  warning too (its last evaluation within `corroborate_within` steps). Two independent signals
  out of their normal range at once are the evidence a single one needs 3× for.
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
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping, Sequence

from mismatch.probes.alerts import SIGNALS, Alert, Sink

__all__ = ["SignalRule", "MonitorConfig", "CollapseMonitor", "default_rules",
           "baselines_from", "episode_end_reason", "episode_summary", "FORMAT_ERROR_REASONS"]

RuleKind = Literal["growth", "fall", "share", "drop"]
_KINDS = ("growth", "fall", "share", "drop")
_NONE, _WARNING, _CRITICAL = 0, 1, 2
_SEVERITY = {_WARNING: "warning", _CRITICAL: "critical"}
_TINY_BASELINE = 1e-12  # growth/fall/drop need a positive reference: below it, not judged

FORMAT_ERROR_REASONS = frozenset({"format_errors", "format_error", "repeated_format_errors",
                                  "no_tool_call"})
"""End reasons that count as "ended on repeated format errors" (`format_errors` is the zoo's,
mismatch/zoo/episode.py; the others are spellings seen in other environments)."""


@dataclass(frozen=True, kw_only=True)
class SignalRule:
    """How one signal is judged against its baseline."""

    kind: RuleKind
    """growth: value / baseline ≥ threshold; fall: value / baseline ≤ threshold; share: absolute
    share ≥ max(threshold, baseline + margin); drop: (peak − value) / peak ≥ threshold."""
    warning: float | None
    """Threshold of a warning (None: never warns)."""
    critical: float | None = None
    """Threshold of a critical alert (None: this signal alone never goes critical)."""
    floor: float = 0.0
    """growth: the value must also reach this absolute level (a 3× rise of a negligible masked
    fraction is still negligible)."""
    margin: float = 0.0
    """share: the share must also exceed the baseline by this much (an environment whose healthy
    share is already high is judged against its own level)."""
    smooth_steps: int = 1
    """Judge the median of the last this-many values (1: the value itself)."""
    hint: str = ""
    """What to look at, appended to the alert's message."""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"SignalRule.kind must be one of {', '.join(_KINDS)}, "
                             f"got {self.kind!r}")
        if self.warning is None and self.critical is None:
            raise ValueError("SignalRule needs a warning or a critical threshold")
        if self.smooth_steps < 1:
            raise ValueError(f"SignalRule.smooth_steps must be >= 1, got {self.smooth_steps}")
        if self.warning is not None and self.critical is not None:
            rising = self.kind != "fall"
            if (self.critical < self.warning) if rising else (self.critical > self.warning):
                raise ValueError(f"SignalRule ({self.kind}): critical {self.critical} is milder "
                                 f"than warning {self.warning}")
        if self.kind == "drop" and any(x is not None and not 0 < x <= 1
                                       for x in (self.warning, self.critical)):
            raise ValueError("SignalRule (drop): thresholds are fractions of the peak in (0, 1]")


def default_rules() -> dict[str, SignalRule]:
    """The shipped rules, one per signal; why each number is what it is:

    - kl: the study's collapses all grew the sampler–trainer KL 3× or more (critical); 2× is the
      first sign, and with format errors or a reward fall at the same time it is the signature.
    - format_error_rate: 62% of episodes ended this way at the collapsed checkpoint, against a
      few percent in healthy runs; 15% is far above binomial noise for batches of hundreds of
      episodes, 30% is a third of the batch gone.
    - reward: a quarter off its peak is a warning, half is critical on its own (by then KL and
      format errors should have fired). Smoothed over 5 steps: a batch's mean reward is noisy.
      The fall is a fraction of the peak, so the reward must be non-negative (0/1 pass rates).
    - sc_tail_ratio: the SC tail ratio was ~1.2 in stable runs and rose to 52 when SC alone
      collapsed (NUMERICS §5): 2× is a warning, 5× is out of anything a stable run showed.
    - mis_masked_fraction: moves with the KL (2× / 3×), but only above the 1% that `qualify`'s
      default policy allows (below it, MIS wastes little whatever the ratio).
    - entropy, response_length: warnings only. The study's stable runs' entropy moved both ways
      and trajectory length showed no consistent pattern across collapses, so neither decides a
      run's fate alone; halving entropy or doubling length is still worth a look.
    """
    return {
        "kl": SignalRule(kind="growth", warning=2.0, critical=3.0,
                         hint="check the sampler's precision, its staleness and the IS correction "
                              "(MIS + SC)"),
        "format_error_rate": SignalRule(
            kind="share", warning=0.15, critical=0.30, margin=0.10,
            hint="the policy is stopping its tool calls (empty replies): the collapse's ending"),
        "reward": SignalRule(kind="drop", warning=0.25, critical=0.5, smooth_steps=5,
                             hint="compare with KL and format errors of the same steps"),
        "sc_tail_ratio": SignalRule(kind="growth", warning=2.0, critical=5.0,
                                    hint="score centering's tail model is breaking down; SC "
                                         "needs MIS"),
        "mis_masked_fraction": SignalRule(kind="growth", warning=2.0, critical=3.0, floor=0.01,
                                          hint="MIS is discarding a growing share of tokens"),
        "entropy": SignalRule(kind="fall", warning=0.5,
                              hint="policy entropy is collapsing: exploration is drying up"),
        "response_length": SignalRule(kind="growth", warning=2.0,
                                      hint="responses are running away (repetition?)"),
    }


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """Baselines, persistence and debouncing of the collapse monitor."""

    rules: Mapping[str, SignalRule] = field(default_factory=default_rules)
    """signal → its rule; a signal without a rule is tracked (values()) but never judged."""
    warmup_steps: int = 3
    """First observations of each signal left out of its baseline (the first steps of a run are
    atypical: weights just loaded, no staleness yet, the KL of an untrained policy)."""
    baseline_steps: int = 10
    """Observations whose median is the baseline; the signal is judged only after them."""
    warning_steps: int = 2
    """Consecutive evaluations at warning or above before a warning fires."""
    critical_steps: int = 3
    """Consecutive evaluations at critical before a critical alert fires."""
    rearm_steps: int = 10
    """Consecutive evaluations back at normal after which a signal can alert again."""
    signature: tuple[str, ...] = ("kl", "format_error_rate", "reward")
    """The collapse signature's signals: a sustained warning of one is critical while another
    one's warning is sustained too."""
    corroborate: bool = True
    """Turn corroboration within the signature on."""
    corroborate_within: int = 2
    """Steps within which another signal's level still counts (records may split a step)."""
    baselines: Mapping[str, float] = field(default_factory=dict)
    """Known baselines (signal → value) that replace the measured ones."""
    max_format_errors: int = 3
    """Replies in a row without a tool call that end an episode (zoo EpisodeConfig default)."""
    max_turns: int | None = None
    """Turn limit of the environment, to tell turn-limit endings from unknown ones in raw
    episodes (None: an episode that ends without a format-error streak or a submit is "other")."""

    def __post_init__(self) -> None:
        unknown = [s for s in (*self.rules, *self.signature, *self.baselines) if s not in SIGNALS]
        if unknown:
            raise ValueError(f"unknown signal {unknown[0]!r}; signals: {', '.join(SIGNALS)}")
        for name in ("baseline_steps", "warning_steps", "critical_steps", "rearm_steps",
                     "max_format_errors"):
            if getattr(self, name) < 1:
                raise ValueError(f"MonitorConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0 or self.corroborate_within < 0:
            raise ValueError("MonitorConfig.warmup_steps and corroborate_within must be >= 0")
        for signal, value in self.baselines.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"MonitorConfig.baselines[{signal!r}] must be a finite number, "
                                 f"got {value!r}")


class _Track:
    """One signal's history: smoothing window, baseline, level, and its debouncing state."""

    __slots__ = ("rule", "seen", "base", "baseline", "window", "peak", "level", "score",
                 "value", "smoothed", "last_eval", "state", "run_warn", "run_crit", "calm")

    def __init__(self, rule: SignalRule | None, baseline: float | None) -> None:
        self.rule = rule
        self.seen = 0
        self.base: list[float] = []
        self.baseline = baseline
        self.window: deque[float] = deque(maxlen=rule.smooth_steps if rule else 1)
        self.peak: float | None = baseline if rule and rule.kind == "drop" else None
        self.level = _NONE
        self.score = math.nan
        self.value: float | None = None
        self.smoothed = math.nan
        self.last_eval: int | None = None
        self.state = _NONE
        self.run_warn = self.run_crit = self.calm = 0

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
        cfg = self.config
        self._tracks = {s: _Track(cfg.rules.get(s), cfg.baselines.get(s)) for s in SIGNALS}

    # -- the public surface -------------------------------------------------------------------

    def update(self, record: Mapping[str, Any]) -> list[Alert]:
        """Feed one training step's record; returns the alerts it raised (also sent to sinks)."""
        step = self._step_of(record)
        self.counts["records"] += 1
        values = self._values_of(record)
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
        raw = _number(record.get("step"))
        step = int(raw) if raw is not None and math.isfinite(raw) else None
        if step is None:
            self.counts["missing_step"] += 1
            step = 0 if self.last_step is None else self.last_step + 1
        if self.first_step is None:
            self.first_step = step
        self.last_step = step
        return step

    def _values_of(self, record: Mapping[str, Any]) -> dict[str, float]:
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
        t.level = _NONE
        if rule is None:
            return
        t.window.append(value)
        if len(t.window) < t.window.maxlen:
            return
        x = t.window[0] if t.window.maxlen == 1 else statistics.median(t.window)
        t.smoothed = x
        if rule.kind == "drop":
            if t.seen <= cfg.warmup_steps and t.baseline is None:
                return
            t.peak = x if t.peak is None else max(t.peak, x)
            if t.baseline is None and t.seen <= cfg.warmup_steps + cfg.baseline_steps:
                return
        elif t.baseline is None:
            if t.seen > cfg.warmup_steps:
                t.base.append(value)
                if len(t.base) == cfg.baseline_steps:
                    t.baseline = statistics.median(t.base)
            return
        t.last_eval = step
        t.level, t.score = _level(rule, x, t.reference())

    def _count(self, t: _Track) -> None:
        """Consecutive evaluations at warning+, at critical, at normal; re-arm after calm."""
        t.run_warn = t.run_warn + 1 if t.level >= _WARNING else 0
        t.run_crit = t.run_crit + 1 if t.level >= _CRITICAL else 0
        t.calm = t.calm + 1 if t.level == _NONE else 0
        if t.state != _NONE and t.calm >= self.config.rearm_steps:
            t.state = _NONE

    def _fire(self, signal: str, step: int) -> Alert | None:
        """At most one alert: critical when sustained at critical, or when sustained at warning
        together with another signature signal sustained at warning (corroborated); warning when
        sustained at warning — held while the signal sits at critical and may still go critical,
        so a jump straight to critical raises the critical alert alone. Each severity fires once
        until the signal re-arms."""
        t, cfg = self._tracks[signal], self.config
        partners: list[str] = []
        if cfg.corroborate and signal in cfg.signature and t.run_warn >= cfg.warning_steps:
            partners = [o for o in cfg.signature if o != signal
                        and self._tracks[o].run_warn >= cfg.warning_steps
                        and self._tracks[o].last_eval is not None
                        and step - self._tracks[o].last_eval <= cfg.corroborate_within]
        held = t.level == _CRITICAL and t.run_crit < cfg.critical_steps  # may go critical next
        if (t.run_crit >= cfg.critical_steps or partners) and t.state < _CRITICAL:
            t.state = _CRITICAL
        elif t.run_warn >= cfg.warning_steps and t.state < _WARNING and not held:
            t.state = _WARNING
        else:
            return None
        steps = t.run_crit if t.state == _CRITICAL and not partners else t.run_warn
        return Alert(step=step, signal=signal, severity=_SEVERITY[t.state], value=t.smoothed,
                     baseline=t.reference(), message=_message(signal, t, steps, partners))


def baselines_from(records: Iterable[Mapping[str, Any]],
                   config: MonitorConfig | None = None) -> dict[str, float]:
    """The baselines a known-good run's `records` set, for `MonitorConfig(baselines=...)`: each
    judged signal's median over the same observations a live monitor would take (after
    `warmup_steps`, the next `baseline_steps`; the reward's median there starts its peak). A
    monitor given them judges a new run from its first full smoothing window instead of after
    warmup + baseline steps. Signals the records hold too few observations of are left out."""
    cfg = config or MonitorConfig()
    reader = CollapseMonitor(MonitorConfig(rules=cfg.rules, max_format_errors=cfg.max_format_errors,
                                           max_turns=cfg.max_turns))
    seen: dict[str, list[float]] = {s: [] for s in cfg.rules}
    for record in records:
        for signal, value in reader._values_of(record).items():
            if signal in seen:
                seen[signal].append(value)
    window = slice(cfg.warmup_steps, cfg.warmup_steps + cfg.baseline_steps)
    return {s: statistics.median(v[window]) for s, v in seen.items()
            if len(v[window]) == cfg.baseline_steps}


def _number(x: Any) -> float | None:
    """x as a float if it is a number (Python, numpy or torch scalar; not a bool), else None."""
    if type(x) is float or type(x) is int:
        return float(x)
    if isinstance(x, bool) or isinstance(x, (str, bytes)) or not hasattr(x, "__float__"):
        return None
    try:
        return float(x)
    except (TypeError, ValueError):  # e.g. an array of several values
        return None


def _finite(x: Any, counts: Counter[str]) -> float | None:
    """x as a float if it is a finite number; otherwise count why not and return None."""
    if x is None:
        return None
    value = _number(x)
    if value is None:
        counts["non_numeric"] += 1
    elif not math.isfinite(value):
        counts["nan"] += 1
        value = None
    return value


def _level(rule: SignalRule, x: float, ref: float | None) -> tuple[int, float]:
    """(level, score) of value x against its reference under `rule`."""
    if ref is None:
        return _NONE, math.nan
    if rule.kind == "share":
        warn = None if rule.warning is None else max(rule.warning, ref + rule.margin)
        crit = None if rule.critical is None else max(rule.critical, ref + rule.margin,
                                                      warn if warn is not None else 0.0)
        score = x
        up = True
    elif ref < _TINY_BASELINE:  # ratios to a zero or negative reference mean nothing
        return _NONE, math.nan
    elif rule.kind == "drop":
        warn, crit, score, up = rule.warning, rule.critical, (ref - x) / ref, True
    else:
        warn, crit, score, up = rule.warning, rule.critical, x / ref, rule.kind == "growth"
        if up and x < rule.floor:
            return _NONE, score

    def beyond(threshold: float | None) -> bool:
        return threshold is not None and (score >= threshold if up else score <= threshold)

    if beyond(crit):
        return _CRITICAL, score
    if beyond(warn):
        return _WARNING, score
    return _NONE, score


def _message(signal: str, t: _Track, steps: int, partners: Sequence[str]) -> str:
    rule, x, ref, score = t.rule, t.smoothed, t.reference(), t.score
    assert rule is not None and ref is not None
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
                 "format_error_rate": "format errors rising"}
        text += (f", with {' and '.join(moved.get(p, p) for p in partners)} too: the collapse "
                 "signature")
    return f"{text}; {rule.hint}" if rule.hint else text


# -- episodes ---------------------------------------------------------------------------------


def _reply_calls(reply: Any) -> tuple[bool, bool] | None:
    """(made a well-formed tool call, submitted) for one reply, or None if it says neither.

    A reply is a bool or 0/1 (1: it called a tool), a dict with `tool_call` (bool), `tool_calls`
    (list of calls, each a dict with a `name`), `submit` (bool), or `content`/`text` (the raw
    reply), or the raw reply text itself, parsed as the zoo's RL loop parses it.
    """
    if isinstance(reply, bool):
        return reply, False
    if isinstance(reply, str):
        from mismatch.zoo.tool_calls import parse_reply

        calls = parse_reply(reply).tool_calls
        return bool(calls), any(c.name == "submit" for c in calls)
    if not isinstance(reply, Mapping):
        return None
    submitted = reply.get("submit") is True or reply.get("tool") == "submit"
    if "tool_calls" in reply and isinstance(reply["tool_calls"], list):
        calls = reply["tool_calls"]
        submitted = submitted or any(isinstance(c, Mapping) and c.get("name") == "submit"
                                     for c in calls)
        return bool(calls) or submitted, submitted
    if "tool_call" in reply:
        return bool(reply["tool_call"]) or submitted, submitted
    text = reply.get("content", reply.get("text"))
    if isinstance(text, str):
        return _reply_calls(text)
    return (True, True) if submitted else None


def _flags(replies: list) -> bytes | None:
    """Replies given as bools (or 0/1) as one byte each, or None for any other form."""
    if not replies or type(replies[0]) not in (bool, int):
        return None
    try:
        flags = bytes(replies)
    except (TypeError, ValueError):
        return None
    return None if flags.translate(None, b"\x00\x01") else flags


def episode_end_reason(episode: Any, *, max_format_errors: int = 3,
                       max_turns: int | None = None) -> str | None:
    """Why an episode ended: "format_errors", "submit", "turn_limit", another stated reason,
    "other" (replies without a terminating event), or None when the record says nothing usable.

    An explicit `end_reason` wins (format-error spellings in FORMAT_ERROR_REASONS map to
    "format_errors"); otherwise the `replies` (or `turns`) are replayed under the environment's
    rules (mismatch/zoo/episode.py): `max_format_errors` replies in a row without a tool call end
    it, a submit ends it, `max_turns` replies end it.
    """
    if type(episode) is not dict and not isinstance(episode, Mapping):
        return None
    reason = episode.get("end_reason")
    if isinstance(reason, str) and reason:
        return "format_errors" if reason in FORMAT_ERROR_REASONS else reason
    replies = episode.get("replies", episode.get("turns"))
    if not isinstance(replies, list):
        return None
    flags = _flags(replies)
    if flags is not None:  # the compact form, scanned in C
        at = flags.find(b"\x00" * max_format_errors)
        ended = at + max_format_errors if at >= 0 else None  # 1-based reply that ends it
        if max_turns is not None and len(flags) >= max_turns and (ended is None
                                                                  or ended > max_turns):
            return "turn_limit"
        return "format_errors" if ended is not None else "other"
    streak = 0
    for i, reply in enumerate(replies, 1):
        if reply is True or reply is False:
            called, submitted = reply, False
        elif type(reply) is dict and len(reply) == 1 and "tool_call" in reply:  # compact form
            called, submitted = bool(reply["tool_call"]), False
        else:
            calls = _reply_calls(reply)
            if calls is None:
                return None
            called, submitted = calls
        if not called:
            streak += 1
            if streak >= max_format_errors:
                return "format_errors"
        else:
            streak = 0
            if submitted:
                return "submit"
        if max_turns is not None and i >= max_turns:
            return "turn_limit"
    return "other"


def episode_summary(episodes: Any, *, max_format_errors: int = 3,
                    max_turns: int | None = None) -> dict[str, Any]:
    """End reasons of a step's episodes: {episodes, bad, end_reasons, format_error_rate, reward}.

    `reward` is the mean of the episodes' numeric `reward` fields (None if none has one);
    `bad` counts entries that say nothing usable (they are left out of the shares).
    """
    reasons: dict[str, int] = {}
    reward_sum, rewarded, bad = 0.0, 0, 0
    for episode in episodes if isinstance(episodes, list) else ():
        reason = episode_end_reason(episode, max_format_errors=max_format_errors,
                                    max_turns=max_turns)
        if reason is None:
            bad += 1
            continue
        reasons[reason] = reasons.get(reason, 0) + 1
        r = _number(episode.get("reward"))
        if r is not None and math.isfinite(r):
            reward_sum += r
            rewarded += 1
    if not isinstance(episodes, list):
        bad += 1
    n = sum(reasons.values())
    return {"episodes": n, "bad": bad, "end_reasons": reasons,
            "format_error_rate": reasons.get("format_errors", 0) / n if n else None,
            "reward": reward_sum / rewarded if rewarded else None}
