"""Probe outputs: results.json, report.md and plots, written atomically into one directory."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from pathlib import Path

import torch

__all__ = ["atomic_directory", "format_table", "markdown_report", "save_figure",
           "write_probe_outputs"]

_ROWS = (("kl_k3", "KL k3", "{:.3e}"), ("kl_k1", "KL k1", "{:+.3e}"),
         ("abs_logprob_diff_mean", "|Δlogp| mean", "{:.3e}"),
         ("abs_logprob_diff_p99", "|Δlogp| p99", "{:.3e}"),
         ("abs_logprob_diff_max", "|Δlogp| max", "{:.3e}"),
         ("mis_masked_fraction", "outside [0.5, 5]", "{:.4%}"),
         ("ess", "ESS", "{:.5f}"))


def _columns(summary: dict) -> list[tuple[str, dict]]:
    return [("total", summary["total"])] + list(summary["sources"].items())


def format_table(summary: dict) -> str:
    """A plain-text table of the figures (one column per source), for the terminal."""
    cols = _columns(summary)
    head = f"{'':<18}" + "".join(f"{name:>22}" for name, _ in cols)
    lines = [head]
    for key, label, fmt in _ROWS:
        lines.append(f"{label:<18}" + "".join(f"{fmt.format(c[key]):>22}" for _, c in cols))
    ci = "".join(f"{'[{:.2e}, {:.2e}]'.format(*c['kl_k3_ci95']):>22}" for _, c in cols)
    lines.append(f"{'k3 95% CI':<18}{ci}")
    return "\n".join(lines)


def markdown_report(summary: dict, command: str) -> str:
    cols = _columns(summary)
    mode = summary["mode"].upper()
    out = [f"# Probe: {summary['gpu']} {summary['dtype']} sampler vs {summary['trainer_dtype']} "
           f"trainer ({mode})", "",
           f"Command: `{command}`", "",
           f"- mode: **{summary['mode']}** — " + (
               "the sampler ran on this GPU's own kernels" if summary["mode"] == "measured" else
               "the sampler's formats and kernels were emulated on this machine's CPU"),
           f"- sampler: {summary['kernel_path']}; attention kernel family: {summary['attention']}; "
           f"KV cache: {summary['kv_cache']}",
           f"- model: {summary['model']}; prompts: {summary['prompts']}; completion tokens: "
           f"{summary['tokens']}", "",
           "| figure | " + " | ".join(name for name, _ in cols) + " |",
           "|---|" + "---:|" * len(cols)]
    for key, label, fmt in _ROWS:
        out.append(f"| {label} | " + " | ".join(fmt.format(c[key]) for _, c in cols) + " |")
    out.append("| k3 95% CI (sequence bootstrap) | " + " | ".join(
        "[{:.2e}, {:.2e}]".format(*c["kl_k3_ci95"]) for _, c in cols) + " |")
    out += ["", "Sources: `precision` = trainer vs the same teacher-forced forward with the "
            "sampler's formats; `accelerator` = that vs the full sampler (decode path, attention "
            "kernel family, GEMM accumulation). KL figures estimate KL(sampler ‖ trainer) on "
            "tokens the sampler drew.", "",
            "![log-ratio histogram](log_ratio_hist.png)", "",
            "![per-position divergence](per_position.png)", ""]
    return "\n".join(out)


def save_figure(fig, path: Path) -> str:
    """Lay out, write (110 dpi) and close one matplotlib figure; returns the file's name."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path).name


def _plots(tmp: Path, log_ratio: torch.Tensor, per_position: dict[str, list[float]],
           title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    r = log_ratio.double()
    r = r[torch.isfinite(r)]
    lim = max(float(r.abs().max()) if r.numel() else 1.0, 1e-6)
    ax.hist(r.numpy(), bins=80, range=(-lim, lim), color="#4a72b0")
    ax.set_yscale("log")
    ax.set_xlabel("log π_trainer − log μ_sampler (per token)")
    ax.set_ylabel("tokens")
    ax.set_title(title, fontsize=9)
    save_figure(fig, tmp / "log_ratio_hist.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, values in per_position.items():
        xs = [i for i, v in enumerate(values) if not math.isnan(v) and v > 0]
        ax.plot(xs, [values[i] for i in xs], label=name, lw=1.2)
    ax.set_yscale("log")
    ax.set_xlabel("completion position")
    ax.set_ylabel("mean k3")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, tmp / "per_position.png")


@contextlib.contextmanager
def atomic_directory(out: Path, *, force: bool = True):
    """Yield a fresh temporary sibling of `out` to fill; when the block succeeds it replaces
    `out` (which must not exist unless `force`), when it fails it is removed: a reader never
    sees a half-written `out`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            if not force:
                raise FileExistsError(f"{out} exists")
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_probe_outputs(out: Path, result, command: str, *, force: bool = True) -> Path:
    """Write results.json, report.md and two PNG plots into `out`, via a temporary sibling."""
    with atomic_directory(out, force=force) as tmp:
        summary = dict(result.summary, command=command)
        (tmp / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
        (tmp / "report.md").write_text(markdown_report(summary, command))
        label = "EMULATED" if summary["mode"] == "emulated" else "MEASURED"
        _plots(tmp, result.log_ratio_total, result.per_position,
               f"{summary['gpu']} {summary['dtype']} vs {summary['trainer_dtype']} trainer "
               f"({label})")
    return Path(out)
