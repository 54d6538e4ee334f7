"""Outputs of `mismatch probe --sources ... [--ladder]`: results.json, report.md and plots.

Plots (written only where the data exists): per-source KL bars with 95% intervals, per-source
log-ratio histograms, MoE routing flips per layer, KL against staleness, and the ladder's
waterfall. Everything is written into a temporary sibling directory and renamed into place.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

__all__ = ["write_sources_outputs", "sources_markdown", "format_sources_table"]

_HEADLINE = (("kl_exact", "KL exact", "{:.3e}"), ("kl_k3", "KL k3", "{:.3e}"),
             ("abs_logprob_diff_mean", "|Δlogp| mean", "{:.2e}"),
             ("mis_masked_fraction", "outside [0.5, 5]", "{:.3%}"), ("tokens", "tokens", "{}"))


def _fmt(fmt: str, value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return fmt.format(value)


def _ci(s: dict, key: str = "kl_exact_ci95") -> str:
    lo, hi = s.get(key, (math.nan, math.nan))
    return "–" if math.isnan(lo) else f"[{lo:.2e}, {hi:.2e}]"


def _columns(summary: dict) -> list[tuple[str, dict]]:
    cols = [("total", summary["total"])]
    cols += [(n, s) for n, s in summary["sources"].items() if "kl_exact" in s or "kl_k3" in s]
    return cols


def format_sources_table(summary: dict) -> str:
    """One row per source (headline comparison) for the terminal."""
    lines = [f"{'source':<16}{'KL exact':>12}{'95% CI':>24}{'KL k3':>12}{'|Δlogp|':>11}"
             f"{'tokens':>8}"]
    for name, s in _columns(summary):
        lines.append(f"{name:<16}{_fmt('{:.3e}', s.get('kl_exact')):>12}{_ci(s):>24}"
                     f"{_fmt('{:.3e}', s.get('kl_k3')):>12}"
                     f"{_fmt('{:.2e}', s.get('abs_logprob_diff_mean')):>11}"
                     f"{_fmt('{}', s.get('tokens')):>8}")
    for name, s in summary["sources"].items():
        if not s.get("applies", True):
            lines.append(f"{name:<16}does not apply: {' '.join(s.get('notes', []))}")
    if "ladder" in summary:
        lad = summary["ladder"]
        lines.append("ladder: " + "  ".join(f"{r['rung']} {r['kl_exact']:.2e} "
                                            f"(+{r['increment']:.2e})" for r in lad["rungs"])
                     + f"  interaction {lad['interaction']:+.2e}")
    return "\n".join(lines)


def _parts_table(parts: dict[str, dict]) -> list[str]:
    out = ["| configuration | " + " | ".join(label for _, label, _ in _HEADLINE)
           + " | KL exact 95% CI |", "|---|" + "---:|" * len(_HEADLINE) + "---|"]
    for name, s in parts.items():
        cells = [_fmt(fmt, s.get(key)) for key, _, fmt in _HEADLINE]
        flag = "" if s.get("ci_target_met", True) else " ⚠"
        out.append(f"| {name} | " + " | ".join(cells) + f" | {_ci(s)}{flag} |")
    return out


def _scalar_lines(extra: dict) -> list[str]:
    out = []
    for key, value in extra.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            continue
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        out.append(f"- `{key}`: {text}")
    return out


def sources_markdown(summary: dict, command: str, plots: list[str]) -> str:
    s = summary
    out = [f"# Mismatch by source: {s['gpu']} {s['dtype']} sampler vs {s['trainer_dtype']} "
           f"trainer (EMULATED)", "",
           f"Command: `{command}`", "",
           "- mode: **emulated** — formats and kernels emulated on this machine's CPU",
           f"- sampler: {s['kernel_path']}; attention family {s['attention']}; KV cache "
           f"{s['kv_cache']}; trainer: {s['trainer_dtype']} on {s['trainer_gpu']}",
           f"- model: {s['model']}; prompts: {s['prompts']}; completion tokens: {s['tokens']}",
           "- KL exact = full-vocabulary KL(sampler ‖ trainer) per sampled position; k3 = the "
           "sampled estimator; intervals: 95% bootstrap over sequences. ⚠ marks a figure above "
           "the noise floor (1e-7) whose interval half-width is over 20% of its value.", "",
           "## Per source (headline comparison)", ""]
    out += _parts_table(dict(_columns(s)))
    if "source_kl.png" in plots:
        out += ["", "![KL per source](source_kl.png)"]
    if "ladder" in s:
        lad = s["ladder"]
        out += ["", "## Ladder", "", "| rung | KL exact | increment | 95% CI |", "|---|---:|---:|---|"]
        for r in lad["rungs"]:
            out.append(f"| {r['rung']} | {r['kl_exact']:.3e} | {r['increment']:+.3e} | "
                       f"{_ci(r)} |")
        out += ["", "| alone | KL exact |", "|---|---:|"]
        out += [f"| {k} | {v:.3e} |" for k, v in lad["alone"].items()]
        out += ["", f"Interaction (total − Σ alone): {lad['interaction']:+.3e} "
                f"({lad['interaction_fraction']:+.0%} of the total).", ""]
        out += [f"- {n}" for n in lad.get("notes", [])]
        if "ladder.png" in plots:
            out += ["", "![ladder](ladder.png)"]
    for name, src in s["sources"].items():
        out += ["", f"## {name}", ""]
        out += [f"- {n}" for n in src.get("notes", [])]
        if not src.get("applies", True):
            continue
        scalars = _scalar_lines({k: v for k, v in src.items() if k not in
                                 dict((h[0], 0) for h in _HEADLINE) and not k.startswith("kl_k")
                                 and k not in ("abs_logprob_diff_p99", "abs_logprob_diff_max",
                                               "ratio_mean", "ess", "kl_exact_ci_rel",
                                               "applies", "kl_exact")})
        if scalars:
            out += [""] + scalars
        if src.get("parts"):
            out += [""] + _parts_table(src["parts"])
        for plot in (f"{name}.png",):
            if plot in plots:
                out += ["", f"![{name}]({plot})"]
    if "log_ratio_hist.png" in plots:
        out += ["", "## Log-ratio histograms", "", "![log-ratio histograms](log_ratio_hist.png)"]
    return "\n".join(out) + "\n"


def _plots(tmp: Path, run) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = run.summary
    label = f"{s['gpu']} {s['dtype']} vs {s['trainer_dtype']} trainer (EMULATED)"
    made: list[str] = []

    cols = [(n, c) for n, c in _columns(s) if c.get("kl_exact") is not None]
    if cols:
        fig, ax = plt.subplots(figsize=(6.5, 3.5))
        vals = [max(c["kl_exact"], 1e-12) for _, c in cols]
        lo = [max(v - max(c["kl_exact_ci95"][0], 1e-12), 0) for v, (_, c) in zip(vals, cols)]
        hi = [max(c["kl_exact_ci95"][1] - v, 0) for v, (_, c) in zip(vals, cols)]
        ax.bar(range(len(cols)), vals, yerr=[lo, hi], capsize=3, color="#4a72b0")
        ax.set_xticks(range(len(cols)), [n for n, _ in cols], rotation=30, ha="right",
                      fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("KL exact (nats/token)")
        ax.set_title(label, fontsize=9)
        fig.tight_layout()
        fig.savefig(tmp / "source_kl.png", dpi=110)
        plt.close(fig)
        made.append("source_kl.png")

    hists = [("total", run.log_ratio_total)] + [
        (n, r.log_ratio) for n, r in run.results.items()
        if r.log_ratio is not None and r.log_ratio.numel()]
    if hists:
        k = len(hists)
        ncol = min(3, k)
        nrow = math.ceil(k / ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(3.2 * ncol, 2.4 * nrow), squeeze=False)
        for ax, (name, r) in zip(axes.flat, hists):
            r = r.double()
            r = r[r.isfinite()]
            lim = max(float(r.abs().max()) if r.numel() else 1.0, 1e-6)
            ax.hist(r.numpy(), bins=60, range=(-lim, lim), color="#4a72b0")
            ax.set_yscale("log")
            ax.set_title(name, fontsize=8)
            ax.tick_params(labelsize=7)
        for ax in list(axes.flat)[k:]:
            ax.axis("off")
        fig.suptitle(f"log π_trainer − log μ_sampler per token — {label}", fontsize=8)
        fig.tight_layout()
        fig.savefig(tmp / "log_ratio_hist.png", dpi=110)
        plt.close(fig)
        made.append("log_ratio_hist.png")

    routing = s["sources"].get("routing", {})
    if routing.get("flip_rate_by_layer"):
        rates = routing["flip_rate_by_layer"]
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar(range(len(rates)), rates, color="#b0704a")
        ax.axhline(routing["flip_rate_any_layer"], ls="--", color="k", lw=1,
                   label=f"any layer: {routing['flip_rate_any_layer']:.1%}")
        ax.set_xlabel("MoE layer")
        ax.set_ylabel("share of positions with a flip")
        ax.legend(fontsize=8)
        ax.set_title(f"routing flips — {label}", fontsize=8)
        fig.tight_layout()
        fig.savefig(tmp / "routing.png", dpi=110)
        plt.close(fig)
        made.append("routing.png")

    stale = s["sources"].get("staleness", {})
    if stale.get("kl_exact_by_lag"):
        lags = sorted(int(k) for k in stale["kl_exact_by_lag"])
        ys = [stale["kl_exact_by_lag"][str(k)] for k in lags]
        cis = stale.get("kl_exact_ci95_by_lag", {})
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.plot(lags, ys, "o-", color="#4a72b0", label="KL exact")
        if cis:
            ax.fill_between(lags, [cis[str(k)][0] for k in lags], [cis[str(k)][1] for k in lags],
                            alpha=0.25, color="#4a72b0", label="95% CI")
        if stale.get("kl_k3_by_lag"):
            ax.plot(lags, [stale["kl_k3_by_lag"][str(k)] for k in lags], "s--", ms=3,
                    color="#b0704a", label="KL k3")
        ax.set_yscale("symlog", linthresh=1e-8)
        ax.set_xlabel("staleness k (optimizer steps behind)")
        ax.set_ylabel("KL (nats/token)")
        ax.legend(fontsize=8)
        ax.set_title(f"staleness — {s['model']} (EMULATED)", fontsize=8)
        fig.tight_layout()
        fig.savefig(tmp / "staleness.png", dpi=110)
        plt.close(fig)
        made.append("staleness.png")

    if "ladder" in s:
        rungs = s["ladder"]["rungs"]
        fig, ax = plt.subplots(figsize=(5.5, 3.2))
        bottom = 0.0
        for i, r in enumerate(rungs):
            inc = r["increment"]
            ax.bar(i, inc, bottom=bottom if inc >= 0 else bottom + inc,
                   color="#4a72b0" if inc >= 0 else "#b04a4a")
            bottom += inc
        ax.bar(len(rungs), bottom, color="#333333")
        lo, hi = rungs[-1]["kl_exact_ci95"]
        ax.errorbar(len(rungs), bottom, yerr=[[max(bottom - lo, 0)], [max(hi - bottom, 0)]],
                    color="k", capsize=3)
        ax.set_xticks(range(len(rungs) + 1), [r["rung"] for r in rungs] + ["total"],
                      fontsize=8, rotation=15)
        ax.set_ylabel("KL exact (nats/token)")
        ax.set_title(f"ladder — {label}", fontsize=8)
        fig.tight_layout()
        fig.savefig(tmp / "ladder.png", dpi=110)
        plt.close(fig)
        made.append("ladder.png")
    return made


def write_sources_outputs(out: Path, run, command: str) -> Path:
    """results.json, report.md and plots into `out`, via a temporary sibling."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        summary = dict(run.summary, command=command)
        (tmp / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
        plots = _plots(tmp, run)
        (tmp / "report.md").write_text(sources_markdown(summary, command, plots))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
