"""The study's report: the study's claims answered with intervals, curves, the per-cell table,
the monitor's lead times and every run (`aggregate`); the runs' summaries and the definitions
of every figure are in runs.py.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from mismatch.io import atomic_write_text

from .cells import STUDY_ARMS, STUDY_FLEETS, Cell, StudyConfig, cells, fleet_label
from .runs import (WINDOW, RunSummary, cell_panels, cell_runs, ci95, lag_label, share_ci,
                   replayed_alert, summarize_run)

__all__ = ["aggregate", "summarize_run"]


STUDY_KL_RATIO = 4.7
"""The reference study's L2/L0 sampler–trainer KL ratio (reference/: mixed vs homogeneous)."""


def _fmt_ci(mean: float, half: float, digits: int = 2) -> str:
    if not math.isfinite(mean):
        return "–"
    return f"{mean:.{digits}f} ± {half:.{digits}f}" if math.isfinite(half) else f"{mean:.{digits}f}"


def _steps_list(values: list[int | None]) -> str:
    return ", ".join("–" if v is None else str(v) for v in values)


def aggregate(cfg: StudyConfig, out: Path, report: Path, *, command: str = "",
              elapsed: float | None = None, notes: str | None = None) -> Path:
    """Write `report` (markdown) and its plots (`<stem>-reward.png`, `-kl.png`, `-format.png`)
    beside it, atomically. Cells without a run are listed as missing."""
    out, report = Path(out), Path(report)
    runs: dict[Cell, RunSummary] = {}
    for cell in cells(cfg):
        s = summarize_run(out / cell.name)
        if s is not None:
            runs[cell] = s
    if not runs:
        raise ValueError(f"{out} holds no study run with a logged step; run `mismatch study` "
                         "first")
    report.parent.mkdir(parents=True, exist_ok=True)
    from .plots import plot_study

    figures = plot_study(cfg, runs, report.parent, report.stem)
    text = _markdown(cfg, runs, figures, command=command, elapsed=elapsed)
    if notes:
        text += "\n" + notes.strip() + "\n"
    atomic_write_text(report, text)
    return report


def _halving(rs: list[RunSummary], steps: int) -> str:
    """Halving steps, and their mean ± interval counting a run that never halved at `steps`."""
    at = [r.halved_step for r in rs]
    if all(x is None for x in at):
        return f"never in {steps} steps"
    censored = ci95([steps if x is None else x for x in at])
    return f"at step {_steps_list(at)} (mean {_fmt_ci(*censored, digits=0)}, never = {steps})"


def _complete(cfg: StudyConfig, runs: dict[Cell, RunSummary]) -> dict[Cell, RunSummary]:
    """The runs that reached the grid's steps: the claims are judged on these alone."""
    return {c: r for c, r in runs.items() if r.last_step >= cfg.steps}


