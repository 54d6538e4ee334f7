"""The study's curves: reward, KL and format-error endings over steps, one panel per fleet and
staleness (and one per fleet of on-policy controls), mean over seeds with the min–max band."""

from __future__ import annotations

from pathlib import Path

from mismatch.io import save_figure

from .cells import STUDY_FLEETS, Cell, StudyConfig, fleet_label
from .runs import WINDOW, RunSummary, cell_panels, cell_runs, trailing

__all__ = ["plot_study"]

_COLORS = {"grpo": "tab:red", "mis": "tab:orange", "sc": "tab:purple", "sc+mis": "tab:blue",
           "grpo+topp": "tab:brown", "sc+mis+topp": "tab:green"}


def plot_study(cfg: StudyConfig, runs: dict[Cell, RunSummary], folder: Path,
               stem: str) -> list[str]:
    """Write `<stem>-reward.png`, `-kl.png`, `-format.png` and (with held-out evaluations)
    `-heldout.png` into `folder` (each renamed into place only when whole); returns their
    names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = cell_panels(cfg)
    names = []
    files = {"accuracy": "reward", "kl": "kl", "format_error_rate": "format"}
    for key, title, log in (("accuracy", f"training reward ({WINDOW}-step moving average)",
                             False),
                            ("kl", "sampler–trainer KL (k3, per token)", True),
                            ("format_error_rate", "episodes ending on format errors", False)):
        fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6),
                                 squeeze=False, sharey=True)
        for ax, (fleet, k, arms) in zip(axes[0], panels):
            for arm in arms:
                rs = cell_runs(runs, fleet, k, arm)
                if not rs:
                    continue
                n = min(len(r.steps) for r in rs)
                steps = rs[0].steps[:n]
                series = [getattr(r, key)[:n] if key != "format_error_rate"
                          else trailing(getattr(r, key))[:n] for r in rs]
                mean = [sum(v) / len(v) for v in zip(*series)]
                lo = [min(v) for v in zip(*series)]
                hi = [max(v) for v in zip(*series)]
                ax.plot(steps, mean, color=_COLORS.get(arm), lw=1.6, label=arm)
                ax.fill_between(steps, lo, hi, color=_COLORS.get(arm), alpha=0.12, lw=0)
            lag = "on-policy (sync)" if k is None else f"staleness {k}"
            ax.set_title(f"{_title(fleet)}, {lag}", fontsize=9)
            ax.set_xlabel("optimizer step")
            if log:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="best")
        axes[0][0].set_ylabel(title, fontsize=9)
        fig.suptitle(f"{title}: mean over seeds, band = min–max (emulated samplers)",
                     fontsize=10)
        names.append(save_figure(fig, folder / f"{stem}-{files[key]}.png"))
    if any(r.heldout for r in runs.values()):
        names.append(_heldout_plot(cfg, runs, folder / f"{stem}-heldout.png"))
    return names


def _heldout_plot(cfg: StudyConfig, runs: dict[Cell, RunSummary], final: Path) -> str:
    """Held-out reward before, midway and after, per arm: mean over seeds, min–max bars."""
    import matplotlib.pyplot as plt

    panels = cell_panels(cfg)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6), squeeze=False,
                             sharey=True)
    points = (("base", 0), ("mid", (cfg.steps + 1) // 2), ("final", cfg.steps))
    for ax, (fleet, k, arms) in zip(axes[0], panels):
        for i, arm in enumerate(arms):
            rs = [r for r in cell_runs(runs, fleet, k, arm) if r.heldout]
            # a top-p arm: through its nucleus (solid), and from the full vocabulary (dashed)
            for suffix, style, label in (("", "-", arm),
                                         ("_full", "--", f"{arm}, full vocabulary")):
                xs, mean, lo, hi = [], [], [], []
                for key, step in points:
                    vals = [r.heldout[key + suffix] for r in rs
                            if key + suffix in r.heldout]
                    if vals:
                        xs.append(step + (i - len(arms) / 2) * cfg.steps / 80)  # side by side
                        mean.append(sum(vals) / len(vals))
                        lo.append(mean[-1] - min(vals))
                        hi.append(max(vals) - mean[-1])
                if xs:
                    ax.errorbar(xs, mean, yerr=[lo, hi], color=_COLORS.get(arm),
                                marker="o" if not suffix else "s", ls=style, lw=1.4,
                                capsize=3, label=label)
        lag = "on-policy (sync)" if k is None else f"staleness {k}"
        ax.set_title(f"{_title(fleet)}, {lag}", fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.set_xlim(-0.06 * cfg.steps, 1.06 * cfg.steps)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    axes[0][0].set_ylabel("held-out reward (64 tasks × 4, temperature 1)", fontsize=9)
    fig.suptitle("held-out reward before, midway and after: mean over seeds, bars = min–max "
                 "(emulated samplers)", fontsize=10)
    return save_figure(fig, final)


def _title(fleet: str) -> str:
    """A panel's fleet: its label and what it trains on (a preset, or the fleet file's name)."""
    return f"{fleet_label(fleet)} ({STUDY_FLEETS.get(fleet, Path(fleet).name)})"
