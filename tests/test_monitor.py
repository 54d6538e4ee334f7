"""The collapse monitor: detection on seeded synthetic runs, debouncing, episodes' end reasons,
and `mismatch monitor` on files (exit codes, JSON, following a growing,
truncated and rotated log)."""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

from mismatch.cli.monitor import monitor_command
from mismatch.zoo.episode import Episode, EpisodeConfig
from mismatch.zoo.tasks import make_task
from mismatch.probes.monitor import (CollapseMonitor, MonitorConfig, SignalRule, baselines_from,
                                     default_rules, episode_end_reason, episode_summary,
                                     follow_lines, with_kl_floor)
from mismatch.probes.monitor.rules import CRITICAL, NORMAL, judge

from mismatch.probes.monitor import traces as bench  # noqa: E402  the study's collapse shapes

N_TRACES = 30  # seeds of each kind; reports/monitor.md runs 200 and more


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("monitor")(monitor_command)

    @app.callback()
    def _root() -> None:
        """Test app."""

    return app


def _run(*args: str):
    return CliRunner().invoke(_app(), ["monitor", *args])


def _write(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _flat(n: int, **signals) -> list[dict]:
    """n steps of constant signals (deterministic)."""
    return [{"step": i, **signals} for i in range(n)]


# -- detection on synthetic runs --------------------------------------------------------------


@pytest.mark.parametrize("seed", range(N_TRACES))
def test_stable_runs_raise_no_critical_alert(seed):
    alerts = bench.run_monitor(bench.synthetic_trace("stable", seed))
    assert [a for a in alerts if a.severity == "critical"] == []


@pytest.mark.parametrize("seed", range(N_TRACES))
def test_collapse_is_critical_within_10_steps_and_before_the_reward_halves(seed):
    trace = bench.synthetic_trace("collapse", seed)
    critical = [a for a in bench.run_monitor(trace) if a.severity == "critical"]
    assert critical, "collapse not flagged"
    first = critical[0]
    assert trace.onset <= first.step <= trace.onset + 10, (first, trace.onset)
    assert trace.half_step is None or first.step < trace.half_step
    assert trace.reward_true[first.step] > 0.5 * trace.reward_true[trace.onset]


@pytest.mark.parametrize("seed", range(N_TRACES))
def test_one_step_kl_spike_is_at_most_a_warning(seed):
    trace = bench.synthetic_trace("spike", seed)
    alerts = bench.run_monitor(trace)
    assert all(a.severity == "warning" for a in alerts)


def test_a_10x_one_step_spike_on_a_flat_run_raises_nothing():
    records = _flat(60, kl=1e-3, reward=0.5, format_error_rate=0.02)
    records[30]["kl"] = 1e-2
    monitor = CollapseMonitor()
    assert [a for r in records for a in monitor.update(r)] == []
    assert monitor.baselines()["kl"] == pytest.approx(1e-3)


# -- debouncing, corroboration, missing values ------------------------------------------------


def test_one_alert_per_severity_per_episode_of_trouble_and_rearm_after_calm():
    kl = [1e-3] * 20 + [12e-3] * 30 + [1e-3] * 5 + [12e-3] * 10 + [1e-3] * 10 + [12e-3] * 5
    monitor = CollapseMonitor()
    alerts = [a for i, x in enumerate(kl) for a in monitor.update({"step": i, "kl": x})]
    # trouble at 20, straight at critical (12x, alone): one critical alert after 3 steps; 5 calm
    # steps do not re-arm, so the second burst (55) is silent; 10 calm steps (65–74) re-arm
    assert [(a.step, a.severity) for a in alerts] == [(22, "critical"), (77, "critical")]
    assert all(a.signal == "kl" and a.baseline == pytest.approx(1e-3) for a in alerts)
    assert alerts[1].value == pytest.approx(12e-3) and "12.0x" in alerts[1].message


def test_kl_at_2_5x_alone_warns_and_with_format_errors_goes_critical():
    base = _flat(15, kl=1e-3, format_error_rate=0.02)
    up = [{"step": 15 + i, "kl": 2.5e-3, "format_error_rate": 0.02} for i in range(20)]
    monitor = CollapseMonitor()
    alone = [a for r in base + up for a in monitor.update(r)]
    assert [(a.signal, a.severity) for a in alone] == [("kl", "warning")]
    both = [{"step": 15 + i, "kl": 2.5e-3, "format_error_rate": 0.2} for i in range(20)]
    monitor = CollapseMonitor()
    fired = [a for r in base + both for a in monitor.update(r)]
    assert {(a.signal, a.severity) for a in fired if a.step == 16} == {
        ("kl", "critical"), ("format_error_rate", "critical")}
    assert "collapse signature" in fired[-1].message
    lone = CollapseMonitor(MonitorConfig(corroborate=False))
    assert {a.severity for r in base + both for a in lone.update(r)} == {"warning"}


def test_signals_split_across_records_of_one_step_still_corroborate():
    monitor = CollapseMonitor()
    fired = []
    for i in range(30):
        bad = i >= 15
        fired += monitor.update({"step": i, "kl": 2.5e-3 if bad else 1e-3})
        fired += monitor.update({"step": i, "format_error_rate": 0.25 if bad else 0.02})
    # kl's record of step 16 comes first, when format errors have been up for one step only
    assert {(a.signal, a.severity, a.step) for a in fired} == {
        ("kl", "warning", 16), ("format_error_rate", "critical", 16), ("kl", "critical", 17)}


def test_missing_signals_are_not_judged_and_bad_values_are_counted():
    monitor = CollapseMonitor()
    for i in range(30):
        monitor.update({"step": i, "reward": 0.5})
    assert monitor.values()["kl"] is None and monitor.baselines()["kl"] is None
    assert monitor.values()["reward"] == 0.5 and monitor.baselines()["reward"] == 0.5
    monitor.update({"step": 30, "kl": float("nan"), "entropy": "high", "reward": True,
                    "response_length": float("inf")})
    monitor.update({"kl": 1e-3})
    monitor.update({"step": 32, "kl": np.float32(1e-3), "entropy": torch.tensor(0.5),
                    "response_length": np.array([1.0, 2.0])})
    assert monitor.values()["kl"] == pytest.approx(1e-3) and monitor.values()["entropy"] == 0.5
    assert (monitor.counts["nan"], monitor.counts["non_numeric"]) == (2, 3)
    assert monitor.counts["missing_step"] == 1 and monitor.last_step == 32
    assert monitor.alerts == []


def test_reward_fall_and_warning_only_signals():
    monitor = CollapseMonitor()
    fired = []
    for i in range(60):
        fired += monitor.update({"step": i, "reward": 0.6 if i < 30 else 0.2,
                                 "entropy": 1.0 if i < 30 else 0.1,
                                 "response_length": 500 if i < 30 else 5000})
    got = {(a.signal, a.severity) for a in fired}
    assert ("reward", "critical") in got and ("reward", "warning") not in got  # 67% off at once
    assert [a.step for a in fired if a.signal == "reward"] == [34]  # median of 5 turns at 32
    assert {("entropy", "warning"), ("response_length", "warning")} <= got
    assert not {("entropy", "critical"), ("response_length", "critical")} & got
    reward = next(a for a in fired if a.signal == "reward")
    assert reward.baseline == pytest.approx(0.6) and "below its peak" in reward.message


def test_given_baselines_judge_from_the_first_step():
    monitor = CollapseMonitor(MonitorConfig(baselines={"kl": 1e-3}))
    fired = [a for i in range(3) for a in monitor.update({"step": i, "kl": 12e-3})]
    assert [(a.step, a.severity) for a in fired] == [(2, "critical")]


def test_config_checks():
    with pytest.raises(ValueError, match="unknown signal"):
        MonitorConfig(rules={"klx": default_rules()["kl"]})
    with pytest.raises(ValueError, match="milder"):
        SignalRule(kind="growth", warning=3.0, critical=2.0)
    with pytest.raises(ValueError, match="milder"):
        SignalRule(kind="fall", warning=0.5, critical=0.8)
    with pytest.raises(ValueError, match=">= 1"):
        MonitorConfig(critical_steps=0)
    with pytest.raises(ValueError, match="finite"):
        MonitorConfig(baselines={"kl": float("nan")})


class _Recorder:
    def __init__(self):
        self.emitted, self.observed, self.closed = [], [], False

    def emit(self, alert):
        self.emitted.append(alert)

    def observe(self, step, values, baselines):
        self.observed.append((step, dict(values), dict(baselines)))

    def close(self):
        self.closed = True


def test_sinks_get_every_alert_and_every_step():
    sink = _Recorder()
    with CollapseMonitor(sinks=[sink]) as monitor:
        for i in range(40):
            monitor.update({"step": i, "kl": 1e-3 if i < 20 else 4e-3})
    assert sink.closed and sink.emitted == monitor.alerts and len(sink.emitted) == 1
    assert [s for s, _, _ in sink.observed] == list(range(40))
    step, values, baselines = sink.observed[-1]
    assert values["kl"] == 4e-3 and baselines["kl"] == pytest.approx(1e-3)
    assert set(values) == set(baselines) == set(default_rules())


# -- episodes ---------------------------------------------------------------------------------

_CALC = '<tool_call>\n{"name": "calc", "arguments": {"expression": "1+1"}}\n</tool_call>'
_SUBMIT = '<tool_call>\n{"name": "submit", "arguments": {"answer": 7}}\n</tool_call>'
_NO_CALL = ("", "<think>\nhmm\n</think>\n\nThe answer is 5.", '<tool_call>\n{"name": calc}\n'
            "</tool_call>")


@pytest.mark.parametrize("seed", range(40))
def test_end_reason_from_replies_agrees_with_the_environment(seed):
    rng = random.Random(seed)
    config = EpisodeConfig(max_turns=8)
    episode = Episode(make_task(seed), config)
    texts = []
    while not episode.done:
        text = rng.choice([_CALC, _CALC, _SUBMIT if rng.random() < 0.2 else _CALC, *_NO_CALL])
        texts.append(text)
        episode.step(text)
    assert episode_end_reason({"replies": texts}, max_turns=8) == episode.end_reason
    flags = [{"tool_call": bool(t == _CALC or t == _SUBMIT), "submit": t == _SUBMIT}
             for t in texts]
    assert episode_end_reason({"replies": flags}, max_turns=8) == episode.end_reason
    bools = [f["tool_call"] for f in flags]  # the compact form cannot say "submit"
    expected = episode.end_reason if episode.end_reason != "submit" else (
        "turn_limit" if len(bools) >= 8 else "other")
    assert episode_end_reason({"replies": bools}, max_turns=8) == expected
    assert episode_end_reason({"end_reason": episode.end_reason}) == episode.end_reason


def test_end_reason_forms():
    assert episode_end_reason({"replies": [True, False, False, False]}) == "format_errors"
    assert episode_end_reason({"replies": [1] * 5 + [0] * 3}, max_turns=8) == "format_errors"
    assert episode_end_reason({"replies": [1] * 6 + [0] * 3}, max_turns=8) == "turn_limit"
    assert episode_end_reason({"replies": [1, 0, 2]}) is None  # not the compact form
    assert episode_end_reason({"turns": [{"tool_calls": [{"name": "submit"}]}]}) == "submit"
    assert episode_end_reason({"replies": [{"content": _CALC}] * 5}) == "other"
    assert episode_end_reason({"replies": [{"content": _CALC}] * 5}, max_turns=5) == "turn_limit"
    assert episode_end_reason({"end_reason": "no_tool_call"}) == "format_errors"
    assert episode_end_reason({"replies": [{"x": 1}]}) is None
    assert episode_end_reason("submit") is None


def test_monitor_computes_the_format_error_share_from_raw_episodes():
    def step_episodes(n_bad: int, n: int = 50) -> list[dict]:
        bad = [{"replies": [True, False, False, False], "reward": 0.0}] * n_bad
        good = [{"replies": [{"content": _CALC}, {"content": _SUBMIT}], "reward": 1.0}]
        return bad + good * (n - n_bad)

    summary = episode_summary(step_episodes(10) + ["junk"])
    assert summary["end_reasons"] == {"format_errors": 10, "submit": 40}
    assert (summary["format_error_rate"], summary["reward"], summary["bad"]) == (0.2, 0.8, 1)
    monitor = CollapseMonitor()
    fired = []
    for i in range(40):
        fired += monitor.update({"step": i, "episodes": step_episodes(1 if i < 25 else 30)})
    assert monitor.values()["format_error_rate"] == 0.6 and monitor.last_end_reasons == {
        "format_errors": 30, "submit": 20}
    assert monitor.values()["reward"] == pytest.approx(0.4)
    assert [(a.step, a.signal, a.severity) for a in fired] == [
        (27, "format_error_rate", "critical"), (28, "reward", "critical")]
    assert monitor.counts["episodes"] == 40 * 50


# -- the command ------------------------------------------------------------------------------


def test_cli_exit_codes_and_json(tmp_path):
    stable = _write(tmp_path / "stable.jsonl", bench.synthetic_trace("stable", 0).records)
    res = _run(str(stable))
    assert res.exit_code == 0 and "monitored 200 records (steps 0–199)" in res.stdout
    trace = bench.synthetic_trace("collapse", 0)
    collapse = _write(tmp_path / "collapse.jsonl", trace.records)
    res = _run(str(collapse), "--json", "--alert-log", str(tmp_path / "alerts.jsonl"))
    assert res.exit_code == 1
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    alerts, summary = lines[:-1], lines[-1]["summary"]
    assert alerts and all(set(a) == {"step", "signal", "severity", "value", "baseline",
                                     "message"} for a in alerts)
    assert any(a["severity"] == "critical" for a in alerts)
    assert summary["alerts"]["critical"] == sum(a["severity"] == "critical" for a in alerts)
    logged = [json.loads(x) for x in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    assert logged == alerts
    warn_only = _write(tmp_path / "warn.jsonl", _flat(15, kl=1e-3) + [
        {"step": 15 + i, "kl": 2.5e-3} for i in range(10)])
    assert _run(str(warn_only)).exit_code == 0
    assert _run(str(warn_only), "--fail-on", "warning").exit_code == 1
    for args, message in ([str(tmp_path / "none.jsonl")], "no such file"), \
                         ([str(stable), "--format", "openrlhf"], "unknown format"), \
                         ([str(stable), "--map", "klx=a"], "unknown signal"), \
                         ([str(stable), "--fail-on", "info"], "--fail-on"), \
                         ([str(tmp_path)], "not a regular file"):
        res = _run(*args)
        assert res.exit_code == 2 and message in res.output, (args, res.output)


def test_cli_serves_prometheus_while_it_runs(tmp_path):
    pytest.importorskip("prometheus_client")
    path = _write(tmp_path / "c.jsonl", bench.synthetic_trace("collapse", 1).records)
    res = _run(str(path), "--prometheus-port", "0", "--json")
    assert res.exit_code == 1 and "serving Prometheus metrics at http://127.0.0.1:" in res.stderr
    res = _run(str(path), "--prometheus-port", "70000")
    assert res.exit_code == 2 and "--prometheus-port" in res.output


def test_cli_counts_malformed_lines_and_nan(tmp_path):
    path = tmp_path / "m.jsonl"
    good = [json.dumps(r) for r in _flat(20, kl=1e-3, reward=0.5)]
    path.write_text("\n".join(good[:10] + ["{not json", "[1, 2]", '{"step": 10, "kl": NaN}',
                                           '{"step": 11, "kl": "big", "reward": 0.5}',
                                           '{"step": 12, "loss": 1.0}', "", '{"kl": 1e-3}']
                              + good[13:]) + "\n")
    res = _run(str(path), "--json")
    assert res.exit_code == 0
    summary = json.loads(res.stdout.splitlines()[-1])["summary"]
    assert summary["skipped"] == {"malformed_lines": 2, "other_events": 0,
                                  "lines_without_signals": 1, "nan_values": 1,
                                  "non_numeric_values": 1, "missing_step": 1,
                                  "bad_episodes": 0}
    assert summary["records"] == 10 + 3 + 7
    res = _run(str(path))
    assert "2 malformed lines" in res.stdout and "1 NaN value" in res.stdout


def test_cli_reads_a_verl_log_with_a_map(tmp_path):
    trace = bench.synthetic_trace("collapse", 3)
    path = _write(tmp_path / "verl.jsonl", [
        {"step": r["step"], "data": {"critic/score/mean": r["reward"], "my/kl": r["kl"],
                                     "actor/entropy": r["entropy"]}} for r in trace.records])
    def first_critical(*args):
        res = _run(str(path), "--format", "verl", "--json", *args)
        assert res.exit_code == 1
        return next(a for a in map(json.loads, res.stdout.splitlines())
                    if a.get("severity") == "critical")

    alone = first_critical()  # no sampler–trainer KL in this log: the reward fall alone, late
    assert alone["signal"] == "reward" and alone["step"] >= trace.half_step
    mapped = first_critical("--map", "kl=my/kl")  # a sampler–trainer KL under its own name
    assert trace.onset <= mapped["step"] < trace.half_step


def test_follow_lines_through_truncation_and_rotation(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text("a1\na2\n")
    stop, events = threading.Event(), Counter()
    lines = follow_lines(path, follow=True, poll_interval=0.01, max_idle=5, stop=stop,
                         events=events)
    assert [next(lines), next(lines)] == [b"a1", b"a2"]
    with open(path, "a") as f:
        f.write("a3\npart")
    assert next(lines) == b"a3"
    with open(path, "a") as f:
        f.write("ial\n")
    assert next(lines) == b"partial"
    path.write_text("b1\n")  # truncated in place, shorter
    assert next(lines) == b"b1" and events["truncations"] == 1
    with open(path, "a") as f:
        f.write("b2\nb3")  # the last line of the old file has no newline
    os.rename(path, tmp_path / "log.jsonl.1")
    path.write_text("c1\n")
    assert [next(lines), next(lines), next(lines)] == [b"b2", b"b3", b"c1"]
    assert events["rotations"] == 1
    stop.set()
    assert list(lines) == []


def _reader_at_end(path: Path) -> bool:
    """Whether some open descriptor of this process on `path` is exactly at its end (Linux
    /proc): a reader that has not yet seen a truncation sits past the end, not at it."""
    size = path.stat().st_size
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != os.path.realpath(path):
                continue
            pos = int(Path(f"/proc/self/fdinfo/{fd}").read_text().split()[1])
        except OSError:
            continue
        if pos == size:
            return True
    return False


def _wait_for_reader(path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    if not os.path.isdir("/proc/self/fdinfo"):
        time.sleep(0.5)
        return
    while time.monotonic() < deadline and not _reader_at_end(path):
        time.sleep(0.01)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fdinfo"), reason="needs Linux /proc")
def test_cli_follows_a_growing_truncated_and_rotated_log(tmp_path):
    path = tmp_path / "metrics.jsonl"
    trace = bench.synthetic_trace("collapse", 5)
    records = trace.records
    first, second = records[:60], records[60:110]
    path.write_text("")
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            with open(path, "a") as f:
                for r in first:
                    f.write(json.dumps(r) + "\n")
                    f.flush()
                    time.sleep(0.002)
            _wait_for_reader(path)
            path.write_text(json.dumps(records[0]) + "\n")  # truncated: a restarted run
            _wait_for_reader(path)
            os.rename(path, tmp_path / "metrics.jsonl.1")  # rotated: a new file, same name
            with open(path, "w") as f:
                for r in second + records[110:]:
                    f.write(json.dumps(r) + "\n")
                    f.flush()
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    res = _run(str(path), "--follow", "--poll-interval", "0.01", "--max-idle", "1.5", "--json")
    thread.join(10)
    assert not errors and not thread.is_alive()
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    summary = lines[-1]["summary"]
    assert (summary["truncations"], summary["rotations"]) == (1, 1)
    assert summary["records"] == 60 + 1 + 140 and summary["last_step"] == 199
    assert res.exit_code == 1 and summary["alerts"]["critical"] >= 1
    assert any(a["severity"] == "critical" and a["step"] >= trace.onset for a in lines[:-1])


_MAIN = """
import sys
from mismatch.cli.main import app, main
from mismatch.cli.monitor import monitor_command
app.command("monitor")(monitor_command)
sys.argv = ["mismatch"] + sys.argv[1:]
main()
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fdinfo"), reason="needs Linux /proc")
def test_follow_stops_cleanly_on_sigterm(tmp_path):
    import signal
    import subprocess

    path = _write(tmp_path / "m.jsonl", bench.synthetic_trace("collapse", 2).records)
    proc = subprocess.Popen([sys.executable, "-c", _MAIN, "monitor", str(path), "--follow",
                             "--json", "--poll-interval", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        reading = False
        while time.monotonic() < deadline and not reading and proc.poll() is None:
            time.sleep(0.05)
            for fd in os.listdir(f"/proc/{proc.pid}/fd"):
                try:
                    if os.readlink(f"/proc/{proc.pid}/fd/{fd}") != os.path.realpath(path):
                        continue
                    pos = int(Path(f"/proc/{proc.pid}/fdinfo/{fd}").read_text().split()[1])
                except OSError:
                    continue
                reading = reading or pos == path.stat().st_size
        assert reading, "the monitor never reached the end of the file"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    summary = json.loads(out.splitlines()[-1])["summary"]
    assert summary["records"] == 200 and summary["alerts"]["critical"] >= 1


def test_alert_json_is_strict():
    monitor = CollapseMonitor()
    for i in range(40):
        monitor.update({"step": i, "kl": 1e-3 if i < 20 else 1e-2})
    for alert in monitor.alerts:
        text = json.dumps(alert.to_json(), allow_nan=False)
        assert not math.isnan(json.loads(text)["value"])


def test_monitor_option_snapshot_and_light_import():
    import subprocess

    command = typer.main.get_command(_app()).commands["monitor"]
    options = sorted(o for p in command.params for o in p.opts if o.startswith("--"))
    assert options == ["--alert-log", "--baseline", "--fail-on", "--follow", "--format", "--json",
                       "--kl-floor", "--map", "--masked-loss", "--max-idle", "--poll-interval",
                       "--prometheus-port", "--webhook"]
    # the CLI module loads the monitor package (the --format choices come from it), but nothing
    # heavy: no tensors, no rich console, no network stack (the webhook and Prometheus sinks
    # import theirs when a run asks for them)
    heavy = ("torch", "numpy", "rich", "urllib.request", "prometheus_client")
    probe = subprocess.run([sys.executable, "-c", "import sys, mismatch.cli.monitor; "
                            f"print(sorted(m for m in {heavy!r} if m in sys.modules))"],
                           capture_output=True, text=True)
    assert probe.stdout.strip() == "[]", probe.stderr


def test_baselines_from_a_known_good_run_judge_a_new_run_early():
    """A known-good run's first steps give the baselines (the medians a live monitor would take
    over steps 4-13); a new run judged against them alerts at step 3 instead of after step 14."""
    good = [{"step": s, "kl": 1e-3 * (1 + 0.01 * s), "reward": 0.5} for s in range(1, 20)]
    base = baselines_from(good)
    assert base["kl"] == pytest.approx(statistics.median(1e-3 * (1 + 0.01 * s)
                                                         for s in range(4, 14)))
    assert base["reward"] == 0.5 and "entropy" not in base  # no observations: left out
    assert len(baselines_from(good[:12])) == 0  # fewer than warmup + baseline steps
    bad = [{"step": s, "kl": 12e-3, "reward": 0.5} for s in range(1, 6)]
    default = CollapseMonitor(MonitorConfig())
    assert [a for r in bad for a in default.update(r)] == []  # still building its baseline
    early = CollapseMonitor(MonitorConfig(baselines=base))
    fired = [a for r in bad for a in early.update(r)]
    assert [(a.step, a.signal, a.severity) for a in fired][:1] == [(3, "kl", "critical")]


def test_cli_baseline_from_a_known_good_log(tmp_path):
    good = _write(tmp_path / "good.jsonl",
                  [{"step": s, "kl": 1e-3, "reward": 0.5} for s in range(1, 20)])
    bad = _write(tmp_path / "bad.jsonl", [{"step": s, "kl": 12e-3, "reward": 0.5}
                                          for s in range(1, 6)])
    assert _run(str(bad), "--json").exit_code == 0  # the defaults cannot judge 5 steps
    res = _run(str(bad), "--json", "--baseline", str(good))
    assert res.exit_code == 1
    first = json.loads(res.stdout.splitlines()[0])
    assert (first["signal"], first["severity"], first["baseline"]) == ("kl", "critical", 1e-3)
    short = _write(tmp_path / "short.jsonl", [{"step": 1, "kl": 1e-3}])
    for path, match in ((short, "too few for a baseline"), (tmp_path / "nope", "no such file")):
        res = _run(str(bad), "--baseline", str(path))
        assert res.exit_code == 2 and match in res.output


def test_cli_kl_floor_silences_a_tiny_kl_that_grows_but_not_a_collapse(tmp_path):
    """A tiny KL that grows past the KL rule's lone critical (10×: 1.15e-5 → 1.5e-4, the shape of
    the study's on-policy controls) alerts by default when no probe says what its level means; a
    floor of 1e-3 silences it and keeps the alert on a collapse's KL (1e-3 → 1.5e-2)."""
    def log(name, low, high):
        return _write(tmp_path / name, [{"step": s, "kl": low if s < 30 else high, "reward": 0.5}
                                        for s in range(1, 60)])
    sharpening = log("sync.jsonl", 1.15e-5, 1.5e-4)
    collapse = log("collapse.jsonl", 1e-3, 1.5e-2)
    assert _run(str(sharpening), "--json").exit_code == 1  # the default: growth alone
    quiet = _run(str(sharpening), "--json", "--kl-floor", "1e-3")
    assert quiet.exit_code == 0, quiet.output
    assert json.loads(quiet.stdout.splitlines()[-1])["summary"]["alerts"]["critical"] == 0
    loud = _run(str(collapse), "--json", "--kl-floor", "1e-3")
    assert loud.exit_code == 1
    first = json.loads(loud.stdout.splitlines()[0])
    assert (first["signal"], first["severity"], first["step"]) == ("kl", "critical", 32)
    for bad in ("-1e-3", "nan", "inf"):
        res = _run(str(collapse), "--kl-floor", bad)
        assert res.exit_code == 2 and "--kl-floor" in res.output and "\n" not in res.output.strip()


def test_with_kl_floor_changes_the_kl_rule_alone():
    rules = default_rules()
    floored = with_kl_floor(rules, 1e-3)
    assert floored["kl"].floor == 1e-3 and rules["kl"].floor == 0.0  # a copy, not in place
    assert {k: v for k, v in floored.items() if k != "kl"} == {k: v for k, v in rules.items()
                                                               if k != "kl"}
    assert judge(floored["kl"], 8e-5, 1e-5)[0] == NORMAL
    assert judge(floored["kl"], 12e-3, 1e-3)[0] == CRITICAL
    with pytest.raises(ValueError, match="--kl-floor"):
        with_kl_floor(rules, -1.0)
