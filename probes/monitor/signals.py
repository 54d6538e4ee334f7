"""The monitor's vocabulary: the signals it reads, the alerts it emits, and where they go.

`SIGNALS` are the field names of the native metrics format (what train/trainer.py logs and
`mismatch monitor` reads without an adapter); `as_number` is what counts as a value of one.
An `Alert` is one episode of trouble on one signal (the monitor debounces: one alert when a
signal crosses into a severity, not one per step). A `Sink` receives alerts as they fire and,
for exporters, the monitor's current view of every signal after each step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from mismatch.step_record import StepRecord

__all__ = ["SEVERITIES", "SIGNALS", "STALENESS_FIELDS", "Alert", "Sink", "alert_json", "as_number",
           "native_record", "severity_rank"]

SIGNALS = ("kl", "format_error_rate", "reward", "sc_tail_ratio", "mis_masked_fraction",
           "entropy", "response_length", "nonfinite_tokens")
"""The monitored signals, in the native metrics format's field names (`nonfinite_tokens`: the
trainer's count of non-finite log-probs at unmasked positions of the step)."""
SEVERITIES = ("warning", "critical")
STALENESS_FIELDS = ("staleness_max", "staleness_mean")
"""Fields passed on beside the signals: a first record at staleness 0 was sampled at the weights
it trains, so its KL is the probe of the KL's floor (state.py)."""


def native_record(record: StepRecord) -> dict[str, Any]:
    """A `mismatch train` step's record as the monitor reads it: its step, every signal and the
    staleness fields, read by attribute (a signal the schema renames fails here, not silently in
    the monitor). Older logs' `nonfinite_tokens` is None: not observed."""
    return {name: getattr(record, name) for name in ("step", *SIGNALS, *STALENESS_FIELDS)}


Severity = Literal["warning", "critical"]


def as_number(x: Any) -> float | None:
    """x as a float if it is a number (Python, numpy or torch scalar; not a bool), else None."""
    if type(x) is float or type(x) is int:
        return float(x)
    if isinstance(x, bool) or isinstance(x, (str, bytes)) or not hasattr(x, "__float__"):
        return None
    try:
        return float(x)
    except (TypeError, ValueError):  # e.g. an array of several values
        return None


def severity_name(severity: Any) -> Severity:
    """`severity` if it is one of SEVERITIES, else a ValueError naming them."""
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of {', '.join(SEVERITIES)}, got {severity!r}")
    return severity


def severity_rank(severity: str) -> int:
    """0 for warning, 1 for critical (for --fail-on comparisons)."""
    return SEVERITIES.index(severity_name(severity))


@dataclass(frozen=True)
class Alert:
    """One alert: at `step`, `signal` reached `severity` with `value` against `baseline`."""

    step: int
    signal: str
    severity: Severity
    value: float
    baseline: float | None
    message: str
    """One line a person reads: what happened, against what, and what to look at."""

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Alert:
        """An alerts.jsonl line back as an alert (null value or baseline: not finite / none);
        a line that is not one is a ValueError naming what it lacks."""
        try:
            value = d["value"]
            return cls(step=int(d["step"]), signal=str(d["signal"]),
                       severity=severity_name(d["severity"]),
                       value=float("nan") if value is None else float(value),
                       baseline=None if d["baseline"] is None else float(d["baseline"]),
                       message=str(d["message"]))
        except KeyError as exc:
            raise ValueError(f"alert record {d!r:.80} has no {exc.args[0]!r}") from None

    def to_json(self) -> dict:
        def clean(x):
            return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x

        return {"step": self.step, "signal": self.signal, "severity": self.severity,
                "value": clean(self.value), "baseline": clean(self.baseline),
                "message": self.message}


def _json_default(obj: Any) -> Any:
    """numpy / torch scalars and the like: as a float, non-finite as null."""
    x = float(obj)
    return x if math.isfinite(x) else None


def alert_json(alert: Alert) -> str:
    """The alert as one line of strict JSON (no NaN/Infinity): `Alert.to_json()`."""
    return json.dumps(alert.to_json(), default=_json_default, allow_nan=False,
                      separators=(",", ":"))


class Sink(Protocol):
    """Where alerts go. `emit` must not block the training loop for long (webhooks queue)."""

    def emit(self, alert: Alert) -> None: ...

    def observe(self, step: int, values: dict[str, float | None],
                baselines: dict[str, float | None]) -> None:
        """The latest value and baseline of every signal after `step` (exporters' gauges)."""
        ...

    def close(self) -> None: ...
