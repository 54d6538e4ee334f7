"""Probe outputs: results.json, report.md and plots, written atomically into one directory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from mismatch.io import atomic_directory, mark_output, save_figure
from mismatch.probes.kl_summary import KLSummary
from mismatch.probes.summary import Figures, ProbeSummary, as_record

__all__ = ["format_table", "markdown_report", "split_check", "write_probe_outputs"]

_ESTIMATOR = {"kl_k3", "kl_k1", "ess", "kl_k3_ci95"}
"""Figures that estimate KL(μ‖π) or weigh by π/μ: valid only on tokens drawn from μ itself."""
_ROWS = (("kl_exact", "KL exact", "{:.3e}"), ("kl_exact_ci95", "KL exact 95% CI", None),
         ("kl_k3", "KL k3", "{:.3e}"), ("kl_k3_ci95", "k3 95% CI", None),
         ("kl_k1", "KL k1", "{:+.3e}"),
         ("abs_logprob_diff_mean", "|Δlogp| mean", "{:.3e}"),
         ("abs_logprob_diff_p99", "|Δlogp| p99", "{:.3e}"),
         ("abs_logprob_diff_max", "|Δlogp| max", "{:.3e}"),
         ("logprob_diff_rms", "Δlogp RMS", "{:.3e}"),
         ("logprob_rel_rms", "Δlogp RMS rel", "{:.3%}"),
         ("logprob_diff_sd", "Δlogp sd", "{:.3e}"),
         ("mis_masked_fraction", "outside [0.5, 5]", "{:.4%}"),
         ("ratio_outside_10pct", "outside [0.9, 1.1]", "{:.4%}"),
         ("ess", "ESS", "{:.5f}"))
_OFF = "n/a†"
_FOOTNOTE = ("† k1/k3 and ESS estimate KL(μ‖π) only on tokens drawn from μ; {who} drew none "
             "(the tokens are the sampler's), so only {its} exact KL counts (the JSON keeps the "
             "token figures, flagged k_estimators_valid: false).")
_MEANING = ("Columns: `total` = KL(sampler ‖ trainer); `precision` = KL(precision ‖ trainer), "
            "the trainer's forward with the sampler's formats (weights decoded from their real "
            "storage, activations and KV cache quantized); `accelerator` = KL(sampler ‖ "
            "precision), the full sampler (decode path, attention kernel family, GEMM "
            "accumulation) against that. Each headline is the exact full-vocabulary KL of the "
            "pair at the positions the sampler visited, with a 95% bootstrap interval over "
            "sequences; the token figures below it are computed on the sampler's tokens. KL is "
            "not additive: precision + accelerator need not equal the total, and a source may "
            "exceed it when the other partly cancels it.")


Summary = ProbeSummary | dict
"""A probe record, or a results.json body (read back through ProbeSummary / KLSummary)."""


def _columns(summary: Summary) -> list[tuple[str, KLSummary]]:
    return Figures.of(summary).columns


def _cell(col: KLSummary, key: str, fmt: str | None) -> str:
    if key in _ESTIMATOR and col.k_estimators_valid is False:
        return _OFF
    value = col.figure(key)
    if value is None:
        return "-"
    return "[{:.2e}, {:.2e}]".format(*value) if fmt is None else fmt.format(value)


def _has_off(cols: list[tuple[str, KLSummary]]) -> bool:
    return any(c.k_estimators_valid is False for _, c in cols)


def _footnote(cols: list[tuple[str, KLSummary]]) -> str:
    """The † note, naming the columns whose token estimators do not apply."""
    off = [name for name, c in cols if c.k_estimators_valid is False]
    who = (f"the {off[0]} column" if len(off) == 1
           else f"the {', '.join(off[:-1])} and {off[-1]} columns")
    return _FOOTNOTE.format(who=who, its="its" if len(off) == 1 else "their")


def _half(interval: list[float]) -> float:
    return (interval[1] - interval[0]) / 2


def split_check(summary: Summary) -> str:
    """One sentence: the sum of the sources against the total, and any source above the total
    by more than the two intervals' half-widths (which would mean the sources cancel)."""
    figures = Figures.of(summary)
    total = figures.total
    if total.kl_exact is None:
        return ""
    srcs = {name: figures.headline(name) for name in figures.sources}
    over = [name for name, c in srcs.items() if c.kl_exact > total.kl_exact
            + _half(total.kl_exact_ci95) + _half(c.kl_exact_ci95)]
    line = (f"Exact KL: precision + accelerator = "
            f"{sum(c.kl_exact for c in srcs.values()):.3e} against a total of "
            f"{total.kl_exact:.3e}.")
    if over:
        line += (f" {', '.join(over)} exceeds the total beyond the intervals: the sources "
                 f"partly cancel in the full sampler.")
    return line


def format_table(summary: Summary) -> str:
    """A plain-text table of the figures (one column per source), for the terminal."""
    cols = _columns(summary)
    head = f"{'':<18}" + "".join(f"{name:>22}" for name, _ in cols)
    lines = [head]
    for key, label, fmt in _ROWS:
        lines.append(f"{label:<18}" + "".join(f"{_cell(c, key, fmt):>22}" for _, c in cols))
    if _has_off(cols):
        lines.append(_footnote(cols))
    return "\n".join(lines)


def markdown_report(summary: Summary, command: str) -> str:
    s = as_record(summary)
    cols = _columns(s)
    out = [f"# Probe: {s.gpu} {s.dtype} sampler vs {s.trainer_dtype} trainer ({s.mode.upper()})",
           "", f"Command: `{command}`", "",
           f"- mode: **{s.mode}** — " + (
               "the sampler ran on this GPU's own kernels" if s.mode == "measured" else
               "the sampler's formats and kernels were emulated on this machine's CPU"),
           f"- sampler: {s.kernel_path}; attention kernel family: {s.attention}; "
           f"KV cache: {s.kv_cache}",
           f"- model: {s.model}; prompts: {s.prompts}; completion tokens: {s.tokens}", "",
           "| figure | " + " | ".join(name for name, _ in cols) + " |",
           "|---|" + "---:|" * len(cols)]
    for key, label, fmt in _ROWS:
        label = f"**{label}**" if key == "kl_exact" else label.replace("|", "\\|")
        out.append(f"| {label} | " + " | ".join(_cell(c, key, fmt) for _, c in cols) + " |")
    out += [""] + ([_footnote(cols), ""] if _has_off(cols) else [])
    out += [_MEANING, "", split_check(s), "",
            "![log-ratio histogram](log_ratio_hist.png)", "",
            "![per-position divergence](per_position.png)", ""]
    return "\n".join(out)


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
    ax.set_ylabel("mean exact KL")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, tmp / "per_position.png")


def write_probe_outputs(out: Path, result, command: str, *, force: bool = True) -> Path:
    """Write results.json, report.md and two PNG plots into `out`, via a temporary sibling."""
    with atomic_directory(out, force=force) as tmp:
        s: ProbeSummary = result.record
        mark_output(tmp, "probe")
        (tmp / "results.json").write_text(json.dumps(dict(s.to_json(), command=command),
                                                     indent=2) + "\n")
        (tmp / "report.md").write_text(markdown_report(s, command))
        label = "EMULATED" if s.mode == "emulated" else "MEASURED"
        _plots(tmp, result.log_ratio_total, result.per_position,
               f"{s.gpu} {s.dtype} vs {s.trainer_dtype} trainer ({label})")
    return Path(out)
