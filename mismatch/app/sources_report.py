"""Outputs of `mismatch probe --sources ... [--ladder]`: results.json, report.md and plots.

Plots (written only where the data exists): per-source KL bars with 95% intervals, per-source
log-ratio histograms, MoE routing flips per layer, KL against staleness, and the ladder's
waterfall. Everything is written into a temporary sibling directory and renamed into place.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from mismatch.probes.base import SourceResult
from mismatch.probes.kl_summary import KLSummary
from mismatch.probes.source_figures import (AcceleratorFigures, LadderFigures, RoutingFlips,
                                            StalenessByLag)
from mismatch.probes.summary import Figures, ProbeSummary, as_record

from .literature import literature_checks

__all__ = ["fleet_markdown", "fleet_plot", "format_sources_table", "literature_checks",
           "sources_markdown", "write_sources_outputs"]

_HEADLINE = (("kl_exact", "KL exact", "{:.3e}"), ("kl_k3", "KL k3", "{:.3e}"),
             ("abs_logprob_diff_mean", "|Δlogp| mean", "{:.2e}"),
             ("mis_masked_fraction", "outside [0.5, 5]", "{:.3%}"), ("tokens", "tokens", "{}"))


def _fmt(fmt: str, value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return fmt.format(value)


def _ci(interval: list[float] | None) -> str:
    lo, hi = interval if interval is not None else (math.nan, math.nan)
    return "–" if math.isnan(lo) else f"[{lo:.2e}, {hi:.2e}]"


def _columns(summary: ProbeSummary | dict) -> list[tuple[str, KLSummary]]:
    return [(n, s) for n, s in Figures.of(summary).columns
            if s.kl_exact is not None or s.kl_k3 is not None]


def _not_applying(s: ProbeSummary) -> list[tuple[str, SourceResult]]:
    return [(n, r) for n, r in s.sources.items()
            if isinstance(r, SourceResult) and not r.applies]


def format_sources_table(summary: ProbeSummary | dict) -> str:
    """One row per source (headline comparison) for the terminal."""
    rec = as_record(summary)
    lines = [f"{'source':<16}{'KL exact':>12}{'95% CI':>24}{'KL k3':>12}{'|Δlogp|':>11}"
             f"{'tokens':>8}"]
    for name, s in _columns(rec):
        lines.append(f"{name:<16}{_fmt('{:.3e}', s.kl_exact):>12}{_ci(s.kl_exact_ci95):>24}"
                     f"{_fmt('{:.3e}', s.kl_k3):>12}"
                     f"{_fmt('{:.2e}', s.abs_logprob_diff_mean):>11}"
                     f"{_fmt('{}', s.tokens):>8}")
    for name, r in _not_applying(rec):
        lines.append(f"{name:<16}does not apply: {' '.join(r.notes)}")
    lad = LadderFigures.of(rec.ladder)
    if lad is not None:
        lines.append("ladder: " + "  ".join(f"{r.rung} {r.kl_exact:.2e} "
                                            f"(+{r.increment:.2e})" for r in lad.rungs)
                     + f"  interaction {lad.interaction:+.2e}")
    return "\n".join(lines)


def _parts_table(parts: dict[str, KLSummary]) -> list[str]:
    out = ["| configuration | " + " | ".join(label for _, label, _ in _HEADLINE)
           + " | KL exact 95% CI |", "|---|" + "---:|" * len(_HEADLINE) + "---|"]
    for name, s in parts.items():
        cells = [_fmt(fmt, s.figure(key)) for key, _, fmt in _HEADLINE]
        flag = " ⚠" if s.ci_target_met is False else ""
        out.append(f"| {name} | " + " | ".join(cells) + f" | {_ci(s.kl_exact_ci95)}{flag} |")
    return out


def _scalar_lines(extra: dict) -> list[str]:
    out = []
    for key, value in extra.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            continue
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        out.append(f"- `{key}`: {text}")
    return out


_NOT_LISTED = ({h[0] for h in _HEADLINE} | {"abs_logprob_diff_p99", "abs_logprob_diff_max",
                                            "ratio_mean", "ess", "kl_exact_ci_rel", "applies"})
"""A source's figures its section does not list (the table above, or the intervals' parts)."""


def _source_section(name: str, src: KLSummary | SourceResult, plots: list[str]) -> list[str]:
    result = src if isinstance(src, SourceResult) else SourceResult(name=name, headline=src)
    out = ["", f"## {name}", ""] + [f"- {n}" for n in result.notes]
    if not result.applies:
        return out
    # every figure in results.json's order: the headline's, then the source's own
    scalars = _scalar_lines({k: v for k, v in result.to_json().items()
                             if k not in _NOT_LISTED and not k.startswith("kl_k")})
    if scalars:
        out += [""] + scalars
    if result.parts:
        out += [""] + _parts_table(result.parts)
    if f"{name}.png" in plots:
        out += ["", f"![{name}]({name}.png)"]
    return out


def sources_markdown(summary: ProbeSummary | dict, command: str, plots: list[str]) -> str:
    s = as_record(summary)
    out = [f"# Mismatch by source: {s.gpu} {s.dtype} sampler vs {s.trainer_dtype} "
           f"trainer (EMULATED)", "",
           f"Command: `{command}`", "",
           "- mode: **emulated** — formats and kernels emulated on this machine's CPU",
           f"- sampler: {s.kernel_path}; attention family {s.attention}; KV cache "
           f"{s.kv_cache}; trainer: {s.trainer_dtype} on {s.trainer_gpu}",
           f"- model: {s.model}; prompts: {s.prompts}; completion tokens: {s.tokens}",
           "- KL exact = full-vocabulary KL(sampler ‖ trainer) per sampled position; k3 = the "
           "sampled estimator; intervals: 95% bootstrap over sequences. ⚠ marks a figure above "
           "the noise floor (1e-7) whose interval half-width is over 20% of its value.", ""]
    ci = s.ci_target
    if ci is not None and ci.target:
        out[-1:] = [f"- --ci-target {ci.target:g}: " + (
            "met by every headline" if ci.met else
            f"not met within --max-prompts for: {', '.join(ci.unmet)}"), ""]
    out += ["## Per source (headline comparison)", ""]
    out += _parts_table(dict(_columns(s)))
    if "source_kl.png" in plots:
        out += ["", "![KL per source](source_kl.png)"]
    lad = LadderFigures.of(s.ladder)
    if s.ladder is not None and lad is not None:
        out += ["", "## Ladder", "", "| rung | KL exact | increment | 95% CI |",
                "|---|---:|---:|---|"]
        for r in lad.rungs:
            out.append(f"| {r.rung} | {r.kl_exact:.3e} | {r.increment:+.3e} | "
                       f"{_ci(r.kl_exact_ci95)} |")
        out += ["", "| alone | KL exact |", "|---|---:|"]
        out += [f"| {k} | {v:.3e} |" for k, v in lad.alone.items()]
        out += ["", f"Interaction (total − Σ alone): {lad.interaction:+.3e} "
                f"({lad.interaction_fraction:+.0%} of the total).", ""]
        out += [f"- {n}" for n in s.ladder.notes]
        if "ladder.png" in plots:
            out += ["", "![ladder](ladder.png)"]
    for name, src in s.sources.items():
        out += _source_section(name, src, plots)
    checks = literature_checks(s)
    if checks:
        out += ["", "## Against the literature", "",
                "| source | published | here | holds | why not |", "|---|---|---|:-:|---|"]
        out += [f"| {c.source} | {c.published} | {c.ours} | "
                f"{'yes' if c.holds else 'no'} | {c.why} |" for c in checks]
    if "log_ratio_hist.png" in plots:
        out += ["", "## Log-ratio histograms", "", "![log-ratio histograms](log_ratio_hist.png)"]
    return "\n".join(out) + "\n"


def _plots(tmp: Path, run) -> list[str]:
    from mismatch.io import save_figure
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s: ProbeSummary = run.record
    label = f"{s.gpu} {s.dtype} vs {s.trainer_dtype} trainer (EMULATED)"
    made: list[str] = []

    cols = [(n, c) for n, c in _columns(s) if c.kl_exact is not None]
    if cols:
        fig, ax = plt.subplots(figsize=(6.5, 3.5))
        vals = [max(c.kl_exact, 1e-12) for _, c in cols]
        lo = [max(v - max(c.kl_exact_ci95[0], 1e-12), 0) for v, (_, c) in zip(vals, cols)]
        hi = [max(c.kl_exact_ci95[1] - v, 0) for v, (_, c) in zip(vals, cols)]
        ax.bar(range(len(cols)), vals, yerr=[lo, hi], capsize=3, color="#4a72b0")
        ax.set_xticks(range(len(cols)), [n for n, _ in cols], rotation=30, ha="right",
                      fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("KL exact (nats/token)")
        ax.set_title(label, fontsize=9)
        made.append(save_figure(fig, tmp / "source_kl.png"))

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
        made.append(save_figure(fig, tmp / "log_ratio_hist.png"))

    routing = RoutingFlips.of(s.sources.get("routing"))
    if routing is not None and routing.flip_rate_by_layer:
        rates = routing.flip_rate_by_layer
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar(range(len(rates)), rates, color="#b0704a")
        ax.axhline(routing.flip_rate_any_layer, ls="--", color="k", lw=1,
                   label=f"any layer: {routing.flip_rate_any_layer:.1%}")
        ax.set_xlabel("MoE layer")
        ax.set_ylabel("share of positions with a flip")
        ax.legend(fontsize=8)
        ax.set_title(f"routing flips — {label}", fontsize=8)
        made.append(save_figure(fig, tmp / "routing.png"))

    stale = StalenessByLag.of(s.sources.get("staleness"))
    if stale is not None and stale.kl_exact_by_lag:
        lags = stale.lags
        ys = [stale.kl_exact_at(k) for k in lags]
        cis = stale.kl_exact_ci95_by_lag
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.plot(lags, ys, "o-", color="#4a72b0", label="KL exact")
        if cis:
            ax.fill_between(lags, [cis[str(k)][0] for k in lags], [cis[str(k)][1] for k in lags],
                            alpha=0.25, color="#4a72b0", label="95% CI")
        if stale.kl_k3_by_lag:
            ax.plot(lags, [stale.kl_k3_by_lag[str(k)] for k in lags], "s--", ms=3,
                    color="#b0704a", label="KL k3")
        ax.set_yscale("symlog", linthresh=1e-8)
        ax.set_xlabel("staleness k (optimizer steps behind)")
        ax.set_ylabel("KL (nats/token)")
        ax.legend(fontsize=8)
        ax.set_title(f"staleness — {s.model} (EMULATED)", fontsize=8)
        made.append(save_figure(fig, tmp / "staleness.png"))

    ladder = LadderFigures.of(s.ladder)
    if ladder is not None:
        rungs = ladder.rungs
        fig, ax = plt.subplots(figsize=(5.5, 3.2))
        bottom = 0.0
        for i, r in enumerate(rungs):
            inc = r.increment
            ax.bar(i, inc, bottom=bottom if inc >= 0 else bottom + inc,
                   color="#4a72b0" if inc >= 0 else "#b04a4a")
            bottom += inc
        ax.bar(len(rungs), bottom, color="#333333")
        lo, hi = rungs[-1].kl_exact_ci95
        ax.errorbar(len(rungs), bottom, yerr=[[max(bottom - lo, 0)], [max(hi - bottom, 0)]],
                    color="k", capsize=3)
        ax.set_xticks(range(len(rungs) + 1), [r.rung for r in rungs] + ["total"],
                      fontsize=8, rotation=15)
        ax.set_ylabel("KL exact (nats/token)")
        ax.set_title(f"ladder — {label}", fontsize=8)
        made.append(save_figure(fig, tmp / "ladder.png"))
    return made


def write_sources_outputs(out: Path, run, command: str) -> Path:
    """results.json, report.md and plots into `out`, via a temporary sibling."""
    from mismatch.io import atomic_directory, mark_output

    with atomic_directory(out) as tmp:
        mark_output(tmp, "probe")
        summary = dict(run.record.to_json(), command=command)
        (tmp / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
        plots = _plots(tmp, run)
        (tmp / "report.md").write_text(sources_markdown(run.record, command, plots))
    return Path(out)


def _accelerator(summary: ProbeSummary | dict) -> tuple[SourceResult, AcceleratorFigures]:
    """The accelerator source's result and its own figures."""
    acc = as_record(summary).sources.get("accelerator")
    figures = AcceleratorFigures.of(acc)
    if not isinstance(acc, SourceResult) or figures is None:
        raise ValueError("no accelerator source in this probe summary (--sources accelerator)")
    return acc, figures