def _verdicts(cfg: StudyConfig, runs: dict[Cell, RunSummary]) -> list[str]:
    """The study's claims, each answered from the runs (numbers and intervals, not adjectives)."""
    lines: list[str] = []
    partial = sorted(f"{c.name} (step {r.last_step})" for c, r in runs.items()
                     if r.last_step < cfg.steps)
    started, runs = runs, _complete(cfg, runs)
    lines.append(f"Judged on the {len(runs)} run(s) that reached step {cfg.steps}"
                 + (f"; still running or stopped early, shown in the tables and curves only: "
                    f"{', '.join(partial)}" if partial else "") + ".")
    lines.append("")
    controls = [f"- {f} {arm}: {_heldout_line(cell_runs(runs, f, None, arm))}."
                for f in cfg.sync_fleets for arm in cfg.sync_arms
                if cell_runs(runs, f, None, arm)]
    if controls:
        lines += ["On-policy controls (`--sync`, no staleness): does training raise the held-out "
                  "reward?", *controls, ""]
    for k in cfg.staleness:
        verdict = {}
        for arm in cfg.arms:
            for f in cfg.fleets:
                rs = cell_runs(runs, f, k, arm)
                if rs:
                    n = sum(r.halved_step is not None for r in rs)
                    verdict[f, arm] = (n, len(rs), rs)
        if not verdict:
            continue
        lines.append(f"Forced staleness {k}:")
        if any(a == "grpo" for _, a in verdict):
            parts = [f"{f} {share_ci(n, t)}, {_halving(rs, cfg.steps)}"
                     for (f, a), (n, t, rs) in verdict.items() if a == "grpo"]
            lines.append("- Does uncorrected GRPO collapse? Runs collapsed: " + "; ".join(parts)
                         + ".")
            if ("L0", "grpo") in verdict and ("L2", "grpo") in verdict:
                h = {f: [cfg.steps if r.halved_step is None else r.halved_step
                         for r in verdict[f, "grpo"][2]] for f in ("L0", "L2")}
                lines.append(f"- Earlier on the mixed fleet? Median halving step (never = "
                             f"{cfg.steps}): L2 {statistics.median(h['L2']):g} vs L0 "
                             f"{statistics.median(h['L0']):g}.")
        for arm in cfg.arms:
            if arm == "grpo":
                continue
            single = arm in ("mis", "sc", "grpo+topp")
            parts = []
            for f in cfg.fleets:
                if (f, arm) not in verdict:
                    continue
                n, t, rs = verdict[f, arm]
                parts.append(f"{f}: collapsed {share_ci(n, t)}, {_halving(rs, cfg.steps)}; "
                             f"final training reward {_fmt_ci(*ci95([r.final for r in rs]))}"
                             f"; held-out {_heldout_line(rs)}")
            ask = ("alone: collapse delayed rather than avoided?" if single
                   else "stable to the end?")
            if parts:
                lines.append(f"- {arm} {ask} " + " — ".join(parts) + ".")
        collapsed = [r for c, r in runs.items() if c.staleness == k
                     and r.halved_step is not None]
        if collapsed:
            kl3 = sum(r.kl_growth_at_collapse >= 3 for r in collapsed)
            fmt = sum(r.format_at_collapse >= max(0.5, 3 * r.format_early)
                      for r in collapsed)
            ending = [r.format_ending_step for r in collapsed
                      if r.format_ending_step is not None]
            lines.append(
                f"- The collapse signature, over the {len(collapsed)} collapsed runs (judged up "
                f"to {WINDOW} steps after the halving): reward halved in all (by definition); "
                f"KL ≥ 3× its first steps in {share_ci(kl3, len(collapsed))}; most episodes "
                f"(≥ 50% and ≥ 3× the first steps, {WINDOW}-step mean) ending on format errors "
                f"in {share_ci(fmt, len(collapsed))}; at any step of the run in "
                f"{share_ci(len(ending), len(collapsed))}"
                + (f" (first at step {_steps_list(ending)})" if ending else "") + ".")
        lines.append("")
    lines += _kl_ratio(cfg, started)  # step 1: every run that logged one; run means: finished
    return lines


def _heldout_line(rs: list[RunSummary]) -> str:
    """Held-out reward base → mid → final over a cell's runs (mean ± 95% interval)."""
    parts = []
    for key in ("base", "mid", "final"):
        vals = [r.heldout[key] for r in rs if key in r.heldout]
        if vals:
            parts.append(f"{key} {_fmt_ci(*ci95(vals))}")
    line = " → ".join(parts) if parts else "not evaluated"
    full = [f"{key} {_fmt_ci(*ci95(vals))}" for key in ("base", "mid", "final")
            if (vals := [r.heldout[f"{key}_full"] for r in rs
                         if f"{key}_full" in r.heldout])]
    if full:  # top-p arms: their own nucleus above, the study's full vocabulary here
        line += f" (from the full vocabulary, the study's evaluation: {' → '.join(full)})"
    return line


def _ratio_line(what: str, logs: dict[str, list[float]], unit: str, tail: str) -> str:
    """One verdict line: the L2/L0 ratio of geometric means from natural logs of KL (one value
    per seed or run on each side), with its 95% interval over them."""
    m0, h0 = ci95(logs["L0"])
    m2, h2 = ci95(logs["L2"])
    half = math.sqrt(h0 ** 2 + h2 ** 2)  # nan with a single value on either side
    spread = (f"95% interval {math.exp(m2 - m0 - half):.1f}–{math.exp(m2 - m0 + half):.1f}×"
              if math.isfinite(half) else "no interval from a single seed")
    return (f"- L2/L0 sampler–trainer KL {what}: {math.exp(m2):.2e} / {math.exp(m0):.2e} = "
            f"{math.exp(m2 - m0):.1f}× ({spread}, {len(logs['L2'])} and {len(logs['L0'])} "
            f"{unit}; {tail}).")


