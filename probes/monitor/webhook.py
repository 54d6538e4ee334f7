"""`WebhookSink`: each alert's JSON POSTed to a URL, off the training loop's thread.

`emit` only enqueues; a daemon thread sends, with retries on transient failures (connection
errors, timeouts, 5xx, 429) and none on refusals. Standard library only; it imports
urllib.request, which is why the package's `__init__` leaves this module to be imported on use.
"""

from __future__ import annotations

import collections
import http.client
import threading
import urllib.error
import urllib.request

from mismatch.probes.monitor.signals import Alert, alert_json

__all__ = ["WebhookSink"]


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