def fleet_markdown(summary: ProbeSummary | dict, command: str, plot: str | None = None) -> str:
    """The study's mixed fleet from an accelerator-probe run: each group, and the
    capacity-weighted fleet."""
    from mismatch.profiles import resolve

    acc, figures = _accelerator(summary)
    shares = figures.fleet_shares
    out = ["# The study's mixed sampler fleet against a BF16 trainer (EMULATED)", "",
           f"Command: `{command}`", "",
           "Each group serves with its GPU's own kernels and an FP8 KV cache "
           "(as in the reference study, docs/study.md); the trainer is the BF16 teacher-forced "
           f"forward. Model: {as_record(summary).model}. All groups score the same sampled tokens; "
           "KL exact is the full-vocabulary KL(group ‖ trainer) per position, with a 95% BCa "
           "bootstrap interval over sequences.", "",
           "| group | runs as | attention | share | tokens | KL exact | 95% CI | KL k3 | "
           "outside [0.5, 5] |", "|---|---|---|---:|---:|---:|---|---:|---:|"]
    for group, share in shares.items():
        gpu, dtype = group.rsplit("-", 1)
        spec = resolve(gpu, dtype, "fp8")
        p = acc.parts[f"fleet {group}"]
        out.append(f"| {group} | {spec.kernel_path} | {spec.attention} | {share:.3f} | "
                   f"{p.tokens} | {p.kl_exact:.3e} | {_ci(p.kl_exact_ci95)} | {p.kl_k3:.3e} | "
                   f"{p.mis_masked_fraction:.3%} |")
    w = figures.fleet_weighted
    out += [f"| **fleet (capacity-weighted)** | | | 1.000 | | **{w.kl_exact:.3e}** | "
            f"{_ci(w.kl_exact_ci95)} | {w.kl_k3:.3e} | {w.mis_masked_fraction:.3%} |",
            ""]
    out += ["- Shares: " + ("equal (the study's per-group shares are not published as numbers; "
                            "set them with --fleet-shares)." if len(set(shares.values())) == 1
                            else "from --fleet-shares."),
            "- The fleet interval is the share-weighted sum of the groups' bounds "
            "(conservative: the groups share prompts, so their errors are correlated).",
            "- Groups that emulate identically (H100/H200, B200/B300: same architecture and "
            "kernels) show identical figures; on this model's short contexts A100's and H100's "
            "BF16 attention tiles also coincide (FA2 and FA3 both use 128-key prefill tiles, "
            "and decode caches stay under one split)."]
    if plot:
        out += ["", f"![fleet]({plot})"]
    return "\n".join(out) + "\n"


def fleet_plot(summary: dict, path: Path) -> None:
    """Per-group KL bars with intervals, and the capacity-weighted fleet."""
    from mismatch.io import save_figure
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc, figures = _accelerator(summary)
    names = list(figures.fleet_shares)
    weighted = figures.fleet_weighted
    rows = [acc.parts[f"fleet {g}"] for g in names]
    labels = names + ["fleet"]
    vals = [r.kl_exact for r in rows] + [weighted.kl_exact]
    cis = [r.kl_exact_ci95 for r in rows] + [weighted.kl_exact_ci95]
    err = [[max(v - ci[0], 0) for v, ci in zip(vals, cis)],
           [max(ci[1] - v, 0) for v, ci in zip(vals, cis)]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(range(len(vals)), vals, yerr=err, capsize=3,
           color=["#4a72b0"] * len(names) + ["#333333"])
    ax.set_xticks(range(len(vals)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("KL exact (nats/token)")
    ax.set_title("mixed fleet vs BF16 trainer, FP8 KV caches (EMULATED)", fontsize=9)
    save_figure(fig, path)