def _kl_ratio(cfg: StudyConfig, runs: dict[Cell, RunSummary]) -> list[str]:
    """L2/L0 sampler–trainer KL two ways. At step 1 (same weights: the numerics alone), per
    sampling mode (top-p arms never sample the tail, where most of the mismatch lives), over
    every run that logged a step. And averaged over the run, the study's own measure (its 4.7× is
    the mixed samplers' KL on average over training, SC+MIS+top-p), for the arms that stay stable
    (sc+mis, sc+mis+topp) over the runs that reached the last step: there the policy's staleness
    adds to the numerics on both fleets."""
    if not {"L0", "L2"} <= set(cfg.fleets):
        return []
    lines = []
    for mode, pick in (("full-distribution arms", lambda a: not STUDY_ARMS[a].endswith("topp")),
                       ("top-p arms", lambda a: STUDY_ARMS[a].endswith("topp"))):
        # at step 1 every arm of a seed holds the same weights and the same episodes: one value
        # per seed (the mean over its arms), the interval over seeds
        logs = {}
        for f in ("L0", "L2"):
            per_seed: dict[int, list[float]] = {}
            for c, r in runs.items():
                if c.fleet == f and pick(c.arm) and r.kl_first > 0:
                    per_seed.setdefault(c.seed, []).append(math.log(r.kl_first))
            logs[f] = [sum(v) / len(v) for v in per_seed.values()]
        if not (logs["L0"] and logs["L2"]):
            continue
        lines.append(_ratio_line(f"at step 1, {mode}", logs, "seed(s)",
                                 f"geometric means; the study: {STUDY_KL_RATIO}×"))
    done = _complete(cfg, runs)
    for k in cfg.staleness:
        for arm in ("sc+mis", "sc+mis+topp"):
            logs = {f: [math.log(r.kl_mean) for r in cell_runs(done, f, k, arm)
                        if r.kl_mean > 0] for f in ("L0", "L2")}
            if not (logs["L0"] and logs["L2"]):
                continue
            lines.append(_ratio_line(
                f"averaged over the run (the study's measure), {arm} at staleness {k}", logs,
                "run(s)", f"the study: {STUDY_KL_RATIO}× for SC+MIS+top-p"))
    return lines


def _cell_table(cfg: StudyConfig, runs: dict[Cell, RunSummary]) -> list[str]:
    out = ["| fleet | K | arm | runs | train reward first 3 | final | collapsed | halved at | "
           "held-out base → mid → final | KL step 1 | KL growth | format errors (end / max) | "
           "MIS-masked (end) | first critical alert |", "|" + "---|" * 14]
    for f, k, arms in cell_panels(cfg):
        for arm in arms:
            rs = cell_runs(runs, f, k, arm)
            if not rs:
                continue
            col = sum(r.halved_step is not None for r in rs)
            mean = lambda key: sum(getattr(r, key) for r in rs) / len(rs)  # noqa: E731
            out.append(
                f"| {f} | {lag_label(k)} | {arm} | {len(rs)} | {mean('base'):.2f} | "
                f"{_fmt_ci(*ci95([r.final for r in rs]))} | {col}/{len(rs)} | "
                f"{_steps_list([r.halved_step for r in rs])} | {_heldout_line(rs)} | "
                f"{mean('kl_first'):.1e} | {mean('kl_growth'):.1f}× | "
                f"{mean('format_end'):.2f} / {mean('format_max'):.2f} | "
                f"{mean('mis_masked_end'):.3f} | "
                f"{_steps_list([r.first_critical for r in rs])} |")
    return out


