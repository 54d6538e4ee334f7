"""The rule table: how each monitored signal is judged, and the monitor's thresholds.

A `SignalRule` turns one value and its reference into a level (normal / warning / critical), by
its kind:

- `growth`: value / baseline ≥ threshold, and value ≥ `floor` (the KL, the SC tail ratio);
- `fall`: value / baseline ≤ threshold (entropy);
- `share`: an absolute share above max(threshold, baseline + `margin`) (format errors);
- `drop`: fall from the running peak, as a fraction of the peak (the reward);
- `count`: steps with a positive count since the signal was last clear (non-finite log-probs):
  no baseline, judged from the first step, fires without waiting for a sustained level.

`default_rules()` is the shipped table, each number justified by the study; `MonitorConfig`
holds the table with what the state machine (state.py) needs around it: the baseline window,
how many steps make a level sustained, corroboration, re-arming and the KL's probe floor.
`judge` is the level of one value. docs/monitor-rules.md says why each rule is what it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal, Mapping

from mismatch.probes.monitor.signals import SIGNALS

__all__ = ["SignalRule", "MonitorConfig", "default_rules", "with_kl_floor", "judge", "NORMAL",
           "WARNING", "CRITICAL"]

RuleKind = Literal["growth", "fall", "share", "drop", "count"]
_KINDS = ("growth", "fall", "share", "drop", "count")
NORMAL, WARNING, CRITICAL = 0, 1, 2
"""A step's level, ordered: comparisons (level >= WARNING) are how the state machine counts."""
_TINY_BASELINE = 1e-12  # growth/fall/drop need a positive reference: below it, not judged


