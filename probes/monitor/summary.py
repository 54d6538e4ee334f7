"""The end of a monitored run: its summary, and what went wrong when nothing could be read.

`run_summary` is the object `mismatch monitor --json` prints last (records, steps, alerts by
severity, what was skipped and why, truncations and rotations followed, the reader's notes);
`summary_line` is its one line for a person (saying so when too few steps were read for any
signal to be judged). `unreadable` is the error for a log of which not
one record could be read, saying what the chosen format expected; `sink_problems` what a sink
failed to deliver.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from mismatch.probes.monitor.formats import ADAPTERS, RecordReader
from mismatch.probes.monitor.formats.reader import expected_input
from mismatch.probes.monitor.signals import Sink
from mismatch.probes.monitor.state import CollapseMonitor

__all__ = ["run_summary", "summary_line", "steps_needed", "unreadable", "sink_problems"]


def steps_needed(monitor: CollapseMonitor) -> int | None:
    """How many steps a signal needs before it is judged: its warmup and baseline steps, then the
    first judged one (14 by default); None when baselines were given (judged from the start)."""
    cfg = monitor.config
    return None if cfg.baselines else cfg.warmup_steps + cfg.baseline_steps + 1


def run_summary(monitor: CollapseMonitor, reader: RecordReader, fail_on: str,
                steps: int | None = None) -> dict:
    """What a run's monitoring amounted to: records, steps, alerts, what was skipped and why.
    `steps`: how many distinct steps were read (None: not counted)."""
    tally, notes = reader.tally, reader.notes
    alerts = monitor.alerts
    return {
        "records": monitor.counts["records"], "first_step": monitor.first_step,
        "last_step": monitor.last_step, "steps": steps, "steps_needed": steps_needed(monitor),
        "alerts": {"warning": sum(a.severity == "warning" for a in alerts),
                   "critical": sum(a.severity == "critical" for a in alerts)},
        "fail_on": fail_on,
        "skipped": {"malformed_lines": tally["malformed"], "other_events": tally["other_events"],
                    "lines_without_signals": tally["no_signals"],
                    "nan_values": monitor.counts["nan"],
                    "non_numeric_values": monitor.counts["non_numeric"],
                    "missing_step": monitor.counts["missing_step"],
                    "bad_episodes": monitor.counts["bad_episodes"]},
        "episodes": monitor.counts["episodes"],
        "truncations": tally["truncations"], "rotations": tally["rotations"],
        "notes": {k: notes[k] for k in ("kl_squared", "zero_unset", "train_steps_moved")},
    }


_LABELS = {"malformed_lines": ("malformed line", "malformed lines"),
           "other_events": ("other event", "other events"),
           "lines_without_signals": ("line without signals", "lines without signals"),
           "nan_values": ("NaN value", "NaN values"),
           "non_numeric_values": ("non-numeric value", "non-numeric values"),
           "missing_step": ("record without a step", "records without a step"),
           "bad_episodes": ("unusable episode", "unusable episodes")}


def summary_line(summary: dict) -> str:
    """`run_summary` as the one line a person reads."""
    steps = ("" if summary["first_step"] is None
             else f" (steps {summary['first_step']}–{summary['last_step']})")
    a = summary["alerts"]
    skipped = ", ".join(f"{v} {_LABELS[k][v != 1]}" for k, v in summary["skipped"].items() if v)
    followed = ", ".join(f"{summary[k]} {k}" for k in ("truncations", "rotations") if summary[k])
    n, needed = summary.get("steps"), summary.get("steps_needed")
    few = (f"; only {n} step{'s' if n != 1 else ''}: too few to judge (the baseline needs "
           f"{needed})") if n is not None and needed is not None and n < needed else ""
    return (f"monitored {summary['records']} records{steps}: {a['critical']} critical, "
            f"{a['warning']} warning alert{'s' if a['warning'] != 1 else ''}"
            + few
            + (f"; skipped {skipped}" if skipped else "")
            + (f"; followed {followed}" if followed else ""))


def unreadable(file: Path, reader: RecordReader) -> str | None:
    """The one-line error for a log of which no record could be read: an empty one too (a gate
    that passes on nothing would pass on a run that never logged)."""
    t, name = reader.tally, reader.adapter.name
    if not t["lines"]:
        return (f"{file}: empty, not one record to monitor; --format {name} expects "
                f"{expected_input(reader.adapter)}")
    seen = t["json_objects"] + t["console_lines"]
    if not seen:
        what = "a JSON object" + (" or a console metrics line" if reader.console else "")
        return (f"{file}: read {t['lines']} lines, none is {what}; --format {name} expects "
                f"{expected_input(reader.adapter)}")
    if t["other_events"] == seen:
        return (f"{file}: read {seen} objects, all other events (no metric event); "
                f"--format {name} expects {expected_input(reader.adapter)}")
    return (f"{file}: read {seen} objects, none has a field --format {name} reads; check "
            f"--format ({', '.join(ADAPTERS)}) or name the fields with --map SIGNAL=FIELD")


def sink_problems(sinks: Iterable[Sink]) -> list[str]:
    """One line per sink that failed or dropped alerts (the webhook's `stats`)."""
    problems = []
    for sink in sinks:
        stats = getattr(sink, "stats", None)
        if isinstance(stats, dict) and (stats.get("failed") or stats.get("dropped")):
            problems.append(f"webhook: {stats.get('sent', 0)} sent, {stats.get('failed', 0)} "
                            f"failed, {stats.get('dropped', 0)} dropped")
    return problems
