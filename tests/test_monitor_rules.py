"""The monitor's rules on the study's committed runs (it must not cry wolf on runs that held, and
must still see the collapses early), the KL's probe floor, and the non-finite log-prob rule.

The runs are the logs `mismatch study --export` committed under reports/; whether a run collapsed
is the study's own test (`summarize_run`: the training reward's 5-step mean halved)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from mismatch.probes.monitor import CollapseMonitor, MonitorConfig, default_rules
from mismatch.train.rundir import read_metrics, run_masks_tokens
from mismatch.study.runs import summarize_run

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "reports" / "study-runs"


def _alerts(records, config=None):
    monitor = CollapseMonitor(config)
    return [a for r in records for a in monitor.update(r)]


def _criticals(records, config=None):
    return [a for a in _alerts(records, config) if a.severity == "critical"]


# -- the study's runs ---------------------------------------------------------------------------


@pytest.mark.parametrize("run", [
    "L0-sync-sc_mis-s0",     # on-policy control: KL 1.15e-5 -> 8.2e-5 (7x) as it learned
    "L0-k8-sc_mis_topp-s0",  # SC+MIS+top-p: KL 1.3e-3 -> 4.8e-3 over its last 60 steps, alone
    "L0-k8-sc_mis_topp-s1",  # KL 2-4.6x for two noisy steps, masked share at most 0.27%
    "L2-k8-sc_mis_topp-s0",  # KL 4-5.7x for six steps, masked share at most 0.58%, recovered
])
def test_runs_that_held_raise_no_critical_alert(run):
    summary = summarize_run(RUNS / run)
    assert summary.halved_step is None  # the study's verdict: it never collapsed
    assert summary.first_critical is not None  # the monitor that ran inside it cried wolf
    assert run_masks_tokens(RUNS / run)  # its config.json: an MIS arm
    assert _criticals(summary.records, MonitorConfig(masked_loss=True)) == []


def test_the_last_two_false_alarms_need_both_changes():
    """Without `masked_loss` both alert at the KL's growth with the reward (steps 17 and 58);
    with it but the reward's 5-step peak, L2 seed 0 alerts at step 112, on a reward 52% off a
    peak of its luckiest five batches."""
    old = default_rules()
    old["reward"] = replace(old["reward"], peak_steps=0)
    for run, config, step in [("L0-k8-sc_mis_topp-s1", MonitorConfig(), 17),
                              ("L2-k8-sc_mis_topp-s0", MonitorConfig(), 58),
                              ("L2-k8-sc_mis_topp-s0", MonitorConfig(rules=old, masked_loss=True),
                               112)]:
        critical = _criticals(summarize_run(RUNS / run).records, config)
        assert critical and critical[0].step == step, (run, critical)


def test_study_replay_no_false_critical_and_the_lead_kept():
    """scripts/monitor_on_study.py, the table of reports/monitor.md: over the grid's 24 runs
    that held, no critical alert; the 12 collapses alerted with a median lead of at least 10
    steps; the held-out set (not looked at while the rules were set) likewise."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("monitor_on_study",
                                                  ROOT / "scripts" / "monitor_on_study.py")
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    results = replay.evaluate()
    grid, held_out = replay.counts(results["grid"]), replay.counts(results["held-out"])
    assert (grid["held"], grid["collapsed"]) == (24, 12)
    assert grid["false"] == [] and held_out["false"] == []
    assert grid["missed"] == [] and held_out["missed"] == []
    assert grid["median_lead"] >= 10 and held_out["median_lead"] >= 10
    assert grid["before"] >= 11 and held_out["before"] == held_out["collapsed"] == 6


@pytest.mark.parametrize("run, lead", [("L0-k8-grpo-s0", 10), ("L2-k8-grpo-s2", 10),
                                       ("L0-k8-sc-s1", 10)])
def test_collapses_are_critical_well_before_the_reward_halves(run, lead):
    summary = summarize_run(RUNS / run)
    critical = _criticals(summary.records)
    assert critical, f"{run}: collapse not flagged"
    assert summary.halved_step - critical[0].step >= lead
    assert critical[0].signal in ("kl", "reward")  # the signature, corroborated


def test_the_on_policy_control_is_silenced_by_its_probe_not_by_a_fixed_level():
    """The same log without its staleness fields (so no probe from its first step) alerts: the
    floor comes from the run's own same-weights KL, and an explicit probe does the same. Judged
    with the reward's peak as the best 5-step median (peak_steps 0), under which the control's
    reward dip at step 108 corroborates its KL: the probe alone must then keep it quiet. (With
    the shipped 10-step peak the reward never warns there, and the KL's growth from 1e-5 is a
    warning from step 20 without the probe, from step 53 with it.)"""
    records = read_metrics(RUNS / "L0-sync-sc_mis-s0" / "metrics.jsonl")
    bare = [{k: v for k, v in r.items() if not k.startswith("staleness")} for r in records]
    rules = default_rules()
    rules["reward"] = replace(rules["reward"], peak_steps=0)
    assert _criticals(bare, MonitorConfig(rules=rules))
    assert _criticals(bare, MonitorConfig(rules=rules, kl_probe=records[0]["kl"])) == []
    assert _criticals(records, MonitorConfig(rules=rules)) == []
    assert _criticals(records, MonitorConfig(rules=rules, probe_from_first_step=False))
    first_kl = [min(a.step for a in _alerts(bare, config) if a.signal == "kl")
                for config in (None, MonitorConfig(kl_probe=records[0]["kl"]))]
    assert first_kl == [20, 53]


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


