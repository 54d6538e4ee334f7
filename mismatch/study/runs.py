"""The study's runs summarized from their logs (`summarize_run`): curves, the collapse test,
the held-out reward, and the small statistics the report and the plots share.

Definitions (every figure in the report uses them):

- accuracy: reward of the training batches (1 for a correct submit), a 5-step trailing mean;
- collapsed: that mean fell to half the mean of the first 3 steps, or below (`halved_step`);
- held-out reward: `mismatch train --eval-tasks` on tasks never trained on, at temperature 1
  under the trainer's numerics, before the first step, midway and after the last;
- KL growth: the highest 5-step KL mean over the median KL of the first 5 steps;
- intervals: 95% t-intervals over seeds for means, Clopper–Pearson for shares of runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch.probes.monitor.sinks import read_alerts
from mismatch.step_record import StepRecord

from .cells import Cell, StudyConfig

__all__ = ["RunSummary", "summarize_run", "replayed_alert", "cell_runs", "cell_panels",
           "WINDOW", "trailing", "ci95", "share_ci", "lag_label"]


WINDOW = 5
"""Steps of the trailing moving average that accuracy, halving and the end values use."""


def trailing(xs: list[float], w: int = WINDOW) -> list[float]:
    """The trailing mean over the last `w` finite values at each step (nan where none)."""
    out = []
    for i in range(len(xs)):
        part = [x for x in xs[max(0, i - w + 1):i + 1] if x is not None and math.isfinite(x)]
        out.append(sum(part) / len(part) if part else float("nan"))
    return out


def ci95(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval (nan with fewer than two values)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return float("nan"), float("nan")
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return mean, float("nan")
    from scipy import stats

    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    return mean, float(stats.t.ppf(0.975, len(vals) - 1)) * sd / math.sqrt(len(vals))


def share_ci(k: int, n: int) -> str:
    """`k/n` with its 95% Clopper–Pearson interval."""
    from scipy import stats

    lo = 0.0 if k == 0 else float(stats.beta.ppf(0.025, k, n - k + 1))
    hi = 1.0 if k == n else float(stats.beta.ppf(0.975, k + 1, n - k))
    return f"{k}/{n} [{lo:.2f}, {hi:.2f}]"


def _heldout(run: Path) -> dict[str, float]:
    """{"base", "mid", "final"} held-out reward of a run's eval.json (those it holds), and for
    a top-p run evaluated from the full vocabulary too (by the run, or afterwards by
    full_vocab.py), "base_full", "mid_full" and "final_full"."""
    path = run / "eval.json"
    if not path.exists():
        return {}
    from mismatch.train.heldout import HeldOut

    out: dict[str, float] = {}
    ev = HeldOut.from_json(json.loads(path.read_text()))
    for suffix, e in (("", ev), ("_full", ev.full_vocab)):
        for name, score in (("base", e and e.base), ("mid", e and e.mid),
                            ("final", e and e.final)):
            if score is not None:
                out[name + suffix] = score.reward
    return out


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """One run of the study, as the report and the plots compare it (module docstring: the
    definitions). Curves are per logged step; `_early` / `_end` are the first / last WINDOW
    steps; `_at_collapse` looks up to WINDOW steps past the halving (the whole run if none)."""

    steps: list[int]
    reward: list[float]
    """Training-batch reward per step."""
    kl: list[float]
    """KL k3 (sampler ‖ trainer) per step."""
    format_error_rate: list[float]
    accuracy: list[float]
    """The reward's WINDOW-step trailing mean."""
    base: float
    """Mean reward of the first 3 steps (the halving's reference)."""
    final: float
    peak: float
    kl_first: float
    kl_mean: float
    kl_early: float
    """Median KL of the first WINDOW steps."""
    kl_end: float
    kl_max: float
    """Highest WINDOW-step KL mean."""
    kl_growth: float
    kl_growth_at_collapse: float
    format_end: float
    format_max: float
    format_at_collapse: float
    format_early: float
    format_ending_step: int | None
    """First step where most episodes (WINDOW-step mean) end on format errors, ≥ 3× early."""
    halved_step: int | None
    """First step whose accuracy is half the base or below: the collapse test."""
    first_critical: int | None
    """The live monitor's first critical alert."""
    critical_alerts: int
    alert_signals: list[str]
    group_kl_first: dict[str, float]
    mis_masked_end: float
    heldout: dict[str, float]
    """base / mid / final held-out reward (and `_full` for a top-p arm's full vocabulary)."""
    records: list[dict[str, Any]]
    """metrics.jsonl as JSON objects, as the monitor replays any framework's log."""

    @property
    def last_step(self) -> int:
        """The last step the run logged."""
        return self.steps[-1]


