"""`Adapter`: one framework's metric names → the monitor's native signals.

One parsed line (a dict) in, one native record (`{"step": ..., "<signal>": value, ...,
"episodes": [...]}`) out. An adapter lists, for each signal, candidate fields in order of
preference: the first one present in the line is used. A candidate may be

- a field name: `"critic/score/mean"`;
- a sum of fields, `"a+b"` (present when all are): a masked share logged in halves;
- a glob, `"train/agg/effective/*/reward/mean"`: the mean of all matching fields. `*` matches
  one path segment (no `/`), so `.../a/rewards/reward/mean` is not a `.../*/reward/mean`;
- any of these followed by `^2`: the value squared (see below).

**Proxies of the KL.** Where a framework logs no KL but a mean |Δ log p| or |Δ p| between
sampler and trainer, that proxy grows linearly with the scale of the log-ratio, while a KL grows
as its square (k3 ≈ ½ E[Δ²] for small Δ). Judged as it is, a proxy under-reacts: a 3.5× rise of
the KL moves it only 1.87×, below the 2× warning. Such candidates are therefore squared (`^2`)
before the monitor judges them as `kl`: the ratio to the run's own baseline is then that of a
KL (the absolute value is still not a KL). `--map kl=FIELD^2` does the same for a proxy of your
own.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from mismatch.probes.monitor.signals import SIGNALS, STALENESS_FIELDS, native_record
from mismatch.step_record import StepRecord

__all__ = ["Adapter", "parse_map", "glob_matches"]


@dataclass(frozen=True, kw_only=True)
class Adapter:
    """How to read one framework's metrics lines."""

    name: str
    fields: Mapping[str, tuple[str, ...]]
    """signal → candidate fields, first present wins (see the module docstring)."""
    step: tuple[str, ...] = ("step",)
    """Candidate fields of the step (the first present and not null wins)."""
    train_step: tuple[str, ...] = ()
    """Frameworks with two step axes (slime, Miles): candidate fields of the train-step axis.
    A line with one of these gets `"train_step"` in its record too, for
    `formats.reader.RecordReader` to put on the `step` axis."""
    envelope: tuple[str, ...] = ()
    """Keys whose dict value holds the metrics (merged into the line before lookup)."""
    event_type: str | None = None
    """If set, lines with a different `type` field are other events and are skipped."""
    zero_is_unset: frozenset[str] = frozenset()
    """Fields a framework logs as exactly 0.0 when it did not compute them (Miles' entropy_loss
    without entropy): a 0.0 there is no observation; the next candidate is tried."""
    description: str = ""
    """What the lines look like, in a few words."""
    step_records: bool = False
    """The native format: a line that reads as a `mismatch train` step
    (`StepRecord.from_json`) is read through that record (`signals.native_record`); any other
    line (another tool's, or a user's, with some of the native fields) field by field. A `--map`
    override turns this off: the fields it names are read as given."""

    def __post_init__(self) -> None:
        unknown = [s for s in self.fields if s not in SIGNALS]
        if unknown:
            raise ValueError(f"adapter {self.name}: unknown signal {unknown[0]!r}")

    def with_map(self, overrides: Mapping[str, str]) -> Adapter:
        """This adapter with `signal → field` overrides (`step` sets the step field)."""
        fields = dict(self.fields)
        step = self.step
        for signal, name in overrides.items():
            if signal == "step":
                step = (name,)
            else:
                fields[signal] = (name,)
        return replace(self, fields=fields, step=step, step_records=False)

    def flatten(self, line: Mapping[str, Any]) -> Mapping[str, Any]:
        """The line with its envelope's dict merged in."""
        if not (self.envelope and any(isinstance(line.get(k), Mapping) for k in self.envelope)):
            return line
        merged = {k: v for k, v in line.items() if k not in self.envelope}
        for key in self.envelope:
            inner = line.get(key)
            if isinstance(inner, Mapping):
                merged.update(inner)
        return merged

    def record(self, line: Mapping[str, Any], notes: Counter | None = None
               ) -> dict[str, Any] | None:
        """The native record of one parsed line, or None for a line that is another event.

        Values are passed through as found (NaN, strings): the monitor counts what it skips.
        A line without a step field gets `"step": None`; `"train_step"`: see above.
        `notes` counts what was read in a way the user should be told of: `kl_squared` (a
        proxy squared), `zero_unset` (a 0.0 that means "not computed", skipped).
        """
        if self.event_type is not None and line.get("type", self.event_type) != self.event_type:
            return None
        flat = self.flatten(line)
        if self.step_records:
            try:
                return native_record(StepRecord.from_json(flat))
            except ValueError:  # not a whole step record: field by field
                pass
        notes = notes if notes is not None else Counter()
        out: dict[str, Any] = {"step": _first(flat, self.step)}
        if self.train_step:
            train = _first(flat, self.train_step)
            if train is not None:
                out["train_step"] = train
        for signal, candidates in self.fields.items():
            for candidate in candidates:
                found, value = _lookup(flat, candidate)
                if not found:
                    continue
                if candidate in self.zero_is_unset and value == 0.0:
                    notes["zero_unset"] += 1
                    continue
                if candidate.endswith("^2"):
                    notes["kl_squared" if signal == "kl" else "squared"] += 1
                out[signal] = value
                break
        for passed in ("episodes", *STALENESS_FIELDS):
            if passed in flat:
                out[passed] = flat[passed]
        return out


def _first(flat: Mapping[str, Any], names: Sequence[str]) -> Any:
    for name in names:
        if flat.get(name) is not None:
            return flat[name]
    return None


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def glob_matches(pattern: str, key: str) -> bool:
    """Whether `key` matches `pattern`, where `*` stands for one path segment (no `/`)."""
    regex = "[^/]*".join(re.escape(part) for part in pattern.split("*"))
    return re.fullmatch(regex, key) is not None


def _lookup(flat: Mapping[str, Any], candidate: str) -> tuple[bool, Any]:
    """(present, value) of one candidate: a field, a `+` sum, a `*` glob mean, or any `^2`."""
    if candidate.endswith("^2") and candidate not in flat:
        found, value = _lookup(flat, candidate[:-2])
        number = _number(value) if found else None
        return found, (number * number if number is not None else value)
    if "*" in candidate:
        matches = [flat[k] for k in flat if glob_matches(candidate, k)]
        if not matches:
            return False, None
        numbers = [n for n in map(_number, matches) if n is not None]
        return True, (sum(numbers) / len(numbers) if numbers else matches[0])
    if "+" in candidate and candidate not in flat:
        parts = candidate.split("+")
        if not all(p in flat for p in parts):
            return False, None
        numbers = [_number(flat[p]) for p in parts]
        bad = [flat[p] for p, n in zip(parts, numbers) if n is None]
        return True, (bad[0] if bad else sum(numbers))
    if candidate in flat:
        return True, flat[candidate]
    return False, None


def parse_map(items: Sequence[str] | None) -> dict[str, str]:
    """["kl=my/kl", ...] → {"kl": "my/kl"}; a bad item is a one-line ValueError."""
    out: dict[str, str] = {}
    for item in items or ():
        signal, sep, name = item.partition("=")
        signal, name = signal.strip(), name.strip()
        if not sep or not signal or not name:
            raise ValueError(f"--map {item!r} is not SIGNAL=FIELD (e.g. kl=rollout_corr/k3_kl)")
        if signal not in SIGNALS and signal != "step":
            raise ValueError(f"--map {item!r}: unknown signal {signal!r}; signals: step, "
                             f"{', '.join(SIGNALS)}")
        out[signal] = name
    return out