# -- an MIS run's drift, and the reward's peak -------------------------------------------------


def _drift_run(masked_share_high, n=40):
    """KL 4x from step 20 and the reward 35% down; the masked share from 0.4% to the given."""
    return [{"step": s, "kl": 1e-3 if s < 20 else 4e-3, "reward": 0.6 if s < 20 else 0.39,
             "mis_masked_fraction": 0.004 if s < 20 else masked_share_high} for s in range(n)]


def test_masked_loss_reads_the_masked_share_as_the_drift():
    flat, rising = _drift_run(0.004), _drift_run(0.015)
    # without masked_loss, KL growth and the reward fall corroborate: critical
    assert {a.signal for a in _criticals(flat)} == {"kl", "reward"}
    # with it, a KL the loss masks away is a warning; the reward's 35% fall alone too
    quiet = _alerts(flat, MonitorConfig(masked_loss=True))
    assert quiet and all(a.severity == "warning" for a in quiet)
    assert {a.signal for a in quiet} == {"kl", "reward"}
    # MIS masking 3.75x as many tokens (above the 1% budget) with the reward falling: critical
    loud = _criticals(rising, MonitorConfig(masked_loss=True))
    assert {a.signal for a in loud} >= {"mis_masked_fraction", "reward"}
    assert min(a.step for a in loud) <= 22
    assert "MIS masking more tokens" in next(a for a in loud if a.signal == "reward").message
    # an order of magnitude of KL growth is still critical alone
    assert any(a.signal == "kl" for a in _criticals(
        [{**r, "kl": 1.2e-2 if r["step"] >= 20 else r["kl"]} for r in flat],
        MonitorConfig(masked_loss=True)))


def test_masked_loss_config_and_signature():
    assert MonitorConfig().signature_signals() == ("kl", "format_error_rate", "reward")
    assert MonitorConfig(masked_loss=True).signature_signals() == (
        "mis_masked_fraction", "format_error_rate", "reward")
    rules = default_rules()
    del rules["mis_masked_fraction"]
    with pytest.raises(ValueError, match="mis_masked_fraction"):
        MonitorConfig(rules=rules, masked_loss=True)
    with pytest.raises(ValueError, match="peak_steps"):
        replace(default_rules()["reward"], peak_steps=-1)


def test_the_reward_peak_is_a_level_held_not_a_lucky_stretch():
    """Four lucky batches at 0.9 among 0.5s: a 5-step peak of 0.9 makes the ordinary 0.44 after
    them a 50% fall (critical); the 10-step peak (0.5) sees 10%. A real fall still fires."""
    rewards = [0.5] * 20 + [0.9] * 4 + [0.5] * 3 + [0.44] * 13
    records = [{"step": s, "reward": r} for s, r in enumerate(rewards)]
    old = default_rules()
    old["reward"] = replace(old["reward"], peak_steps=0)
    assert _criticals(records, MonitorConfig(rules=old))
    assert _alerts(records) == []
    falling = [{"step": s, "reward": 0.5 if s < 20 else 0.2} for s in range(40)]
    assert [a.signal for a in _criticals(falling)] == ["reward"]


def test_run_masks_tokens_reads_the_run_config(tmp_path):
    for correction, masks in [("sc+mis+topp", True), ("mis", True), ("grpo", False),
                              ("sc", False), ("no such arm", False)]:
        run = tmp_path / correction.replace("+", "_").replace(" ", "_")
        run.mkdir()
        (run / "metrics.jsonl").write_text("")
        (run / "config.json").write_text(f'{{"correction": "{correction}"}}')
        assert run_masks_tokens(run) is masks
        assert run_masks_tokens(run / "metrics.jsonl") is masks
    (tmp_path / "mis" / "config.json").write_text("{not json")
    assert run_masks_tokens(tmp_path / "mis") is False
    assert run_masks_tokens(tmp_path / "nowhere") is False


def test_the_command_line_takes_masked_loss_from_the_run_folder(tmp_path):
    """`mismatch monitor RUN` on the L2 SC+MIS+top-p run is quiet (its config.json names an MIS
    arm); its log alone, copied out of the folder, alerts unless told --masked-loss."""
    import shutil
    import subprocess
    import sys

    run = RUNS / "L2-k8-sc_mis_topp-s0"
    alone = tmp_path / "metrics.jsonl"
    shutil.copy(run / "metrics.jsonl", alone)

    def monitor(*args):
        return subprocess.run([sys.executable, "-m", "mismatch.cli", "monitor", *args],
                              capture_output=True, text=True, timeout=120)

    assert monitor(str(run)).returncode == 0
    assert monitor(str(alone)).returncode == 1
    assert monitor(str(alone), "--masked-loss").returncode == 0


def test_the_trainer_tells_its_monitor_whether_its_loss_masks():
    from mismatch.train.config import TrainConfig

    masks = {arm: TrainConfig(correction=arm).masks_tokens
             for arm in ("grpo", "sc", "mis", "sc+mis", "sc+mis+topp")}
    assert masks == {"grpo": False, "sc": False, "mis": True, "sc+mis": True,
                     "sc+mis+topp": True}
    loop = (ROOT / "train" / "loop.py").read_text()
    assert "MonitorConfig(masked_loss=cfg.masks_tokens)" in loop