def summarize_run(run: Path) -> RunSummary | None:
    """One run's curves and the figures the study compares (None if it logged nothing)."""
    from mismatch.train.rundir import read_metrics

    raw = read_metrics(run / "metrics.jsonl")
    if not raw:
        return None
    recs = [StepRecord.from_json(r) for r in raw]
    alerts = read_alerts(run / "alerts.jsonl")
    reward = [r.reward for r in recs]
    kl = [r.kl for r in recs]
    fmt = [r.format_error_rate for r in recs]
    acc = trailing(reward)
    base = sum(reward[:3]) / len(reward[:3])
    halved = next((recs[i].step for i, a in enumerate(acc)
                   if i >= WINDOW - 1 and a <= 0.5 * base), None)
    critical = [a for a in alerts if a.severity == "critical"]
    first_critical = min((a.step for a in critical), default=None)
    early_kl = sorted(kl[:WINDOW])[len(kl[:WINDOW]) // 2]
    end = slice(-WINDOW, None)
    kl_max = max(trailing(kl))
    # the collapse signature, judged up to 5 steps after the halving (or over the run)
    upto = len(recs) if halved is None else min(len(recs), halved + WINDOW)
    format_early = sum(fmt[:WINDOW]) / len(fmt[:WINDOW])
    # the format-error ending at any step: most episodes (5-step mean) ending on three replies
    # without a tool call, and 3× the run's first steps
    format_ending = next((recs[i].step for i, f in enumerate(trailing(fmt))
                          if i >= WINDOW - 1 and f >= max(0.5, 3 * format_early)), None)
    return RunSummary(
        steps=[r.step for r in recs], reward=reward, kl=kl,
        format_error_rate=fmt, accuracy=acc,
        base=base, final=sum(reward[end]) / len(reward[end]),
        peak=max(a for a in acc[WINDOW - 1:] or acc),
        kl_first=kl[0], kl_mean=sum(kl) / len(kl), kl_early=early_kl,
        kl_end=sum(kl[end]) / len(kl[end]), kl_max=kl_max,
        kl_growth=(kl_max / early_kl) if early_kl > 0 else float("nan"),
        kl_growth_at_collapse=(max(trailing(kl)[:upto]) / early_kl) if early_kl > 0
        else float("nan"),
        format_end=sum(fmt[end]) / len(fmt[end]), format_max=max(trailing(fmt)),
        format_at_collapse=max(trailing(fmt)[:upto]),
        format_early=format_early, format_ending_step=format_ending,
        halved_step=halved, first_critical=first_critical,
        critical_alerts=len(critical), alert_signals=sorted({a.signal for a in critical}),
        group_kl_first=recs[0].group_kl,
        mis_masked_end=sum(r.mis_masked_fraction for r in recs[end]) / len(recs[end]),
        heldout=_heldout(run),
        records=raw,
    )


def replayed_alert(records: list[dict[str, Any]],
                   known_good: list[dict[str, Any]]) -> int | None:
    """The step of the first critical alert of a monitor that replays `records` with the
    baselines a known-good run's records set (`probes.monitor.baselines_from`, what `mismatch
    monitor --baseline` does): it judges from its first smoothing window instead of after the
    run's own steps 4–13. None: no critical alert (or `known_good` too short for baselines)."""
    from mismatch.probes.monitor import CollapseMonitor, MonitorConfig, baselines_from

    baselines = baselines_from(known_good)
    if not baselines:
        return None
    monitor = CollapseMonitor(MonitorConfig(baselines=baselines))
    for rec in records:
        critical = [a.step for a in monitor.update(rec) if a.severity == "critical"]
        if critical:
            return critical[0]
    return None


def cell_runs(runs: dict[Cell, RunSummary], fleet: str, k: int | None,
              arm: str) -> list[RunSummary]:
    """The runs of one (fleet, staleness, arm) cell, by seed (k None: the on-policy control)."""
    return [runs[c] for c in sorted(runs, key=lambda c: c.seed)
            if (c.fleet, c.staleness, c.arm) == (fleet, k, arm)]


def lag_label(k: int | None) -> str:
    """A cell's staleness as the report prints it ("sync" for an on-policy control)."""
    return "sync" if k is None else str(k)


def cell_panels(cfg: StudyConfig) -> list[tuple[str, int | None, tuple[str, ...]]]:
    """(fleet, staleness, arms) of every group of cells, the controls last."""
    return ([(f, k, cfg.arms) for f in cfg.fleets for k in cfg.staleness]
            + [(f, None, cfg.sync_arms) for f in cfg.sync_fleets if cfg.sync_arms])
