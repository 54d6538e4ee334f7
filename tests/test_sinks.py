"""Alert sinks of the collapse monitor (probes/monitor/: sinks.py, prometheus.py, webhook.py)
and its Prometheus rules.

Everything runs on loopback (127.0.0.1) with real sockets: the exporter is scraped
over HTTP, webhooks go to a local http.server in a thread. Every wait has a
deadline, so a hang fails instead of stalling the suite.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from mismatch.probes.monitor import (SEVERITIES, SIGNALS, Alert, JsonlSink, PrometheusSink,
                                     TerminalSink)
from mismatch.probes.monitor.webhook import WebhookSink

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "mismatch" / "monitor_rules.yml"
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
needs_prometheus = pytest.mark.skipif(
    importlib.util.find_spec("prometheus_client") is None,
    reason="needs prometheus_client")


def kl_alert(step: int = 7, severity: str = "critical",
             message: str = "KL 3.2x baseline") -> Alert:
    return Alert(step=step, signal="kl", severity=severity, value=3.2e-3,
                 baseline=1e-3, message=message)


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.005)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def scrape(url: str) -> tuple[str, dict[tuple[str, frozenset], float]]:
    """GET the metrics page: (content type, {(sample name, labels): value})."""
    from prometheus_client.parser import text_string_to_metric_families

    with NO_PROXY.open(url, timeout=5) as r:
        ctype = r.headers["Content-Type"]
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return ctype, samples


def sample(samples, name, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prom():
    sinks = []

    def make(**kw):
        sink = PrometheusSink(**kw)
        sinks.append(sink)
        return sink

    yield make
    for sink in sinks:
        sink.close()


# ------------------------------------------------------------------------------------
# Prometheus


@needs_prometheus
def test_prometheus_scrape_shows_gauges_and_alert_series(prom):
    sink = prom()
    sink.observe(7, {"kl": 1.5e-3, "reward": 0.42, "entropy": None},
                 {"kl": 1e-3, "reward": 0.5, "entropy": 1.2})
    sink.emit(kl_alert(step=7))
    sink.observe(8, {"kl": 3.2e-3, "reward": 0.40, "entropy": 1.1},
                 {"kl": 1e-3, "reward": 0.5, "entropy": 1.2})

    ctype, s = scrape(sink.url)
    assert ctype.startswith("text/plain")
    assert sink.url == f"http://127.0.0.1:{sink.port}/metrics"
    assert sample(s, "mismatch_step") == 8
    value, baseline = "mismatch_signal_value", "mismatch_signal_baseline"
    total, active = "mismatch_alerts_total", "mismatch_alert_active"
    assert sample(s, value, signal="kl") == pytest.approx(3.2e-3)
    assert sample(s, baseline, signal="kl") == pytest.approx(1e-3)
    assert sample(s, value, signal="reward") == pytest.approx(0.40)
    assert sample(s, value, signal="entropy") == pytest.approx(1.1)
    assert sample(s, total, signal="kl", severity="critical") == 1
    assert sample(s, total, signal="kl", severity="warning") == 0
    assert sample(s, active, signal="kl", severity="critical") == 1
    assert sample(s, active, signal="kl", severity="warning") == 0
    # every signal × severity series exists from the start, at 0; no value is NaN
    for signal in SIGNALS:
        for severity in SEVERITIES:
            assert sample(s, total, signal=signal, severity=severity) >= 0
            assert sample(s, active, signal=signal, severity=severity) in (0, 1)
    assert sample(s, total, signal="reward", severity="warning") == 0
    assert math.isnan(sample(s, value, signal="sc_tail_ratio"))

    # a missing value reads NaN, not the previous one
    sink.observe(9, {"kl": None}, {"kl": 1e-3})
    _, s = scrape(sink.url)
    assert math.isnan(sample(s, value, signal="kl"))
    assert sample(s, "mismatch_step") == 9


@needs_prometheus
def test_prometheus_alert_active_hold_and_clear(prom):
    sink = prom(clear_after=5)
    reg = sink.registry

    def active(severity):
        return reg.get_sample_value("mismatch_alert_active",
                                    {"signal": "kl", "severity": severity})

    sink.emit(kl_alert(step=10, severity="warning"))
    assert (active("warning"), active("critical")) == (1, 0)
    sink.emit(kl_alert(step=12, severity="critical"))  # the last severity wins
    assert (active("warning"), active("critical")) == (0, 1)
    assert reg.get_sample_value("mismatch_alerts_total",
                                {"signal": "kl", "severity": "warning"}) == 1
    for step in range(13, 17):  # 4 steps after the last alert: held
        sink.observe(step, {"kl": 1e-3}, {"kl": 1e-3})
        assert active("critical") == 1
    sink.observe(17, {"kl": None}, {"kl": 1e-3})  # no kl value: does not clear
    assert active("critical") == 1
    sink.observe(18, {"kl": 1e-3, "reward": 0.5}, {"kl": 1e-3})
    assert (active("warning"), active("critical")) == (0, 0)
    sink.emit(kl_alert(step=19, severity="critical"))  # a new episode
    assert active("critical") == 1


@needs_prometheus
def test_prometheus_binds_loopback_and_close_frees_the_port(prom):
    sink = prom()
    assert sink.host == "127.0.0.1"
    assert sink._server.server_address == ("127.0.0.1", sink.port)
    assert sink._server.socket.getsockname() == ("127.0.0.1", sink.port)
    assert sink.port > 0
    _, samples = scrape(sink.url)
    assert ("mismatch_step", frozenset()) in samples

    sink.close()
    sink.close()  # idempotent
    assert not sink._thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", sink.port), timeout=2).close()
    again = prom(port=sink.port)  # the port is free for the next exporter
    assert again.port == sink.port
    _, samples = scrape(again.url)
    assert ("mismatch_step", frozenset()) in samples


@needs_prometheus
def test_prometheus_sinks_in_one_process_do_not_clash(prom):
    a, b = prom(), prom()
    a.observe(1, {"kl": 1.0}, {})
    b.observe(2, {"kl": 2.0}, {})
    assert a.port != b.port
    assert sample(scrape(a.url)[1], "mismatch_signal_value", signal="kl") == 1.0
    assert sample(scrape(b.url)[1], "mismatch_signal_value", signal="kl") == 2.0


# ------------------------------------------------------------------------------------
# Rules file


@needs_prometheus
def test_rules_file_parses_and_uses_only_exported_metrics(prom):
    text = RULES.read_text()
    assert text.startswith("#") and "rule_files" in text  # says how to load it
    doc = yaml.safe_load(text)
    rules = [r for group in doc["groups"] for r in group["rules"]]
    assert all(group["name"] for group in doc["groups"])
    names = {r["alert"] for r in rules}
    assert {"MismatchKLCritical", "MismatchFormatErrors", "MismatchRewardFall",
            "MismatchSignalWarning", "MismatchMonitorStale"} <= names
    assert len(names) == len(rules)

    sink = prom()
    _, samples = scrape(sink.url)
    exported = {name for name, _ in samples if not name.endswith("_created")}
    assert exported == set(PrometheusSink.METRICS)

    label_values = {"signal": set(SIGNALS), "severity": set(SEVERITIES)}
    for rule in rules:
        keys = {"alert", "expr", "for", "labels", "annotations"}
        assert set(rule) == keys, rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["for"]
        assert rule["labels"]["severity"] in (*SEVERITIES, "{{ $labels.severity }}")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        expr = rule["expr"]
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")
        used = set(re.findall(r"\bmismatch_[a-z_]+\b", expr))
        assert used and used <= exported, (rule["alert"], used - exported)
        matchers = re.findall(r'(\w+)\s*(?:=~|!~|!=|=)\s*"([^"]*)"', expr)
        for label, value in matchers:
            assert label in label_values, (rule["alert"], label)
            assert set(value.split("|")) <= label_values[label], (rule["alert"], value)
    # metric names anywhere in the file (templates, comments) are exported ones too
    assert set(re.findall(r"\bmismatch_[a-z_]+\b", text)) <= exported
    kl = next(r for r in rules if r["alert"] == "MismatchKLCritical")
    assert kl["for"] == "1m" and kl["labels"]["severity"] == "critical"
    assert 'signal="kl"' in kl["expr"] and 'severity="critical"' in kl["expr"]
    stale = next(r for r in rules if r["alert"] == "MismatchMonitorStale")
    assert "changes(mismatch_step[30m]) == 0" in stale["expr"]


# ------------------------------------------------------------------------------------
# Webhook


class Receiver:
    """A local webhook receiver: records each POST, answers `codes` in order, then
    200. hold_first: the first answer waits for `release` (`entered` is set on the
    first request)."""

    def __init__(self, codes=(), hold_first: bool = False):
        self.codes = list(codes)
        self.requests: list[dict] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()
        lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with lock:
                    receiver.requests.append({"path": self.path, "body": body,
                                              "headers": dict(self.headers)})
                    code = receiver.codes.pop(0) if receiver.codes else 200
                receiver.entered.set()
                receiver.release.wait(10)
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def bodies(self):
        return [json.loads(r["body"]) for r in self.requests]

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def receiver():
    made = []

    def make(**kw):
        r = Receiver(**kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def test_webhook_posts_the_alert_json(receiver):
    rx = receiver()
    sink = WebhookSink(rx.url, timeout=5, backoff=0.01)
    alerts = [kl_alert(step=7),
              Alert(step=8, signal="reward", severity="warning", value=float("nan"),
                    baseline=None, message="reward fell 12% under its baseline")]
    for a in alerts:
        sink.emit(a)
    sink.close(timeout=10)
    assert sink.stats == dict(sent=2, failed=0, dropped=0, retries=0, queued=0)
    assert rx.bodies() == [a.to_json() for a in alerts]
    assert rx.bodies()[1]["value"] is None
    for r in rx.requests:
        assert r["path"] == "/hook"
        assert r["headers"]["Content-Type"] == "application/json"
    assert json.loads(rx.requests[0]["body"]) == {
        "step": 7, "signal": "kl", "severity": "critical", "value": 3.2e-3,
        "baseline": 1e-3, "message": "KL 3.2x baseline"}


def test_webhook_retries_5xx_then_succeeds_but_not_4xx(receiver):
    rx = receiver(codes=[500, 503])
    sink = WebhookSink(rx.url, timeout=5, attempts=3, backoff=0.01)
    sink.emit(kl_alert())
    sink.close(timeout=10)
    assert sink.stats == dict(sent=1, failed=0, dropped=0, retries=2, queued=0)
    assert rx.bodies() == [kl_alert().to_json()] * 3

    rx = receiver(codes=[400])
    sink = WebhookSink(rx.url, timeout=5, attempts=3, backoff=0.01)
    sink.emit(kl_alert())
    sink.close(timeout=10)
    assert sink.stats == dict(sent=0, failed=1, dropped=0, retries=0, queued=0)
    assert len(rx.requests) == 1


def test_webhook_unreachable_never_blocks_emit_and_counts_failures():
    url = f"http://127.0.0.1:{free_port()}/hook"  # nothing listens: refused
    sink = WebhookSink(url, timeout=1, attempts=2, backoff=0.001)
    start = time.perf_counter()
    for step in range(100):
        sink.emit(kl_alert(step=step))
    elapsed = time.perf_counter() - start
    assert elapsed < 0.05, f"100 emits took {elapsed * 1e3:.1f} ms"
    wait_for(lambda: sink.stats["failed"] == 100, timeout=30, what="100 failures")
    sink.close(timeout=5)
    assert sink.stats == dict(sent=0, failed=100, dropped=0, retries=100, queued=0)


def test_webhook_hanging_receiver_never_blocks_emit_or_close():
    with socket.socket() as listener:  # connections complete (backlog), no answer
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/hook"
        sink = WebhookSink(url, timeout=0.5, attempts=3, backoff=0.01)
        start = time.perf_counter()
        for step in range(100):
            sink.emit(kl_alert(step=step))
        elapsed = time.perf_counter() - start
        assert elapsed < 0.05, f"100 emits took {elapsed * 1e3:.1f} ms"
        wait_for(lambda: sink.stats["queued"] == 99, timeout=5, what="first POST")
        start = time.perf_counter()
        sink.close(timeout=0.2)
        assert time.perf_counter() - start < 1.0  # its timeout, not 3 × 0.5 s
        assert sink.stats["dropped"] == 99 and sink.stats["queued"] == 0
        wait_for(lambda: sink.stats["failed"] == 1, timeout=5, what="in-flight POST")
        sink.emit(kl_alert(step=100))  # after close: counted, not queued
        assert sink.stats == dict(sent=0, failed=1, dropped=100, retries=0, queued=0)


def test_webhook_queue_overflow_drops_the_oldest(receiver):
    rx = receiver(hold_first=True)
    sink = WebhookSink(rx.url, timeout=10, attempts=1, queue_size=5)
    sink.emit(kl_alert(step=0))
    assert rx.entered.wait(10), "the first POST never arrived"
    for step in range(1, 11):
        sink.emit(kl_alert(step=step))
    assert sink.stats["dropped"] == 5 and sink.stats["queued"] == 5
    rx.release.set()
    sink.close(timeout=10)
    assert [b["step"] for b in rx.bodies()] == [0, 6, 7, 8, 9, 10]
    assert sink.stats == dict(sent=6, failed=0, dropped=5, retries=0, queued=0)


# ------------------------------------------------------------------------------------
# JSON lines and terminal


def test_jsonl_appends_whole_lines(tmp_path):
    path = tmp_path / "run" / "monitor" / "alerts.jsonl"  # parent dirs created
    sink = JsonlSink(path)
    alerts = [kl_alert(step=s) for s in range(3)]
    alerts.append(Alert(step=3, signal="entropy", severity="warning",
                        value=float("inf"), baseline=2.0,
                        message='entropy "collapsed"\nsee step 3'))
    for a in alerts:
        sink.emit(a)
        assert path.read_text().endswith("\n")  # on disk per line, before close
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        a.to_json() for a in alerts]
    sink.close()
    sink.close()
    with pytest.raises(ValueError):
        sink.emit(alerts[0])

    again = JsonlSink(path)  # appends
    again.emit(kl_alert(step=4))
    again.close()
    steps = [json.loads(x)["step"] for x in path.read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]

    torn = tmp_path / "torn.jsonl"  # an earlier run died mid-line
    torn.write_text('{"step": 1, "sig')
    sink = JsonlSink(torn)
    sink.emit(kl_alert(step=2))
    sink.close()
    lines = torn.read_text().splitlines()
    assert lines[0] == '{"step": 1, "sig'
    assert json.loads(lines[1]) == kl_alert(step=2).to_json()


def test_jsonl_crash_leaves_whole_lines(tmp_path):
    path = tmp_path / "alerts.jsonl"
    code = (
        "import os, sys\n"
        "from mismatch.probes.monitor import Alert, JsonlSink\n"
        "sink = JsonlSink(sys.argv[1])\n"
        "for step in range(200):\n"
        "    sink.emit(Alert(step=step, signal='kl', severity='critical',\n"
        "                    value=3.2e-3, baseline=1e-3, message='x' * 3000))\n"
        "os._exit(3)\n"  # dies without close or any flush
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT,
                            env=env, capture_output=True, timeout=60)
    assert result.returncode == 3, result.stderr.decode()
    data = path.read_bytes()
    assert data.endswith(b"\n")
    steps = [json.loads(line)["step"] for line in data.decode().splitlines()]
    assert steps == list(range(200))


def test_terminal_prints_one_line_per_alert():
    out = io.StringIO()
    sink = TerminalSink(Console(file=out, width=40, color_system=None))
    sink.emit(kl_alert(step=7, message="KL [bold]3.2x[/bold] baseline;\ncheck MIS"))
    sink.emit(Alert(step=9, signal="reward", severity="warning", value=0.41,
                    baseline=None,
                    message="reward fell under its baseline for 20 steps in a row"))
    sink.observe(10, {"kl": 1.0}, {"kl": 1.0})
    sink.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # narrower than the lines: soft-wrapped, never split
    assert lines[0].split()[:4] == ["CRITICAL", "step", "7", "kl"]
    assert "0.0032 vs baseline 0.001" in lines[0]
    # the message is text, not markup, and its newline is folded
    assert lines[0].endswith("KL [bold]3.2x[/bold] baseline; check MIS")
    assert lines[1].split()[:4] == ["WARNING", "step", "9", "reward"]
    assert "0.41 vs baseline —" in lines[1]
    assert lines[1].endswith("reward fell under its baseline for 20 steps in a row")

    colored = io.StringIO()
    sink = TerminalSink(Console(file=colored, force_terminal=True,
                                color_system="standard"))
    sink.emit(kl_alert())
    sink.emit(kl_alert(severity="warning"))
    critical, warning = colored.getvalue().splitlines()
    assert "\x1b[1;31mCRITICAL" in critical and "\x1b[1;33mWARNING" in warning
