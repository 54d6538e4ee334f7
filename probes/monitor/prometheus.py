"""`PrometheusSink`: the monitor's signals and alerts as a Prometheus exporter.

Per-signal gauges (value, baseline), the last step, and per signal × severity alert counters
and "active" holds, served over HTTP on the sink's own server (127.0.0.1 by default), for
Prometheus + Alertmanager with the rules shipped in `mismatch/monitor_rules.yml`. Needs
`prometheus_client` (imported when a sink is made).
"""

from __future__ import annotations

import math
import socket
import threading

from mismatch.probes.monitor.signals import SEVERITIES, SIGNALS, Alert

__all__ = ["PrometheusSink"]


class PrometheusSink:
    """A Prometheus exporter of the monitor's signals and alerts, on its own server.

    Metrics (the names `mismatch/monitor_rules.yml` uses; `METRICS` as scraped):

    - `mismatch_signal_value{signal}`, `mismatch_signal_baseline{signal}`: the latest
      value and baseline of each signal, from `observe` (NaN while it has none).
    - `mismatch_step`: the last step `observe` saw.
    - `mismatch_alerts_total{signal,severity}`: alerts emitted (counter).
    - `mismatch_alert_active{signal,severity}`: 1 for the severity of the signal's
      last alert, 0 otherwise.

    When an alert clears: the monitor emits one alert when a signal crosses into a
    severity and says nothing when it recovers, so `mismatch_alert_active` is a hold.
    An alert on a signal sets its severity's series to 1 (and the other severity's
    to 0); both return to 0 at the first `observe` that has a value for that signal
    at least `clear_after` steps after the signal's last alert. A new alert on the
    signal restarts the hold. A problem that persists without a new alert therefore
    shows as active for `clear_after` steps only; the value and baseline gauges show
    the signal itself all along. Every signal × severity series exists from the
    start, at 0.

    port: 0 picks a free port (see `.port`). host: the address to bind, 127.0.0.1 by
    default; pass "0.0.0.0" (or "::") yourself to expose the metrics beyond this
    machine. registry: a `prometheus_client.CollectorRegistry`; default a new one per
    sink, so several sinks in one process never clash. `close()` stops the server
    and frees the port (it takes up to 0.5 s: the server's poll interval).
    """

    METRICS = ("mismatch_signal_value", "mismatch_signal_baseline",
               "mismatch_step", "mismatch_alerts_total", "mismatch_alert_active")
    """The metric names as they appear in a scrape (the counter with `_total`)."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1", registry=None, *,
                 clear_after: int = 50, signals: tuple[str, ...] = SIGNALS):
        try:
            import prometheus_client
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError("PrometheusSink needs prometheus_client: "
                              "pip install 'prometheus_client>=0.20'") from e
        if clear_after < 1:
            raise ValueError(f"clear_after must be >= 1 step, got {clear_after}")
        from prometheus_client import CollectorRegistry, Counter, Gauge

        if registry is None:
            registry = CollectorRegistry(auto_describe=True)
        self.registry = reg = registry
        self.clear_after = int(clear_after)
        self._value = Gauge("mismatch_signal_value",
                            "Latest value of a monitored signal.",
                            ["signal"], registry=reg)
        self._baseline = Gauge("mismatch_signal_baseline",
                               "Baseline the monitor compares a signal against.",
                               ["signal"], registry=reg)
        self._step = Gauge("mismatch_step",
                           "Last training step the monitor observed.", registry=reg)
        self._alerts = Counter("mismatch_alerts",
                               "Alerts emitted by the collapse monitor.",
                               ["signal", "severity"], registry=reg)
        self._active = Gauge("mismatch_alert_active",
                             "1 for the severity of the signal's last alert until it "
                             f"clears (no alert on the signal for {self.clear_after} "
                             "observed steps).",
                             ["signal", "severity"], registry=reg)
        for signal in signals:
            self._value.labels(signal=signal).set(math.nan)
            self._baseline.labels(signal=signal).set(math.nan)
            for severity in SEVERITIES:
                self._alerts.labels(signal=signal, severity=severity)
                self._active.labels(signal=signal, severity=severity).set(0)
        self._lock = threading.Lock()
        self._last_alert_step: dict[str, int] = {}
        self._closed = False

        started = prometheus_client.start_http_server(port, addr=host,
                                                      registry=reg)
        if not (isinstance(started, tuple) and len(started) == 2):
            raise RuntimeError(
                "PrometheusSink needs prometheus_client>=0.20 (start_http_server "
                "returning its server and thread, so that close() can stop it)")
        self._server, self._thread = started
        bound = self._server.server_address
        self.host: str = bound[0]
        self.port: int = int(bound[1])
        self.address_family = self._server.address_family

    @property
    def url(self) -> str:
        """The metrics endpoint, e.g. http://127.0.0.1:9464/metrics."""
        ipv6 = self.address_family == socket.AF_INET6
        host = f"[{self.host}]" if ipv6 else self.host
        return f"http://{host}:{self.port}/metrics"

    def emit(self, alert: Alert) -> None:
        with self._lock:
            signal = alert.signal
            self._alerts.labels(signal=signal, severity=alert.severity).inc()
            for severity in SEVERITIES:
                self._active.labels(signal=signal, severity=severity).set(
                    1 if severity == alert.severity else 0)
            self._last_alert_step[signal] = int(alert.step)

    def observe(self, step: int, values: dict[str, float | None],
                baselines: dict[str, float | None]) -> None:
        with self._lock:
            self._step.set(step)
            for signal in set(values) | set(baselines):
                value, baseline = values.get(signal), baselines.get(signal)
                self._value.labels(signal=signal).set(_gauge_value(value))
                self._baseline.labels(signal=signal).set(_gauge_value(baseline))
            for signal, last in list(self._last_alert_step.items()):
                seen = values.get(signal) is not None
                if seen and step - last >= self.clear_after:
                    for severity in SEVERITIES:
                        self._active.labels(signal=signal, severity=severity).set(0)
                    del self._last_alert_step[signal]

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and release the port (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._server.shutdown()  # ends serve_forever
        self._server.server_close()  # closes the listening socket: port freed
        self._thread.join(timeout)


def _gauge_value(x: float | None) -> float:
    if x is None:
        return math.nan
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan
