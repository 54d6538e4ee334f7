"""Where the live collapse monitor sends its alerts (`signals.Sink`s), and the set a run opens.

- `TerminalSink`: one rich-formatted line per alert on stderr (or a given Console).
- `JsonlSink`: one JSON object per alert appended to a file, one write per line.
- `PrometheusSink` (prometheus.py): an HTTP exporter (127.0.0.1 by default) with per-signal
  gauges and alert counters, for Prometheus + Alertmanager (`mismatch/monitor_rules.yml`).
- `WebhookSink` (webhook.py): HTTP POST of each alert's JSON from a background thread with a
  bounded queue.

`open_sinks` opens the ones a run asks for (`mismatch monitor`'s options), all or none. Every
sink's `emit` returns quickly: none blocks the training loop on the network.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from mismatch.probes.monitor.signals import Alert, Sink, alert_json

__all__ = ["JsonlSink", "TerminalSink", "open_sinks", "read_alerts"]


def _fmt(x: float | None) -> str:
    """A value as a person reads it: 4 significant digits, a dash for none."""
    if x is None:
        return "—"
    try:
        return f"{float(x):.4g}"
    except (TypeError, ValueError):
        return str(x)


# ------------------------------------------------------------------------------------
# Terminal


class TerminalSink:
    """One line per alert: severity (colored), step, signal, value vs baseline, message.

    console: a `rich.console.Console`; default one on stderr. Lines are soft-wrapped
    (one logical line however narrow the terminal) and the message is printed as
    text, never as rich markup.
    """

    STYLES = {"warning": "bold yellow", "critical": "bold red"}

    def __init__(self, console=None):
        if console is None:
            from rich.console import Console

            console = Console(stderr=True)
        self.console = console

    def emit(self, alert: Alert) -> None:
        from rich.text import Text

        line = Text()
        style = self.STYLES.get(alert.severity, "bold")
        line.append(f"{alert.severity.upper():<8}", style=style)
        line.append(f" step {alert.step}", style="dim")
        line.append(f"  {alert.signal}", style="bold")
        line.append(f"  {_fmt(alert.value)} vs baseline {_fmt(alert.baseline)}")
        message = " ".join(str(alert.message).split())
        if message:
            line.append(f"  {message}")
        self.console.print(line, soft_wrap=True, highlight=False)

    def observe(self, step: int, values: dict[str, float | None],
                baselines: dict[str, float | None]) -> None:
        """Nothing: the terminal shows alerts only."""

    def close(self) -> None:
        """Nothing to release (the console is not ours to close)."""


# ------------------------------------------------------------------------------------
# JSON lines


def read_alerts(path: str | os.PathLike) -> list[Alert]:
    """The alerts a `JsonlSink` wrote to `path`, in order (none if there is no file). A torn
    line (a crash mid-write; the sink starts the next alert on a new line) is left out."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        try:
            out.append(Alert.from_json(obj))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}; the run directory is damaged") from None
    return out


class JsonlSink:
    """Appends `Alert.to_json()` as one JSON line per alert to `path`.

    Parent directories are created. Each line goes to the file in a single
    `write(2)` on an O_APPEND descriptor, so a crash of the training process leaves
    whole lines only (the data is in the OS page cache once `emit` returns). If the
    file ends in a torn line from an earlier run (e.g. a full disk), the first alert
    starts on a new line.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        self._fd: int | None = os.open(self.path, flags, 0o644)
        self._lock = threading.Lock()
        self._needs_newline = False
        size = os.fstat(self._fd).st_size
        if size:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                self._needs_newline = f.read(1) != b"\n"

    def emit(self, alert: Alert) -> None:
        data = (alert_json(alert) + "\n").encode("utf-8")
        with self._lock:
            if self._fd is None:
                raise ValueError(f"JsonlSink({self.path}) is closed")
            if self._needs_newline:
                data = b"\n" + data
                self._needs_newline = False
            view = memoryview(data)
            while view:  # a regular file takes it in one write; loop on a short one
                view = view[os.write(self._fd, view):]

    def observe(self, step: int, values: dict[str, float | None],
                baselines: dict[str, float | None]) -> None:
        """Nothing: the file records alerts only."""

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def open_sinks(display: Sink, *, alert_log: Path | None = None, prometheus_port: int | None = None,
               webhook: str | None = None) -> list[Sink]:
    """`display` (where a person reads the alerts), then the sinks asked for in this order: an
    alert log, a webhook, a Prometheus exporter (last: its `.url` says where it serves). A
    one-line ValueError when one cannot start, after closing those already open."""
    sinks: list[Sink] = [display]
    try:
        if alert_log is not None:
            sinks.append(JsonlSink(alert_log))
        if webhook is not None:
            from mismatch.probes.monitor.webhook import WebhookSink

            sinks.append(WebhookSink(webhook))
        if prometheus_port is not None:
            if not 0 <= prometheus_port <= 65535:
                raise ValueError(f"--prometheus-port must be 0..65535, got {prometheus_port}")
            from mismatch.probes.monitor.prometheus import PrometheusSink

            try:
                sinks.append(PrometheusSink(port=prometheus_port))
            except (OSError, ImportError) as exc:
                raise ValueError(f"cannot serve Prometheus metrics on port {prometheus_port}: "
                                 f"{exc}") from None
    except (ValueError, OSError) as exc:
        for sink in sinks:
            sink.close()
        raise ValueError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    return sinks
