"""What the collapse monitor emits, and where it can send it.

An `Alert` is one episode of trouble on one signal (the monitor debounces: one alert when a
signal crosses into a severity, not one per step). A sink receives alerts as they fire and, for
exporters, the monitor's current view of every signal after each step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = ["SEVERITIES", "SIGNALS", "Alert", "Sink", "severity_rank"]

SIGNALS = ("kl", "format_error_rate", "reward", "sc_tail_ratio", "mis_masked_fraction",
           "entropy", "response_length")
"""The monitored signals, in the native metrics format's field names."""
SEVERITIES = ("warning", "critical")
Severity = Literal["warning", "critical"]


def severity_rank(severity: str) -> int:
    """0 for warning, 1 for critical (for --fail-on comparisons)."""
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of {', '.join(SEVERITIES)}, got {severity!r}")
    return SEVERITIES.index(severity)


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

    def to_json(self) -> dict:
        def clean(x):
            return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x

        return {"step": self.step, "signal": self.signal, "severity": self.severity,
                "value": clean(self.value), "baseline": clean(self.baseline),
                "message": self.message}


class Sink(Protocol):
    """Where alerts go. `emit` must not block the training loop for long (webhooks queue)."""

    def emit(self, alert: Alert) -> None: ...

    def observe(self, step: int, values: dict[str, float | None],
                baselines: dict[str, float | None]) -> None:
        """The latest value and baseline of every signal after `step` (exporters' gauges)."""
        ...

    def close(self) -> None: ...
