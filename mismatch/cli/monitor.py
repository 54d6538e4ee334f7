"""`mismatch monitor FILE`: the collapse monitor over a JSONL metrics log, once or following it.

Registered by mismatch/cli.py (`app.command("monitor")(monitor_command)`). Exit codes: 0 no
alert at or above `--fail-on`, 1 one fired, 2 bad input (missing file, unknown format, bad
`--map`, a sink that cannot start, a file of which not one record could be read). Lines that
cannot be used — not JSON, not an object, no monitored field, non-numeric or NaN values, no
step — are counted and reported at the end; fatal only when no line at all was usable.

What is read: JSON lines, slime's and Miles' console metric lines (`--format slime|miles`), or
TRL's trainer_state.json (`--format trl` given the file, a checkpoint dir or an output dir with
checkpoint-N/ in it: the newest one's), re-read whenever it changes under `--follow`
(`follow_state`). probes/formats/reader.py turns them into records.

Following (`--follow`) is `tail -F`: new lines are read as they are appended; a file that shrinks
(truncated in place) is read again from its start; a file replaced under the same name (renamed
away and re-created, as log rotation does) is drained, then the new one is opened. It stops on
SIGINT / SIGTERM, or after `--max-idle` seconds without new data. A truncation that is refilled
past the old size between two polls cannot be seen (as with tail).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import typer

from mismatch.probes.formats import ADAPTERS
from mismatch.probes.formats.reader import (RecordReader, expected_input, looks_like_state_file,
                                   read_trainer_state, trainer_state_path)

__all__ = ["monitor_command", "follow_lines"]

_CHUNK = 1 << 16  # bytes per read
_MAX_LINE = 1 << 26  # a "line" longer than 64 MiB is no metrics record: handed on (and counted
# malformed) rather than held in memory until a newline that may never come


def follow_lines(path: Path, *, follow: bool, poll_interval: float = 0.5,
                 max_idle: float | None = None, stop: threading.Event | None = None,
                 events: Counter | None = None) -> Iterator[bytes]:
    """Complete lines (without the newline) of `path`; with `follow`, also those appended later.

    A last line without a newline is yielded when the file is done (not following), when a
    rotation replaces it, or when following stops. `events` counts truncations and rotations.
    """
    stop = stop or threading.Event()
    events = events if events is not None else Counter()
    f = open(path, "rb")
    buf = b""
    last_growth = time.monotonic()
    try:
        while not (follow and stop.is_set()):
            chunk = f.read(_CHUNK)
            if chunk:
                last_growth = time.monotonic()
                *lines, buf = (buf + chunk).split(b"\n")
                yield from lines
                if len(buf) > _MAX_LINE:
                    yield buf
                    buf = b""
                continue
            if not follow:
                break
            current = os.fstat(f.fileno())
            try:
                named = os.stat(path)
            except FileNotFoundError:  # renamed away, its successor not created yet
                named = None
            if named is not None and (named.st_ino, named.st_dev) != (current.st_ino,
                                                                      current.st_dev):
                for rest in iter(lambda: f.read(_CHUNK), b""):  # written before the rename
                    buf += rest
                *lines, buf = buf.split(b"\n")
                yield from lines
                if buf:
                    yield buf
                f.close()
                f = open(path, "rb")
                buf = b""
                events["rotations"] += 1
                last_growth = time.monotonic()
                continue
            if current.st_size < f.tell():
                f.seek(0)
                buf = b""
                events["truncations"] += 1
                last_growth = time.monotonic()
                continue
            if max_idle is not None and time.monotonic() - last_growth >= max_idle:
                break
            stop.wait(poll_interval)
        if buf:
            yield buf
    finally:
        f.close()


def follow_state(path: Path, *, follow: bool, poll_interval: float = 0.5,
                 max_idle: float | None = None, stop: threading.Event | None = None,
                 events: Counter | None = None) -> Iterator[dict]:
    """The log_history entries of the trainer_state.json that `path` names (probes.formats.
    reader.trainer_state_path), each once; with `follow`, re-read whenever it changes (or a newer
    checkpoint appears). A file that does not parse is waited for when following (it may be
    being rewritten), a ValueError otherwise. `events` counts the reads (`state_reads`)."""
    stop = stop or threading.Event()
    events = events if events is not None else Counter()
    seen: set[str] = set()
    last: tuple | None = None
    last_growth = time.monotonic()
    while not (follow and stop.is_set()):
        target = trainer_state_path(path)
        try:
            st = os.stat(target) if target is not None else None
        except OSError:
            st = None
        mark = None if st is None else (str(target), st.st_ino, st.st_mtime_ns, st.st_size)
        if mark is not None and mark != last:
            entries = read_trainer_state(target)
            if entries is not None:
                last, last_growth = mark, time.monotonic()
                events["state_reads"] += 1
                for entry in entries:
                    key = json.dumps(entry, sort_keys=True, default=str)
                    if key not in seen:
                        seen.add(key)
                        yield entry
            elif not follow:
                raise ValueError(f"{target}: not a trainer_state.json (no log_history list); "
                                 "--format trl reads the one TRL writes at each checkpoint")
        if not follow:
            if target is None:
                raise ValueError(f"{path}: no trainer_state.json in it nor in a checkpoint-N/ "
                                 "under it; TRL writes one at each checkpoint (save_steps)")
            return
        if max_idle is not None and time.monotonic() - last_growth >= max_idle:
            return
        stop.wait(poll_interval)


class _JsonLines:
    """A sink that prints each alert as one JSON object on stdout."""

    def emit(self, alert) -> None:
        typer.echo(json.dumps(alert.to_json(), allow_nan=False))

    def observe(self, step, values, baselines) -> None:
        """Nothing: stdout carries alerts only."""

    def close(self) -> None:
        """Nothing to release."""


def _sinks(as_json: bool, alert_log: Path | None, prometheus_port: int | None,
           webhook: str | None) -> list:
    """The sinks the options ask for; ValueError (bad input) when one cannot start."""
    from mismatch.probes.sinks import JsonlSink, PrometheusSink, TerminalSink, WebhookSink

    sinks: list = []
    try:
        if as_json:
            sinks.append(_JsonLines())
        else:
            from rich.console import Console

            sinks.append(TerminalSink(Console(soft_wrap=True)))
        if alert_log is not None:
            sinks.append(JsonlSink(alert_log))
        if webhook is not None:
            sinks.append(WebhookSink(webhook))
        if prometheus_port is not None:
            if not 0 <= prometheus_port <= 65535:
                raise ValueError(f"--prometheus-port must be 0..65535, got {prometheus_port}")
            try:
                sink = PrometheusSink(port=prometheus_port)
            except (OSError, ImportError) as exc:
                raise ValueError(f"cannot serve Prometheus metrics on port {prometheus_port}: "
                                 f"{exc}") from None
            sinks.append(sink)
            typer.echo(f"serving Prometheus metrics at {sink.url}", err=True)
    except (ValueError, OSError) as exc:
        for sink in sinks:
            sink.close()
        raise ValueError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    return sinks


def _summary(monitor, tally: Counter, fail_on: str, notes: Counter) -> dict:
    alerts = monitor.alerts
    return {
        "records": monitor.counts["records"], "first_step": monitor.first_step,
        "last_step": monitor.last_step,
        "alerts": {"warning": sum(a.severity == "warning" for a in alerts),
                   "critical": sum(a.severity == "critical" for a in alerts)},
        "fail_on": fail_on,
        "skipped": {"malformed_lines": tally["malformed"], "other_events": tally["other_events"],
                    "lines_without_signals": tally["no_signals"],
                    "nan_values": monitor.counts["nan"],
                    "non_numeric_values": monitor.counts["non_numeric"],
                    "missing_step": monitor.counts["missing_step"],
                    "bad_episodes": monitor.counts["bad_episodes"]},
        "episodes": monitor.counts["episodes"],
        "truncations": tally["truncations"], "rotations": tally["rotations"],
        "notes": {k: notes[k] for k in ("kl_squared", "zero_unset", "train_steps_moved")},
    }


_LABELS = {"malformed_lines": ("malformed line", "malformed lines"),
           "other_events": ("other event", "other events"),
           "lines_without_signals": ("line without signals", "lines without signals"),
           "nan_values": ("NaN value", "NaN values"),
           "non_numeric_values": ("non-numeric value", "non-numeric values"),
           "missing_step": ("record without a step", "records without a step"),
           "bad_episodes": ("unusable episode", "unusable episodes")}


def _print_summary(summary: dict) -> None:
    steps = ("" if summary["first_step"] is None
             else f" (steps {summary['first_step']}–{summary['last_step']})")
    a = summary["alerts"]
    skipped = ", ".join(f"{v} {_LABELS[k][v != 1]}" for k, v in summary["skipped"].items() if v)
    followed = ", ".join(f"{summary[k]} {k}" for k in ("truncations", "rotations") if summary[k])
    typer.echo(f"monitored {summary['records']} records{steps}: {a['critical']} critical, "
               f"{a['warning']} warning alert{'s' if a['warning'] != 1 else ''}"
               + (f"; skipped {skipped}" if skipped else "")
               + (f"; followed {followed}" if followed else ""))


def _known_baselines(path: Path, adapter) -> dict[str, float]:
    """The baselines of a known-good run's log (read with the same adapter as the watched one)."""
    from mismatch.probes.monitor import baselines_from

    if not (path.is_file() or _reads_state(path, adapter)):
        raise ValueError(f"--baseline {path}: no such file; pass a finished run's metrics log")
    reader = RecordReader(adapter)
    if _reads_state(path, adapter):
        found_records = (reader.feed_entry(e) for e in follow_state(path, follow=False))
    else:
        with open(path, "rb") as handle:
            found_records = [reader.feed(line) for line in handle]
    records = [r for r in found_records if r is not None]
    found = baselines_from(records)
    if not found:
        raise ValueError(f"--baseline {path}: {len(records)} readable records, too few for a "
                         "baseline (it needs steps 4-13); pass a longer known-good run")
    return found


