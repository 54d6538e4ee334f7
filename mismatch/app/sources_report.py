"""Outputs of `mismatch probe --sources ... [--ladder]`: results.json, report.md and plots.

Plots (written only where the data exists): per-source KL bars with 95% intervals, per-source
log-ratio histograms, MoE routing flips per layer, KL against staleness, and the ladder's
waterfall. Everything is written into a temporary sibling directory and renamed into place.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["fleet_markdown", "fleet_plot", "format_sources_table", "literature_checks",
           "sources_markdown", "write_sources_outputs"]

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


def _kl(src: dict, key: str = "kl_exact"):
    return src.get(key) if isinstance(src, dict) else None


def literature_checks(summary: dict) -> list[dict]:
    """Each source's figure against the published magnitude or ordering that its check names:
    [{source, published, ours, holds, why}], `why` saying what differs where it does not hold."""
    src = summary["sources"]
    out: list[dict] = []

    def add(source, published, ours, holds, why=""):
        out.append({"source": source, "published": published, "ours": ours,
                    "holds": bool(holds), "why": "" if holds else why})

    k, p = src.get("kernels", {}), src.get("precision", {})
    if _kl(k) is not None:
        add("kernels", "KL ~1e-3 at the same precision (large models, long contexts)",
            f"{k['kl_exact']:.2e}", 1e-4 <= k["kl_exact"] <= 1e-2,
            "more than 10× off: a 2M-parameter model with 4 layers and ~150-token contexts "
            "accumulates far less reduction-order error than a 235B model over 32k tokens")
    if _kl(k) is not None and _kl(p) is not None and summary["dtype"] not in ("bf16",):
        add("kernels vs precision", "a low-precision format costs more than the kernels",
            f"{p['kl_exact']:.2e} vs {k['kl_exact']:.2e}", p["kl_exact"] > k["kl_exact"],
            "the kernels' share is larger here: the target's attention and decode path "
            "dominate on short contexts where the format's error is small")
    grid = p.get("parts", {})
    if all(f"{f} W+A" in grid for f in ("fp8", "nvfp4")):
        a, b = grid["nvfp4 W+A"]["kl_exact"], grid["fp8 W+A"]["kl_exact"]
        add("precision", "NVFP4 W4A4 > FP8 W8A8 (fewer bits)",
            f"{a:.2e} vs {b:.2e}", a > b, "the intervals overlap on this many tokens")
    if all(f"fp8 {st}" in grid for st in ("W+A", "W+A+KV")):
        a, b = grid["fp8 W+A+KV"]["kl_exact"], grid["fp8 W+A"]["kl_exact"]
        add("precision", "an FP8 KV cache adds mismatch", f"{a:.2e} vs {b:.2e}", a > b,
            "the FP8 KV row is within noise of the row without it")
    r = src.get("routing", {})
    if r.get("flip_rate_by_layer"):
        add("routing", "~10% of router decisions differ per layer",
            f"{r['flip_rate_mean']:.1%}", 1 / 30 <= r["flip_rate_mean"] <= 0.3,
            "more than 3× off: the embedded model has 8 experts with top-2 routing and ~150-token "
            "contexts; its routers' margins are wider than a 128-expert model's after 32k tokens")
        n_layers = len(r["flip_rate_by_layer"])
        add("routing", "94% of tokens flip in ≥1 of 48 layers; with p per layer, "
            "1 − (1 − p)^L", f"{r['flip_rate_any_layer']:.1%} over {n_layers} layers",
            abs(r["flip_rate_any_layer"] - (1 - (1 - r["flip_rate_mean"]) ** n_layers)) < 0.1
            or r["flip_rate_any_layer"] > 0.9,
            "flips in different layers are correlated on this model")
        share = r.get("routing_kl_share_fraction", 0.0)
        add("routing", "routing replay removes about half the KL (1.5e-3 → 7.5e-4)",
            f"{r['kl_exact_no_replay']:.2e} → {r['kl_exact_replay']:.2e} ({share:.0%} removed)",
            0.25 <= share <= 0.75,
            "replay removes a different share here: routing flips are rarer on this model "
            "(see the flip rate), so less of the mismatch runs through them")
    st = src.get("staleness", {})
    by_lag = st.get("kl_exact_by_lag") or {}
    if by_lag:
        lags = sorted(int(x) for x in by_lag)
        first, last = by_lag[str(lags[1])] if len(lags) > 1 else 0.0, by_lag[str(lags[-1])]
        add("staleness", "KL grows with staleness (0.002 at 0 → ~0.01 at ~2 steps)",
            f"{first:.2e} at 1 → {last:.2e} at {lags[-1]}", last > first > 0,
            "the steps barely moved the BF16 weights at this learning rate")
    sa = src.get("sampling", {})
    if "processed_minus_raw_mean" in sa:
        add("sampling", f"processed − raw ≤ −log p = {sa['bias_bound']:.3f} nats/token",
            f"{sa['processed_minus_raw_mean']:.4f}",
            0 <= sa["processed_minus_raw_mean"] <= sa["bias_bound"] + 1e-9,
            "the bound is violated: a bug")
    rt = src.get("retokenization", {})
    if "changed_episode_fraction" in rt:
        add("retokenization", "stock Qwen3 template: 100/100 multi-turn rollouts diverge",
            f"{rt['changed_episode_fraction']:.0%} of episodes",
            rt["changed_episode_fraction"] >= 0.5,
            "few episodes here reach a second turn with earlier reasoning to strip")
    return out


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
           "the noise floor (1e-7) whose interval half-width is over 20% of its value.", ""]
    ci = s.get("ci_target") or {}
    if ci.get("target"):
        out[-1:] = [f"- --ci-target {ci['target']:g}: " + (
            "met by every headline" if ci.get("met") else
            f"not met within --max-prompts for: {', '.join(ci.get('unmet', []))}"), ""]
    out += ["## Per source (headline comparison)", ""]
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
    checks = literature_checks(s)
    if checks:
        out += ["", "## Against the literature", "",
                "| source | published | here | holds | why not |", "|---|---|---|:-:|---|"]
        out += [f"| {c['source']} | {c['published']} | {c['ours']} | "
                f"{'yes' if c['holds'] else 'no'} | {c['why']} |" for c in checks]
    if "log_ratio_hist.png" in plots:
        out += ["", "## Log-ratio histograms", "", "![log-ratio histograms](log_ratio_hist.png)"]
    return "\n".join(out) + "\n"


def _plots(tmp: Path, run) -> list[str]:
    from mismatch.io import save_figure
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
        made.append(save_figure(fig, tmp / "routing.png"))

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
        made.append(save_figure(fig, tmp / "staleness.png"))

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
        made.append(save_figure(fig, tmp / "ladder.png"))
    return made


def write_sources_outputs(out: Path, run, command: str) -> Path:
    """results.json, report.md and plots into `out`, via a temporary sibling."""
    from mismatch.io import atomic_directory, mark_output

    with atomic_directory(out) as tmp:
        mark_output(tmp, "probe")
        summary = dict(run.summary, command=command)
        (tmp / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
        plots = _plots(tmp, run)
        (tmp / "report.md").write_text(sources_markdown(summary, command, plots))
    return Path(out)


def fleet_markdown(summary: dict, command: str, plot: str | None = None) -> str:
    """The study's mixed fleet from an accelerator-probe run: each group, and the
    capacity-weighted fleet."""
    from mismatch.profiles import resolve

    acc = summary["sources"]["accelerator"]
    shares = acc["fleet_shares"]
    out = ["# The study's mixed sampler fleet against a BF16 trainer (EMULATED)", "",
           f"Command: `{command}`", "",
           "Each group serves with its GPU's own kernels and an FP8 KV cache "
           "(as in the reference study, docs/study.md); the trainer is the BF16 teacher-forced "
           f"forward. Model: {summary['model']}. All groups score the same sampled tokens; "
           "KL exact is the full-vocabulary KL(group ‖ trainer) per position, with a 95% BCa "
           "bootstrap interval over sequences.", "",
           "| group | runs as | attention | share | tokens | KL exact | 95% CI | KL k3 | "
           "outside [0.5, 5] |", "|---|---|---|---:|---:|---:|---|---:|---:|"]
    for group, share in shares.items():
        gpu, dtype = group.rsplit("-", 1)
        spec = resolve(gpu, dtype, "fp8")
        p = acc["parts"][f"fleet {group}"]
        out.append(f"| {group} | {spec.kernel_path} | {spec.attention} | {share:.3f} | "
                   f"{p['tokens']} | {p['kl_exact']:.3e} | {_ci(p)} | {p['kl_k3']:.3e} | "
                   f"{p['mis_masked_fraction']:.3%} |")
    w = acc["fleet_weighted"]
    out += [f"| **fleet (capacity-weighted)** | | | 1.000 | | **{w['kl_exact']:.3e}** | "
            f"{_ci(w)} | {w['kl_k3']:.3e} | {w['mis_masked_fraction']:.3%} |", ""]
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

    acc = summary["sources"]["accelerator"]
    names = list(acc["fleet_shares"])
    rows = [acc["parts"][f"fleet {g}"] for g in names] + [acc["fleet_weighted"]]
    labels = names + ["fleet"]
    vals = [r["kl_exact"] for r in rows]
    err = [[max(v - r["kl_exact_ci95"][0], 0) for v, r in zip(vals, rows)],
           [max(r["kl_exact_ci95"][1] - v, 0) for v, r in zip(vals, rows)]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(range(len(rows)), vals, yerr=err, capsize=3,
           color=["#4a72b0"] * len(names) + ["#333333"])
    ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("KL exact (nats/token)")
    ax.set_title("mixed fleet vs BF16 trainer, FP8 KV caches (EMULATED)", fontsize=9)
    save_figure(fig, path)
