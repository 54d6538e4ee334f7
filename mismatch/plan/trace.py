"""The inputs of the fleet simulation (mismatch.plan.simulate): a capacity trace — GPUs per
sampler group over time, read from CSV `time_s,group,gpus` — and episode lengths."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


from . import PlanInputError
from .spec import PlanGroup

__all__ = ["CapacityTrace", "TRACE_HEADER", "load_trace", "episode_lengths_from_metrics"]

TRACE_HEADER = ("time_s", "group", "gpus")


@dataclass(frozen=True)
class CapacityTrace:
    """Each group's GPU count over time: {group: ((time_s, gpus), ...)} sorted by time, a step
    function (the count holds until the next change)."""

    changes: dict[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    path: str = "<trace>"

    def at(self, group: str, t: float, default: int) -> int:
        """GPUs of `group` at time t (the last change at or before t; `default` before the
        first)."""
        n = default
        for when, gpus in self.changes.get(group, ()):
            if when > t:
                break
            n = gpus
        return n

    def to_json(self) -> dict:
        return {g: [[t, n] for t, n in rows] for g, rows in self.changes.items()}


def _trace_error(path: str, line: int, msg: str) -> PlanInputError:
    return PlanInputError(f"{path}, line {line}: {msg}")


def load_trace(path: Path | str, groups: Iterable[PlanGroup | str]) -> CapacityTrace:
    """Read a capacity trace: CSV with the header `time_s,group,gpus` and one row per change
    (seconds from the run's start, a group's name, its GPU count from then on), rows in
    non-decreasing time; blank lines and lines starting with `#` are skipped. Raises
    PlanInputError naming the file, the line and what to fix."""
    path = Path(path)
    names = {g if isinstance(g, str) else g.name for g in groups}
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlanInputError(f"cannot read capacity trace {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise PlanInputError(f"{path}: not a text file; a capacity trace is CSV with the header "
                             f"time_s,group,gpus") from None
    lines = text.splitlines()
    rows = [[] if ln.lstrip().startswith("#") else next(csv.reader([ln]), [])
            for ln in lines]  # one line at a time: a stray quote cannot swallow the next rows
    header_at = next((i for i, r in enumerate(rows) if any(c.strip() for c in r)), None)
    if header_at is None:
        raise PlanInputError(f"{path}: empty; a capacity trace is CSV with the header "
                             f"time_s,group,gpus and one row per change")
    header = tuple(c.strip() for c in rows[header_at])
    if header != TRACE_HEADER:
        raise _trace_error(str(path), header_at + 1, f"the header is {','.join(header)!r}; "
                           f"write time_s,group,gpus")
    changes: dict[str, list[tuple[float, int]]] = {}
    last_t = -math.inf
    for i in range(header_at + 1, len(rows)):
        row, line = rows[i], i + 1
        if not any(c.strip() for c in row):
            continue
        if len(row) != 3:
            raise _trace_error(str(path), line, f"{len(row)} fields; write time_s,group,gpus "
                               f"(3 fields)")
        t_raw, group, n_raw = (c.strip() for c in row)
        try:
            t = float(t_raw)
        except ValueError:
            raise _trace_error(str(path), line, f"time_s {t_raw!r} is not a number; write "
                               f"seconds from the run's start") from None
        if not math.isfinite(t) or t < 0:
            raise _trace_error(str(path), line, f"time_s {t_raw!r} must be finite and ≥ 0")
        if t < last_t:
            raise _trace_error(str(path), line, f"time_s {t_raw} comes before the previous "
                               f"row's {last_t:g}; sort the rows by time")
        if group not in names:
            known = ", ".join(sorted(names)) or "none"
            raise _trace_error(str(path), line, f"unknown group {group!r}; the fleet's groups: "
                               f"{known}")
        try:
            gpus = float(n_raw)
        except ValueError:
            raise _trace_error(str(path), line, f"gpus {n_raw!r} is not a number; write a whole "
                               f"number of GPUs ≥ 0") from None
        if not math.isfinite(gpus) or gpus < 0 or gpus != int(gpus):
            raise _trace_error(str(path), line, f"gpus {n_raw!r} must be a whole number ≥ 0")
        rows_g = changes.setdefault(group, [])
        if rows_g and rows_g[-1][0] == t:
            raise _trace_error(str(path), line, f"a second row for {group} at time_s {t_raw}; "
                               f"keep one row per group and time")
        rows_g.append((t, int(gpus)))
        last_t = t
    return CapacityTrace({g: tuple(r) for g, r in changes.items()}, str(path))


def episode_lengths_from_metrics(path: Path | str,
                                 fallback: Sequence[float] | None = None) -> list[float]:
    """Episode lengths (sampled tokens) from a `mismatch train` metrics.jsonl, else `fallback`.

    A step's record holds its `sampled_tokens` and `n_episodes`, not each episode's length, so
    the list holds each step's mean episode length (sampled_tokens / n_episodes), one per step:
    the run's drift in length is kept, but the spread of means is narrower than the spread of
    episodes — give per-episode lengths as `fallback` (or directly to `simulate`) where you have
    them. With no usable record the fallback is returned; with none given, PlanInputError."""
    path = Path(path)
    out: list[float] = []
    problem = None
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        lines, problem = [], f"cannot read {path}: {exc.strerror or exc}"
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        tokens, eps = rec.get("sampled_tokens"), rec.get("n_episodes")
        if (isinstance(tokens, (int, float)) and isinstance(eps, (int, float))
                and not isinstance(tokens, bool) and eps > 0 and tokens > 0):
            out.append(float(tokens) / float(eps))
    if out:
        return out
    if fallback is not None:
        return [float(x) for x in fallback]
    raise PlanInputError(problem or f"{path}: no step with sampled_tokens and n_episodes; give "
                         f"the `mismatch train` metrics.jsonl of a run, or a list of lengths")


def _check_groups(groups: Sequence[PlanGroup]) -> None:
    if not groups:
        raise PlanInputError("simulate: no groups")
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise PlanInputError(f"simulate: two groups share a name in {', '.join(names)}")
    for g in groups:
        for figure, positive in (("tokens_per_s", True), ("price_per_hour", False)):
            v = getattr(g, figure)
            if v is None or not math.isfinite(v) or v < 0 or (positive and v == 0):
                raise PlanInputError(f"group {g.name!r}: {figure} must be a number "
                                     f"{'>' if positive else '≥'} 0, got {v!r}; give it (or let "
                                     f"`mismatch plan` fill it)")
        if g.masked is not None and not (0 <= g.masked < 1):
            raise PlanInputError(f"group {g.name!r}: masked must be in [0, 1), got {g.masked!r}")
