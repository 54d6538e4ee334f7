"""The collapse monitor replayed over every committed study run: does it cry wolf, and how early
does it see the collapses?

Each run's `metrics.jsonl` (the records the trainer logged and the live monitor read) goes
through a fresh `CollapseMonitor` with the shipped rules, record by record, as `mismatch monitor
RUN` would (with `masked_loss` from the run's config.json: its correction masks tokens or not). Whether the run collapsed is the study's own test
(`mismatch.study.runs.summarize_run`): the 5-step trailing mean of the training reward
fell to half the mean of its first 3 steps (`halved_step`). Then:

- lead = halved step − the monitor's first critical alert (positive: the alert came first);
- a false critical = a critical alert on a run that never halved.

The runs, in three sets:

- grid: `reports/study-runs/` — the 36 runs of the study grid (12 collapses, 24 that held);
- held-out: `reports/study-L1/`, `reports/study-k4/` — the L1 fleet and staleness 4, seeds 0–2
  (12 runs: 6 collapses, 6 that held), not looked at when the rules were set;
- extra: `reports/study-control/` (the first on-policy control) and
  `reports/study-targeted/*/` (on-policy GRPO on L2);
- fresh: `reports/study-fresh/*/` — runs with a seed the study never ran (3), made after the
  rules were set (shorter than 150 steps: the steps column says how long).

The "live" column is the first critical alert of the monitor that ran inside the run
(`alerts.jsonl`, the rules of the day), for comparison.

    python scripts/monitor_on_study.py            # the table and the counts on stdout
    python scripts/monitor_on_study.py --report   # also the section of reports/monitor.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mismatch.io import atomic_write_text  # noqa: E402
from mismatch.probes.monitor import CollapseMonitor, MonitorConfig  # noqa: E402
from mismatch.train.rundir import read_metrics, run_masks_tokens  # noqa: E402
from mismatch.study.runs import summarize_run  # noqa: E402

SETS = {"grid": ("reports/study-runs",), "held-out": ("reports/study-L1", "reports/study-k4"),
        "extra": ("reports/study-control", "reports/study-targeted"),
        "fresh": ("reports/study-fresh",)}
BEGIN, END = "<!-- study-replay:begin -->", "<!-- study-replay:end -->"


def study_runs(root: Path = ROOT) -> list[tuple[str, Path]]:
    """(set, run folder) of every committed study run with a metrics log."""
    out = []
    for name, folders in SETS.items():
        for folder in folders:
            base = root / folder
            if not base.is_dir():
                continue
            runs = [base] if (base / "metrics.jsonl").is_file() else sorted(
                p for p in base.iterdir() if (p / "metrics.jsonl").is_file())
            out += [(name, run) for run in runs]
    return out


def replay(records: list[dict], config: MonitorConfig | None = None) -> list:
    """Every alert a fresh monitor raises over the records, in order."""
    monitor = CollapseMonitor(config)
    for record in records:
        monitor.update(record)
    return monitor.alerts


def judge_run(run: Path, config: MonitorConfig | None = None) -> dict:
    """One run: the study's collapse test, the replayed monitor's first critical, the live one.
    Without `config`, the monitor `mismatch monitor RUN` builds: the shipped rules, with
    `masked_loss` from the run's correction."""
    summary = summarize_run(run)
    config = config or MonitorConfig(masked_loss=run_masks_tokens(run))
    alerts = replay(summary.records, config)
    critical = [a for a in alerts if a.severity == "critical"]
    first = critical[0].step if critical else None
    live_path = run / "alerts.jsonl"
    live = [a for a in (read_metrics(live_path) if live_path.is_file() else [])
            if a.get("severity") == "critical"]
    halved = summary.halved_step
    return {
        "run": run.name, "steps": len(summary.records), "halved": halved,
        "first_critical": first,
        "signals": sorted({a.signal for a in critical if a.step == first}),
        "criticals": len(critical),
        "lead": None if halved is None or first is None else halved - first,
        "false": halved is None and first is not None,
        "live_first": min((a["step"] for a in live), default=None),
    }


def evaluate(config: MonitorConfig | None = None, root: Path = ROOT) -> dict[str, list[dict]]:
    """set → the judged runs of that set."""
    out: dict[str, list[dict]] = {}
    for name, run in study_runs(root):
        out.setdefault(name, []).append(judge_run(run, config))
    return out


def counts(rows: list[dict]) -> dict:
    """False criticals, collapses alerted before halving, median lead, over some runs."""
    held = [r for r in rows if r["halved"] is None]
    collapsed = [r for r in rows if r["halved"] is not None]
    leads = [r["lead"] for r in collapsed if r["lead"] is not None]
    return {
        "held": len(held), "false": [r["run"] for r in held if r["false"]],
        "live_false": [r["run"] for r in held if r["live_first"] is not None],
        "collapsed": len(collapsed),
        "before": sum(r["lead"] is not None and r["lead"] > 0 for r in collapsed),
        "missed": [r["run"] for r in collapsed if r["first_critical"] is None],
        "median_lead": statistics.median(leads) if leads else None,
        "min_lead": min(leads) if leads else None,
        "live_median_lead": statistics.median(live) if (live := [
            r["halved"] - r["live_first"] for r in collapsed if r["live_first"] is not None])
        else None,
    }


def _cell(x) -> str:
    return "–" if x is None else str(x)


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| set | run | steps | collapsed (reward halved at) | first critical (signals) | "
             "lead | false critical? | live monitor's first critical |",
             "|---|---|---|---|---|---|---|---|"]
    for name, rows in results.items():
        for r in rows:
            first = ("–" if r["first_critical"] is None
                     else f"{r['first_critical']} ({', '.join(r['signals'])})")
            lines.append(f"| {name} | {r['run']} | {r['steps']} | {_cell(r['halved'])} | {first} "
                         f"| {_cell(r['lead'])} | {'**yes**' if r['false'] else 'no'} "
                         f"| {_cell(r['live_first'])} |")
    return "\n".join(lines)


def summary(results: dict[str, list[dict]]) -> str:
    lines = []
    for name, rows in results.items():
        c = counts(rows)
        lines.append(
            f"- **{name}** ({len(rows)} runs): runs that never halved {c['held']}, with a critical "
            f"alert {len(c['false'])}{' (' + ', '.join(c['false']) + ')' if c['false'] else ''}"
            f" — live monitor {len(c['live_false'])}; collapses {c['collapsed']}, alerted before "
            f"the halving {c['before']}, never alerted {len(c['missed'])}; median lead "
            f"{_cell(c['median_lead'])} steps (min {_cell(c['min_lead'])}; live monitor "
            f"{_cell(c['live_median_lead'])})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", action="store_true",
                        help="write the table into reports/monitor.md between its markers")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "monitor.md")
    parser.add_argument("--json", type=Path, help="also write the judged runs as JSON here")
    args = parser.parse_args(argv)
    results = evaluate()
    text = (f"Command: `python scripts/monitor_on_study.py --report` (the shipped "
            f"`MonitorConfig`).\n\n{table(results)}\n\n{summary(results)}")
    print(text)
    if args.json:
        atomic_write_text(args.json, json.dumps(results, indent=1) + "\n")
    if args.report:
        doc = args.out.read_text()
        if BEGIN not in doc or END not in doc:
            raise SystemExit(f"{args.out}: no {BEGIN} ... {END} markers to write between")
        head, rest = doc.split(BEGIN, 1)
        atomic_write_text(args.out, f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
