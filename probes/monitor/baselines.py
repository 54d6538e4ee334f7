"""Baselines from a known-good run, so that a new run is judged from its first steps.

A live monitor measures each signal's baseline over steps 4–13 of the run it watches (state.py)
and judges nothing before. A known-good run of the same setup already holds those medians:
`baselines_from(records)` takes them the way a live monitor would, and
`MonitorConfig(baselines=...)` hands them to a monitor of a new run. `baselines_from_log` does
the same for a metrics log on disk (`mismatch monitor --baseline`), read with the adapter of the
run being watched.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Iterable, Mapping

from mismatch.probes.monitor.follow import read_records, resolve_log
from mismatch.probes.monitor.formats import Adapter, RecordReader
from mismatch.probes.monitor.rules import MonitorConfig
from mismatch.probes.monitor.state import CollapseMonitor

__all__ = ["baselines_from", "baselines_from_log"]


def baselines_from(records: Iterable[Mapping[str, Any]],
                   config: MonitorConfig | None = None) -> dict[str, float]:
    """The baselines a known-good run's `records` set, for `MonitorConfig(baselines=...)`: each
    judged signal's median over the same observations a live monitor would take (after
    `warmup_steps`, the next `baseline_steps`; the reward's median there starts its peak). A
    monitor given them judges a new run from its first full smoothing window instead of after
    warmup + baseline steps. Signals the records hold too few observations of are left out."""
    cfg = config or MonitorConfig()
    reader = CollapseMonitor(MonitorConfig(rules=cfg.rules, max_format_errors=cfg.max_format_errors,
                                           max_turns=cfg.max_turns))
    seen: dict[str, list[float]] = {s: [] for s in cfg.rules}
    for record in records:
        for signal, value in reader.read(record).items():
            if signal in seen:
                seen[signal].append(value)
    window = slice(cfg.warmup_steps, cfg.warmup_steps + cfg.baseline_steps)
    return {s: statistics.median(v[window]) for s, v in seen.items()
            if len(v[window]) == cfg.baseline_steps}


def baselines_from_log(path: Path, adapter: Adapter) -> dict[str, float]:
    """`baselines_from` over the records of a known-good run's log (read with `adapter`); a
    one-line ValueError when the log is missing or too short for a baseline."""
    try:  # any log the monitor reads: lines, trainer_state.json, TensorBoard, W&B, a run folder
        resolve_log(path, adapter)
    except ValueError as exc:
        raise ValueError(f"--baseline {exc}; pass a finished run's metrics log") from None
    records = list(read_records(path, RecordReader(adapter), follow=False))
    found = baselines_from(records)
    if not found:
        raise ValueError(f"--baseline {path}: {len(records)} readable records, too few for a "
                         "baseline (it needs steps 4-13); pass a longer known-good run")
    return found
