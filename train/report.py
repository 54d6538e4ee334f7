"""`mismatch report DIR [DIR ...]`: the curves of one or more training runs, side by side.

Reads each run's metrics.jsonl (torn last line dropped), config.json, eval.json and
alerts.jsonl; writes report.md plus curves.png (reward, KL, format-error share, MIS-masked
fraction, SC tail ratio, entropy, staleness, tokens/s against the step) and group_kl.png (the KL
of each sampler group, one panel per run) into a fresh directory
(written to a temporary sibling, then renamed). Noisy per-step signals are drawn raw (thin) with
a centered moving average (thick).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch.io import atomic_directory, save_figure
from mismatch.probes.monitor.signals import Alert
from mismatch.probes.monitor.sinks import read_alerts
from mismatch.step_record import StepRecord, read_steps

from .heldout import HeldOut

__all__ = ["write_report", "load_run", "RunLog", "PANELS"]

PANELS = (
    ("reward", "training reward (batch mean)", False),
    ("kl", "sampler–trainer KL (k3, per token)", True),
    ("format_error_rate", "episodes ending on format errors", False),
    ("mis_masked_fraction", "tokens outside the MIS range [0.5, 5]", False),
    ("sc_tail_ratio", "SC tail ratio ρ", False),
    ("entropy", "trainer entropy (nats/token)", False),
    ("staleness_mean", "staleness of consumed tokens (steps)", False),
    ("tokens_per_s", "sampled tokens consumed per second", False),
    ("queue_depth", "finished units queued when the trainer took its batch", False),
    ("trainer_idle_share", "share of the step the trainer waited for samples", False),
)
"""(StepRecord field, title, log scale) of each panel."""
_SMOOTH = 10


@dataclass(frozen=True)
class RunLog:
    """What a run directory holds for its report: steps, held-out evaluation, alerts."""

    path: Path
    steps: list[StepRecord]
    heldout: HeldOut
    alerts: list[Alert]
    label: str
    """The run's correction arm and directory name."""


def load_run(path: Path) -> RunLog:
    """A `mismatch train` run directory's log; a ValueError that says what is wrong if it is
    not one or is damaged."""
    path = Path(path)
    steps = read_steps(path / "metrics.jsonl")
    if not steps:
        raise ValueError(f"{path} has no metrics.jsonl records; is it a `mismatch train` run "
                         "directory?")
    cfg = _json(path / "config.json")
    return RunLog(path=path, steps=steps, heldout=HeldOut.from_json(_json(path / "eval.json")),
                  alerts=read_alerts(path / "alerts.jsonl"),
                  label=f"{cfg.get('correction', path.name)} ({path.name})")


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg}); the run directory is damaged") \
            from exc