def _reads_state(path: Path, adapter) -> bool:
    """Whether `path` is read as a trainer_state.json (TRL), not as lines."""
    return adapter.name == "trl" and (path.is_dir() or (path.is_file()
                                                        and looks_like_state_file(path)))


def _unreadable(file: Path, reader) -> str | None:
    """The one-line error for a file of which no record could be read (None if some was)."""
    t, name = reader.tally, reader.adapter.name
    if not t["lines"]:
        return None
    seen = t["json_objects"] + t["console_lines"]
    if not seen:
        what = "a JSON object" + (" or a console metrics line" if reader.console else "")
        return (f"{file}: read {t['lines']} lines, none is {what}; --format {name} expects "
                f"{expected_input(reader.adapter)}")
    if t["other_events"] == seen:
        return (f"{file}: read {seen} objects, all other events (no metric event); "
                f"--format {name} expects {expected_input(reader.adapter)}")
    return (f"{file}: read {seen} objects, none has a field --format {name} reads; check "
            f"--format ({', '.join(ADAPTERS)}) or name the fields with --map SIGNAL=FIELD")


def _on_signals(stop: threading.Event) -> Callable[[], None]:
    """SIGINT/SIGTERM set `stop` (main thread only); returns the function that restores them."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in previous:
        signal.signal(s, lambda *_: stop.set())

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

    return restore


def monitor_command(
    file: Path = typer.Argument(..., help="Metrics log: JSON lines (one object per step), "
                                "slime/Miles console lines, or TRL's trainer_state.json (or "
                                "checkpoint dir)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep reading as the file grows "
                                "(tail -F: survives truncation and rotation) until SIGINT/SIGTERM "
                                "or --max-idle."),
    fmt: str = typer.Option("native", "--format", help="Whose metric names the log uses: "
                            f"{', '.join(ADAPTERS)}."),
    mapping: list[str] | None = typer.Option(None, "--map", help="SIGNAL=FIELD: read a signal "
                                             "(or step) from this field; repeatable."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per alert (step, "
                                 "signal, severity, value, baseline, message), then a summary "
                                 "object."),
    fail_on: str = typer.Option("critical", "--fail-on", help="Exit 1 if an alert at or above "
                                "this severity fired: warning or critical."),
    alert_log: Path | None = typer.Option(None, "--alert-log", help="Also append each alert as a "
                                          "JSON line to this file."),
    prometheus_port: int | None = typer.Option(None, "--prometheus-port", help="Serve signals "
                                               "and alerts for Prometheus on this port "
                                               "(127.0.0.1; 0 picks one)."),
    webhook: str | None = typer.Option(None, "--webhook", help="POST each alert's JSON to this "
                                       "URL."),
    poll_interval: float = typer.Option(0.5, "--poll-interval", help="Seconds between checks "
                                        "for new data when following."),
    max_idle: float | None = typer.Option(None, "--max-idle", help="Stop following after this "
                                          "many seconds without new data."),
    baseline: Path | None = typer.Option(None, "--baseline", help="A known-good run's log (same "
                                         "format): take the baselines from its steps 4-13 and "
                                         "judge this run from its first steps, not from step 14."),
) -> None:
    """Watch a training run's metrics for the collapse signature: exit 0 quiet, 1 alert, 2 bad
    input."""
    from mismatch.cli.main import fail

    try:
        from mismatch.probes.alerts import SEVERITIES, severity_rank
        from mismatch.probes.formats import get_adapter
        from mismatch.probes.monitor import CollapseMonitor, MonitorConfig

        if fail_on not in SEVERITIES:
            raise ValueError(f"--fail-on must be warning or critical, got {fail_on!r}")
        threshold = severity_rank(fail_on)
        adapter = get_adapter(fmt, mapping)
        if poll_interval <= 0:
            raise ValueError(f"--poll-interval must be > 0 seconds, got {poll_interval}")
        if max_idle is not None and max_idle < 0:
            raise ValueError(f"--max-idle must be >= 0 seconds, got {max_idle}")
        if not file.exists():
            raise ValueError(f"{file}: no such file")
        state = _reads_state(file, adapter)
        if not state and not file.is_file():
            raise ValueError(f"{file}: not a regular file")
        if not state:
            with open(file, "rb"):
                pass
        elif not follow and trainer_state_path(file) is None:
            raise ValueError(f"{file}: no trainer_state.json in it nor in a checkpoint-N/ under "
                             "it; TRL writes one at each checkpoint (save_steps), or log live "
                             "with mismatch.integrations.trl.MonitorLogCallback")
        config = MonitorConfig(baselines=_known_baselines(baseline, adapter)) if baseline \
            else None
        sinks = _sinks(as_json, alert_log, prometheus_port, webhook)
    except (ValueError, OSError) as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    monitor = CollapseMonitor(config, sinks=sinks)
    reader = RecordReader(adapter)
    tally = reader.tally
    stop = threading.Event()
    restore = _on_signals(stop) if follow else (lambda: None)
    options = dict(follow=follow, poll_interval=poll_interval, max_idle=max_idle, stop=stop,
                   events=tally)
    try:
        if state:
            records = (reader.feed_entry(e) for e in follow_state(file, **options))
        else:
            records = (reader.feed(line) for line in follow_lines(file, **options))
        for record in records:
            if record is not None:
                monitor.update(record)
    except ValueError as exc:
        fail(str(exc).splitlines()[0])
    finally:
        restore()
        monitor.close()
    if not monitor.counts["records"] and (problem := _unreadable(file, reader)):
        fail(problem)
    for notice in reader.notices():
        typer.echo(f"mismatch: note: {notice}", err=True)
    for sink in sinks:
        stats = getattr(sink, "stats", None)
        if isinstance(stats, dict) and (stats.get("failed") or stats.get("dropped")):
            typer.echo(f"mismatch: webhook: {stats.get('sent', 0)} sent, "
                       f"{stats.get('failed', 0)} failed, {stats.get('dropped', 0)} dropped",
                       err=True)
    summary = _summary(monitor, tally, fail_on, reader.notes)
    if as_json:
        typer.echo(json.dumps({"summary": summary}))
    else:
        _print_summary(summary)
    fired = any(severity_rank(a.severity) >= threshold for a in monitor.alerts)
    raise typer.Exit(1 if fired else 0)