@dataclass(frozen=True, kw_only=True)
class SignalRule:
    """How one signal is judged against its baseline."""

    kind: RuleKind
    """growth: value / baseline ≥ threshold; fall: value / baseline ≤ threshold; share: absolute
    share ≥ max(threshold, baseline + margin); drop: (peak − value) / peak ≥ threshold; count:
    steps with a positive value since the signal was last clear ≥ threshold."""
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
    peak_steps: int = 0
    """drop: the peak is the running maximum of the median of the last this-many values (0: of
    the judged value, `smooth_steps`). The running maximum of a noisy median drifts upwards as a
    run gets longer (the best of many noisy windows), so over a longer window it is a level the
    signal held, not its luckiest batches."""
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
        if self.peak_steps < 0:
            raise ValueError(f"SignalRule.peak_steps must be >= 0, got {self.peak_steps}")
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

    - kl: the study's collapses all grew the sampler–trainer KL 3× or more, but so did runs that
      held (SC+MIS+top-p 4–9×, on-policy controls 7–11×: reports/study.md), so a KL growth alone
      is a warning from 2×; it is critical with a reward fall or format errors at the same time
      (the signature: corroboration), or alone at 10×, an order of magnitude past the baseline
      (a run that logs the KL alone still gets a critical; on the study's runs any lone
      threshold from 4× up, or none, gives the same alerts: docs/monitor-rules.md). The growth is
      judged only above the probe floor (`MonitorConfig.kl_probe`, state.py): a KL within
      `probe_margin` (5)× of what the same sampler shows at the same weights is numerics, whatever
      its ratio to the baseline.
    - format_error_rate: 62% of episodes ended this way at the collapsed checkpoint, against a
      few percent in healthy runs; 15% is far above binomial noise for batches of hundreds of
      episodes, 30% is a third of the batch gone.
    - reward: a quarter off its peak is a warning, half is critical on its own (by then KL and
      format errors should have fired). Smoothed over 5 steps: a batch's mean reward is noisy.
      The peak is the best median over 10 steps, the baseline window's length: the best of a
      long run's many 5-step medians is its luckiest stretch, and a fall from that is partly
      noise (on the study's longest held runs it was half again above the reward they held).
      The fall is a fraction of the peak, so the reward must be non-negative (0/1 pass rates).
    - sc_tail_ratio: the SC tail ratio was ~1.2 in stable runs and rose to 52 when SC alone
      collapsed (the reference study, docs/study.md): 2× is a warning, 5× is out of anything a stable run showed.
    - mis_masked_fraction: moves with the KL (2× / 3×), but only above the 1% that `qualify`'s
      default policy allows (below it, MIS wastes little whatever the ratio).
    - nonfinite_tokens: log-probs that are NaN or ±inf at unmasked positions (the trainer's
      count). Never a healthy value: the first step with any is a warning at once, a second step
      with any before the signal has been clear for `rearm_steps` is critical (a one-off overflow
      on one sequence can be an outlier; a repeat means the numerics are broken).
    - entropy, response_length: warnings only. The study's stable runs' entropy moved both ways
      and trajectory length showed no consistent pattern across collapses, so neither decides a
      run's fate alone; halving entropy or doubling length is still worth a look.
    """
    return {
        "kl": SignalRule(kind="growth", warning=2.0, critical=10.0,
                         hint="check the sampler's precision, its staleness and the IS correction "
                              "(MIS + SC)"),
        "format_error_rate": SignalRule(
            kind="share", warning=0.15, critical=0.30, margin=0.10,
            hint="the policy is stopping its tool calls (empty replies): the collapse's ending"),
        "reward": SignalRule(kind="drop", warning=0.25, critical=0.5, smooth_steps=5,
                             peak_steps=10,
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
        "nonfinite_tokens": SignalRule(
            kind="count", warning=1, critical=2,
            hint="NaN/inf log-probs reach the loss: check the trainer's precision (overflow in "
                 "BF16/FP8 logits) and the sampler's logged log-probs"),
    }


def with_kl_floor(rules: Mapping[str, SignalRule], floor: float) -> dict[str, SignalRule]:
    """`rules` with the KL rule's absolute floor set to `floor` (0: growth alone, the default).

    The default floor is relative instead: `MonitorConfig.probe_margin` × a probe of the same
    sampler at the same weights (state.py), which needs no knowledge of the KL's scale. A fixed
    one is not on by default: the KL's scale depends on who logs it. On the study's on-policy controls a
    BF16 sampler's KL of ~1e-5 grew 7× as the policy sharpened, with nothing wrong (a floor of
    1e-3, the level same-precision kernels of two stacks differ by, silences it and moves no
    collapse's alert); a framework's logged KL proxy can run at 1e-4 through a whole collapse,
    which the same floor would hide (reports/study-notes.md)."""
    if not (isinstance(floor, (int, float)) and math.isfinite(floor) and floor >= 0):
        raise ValueError(f"the KL floor (--kl-floor) must be a finite number >= 0, got {floor!r}")
    out = dict(rules)
    if "kl" in out:
        out["kl"] = replace(out["kl"], floor=float(floor))
    return out


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
    kl_probe: float | None = None
    """KL(sampler ‖ trainer) of a probe of this sampler against this trainer at the same weights
    (`mismatch probe` / `qualify`'s kl_k3). The KL's growth is judged only above `probe_margin`
    times it. None: taken from the run's first record if it says it was sampled at the trainer's
    weights (`probe_from_first_step`), else no floor beyond the rule's own."""
    probe_margin: float = 5.0
    """How far above the probe a KL must be to count as more than numerics: the upper end of a
    95% interval of one training batch's KL at the probe's level. The probes' sequence-bootstrap
    intervals over 512 prompts reach 1.5× the mean (FP8, NVFP4) to 2.3× (BF16)
    (reports/probe-*.md); a batch of 16 prompts is √32 ≈ 5.7× noisier: 4× to 8.6× the mean."""
    masked_loss: bool = False
    """The run's loss masks tokens whose importance ratio leaves a band (MIS, IcePop; the
    project's arms with weight "mis"). Such a loss takes no gradient from the tokens where the
    sampler and trainer disagree most, so the KL over all sampled tokens can grow while the
    update stays within the band: the drift the update feels is the share it masks. The
    signature's drift signal is then `mis_masked_fraction` instead of `kl` (the KL still warns
    at 2× and is critical alone at 10×). The trainer sets it from its correction; `mismatch
    monitor` from a run folder's config.json, or `--masked-loss`."""
    probe_from_first_step: bool = True
    """Take `kl_probe` from the first record with a KL when it states `staleness_max` (or, without
    it, `staleness_mean`) 0: the trainer's first step samples with the weights it trains, so its
    KL is the numerics alone (train/trainer.py logs both fields)."""

    def __post_init__(self) -> None:
        unknown = [s for s in (*self.rules, *self.signature, *self.baselines) if s not in SIGNALS]
        if unknown:
            raise ValueError(f"unknown signal {unknown[0]!r}; signals: {', '.join(SIGNALS)}")
        for name in ("baseline_steps", "warning_steps", "critical_steps", "rearm_steps",
                     "max_format_errors"):
            if getattr(self, name) < 1:
                raise ValueError(f"MonitorConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.kl_probe is not None and not (isinstance(self.kl_probe, (int, float))
                                              and math.isfinite(self.kl_probe)
                                              and self.kl_probe >= 0):
            raise ValueError(f"MonitorConfig.kl_probe must be a finite number >= 0, "
                             f"got {self.kl_probe!r}")
        if not (math.isfinite(self.probe_margin) and self.probe_margin > 0):
            raise ValueError(f"MonitorConfig.probe_margin must be > 0, got {self.probe_margin}")
        if self.warmup_steps < 0 or self.corroborate_within < 0:
            raise ValueError("MonitorConfig.warmup_steps and corroborate_within must be >= 0")
        if self.masked_loss and "mis_masked_fraction" not in self.rules:
            raise ValueError("MonitorConfig.masked_loss needs a rule for mis_masked_fraction")
        for signal, value in self.baselines.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"MonitorConfig.baselines[{signal!r}] must be a finite number, "
                                 f"got {value!r}")

    def signature_signals(self) -> tuple[str, ...]:
        """The signature as judged: `signature`, with the masked share in the KL's place when
        the loss masks tokens (`masked_loss`)."""
        if not self.masked_loss:
            return self.signature
        out = tuple("mis_masked_fraction" if s == "kl" else s for s in self.signature)
        return tuple(dict.fromkeys(out))


def judge(rule: SignalRule, x: float, ref: float | None,
          floor: float | None = None) -> tuple[int, float]:
    """(level, score) of value x against its reference under `rule`; `floor` (growth) replaces
    the rule's own where higher. For a count rule x is the number of steps with a positive value
    since the signal was last clear, and ref is not needed."""
    if rule.kind == "count":
        warn, crit, score, up = rule.warning, rule.critical, x, True
    elif ref is None:
        return NORMAL, math.nan
    elif rule.kind == "share":
        warn = None if rule.warning is None else max(rule.warning, ref + rule.margin)
        crit = None if rule.critical is None else max(rule.critical, ref + rule.margin,
                                                      warn if warn is not None else 0.0)
        score = x
        up = True
    elif ref < _TINY_BASELINE:  # ratios to a zero or negative reference mean nothing
        return NORMAL, math.nan
    elif rule.kind == "drop":
        warn, crit, score, up = rule.warning, rule.critical, (ref - x) / ref, True
    else:
        warn, crit, score, up = rule.warning, rule.critical, x / ref, rule.kind == "growth"
        if up and x < max(rule.floor, floor or 0.0):
            return NORMAL, score

    def beyond(threshold: float | None) -> bool:
        return threshold is not None and (score >= threshold if up else score <= threshold)

    if beyond(crit):
        return CRITICAL, score
    if beyond(warn):
        return WARNING, score
    return NORMAL, score
