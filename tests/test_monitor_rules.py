"""The monitor's rules on the study's committed runs (it must not cry wolf on runs that held, and
must still see the collapses early), the KL's probe floor, and the non-finite log-prob rule.

The runs are the logs `mismatch study --export` committed under reports/; whether a run collapsed
is the study's own test (`summarize_run`: the training reward's 5-step mean halved)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mismatch.probes.monitor import CollapseMonitor, MonitorConfig, default_rules
from mismatch.train.rundir import read_metrics
from mismatch.train.study_summary import summarize_run

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "reports" / "study-runs"


def _criticals(records, config=None):
    monitor = CollapseMonitor(config)
    return [a for r in records for a in monitor.update(r) if a.severity == "critical"]


# -- the study's runs ---------------------------------------------------------------------------


@pytest.mark.parametrize("run", [
    "L0-sync-sc_mis-s0",     # on-policy control: KL 1.15e-5 -> 8.2e-5 (7x) as it learned
    "L0-k8-sc_mis_topp-s0",  # SC+MIS+top-p: KL 1.3e-3 -> 4.8e-3 over its last 60 steps, alone
])
def test_runs_that_held_raise_no_critical_alert(run):
    summary = summarize_run(RUNS / run)
    assert summary["halved_step"] is None  # the study's verdict: it never collapsed
    assert summary["first_critical"] is not None  # the monitor that ran inside it cried wolf
    assert _criticals(summary["records"]) == []


@pytest.mark.parametrize("run, lead", [("L0-k8-grpo-s0", 10), ("L2-k8-grpo-s2", 10),
                                       ("L0-k8-sc-s1", 10)])
def test_collapses_are_critical_well_before_the_reward_halves(run, lead):
    summary = summarize_run(RUNS / run)
    critical = _criticals(summary["records"])
    assert critical, f"{run}: collapse not flagged"
    assert summary["halved_step"] - critical[0].step >= lead
    assert critical[0].signal in ("kl", "reward")  # the signature, corroborated


def test_the_on_policy_control_is_silenced_by_its_probe_not_by_a_fixed_level():
    """The same log without its staleness fields (so no probe from its first step) alerts: the
    floor comes from the run's own same-weights KL, and an explicit probe does the same."""
    records = read_metrics(RUNS / "L0-sync-sc_mis-s0" / "metrics.jsonl")
    bare = [{k: v for k, v in r.items() if not k.startswith("staleness")} for r in records]
    assert _criticals(bare)
    assert _criticals(bare, MonitorConfig(kl_probe=records[0]["kl"])) == []
    assert _criticals(records, MonitorConfig(probe_from_first_step=False))


# -- the probe floor, on its own ------------------------------------------------------------------


def _kl_run(first_staleness, low, high, n=40):
    """A KL flat at `low`, at `high` from step 20, with the reward falling from step 20 too."""
    out = []
    for s in range(n):
        rec = {"step": s, "kl": low if s < 20 else high, "reward": 0.6 if s < 20 else 0.35}
        if s == 0 and first_staleness is not None:
            rec.update(kl=low, staleness_max=first_staleness, staleness_mean=first_staleness)
        out.append(rec)
    return out


def test_probe_floor_from_a_same_weights_first_step():
    # 4x growth with the reward 40% down: the signature, when the KL's level is above the floor
    sharp = _kl_run(0, 1e-5, 4e-5)  # probe 1e-5: 4e-5 is under 5x the probe -> numerics
    monitor = CollapseMonitor()
    fired = [a for r in sharp for a in monitor.update(r)]
    assert monitor.kl_probe == pytest.approx(1e-5)
    # the reward's 42% fall alone is a warning; the KL under the floor corroborates nothing
    assert [(a.step, a.signal, a.severity) for a in fired] == [(23, "reward", "warning")]
    stale = _kl_run(8, 1e-5, 4e-5)  # the first step was sampled 8 versions behind: no probe
    monitor = CollapseMonitor()
    fired = [(a.step, a.signal, a.severity) for r in stale for a in monitor.update(r)]
    assert monitor.kl_probe is None
    assert fired == [(21, "kl", "warning"), (23, "kl", "critical"), (23, "reward", "critical")]
    above = _kl_run(0, 1e-5, 8e-5)  # 8x the probe: above the floor, judged as before
    assert [(a.step, a.signal) for a in _criticals(above)] == [(23, "kl"), (23, "reward")]


def test_probe_config_checks():
    for bad in (-1e-3, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="kl_probe"):
            MonitorConfig(kl_probe=bad)
    with pytest.raises(ValueError, match="probe_margin"):
        MonitorConfig(probe_margin=0.0)


# -- non-finite log-probs -----------------------------------------------------------------------


def test_nonfinite_tokens_warn_at_once_and_go_critical_when_repeated():
    counts = [0] * 5 + [3] + [0] * 4 + [1] + [0] * 12 + [2] + [0] * 3
    monitor = CollapseMonitor()
    fired = [a for s, n in enumerate(counts)
             for a in monitor.update({"step": s, "nonfinite_tokens": n})]
    # step 5: the first step with any, a warning at once (no baseline, no sustained level);
    # step 10: the second before 10 clean steps re-armed it: critical; 11-22 clean re-arm it,
    # so step 23 is a first occurrence again
    assert [(a.step, a.severity) for a in fired] == [(5, "warning"), (10, "critical"),
                                                     (23, "warning")]
    assert all(a.signal == "nonfinite_tokens" and a.baseline is None for a in fired)
    assert fired[0].value == 3 and "first step with any" in fired[0].message
    assert "second step" in fired[1].message and "precision" in fired[1].message
    assert "nonfinite_tokens" in default_rules()


def test_nonfinite_tokens_on_consecutive_steps_and_a_clean_run():
    monitor = CollapseMonitor()
    fired = [a for s in range(20) for a in monitor.update({"step": s, "nonfinite_tokens":
                                                           7 if s in (0, 1) else 0})]
    assert [(a.step, a.severity) for a in fired] == [(0, "warning"), (1, "critical")]
    clean = CollapseMonitor()
    assert [a for s in range(50) for a in clean.update({"step": s, "nonfinite_tokens": 0})] == []
    assert clean.values()["nonfinite_tokens"] == 0


def test_the_command_line_reads_the_staleness_so_the_control_gets_its_probe_floor():
    """`mismatch monitor metrics.jsonl` (the native format) passes the staleness fields on, so a
    run's same-weights first step is its probe there too: the on-policy control stays quiet."""
    import json
    import subprocess
    import sys

    from mismatch.probes.monitor.formats import get_adapter

    log = RUNS / "L0-sync-sc_mis-s0" / "metrics.jsonl"
    first = json.loads(log.read_text().splitlines()[0])
    record = get_adapter("native").record(first)
    assert record["staleness_max"] == 0 and record["kl"] == first["kl"]
    proc = subprocess.run([sys.executable, "-m", "mismatch.cli", "monitor", str(log), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    alerts = [json.loads(x) for x in proc.stdout.splitlines()[:-1]]
    assert [a for a in alerts if a["severity"] == "critical"] == [], alerts