def _monitor(runs: dict[Cell, RunSummary], steps: int) -> list[str]:
    out = ["Lead time = the step at which the reward halved − the step of the monitor's first "
           "critical alert (positive: the alert came first). The monitor ran live inside every "
           "run with its default rules (probes.monitor.MonitorConfig: baseline over steps 4–13, "
           "judged from step 14).", ""]
    collapsed = [(c, r) for c, r in runs.items() if r.halved_step is not None]
    # a run short of its steps that has not halved yet is not judged stable (nor a false alarm)
    stable = [(c, r) for c, r in runs.items() if r.halved_step is None
              and r.last_step >= steps]
    pending = sorted(c.name for c, r in runs.items() if r.halved_step is None
                     and r.last_step < steps)
    if collapsed:
        out += ["| run | reward halved at | first critical alert | lead (steps) | signals |",
                "|---|---|---|---|---|"]
        for c, r in sorted(collapsed, key=lambda x: x[0].name):
            a = r.first_critical
            lead = "no alert" if a is None else str(r.halved_step - a)
            out.append(f"| {c.name} | {r.halved_step} | {a if a is not None else '–'} | "
                       f"{lead} | {', '.join(r.alert_signals) or '–'} |")
        leads = [r.halved_step - r.first_critical for _, r in collapsed
                 if r.first_critical is not None]
        out += ["", f"Collapsed runs: {len(collapsed)}; alerted before the reward halved: "
                f"{sum(x > 0 for x in leads)}; at the same step: {sum(x == 0 for x in leads)}; "
                f"after: {sum(x < 0 for x in leads)}; never: {len(collapsed) - len(leads)}."
                + (f" Median lead {statistics.median(leads):g} steps." if leads else "")]
    alarmed = [(c, r) for c, r in stable if r.critical_alerts]
    out += ["", f"Runs whose reward never halved: {len(stable)}; with a critical alert (false "
            f"alarms; goal: none): {len(alarmed)}" + (" (" + ", ".join(
                f"{c.name} at step {r.first_critical} on {', '.join(r.alert_signals)}"
                for c, r in sorted(alarmed, key=lambda x: x[0].name)) + ")" if alarmed else "")
            + "." + (f" Not judged, short of {steps} steps and not halved so far: "
                     f"{', '.join(pending)}." if pending else "")]
    return out + _known_good(runs, steps)


def _reference(runs: dict[Cell, RunSummary], cell: Cell, steps: int) -> Cell | None:
    """The known-good run a monitor of `cell` takes its baselines from: a finished SC+MIS run
    that never halved, on the same fleet and staleness, the same seed when that is another run,
    else the nearest other seed."""
    good = [c for c in runs if (c.fleet, c.staleness, c.arm) == (cell.fleet, cell.staleness,
                                                                  "sc+mis")
            and c != cell and runs[c].halved_step is None and runs[c].last_step >= steps]
    return min(good, key=lambda c: (abs(c.seed - cell.seed), c.seed), default=None)


def _known_good(runs: dict[Cell, RunSummary], steps: int) -> list[str]:
    """Every run replayed through a monitor given a known-good run's baselines (`mismatch
    monitor --baseline`): lead times and false alarms when judging starts at the first steps."""
    rows, leads, false_alarms, silent = [], [], [], 0
    for c in sorted(runs, key=lambda c: c.name):
        ref = _reference(runs, c, steps)
        if ref is None:
            continue
        r = runs[c]
        step = replayed_alert(r.records, runs[ref].records)
        halved = r.halved_step
        if halved is not None and step is not None:
            leads.append(halved - step)
        silent += halved is not None and step is None
        if halved is None and step is not None and r.last_step >= steps:
            false_alarms.append(f"{c.name} at step {step}")
        lead = "–" if halved is None or step is None else str(halved - step)
        rows.append(f"| {c.name} | {ref.name} | {halved if halved is not None else '–'} | "
                    f"{r.first_critical if r.first_critical is not None else '–'} | "
                    f"{step if step is not None else '–'} | {lead} |")
    if not rows:
        return []
    return ["", "Replayed with a known-good run's baselines (`mismatch monitor --baseline "
            "RUN/metrics.jsonl`): each run's log through a monitor whose baselines come from "
            "steps 4–13 of the SC+MIS run on the same fleet and staleness (the same seed where "
            "that is another run), so it judges from its first steps. A critical alert on a run "
            "whose reward never halved is a false alarm.", "",
            "| run | baselines from | reward halved at | live monitor: first critical | "
            "replayed: first critical | replayed lead (steps) |", "|---|---|---|---|---|---|",
            *rows, "", f"Replayed: collapsed runs alerted before the reward halved "
            f"{sum(x > 0 for x in leads)} of {len(leads) + silent}"
            + (f" (median lead {statistics.median(leads):g} steps)" if leads else "")
            + f"; runs that never halved with a critical alert: {len(false_alarms)}"
            + (f" ({', '.join(false_alarms)})" if false_alarms else "")
            + " (runs short of their steps not counted)."]


