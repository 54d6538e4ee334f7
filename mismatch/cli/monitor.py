"""`mismatch monitor FILE`: the collapse monitor over a metrics log, once or following it.

Registered by mismatch/cli/main.py (`app.command("monitor")(monitor_command)`). Exit codes: 0 no
alert at or above `--fail-on`, 1 one fired, 2 bad input (missing file, unknown format, bad
`--map`, a sink that cannot start, a log of which not one record could be read — an empty one
too —, a TensorBoard or W&B log without the package that reads it). Fewer steps than a signal
needs to be judged (14 by default) are said so in the summary line. What each framework leaves
on disk and how to point the monitor at it: docs/monitor.md. Lines that
cannot be used — not JSON, not an object, no monitored field, non-numeric or NaN values, no
step — are counted and reported at the end; fatal only when no line at all was usable.

The library does the work (mismatch.probes.monitor): `formats` reads each framework's logs,
`follow` tails the file (`--follow`: `tail -F`, until SIGINT / SIGTERM or `--max-idle`),
`CollapseMonitor` judges, the sinks deliver, `summary` says what it amounted to. This module
parses the options, builds those pieces and prints.
"""

from __future__ import annotations

import json
import threading
from contextlib import nullcontext
from pathlib import Path

import typer

from mismatch.cli.common import choice_list
from mismatch.probes.monitor.formats import ADAPTERS
from mismatch.probes.monitor.signals import SEVERITIES

__all__ = ["monitor_command"]


class _JsonLines:
    """A sink that prints each alert as one JSON object on stdout."""

    def emit(self, alert) -> None:
        typer.echo(json.dumps(alert.to_json(), allow_nan=False))

    def observe(self, step, values, baselines) -> None:
        """Nothing: stdout carries alerts only."""

    def close(self) -> None:
        """Nothing to release."""


def _display(as_json: bool):
    """Where the alerts are printed: JSON lines on stdout, or rich lines on stderr."""
    if as_json:
        return _JsonLines()
    from rich.console import Console

    from mismatch.probes.monitor import TerminalSink

    return TerminalSink(Console(soft_wrap=True))


def _run_masks_tokens(path: Path) -> bool:
    """Whether `path` is a `mismatch train` run whose loss masks tokens. Only a run folder, or
    the metrics.jsonl in one, can be: any other log is judged without reading torch's modules."""
    if not (path.is_dir() or path.name == "metrics.jsonl"):
        return False
    from mismatch.train.rundir import run_masks_tokens

    return run_masks_tokens(path)


def monitor_command(
    file: Path = typer.Argument(..., help="Metrics log: JSON lines (one object per step), "
                                "slime/Miles console lines, TRL's trainer_state.json (or "
                                "checkpoint dir), a TensorBoard run folder or event file, a W&B "
                                "run folder or run-<id>.wandb file, or a `mismatch train` run "
                                "folder (its metrics.jsonl). --format names whose keys it holds."),
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
                                f"this severity fired: {choice_list(SEVERITIES)}."),
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
    kl_floor: float = typer.Option(0.0, "--kl-floor", help="Judge the KL's growth only where the "
                                   "KL is also at least this level, e.g. 1e-3 (default 0: growth "
                                   "alone). Set it to your KL's scale: an on-policy run's tiny KL "
                                   "grows harmlessly as the policy sharpens, and frameworks' KL "
                                   "proxies run low (slime's ~1e-4)."),
    masked_loss: bool = typer.Option(False, "--masked-loss", help="The run's loss masks tokens "
                                     "whose importance ratio leaves a band (MIS, IcePop): judge "
                                     "the masked share, not the KL, as the signature's drift. "
                                     "Read from a `mismatch train` run folder's config.json "
                                     "without it."),
) -> None:
    """Watch a training run's metrics for the collapse signature: exit 0 quiet, 1 alert, 2 bad
    input."""
    from mismatch.cli.common import fail

    try:
        adapter, config, sinks = _setup(
            file, fmt=fmt, mapping=mapping, fail_on=fail_on, follow=follow,
            poll_interval=poll_interval, max_idle=max_idle, baseline=baseline,
            kl_floor=kl_floor, masked_loss=masked_loss, as_json=as_json, alert_log=alert_log,
            prometheus_port=prometheus_port, webhook=webhook)
    except (ValueError, OSError) as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    monitor, reader, steps = _watch(file, adapter, config, sinks, follow=follow,
                                    poll_interval=poll_interval, max_idle=max_idle)
    raise typer.Exit(_report(file, monitor, reader, sinks, fail_on, steps, as_json))