def _smooth(ys: list[float], k: int = _SMOOTH) -> list[float]:
    out = []
    for i in range(len(ys)):
        window = [y for y in ys[max(0, i - k // 2):i + k // 2 + 1] if y is not None
                  and math.isfinite(y)]
        out.append(sum(window) / len(window) if window else float("nan"))
    return out


def _mean(values) -> float:
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else float("nan")


def summary_rows(runs: list[RunLog], window: int = 20) -> list[list[str]]:
    """One row per run: first/last `window` steps' means and the held-out evaluation."""
    rows = []
    for r in runs:
        first, last = r.steps[:window], r.steps[-window:]
        rows.append([
            r.label, str(r.steps[-1].step),
            f"{_mean(s.reward for s in first):.3f} → {_mean(s.reward for s in last):.3f}",
            _heldout(r.heldout),
            f"{_mean(s.kl for s in first):.2e} → {_mean(s.kl for s in last):.2e}",
            f"{_mean(s.format_error_rate for s in first):.3f} → "
            f"{_mean(s.format_error_rate for s in last):.3f}",
            f"{_mean(s.mis_masked_fraction for s in last):.4f}",
            f"{_mean(s.staleness_mean for s in r.steps):.2f}",
            str(len(r.alerts)),
        ])
    return rows


def _heldout(held: HeldOut) -> str:
    """base → final held-out reward; a top-p arm's also from the full vocabulary."""
    if not held.complete:
        return "—"
    out = f"{held.base.reward:.3f} → {held.final.reward:.3f}"
    full = held.full_vocab
    if full is not None and full.complete:
        out += f" (full vocabulary: {full.base.reward:.3f} → {full.final.reward:.3f})"
    return out


def _per_group(plt, runs: list[RunLog], per_group, title: str, log: bool, path: Path):
    """One panel per run: the per-group signal `per_group(step)` ({group: value}) against the
    step."""
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 3.8), squeeze=False,
                             sharey=True)
    for ax, r in zip(axes[0], runs):
        names = sorted({g for row in r.steps for g in per_group(row) or {}})
        for g in names:
            pts = [(row.step, per_group(row)[g]) for row in r.steps
                   if isinstance((per_group(row) or {}).get(g), (int, float))]
            ax.plot([x for x, _ in pts], _smooth([y for _, y in pts]), lw=1.4, marker="o",
                    ms=2.5, label=g)
        if log:
            ax.set_yscale("log")
        ax.set_title(f"{title} — {r.label}", fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    return save_figure(fig, path)


def _staleness(plt, runs: list[RunLog], path: Path):
    """Tokens consumed at each staleness (steps), summed over the run, one bar group per run."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(runs)
    for k, r in enumerate(runs):
        total: dict[int, int] = {}
        for row in r.steps:
            for lag, n in (row.staleness_tokens or {}).items():
                total[int(lag)] = total.get(int(lag), 0) + int(n)
        lags = sorted(total)
        all_tokens = sum(total.values()) or 1
        ax.bar([x + (k - (len(runs) - 1) / 2) * width for x in lags],
               [total[x] / all_tokens for x in lags],
               width=width, label=r.label)
    ax.set_xlabel("staleness (optimizer steps)")
    ax.set_ylabel("share of consumed tokens")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, path)


def write_report(dirs: list[Path], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [load_run(d) for d in dirs]
    with atomic_directory(Path(out)) as tmp:
        fig, axes = plt.subplots(math.ceil(len(PANELS) / 2), 2, figsize=(11, 14.5),
                                 sharex=True)
        for ax, (key, title, log) in zip(axes.flat, PANELS):
            for r in runs:
                xs = [row.step for row in r.steps]
                ys = [getattr(row, key) for row in r.steps]
                ys = [y if isinstance(y, (int, float)) else float("nan") for y in ys]
                line, = ax.plot(xs, ys, lw=0.6, alpha=0.35)
                ax.plot(xs, _smooth(ys), lw=1.8, color=line.get_color(), label=r.label)
            ax.set_title(title, fontsize=10)
            if log:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        for ax in axes[-1]:
            ax.set_xlabel("optimizer step")
        axes.flat[0].legend(fontsize=8)
        fig.suptitle("training curves (emulated sampler fleet; thin: per step, thick: "
                     f"{_SMOOTH}-step moving average)", fontsize=11)
        png = save_figure(fig, tmp / "curves.png")
        group_png = _per_group(plt, runs, lambda s: s.group_kl, "KL per sampler group", True,
                               tmp / "group_kl.png")
        speed_png = _per_group(plt, runs, lambda s: s.group_tokens_per_s,
                               "sampled tokens/s per group", False, tmp / "group_tokens_per_s.png")
        stale_png = _staleness(plt, runs, tmp / "staleness.png")
        head = ["run", "steps", "reward (first 20 → last 20)", "held-out reward (base → final)",
                "KL k3 (first 20 → last 20)", "format-error share", "MIS-masked (last 20)",
                "staleness (mean)", "alerts"]
        lines = ["# Training report", "", "Sampler numerics are emulated (bit-exact formats on "
                 "CPU); the trainer's are BF16.", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in summary_rows(runs)]
        lines += ["", f"![curves]({png})", "", "KL per sampler group (emulated numerics, "
                  f"{_SMOOTH}-step moving average over the steps that group served):", "",
                  f"![group KL]({group_png})", "",
                  "Sampling throughput of each group (tokens over the seconds its samplers "
                  "spent on them; emulated numerics on CPU):", "", f"![group speed]({speed_png})",
                  "", "Staleness of every consumed token over the run:", "",
                  f"![staleness]({stale_png})", ""]
        faults = [(r.label, r.steps[-1]) for r in runs if r.steps[-1].sampler_restarts]
        for label, last in faults:
            lines.append(f"{label}: {last.sampler_restarts} sampler restart(s), "
                         f"{last.requeued_units} unit(s) sampled again.")
        if faults:
            lines.append("")
        for r in runs:
            if r.alerts:
                lines.append(f"Alerts of {r.label}:")
                lines += [f"- step {a.step}: {a.severity} on {a.signal} — {a.message}"
                          for a in r.alerts]
                lines.append("")
        (tmp / "report.md").write_text("\n".join(lines))
    return Path(out) / "report.md"
