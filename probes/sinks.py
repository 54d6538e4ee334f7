"""Where the live collapse monitor sends its alerts (`probes.alerts.Sink`s).

- `TerminalSink`: one rich-formatted line per alert on stderr (or a given Console).
- `JsonlSink`: one JSON object per alert appended to a file, one write per line.
- `PrometheusSink`: an HTTP exporter (127.0.0.1 by default) with per-signal gauges
  and alert counters, for Prometheus + Alertmanager (`mismatch/monitor_rules.yml`).
- `WebhookSink`: HTTP POST of each alert's JSON from a background thread with a
  bounded queue.

Every sink's `emit` returns quickly: none blocks the training loop on the network.
"""

from __future__ import annotations

import collections
import http.client
import json
import math
import os
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from mismatch.probes.alerts import SEVERITIES, SIGNALS, Alert

__all__ = ["JsonlSink", "PrometheusSink", "TerminalSink", "WebhookSink",
           "alert_json"]


def _json_default(obj: Any) -> Any:
    """numpy / torch scalars and the like: as a float, non-finite as null."""
    x = float(obj)
    return x if math.isfinite(x) else None


def alert_json(alert: Alert) -> str:
    """The alert as one line of strict JSON (no NaN/Infinity): `Alert.to_json()`."""
    return json.dumps(alert.to_json(), default=_json_default, allow_nan=False,
                      separators=(",", ":"))


def _fmt(x: float | None) -> str:
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


# ------------------------------------------------------------------------------------
# Prometheus


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


# ------------------------------------------------------------------------------------
# Webhook


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirecting webhook is misconfigured: urllib would turn the POST into a GET."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class _Retryable(Exception):
    pass


class WebhookSink:
    """POSTs each alert's JSON (`Alert.to_json()`, application/json) to `url`.

    `emit` only enqueues (a bounded queue of `queue_size`; when it is full the oldest
    alert is dropped and counted), so the training loop never waits on the network.
    A daemon thread sends them in order, each up to `attempts` times: connection
    errors, timeouts, 5xx and 429 are retried after `backoff`, 2·`backoff`,
    4·`backoff`… seconds; other statuses (4xx, redirects) fail at once. Proxies from
    the environment are ignored. Standard library only.

    `.stats`: sent, failed (gave up after its attempts, or refused), dropped (pushed
    out of a full queue, emitted after close, or still queued when close gave up),
    retries (attempts beyond the first), queued (waiting now).

    `close(timeout)` sends what it can within `timeout` seconds, then stops the
    thread; a request in flight at the deadline is left to its own `timeout` on the
    daemon thread.
    """

    def __init__(self, url: str, timeout: float = 5, attempts: int = 3,
                 backoff: float = 0.5, queue_size: int = 1000):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"webhook url must be http(s)://..., got {url!r}")
        if attempts < 1 or queue_size < 1 or timeout <= 0 or backoff < 0:
            raise ValueError("need attempts >= 1, queue_size >= 1, timeout > 0 "
                             "and backoff >= 0")
        self.url = url
        self.timeout = float(timeout)
        self.attempts = int(attempts)
        self.backoff = float(backoff)
        self.queue_size = int(queue_size)
        self._opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), _NoRedirect())
        self._queue: collections.deque[bytes] = collections.deque()
        self._cond = threading.Condition()
        self._abort = threading.Event()  # close's deadline passed: stop sending
        self._closing = False
        self._counts = {"sent": 0, "failed": 0, "dropped": 0, "retries": 0}
        self._thread = threading.Thread(target=self._run, name="mismatch-webhook",
                                        daemon=True)
        self._thread.start()

    @property
    def stats(self) -> dict[str, int]:
        with self._cond:
            return {**self._counts, "queued": len(self._queue)}

    def emit(self, alert: Alert) -> None:
        body = alert_json(alert).encode("utf-8")
        with self._cond:
            if self._closing:
                self._counts["dropped"] += 1
                return
            if len(self._queue) >= self.queue_size:
                self._queue.popleft()
                self._counts["dropped"] += 1
            self._queue.append(body)
            self._cond.notify()

    def observe(self, step: int, values: dict[str, float | None],
                baselines: dict[str, float | None]) -> None:
        """Nothing: the webhook carries alerts only."""

    def close(self, timeout: float = 10.0) -> None:
        """Flush within `timeout` seconds, then stop the sender thread (idempotent)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(max(0.0, timeout))
        self._abort.set()
        with self._cond:
            self._counts["dropped"] += len(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(0.05)

    # -- sender thread -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue or self._abort.is_set():
                    return
                body = self._queue.popleft()
            self._deliver(body)

    def _deliver(self, body: bytes) -> None:
        for attempt in range(self.attempts):
            if attempt:
                with self._cond:
                    self._counts["retries"] += 1
            try:
                self._post(body)
            except _Retryable:
                if attempt + 1 < self.attempts and not self._abort.wait(
                        self.backoff * 2 ** attempt):
                    continue
                break
            except Exception:  # refused (4xx, redirect) or unusable: no retry
                break
            with self._cond:
                self._counts["sent"] += 1
            return
        with self._cond:
            self._counts["failed"] += 1

    def _post(self, body: bytes) -> None:
        request = urllib.request.Request(
            self.url, data=body, method="POST",
            headers={"Content-Type": "application/json",
                     "User-Agent": "mismatch-monitor"})
        try:
            with self._opener.open(request, timeout=self.timeout) as response:
                response.read()
        except urllib.error.HTTPError as e:
            e.close()
            if e.code >= 500 or e.code == 429:
                raise _Retryable(f"HTTP {e.code}") from e
            raise
        except (OSError, http.client.HTTPException) as e:
            # refused / reset / timed out (URLError and TimeoutError are OSErrors), or
            # a receiver that dropped the connection mid-response (BadStatusLine, ...)
            raise _Retryable(str(e)) from e