def _setup(file: Path, *, fmt, mapping, fail_on, follow, poll_interval, max_idle, baseline,
           kl_floor, masked_loss, as_json, alert_log, prometheus_port, webhook):
    """The options checked (ValueError / OSError: one line): (adapter, MonitorConfig, sinks)."""
    from mismatch.probes.monitor import (MonitorConfig, baselines_from_log, check_log,
                                         default_rules, open_sinks, with_kl_floor)
    from mismatch.probes.monitor.formats import get_adapter

    if fail_on not in SEVERITIES:
        raise ValueError(f"--fail-on must be warning or critical, got {fail_on!r}")
    adapter = get_adapter(fmt, mapping)
    if poll_interval <= 0:
        raise ValueError(f"--poll-interval must be > 0 seconds, got {poll_interval}")
    if max_idle is not None and max_idle < 0:
        raise ValueError(f"--max-idle must be >= 0 seconds, got {max_idle}")
    check_log(file, adapter, follow=follow)
    config = MonitorConfig(rules=with_kl_floor(default_rules(), kl_floor),
                           baselines=baselines_from_log(baseline, adapter) if baseline else {},
                           masked_loss=masked_loss or _run_masks_tokens(file))
    sinks = open_sinks(_display(as_json), alert_log=alert_log,
                       prometheus_port=prometheus_port, webhook=webhook)
    if prometheus_port is not None:
        typer.echo(f"serving Prometheus metrics at {sinks[-1].url}", err=True)
    return adapter, config, sinks


def _watch(file: Path, adapter, config, sinks, *, follow: bool, poll_interval: float,
           max_idle: float | None):
    """Every record of the log through the monitor (following it, until a signal or --max-idle,
    with --follow): (monitor, reader, the steps seen)."""
    from mismatch.cli.common import fail
    from mismatch.probes.monitor import CollapseMonitor, read_records, stop_on_signals
    from mismatch.probes.monitor.formats import RecordReader

    monitor = CollapseMonitor(config, sinks=sinks)
    reader = RecordReader(adapter)
    stop = threading.Event()
    steps: set[int] = set()
    try:
        with stop_on_signals(stop) if follow else nullcontext():
            for record in read_records(file, reader, follow=follow, poll_interval=poll_interval,
                                       max_idle=max_idle, stop=stop):
                monitor.update(record)
                steps.add(monitor.last_step)
    except ValueError as exc:
        fail(str(exc).splitlines()[0])
    finally:
        monitor.close()
    return monitor, reader, steps


def _report(file: Path, monitor, reader, sinks, fail_on: str, steps: set[int],
            as_json: bool) -> int:
    """The summary on stdout, notes and sink problems on stderr; the exit code (1: an alert at
    or above --fail-on). A log without one record is bad input (exit 2): a gate must not pass
    on nothing."""
    from mismatch.cli.common import fail
    from mismatch.probes.monitor import (run_summary, severity_rank, sink_problems,
                                         summary_line, unreadable)

    if not monitor.counts["records"]:
        fail(unreadable(file, reader) or f"{file}: not one record to monitor")
    for notice in reader.notices():
        typer.echo(f"mismatch: note: {notice}", err=True)
    for problem in sink_problems(sinks):
        typer.echo(f"mismatch: {problem}", err=True)
    summary = run_summary(monitor, reader, fail_on, steps=len(steps))
    typer.echo(json.dumps({"summary": summary}) if as_json else summary_line(summary))
    threshold = severity_rank(fail_on)
    return 1 if any(severity_rank(a.severity) >= threshold for a in monitor.alerts) else 0
