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
from pathlib import Path
from typing import Any

from mismatch.report import atomic_directory, save_figure

from .trainer import read_metrics

__all__ = ["write_report", "load_run", "PANELS"]

PANELS = (
    ("reward", "training reward (batch mean)", False),
    ("kl", "sampler–trainer KL (k3, per token)", True),
    ("format_error_rate", "episodes ending on format errors", False),
    ("mis_masked_fraction", "tokens outside the MIS range [0.5, 5]", False),
    ("sc_tail_ratio", "SC tail ratio ρ", False),
    ("entropy", "trainer entropy (nats/token)", False),
    ("staleness_mean", "staleness of consumed tokens (steps)", False),
    ("tokens_per_s", "sampled tokens consumed per second", False),
)
"""(metrics key, title, log scale) of each panel."""
_SMOOTH = 10


def load_run(path: Path) -> dict[str, Any]:
    path = Path(path)
    metrics = read_metrics(path / "metrics.jsonl")
    if not metrics:
        raise ValueError(f"{path} has no metrics.jsonl records; is it a `mismatch train` run "
                         "directory?")
    cfg = _json(path / "config.json")
    return {"path": path, "metrics": metrics, "config": cfg, "eval": _json(path / "eval.json"),
            "alerts": read_metrics(path / "alerts.jsonl"),
            "label": f"{cfg.get('correction', path.name)} ({path.name})"}


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


def _mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(vals) / len(vals) if vals else float("nan")


def summary_rows(runs: list[dict[str, Any]], window: int = 20) -> list[list[str]]:
    """One row per run: first/last `window` steps' means and the held-out evaluation."""
    rows = []
    for r in runs:
        m = r["metrics"]
        first, last = m[:window], m[-window:]
        ev = r["eval"]
        rows.append([
            r["label"], str(m[-1]["step"]),
            f"{_mean(first, 'reward'):.3f} → {_mean(last, 'reward'):.3f}",
            f"{ev['base']['reward']:.3f} → {ev['final']['reward']:.3f}"
            if "base" in ev and "final" in ev else "—",
            f"{_mean(first, 'kl'):.2e} → {_mean(last, 'kl'):.2e}",
            f"{_mean(first, 'format_error_rate'):.3f} → {_mean(last, 'format_error_rate'):.3f}",
            f"{_mean(last, 'mis_masked_fraction'):.4f}",
            f"{_mean(m, 'staleness_mean'):.2f}",
            str(len(r["alerts"])),
        ])
    return rows


def write_report(dirs: list[Path], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [load_run(d) for d in dirs]
    with atomic_directory(Path(out)) as tmp:
        fig, axes = plt.subplots(4, 2, figsize=(11, 12), sharex=True)
        for ax, (key, title, log) in zip(axes.flat, PANELS):
            for r in runs:
                xs = [row["step"] for row in r["metrics"]]
                ys = [row.get(key) for row in r["metrics"]]
                ys = [y if isinstance(y, (int, float)) else float("nan") for y in ys]
                line, = ax.plot(xs, ys, lw=0.6, alpha=0.35)
                ax.plot(xs, _smooth(ys), lw=1.8, color=line.get_color(), label=r["label"])
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
        fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 3.8), squeeze=False,
                                 sharey=True)
        for ax, r in zip(axes[0], runs):
            names = sorted({g for row in r["metrics"] for g in row.get("group_kl", {})})
            for g in names:
                xs = [row["step"] for row in r["metrics"] if g in row.get("group_kl", {})]
                ys = [row["group_kl"][g] for row in r["metrics"] if g in row.get("group_kl", {})]
                ax.plot(xs, _smooth(ys), lw=1.4, label=g)
            ax.set_yscale("log")
            ax.set_title(f"KL per sampler group — {r['label']}", fontsize=9)
            ax.set_xlabel("optimizer step")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        group_png = save_figure(fig, tmp / "group_kl.png")
        head = ["run", "steps", "reward (first 20 → last 20)", "held-out reward (base → final)",
                "KL k3 (first 20 → last 20)", "format-error share", "MIS-masked (last 20)",
                "staleness (mean)", "alerts"]
        lines = ["# Training report", "", "Sampler numerics are emulated (bit-exact formats on "
                 "CPU); the trainer's are BF16.", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in summary_rows(runs)]
        lines += ["", f"![curves]({png})", "", "KL per sampler group (emulated numerics, "
                  f"{_SMOOTH}-step moving average over the steps that group served):", "",
                  f"![group KL]({group_png})", ""]
        for r in runs:
            if r["alerts"]:
                lines.append(f"Alerts of {r['label']}:")
                lines += [f"- step {a['step']}: {a.get('severity')} on {a.get('signal')} — "
                          f"{a.get('message', '')}" for a in r["alerts"]]
                lines.append("")
        (tmp / "report.md").write_text("\n".join(lines))
    return Path(out) / "report.md"