def _markdown(cfg: StudyConfig, runs: dict[Cell, RunSummary], figures: list[str], *, command: str,
              elapsed: float | None) -> str:
    missing = [c.name for c in cells(cfg) if c not in runs]
    short = [c.name for c, r in runs.items() if r.last_step < cfg.steps]
    policy = ("the embedded model" if not cfg.policy_steps else
              f"a zoo policy trained {cfg.policy_steps} steps (`mismatch zoo build --steps "
              f"{cfg.policy_steps} --seed 0`; the embedded model is the same recipe at 1000)")
    out = ["# The study on the CPU testbed: which corrections keep mixed-sampler RL stable", ""]
    out += ["Sampler numerics are **emulated** (bit-exact formats and kernel habits on CPU); the "
            "trainer computes in BF16 on an FP32 master. Policy: " + policy + " — Qwen3-MoE "
            "architecture, 2.0M parameters. Multi-turn calculator task "
            f"(`{cfg.tasks}`; an episode ends on a submit, {cfg.max_turns} turns, or three "
            "replies in a row without a tool call).", ""]
    if command:
        out += ["Regenerate:", "", "```bash", command, "```", ""]
    controls = (f"; on-policy controls (`--sync`): {', '.join(cfg.sync_arms)} on "
                f"{', '.join(cfg.sync_fleets)}" if cfg.sync_arms else "")
    fleets = ', '.join(f'{fleet_label(f)} ({STUDY_FLEETS.get(f, f)})' for f in cfg.fleets)
    out += [f"Grid: fleets {fleets}; forced "
            f"staleness {', '.join(map(str, cfg.staleness))}; arms {', '.join(cfg.arms)}; seeds "
            f"{', '.join(map(str, cfg.seeds))}{controls}. Each run: {cfg.steps} steps of "
            f"{cfg.prompts} prompts × {cfg.samples} episodes, AdamW lr {cfg.lr:g}, temperature 1 "
            "(top-p arms: p = 0.97 after top-k 64), SC over the samplers' top-128 candidates."
            + (f" Held-out reward: {cfg.eval_tasks} tasks × 4 episodes before the first step, "
               f"at step {(cfg.steps + 1) // 2} and after the last; top-p arms sample it "
               "through their nucleus and also from the full vocabulary, as the study "
               "evaluated (runs made before `mismatch train` did both: base and final, by "
               "`--eval-full-vocab`)."
               if cfg.eval_tasks else "")]
    if elapsed is not None:
        out += ["", f"Wall time of the runs in this invocation: {elapsed / 60:.1f} min."]
    if missing or short:
        out += ["", f"**Incomplete**: {len(missing)} run(s) missing "
                f"({', '.join(missing[:6])}{'…' if len(missing) > 6 else ''}), {len(short)} "
                f"short of {cfg.steps} steps."]
    out += ["", "## The study's claims, answered by these runs", "",
            "Collapsed = the training reward's 5-step mean fell to half its first 3 steps. "
            "Intervals: 95% (t over seeds for means; Clopper–Pearson for counts of runs).", ""]
    out += _verdicts(cfg, runs)
    out += ["", "## Curves", ""] + [f"![{f}]({f})" for f in figures]
    out += ["", "## Per cell", "",
            f"Training reward: the batches' reward, {WINDOW}-step trailing mean (final = the "
            f"last {WINDOW} steps); ± = 95% t-interval over seeds. KL growth = highest "
            f"{WINDOW}-step KL mean / median KL of the first {WINDOW} steps.", ""]
    out += _cell_table(cfg, runs)
    out += ["", "## The monitor on these runs", ""] + _monitor(runs, cfg.steps)
    l2 = [r for c, r in runs.items() if c.fleet == "L2" and r.group_kl_first]
    if l2:
        groups = sorted({g for r in l2 for g in r.group_kl_first})
        out += ["", "## KL per sampler group of L2 at step 1 (same weights: numerics only)", "",
                "| group | mean KL (k3) over runs |", "|---|---|"]
        for g in groups:
            vals = [r.group_kl_first[g] for r in l2 if g in r.group_kl_first]
            out.append(f"| {g} | {sum(vals) / len(vals):.2e} |")
    out += ["", "## Every run", "", "| run | steps | train reward first 3 → final | held-out "
            "base → mid → final | halved at | first critical alert |", "|---|---|---|---|---|---|"]
    for c, r in sorted(runs.items(), key=lambda x: x[0].name):
        ho = " → ".join(f"{r.heldout[k]:.2f}" for k in ("base", "mid", "final")
                        if k in r.heldout) or "–"
        if "final_full" in r.heldout:
            ho += " (full vocabulary: " + " → ".join(
                f"{r.heldout[k]:.2f}" for k in ("base_full", "mid_full", "final_full")
                if k in r.heldout) + ")"
        out.append(f"| {c.name} | {r.last_step} | {r.base:.2f} → {r.final:.2f} | {ho} "
                   f"| {_steps_list([r.halved_step])} | "
                   f"{_steps_list([r.first_critical])} |")
    return "\n".join(out) + "\n"
