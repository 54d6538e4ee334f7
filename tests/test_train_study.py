"""`mismatch study` end to end: the CI mini-grid (an uncorrected and a corrected arm on the mixed
fleet, a few steps) runs as separate processes and aggregates into a report; a finished run is
never rerun; a study killed mid-run resumes its runs from their checkpoints with no lost or
duplicated step; bad input exits 2 in one line. The full grid is not run here (reports/study.md
says how long it takes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mismatch.runtime import core_slots
from mismatch.study.cells import STUDY_PRESETS, cells, run_order
from mismatch.study.logs import run_state
from mismatch.study.logs import export_logs
from mismatch.study.aggregate import summarize_run
from mismatch.study.runs import replayed_alert
from mismatch.train.rundir import latest_checkpoint, read_metrics

ROOT = Path(__file__).resolve().parents[1]

CLI = [sys.executable, "-m", "mismatch.cli"]


def _cli(args, **kw):
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=600, **kw)


@pytest.fixture(scope="module")
def ci_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study") / "grid"
    report = out.parent / "reports" / "study.md"
    proc = _cli(["study", "--preset", "ci", "--out", str(out), "--report", str(report),
                 "--quiet"])
    return out, report, proc


def test_ci_grid_runs_each_cell_as_a_process_and_writes_the_report(ci_study):
    out, report, proc = ci_study
    assert proc.returncode == 0, proc.stderr
    cfg = STUDY_PRESETS["ci"]()
    names = [c.name for c in cells(cfg)]
    assert names == ["L2-k2-grpo-s0", "L2-k2-sc_mis-s0", "L2-sync-grpo-s0"]
    assert "3 run(s) finished, 0 already done" in proc.stdout
    if core_slots(2):  # two jobs, each pinned to cores of its own (none shared)
        pinned = [(out / n / "train.log").read_text().splitlines()[0] for n in names[:2]]
        assert all(line.startswith("study: on CPUs ") for line in pinned)
        assert pinned[0] != pinned[1]
    for name in names[:2]:
        run = out / name
        recs = read_metrics(run / "metrics.jsonl")
        assert [r["step"] for r in recs] == list(range(1, cfg.steps + 1))
        saved = json.loads((run / "config.json").read_text())
        assert saved["staleness"] == 2 and saved["fleet"] == "mixed" and saved["seed"] == 0
        assert saved["tasks"] == cfg.tasks and saved["lr"] == cfg.lr
        # forced staleness: step s trained on version max(0, s - 1 - K)'s episodes
        assert [r["staleness_mean"] for r in recs] == [0.0, 1.0, 2.0]
        assert run_state(run, cfg.steps) == "done"
    control = json.loads((out / "L2-sync-grpo-s0" / "config.json").read_text())
    assert control["sync"] is True and control["staleness"] is None
    assert [r["staleness_mean"] for r in read_metrics(out / "L2-sync-grpo-s0" / "metrics.jsonl")
            ] == [0.0, 0.0, 0.0]
    # held-out reward before, midway (step 2 of 3) and after, on 2 tasks × 4 episodes
    ev = json.loads((out / "L2-k2-grpo-s0" / "eval.json").read_text())
    assert (ev["tasks"], ev["samples"], list(ev["during"])) == (2, 4, ["2"])
    assert ev["final"]["step"] == 3 and ev["base"]["episodes"] == 8
    assert json.loads((out / "L2-k2-grpo-s0" / "config.json").read_text())["correction"] == "grpo"
    assert json.loads((out / "L2-k2-sc_mis-s0" / "config.json").read_text())["correction"] \
        == "sc+mis"
    text = report.read_text()
    assert "mismatch study --preset ci" in text  # the command that regenerates it
    for arm in ("grpo", "sc+mis"):
        assert f"| L2 | 2 | {arm} | 1 |" in text
    for fig in ("study-reward.png", "study-kl.png", "study-format.png", "study-heldout.png"):
        assert (report.parent / fig).stat().st_size > 1000
        assert f"]({fig})" in text
    assert "L2 0/1 [0.00, 0.97]" in text or "L2 1/1 [0.03, 1.00]" in text  # with its interval
    assert "| L2 | sync | grpo | 1 |" in text  # the on-policy control
    ev = json.loads((out / "L2-sync-grpo-s0" / "eval.json").read_text())
    assert (f"- L2 grpo: base {ev['base']['reward']:.2f} → mid {ev['during']['2']['reward']:.2f}"
            f" → final {ev['final']['reward']:.2f}.") in text
    assert "KL per sampler group of L2 at step 1" in text


def test_summary_matches_the_runs_log(ci_study):
    out, _, _ = ci_study
    run = out / "L2-k2-grpo-s0"
    recs = read_metrics(run / "metrics.jsonl")
    s = summarize_run(run)
    rewards = [r["reward"] for r in recs]
    assert s.reward == rewards
    assert s.base == pytest.approx(sum(rewards[:3]) / 3)
    assert s.final == pytest.approx(sum(rewards) / len(rewards))  # fewer than 5 steps
    assert s.kl_first == recs[0]["kl"]
    assert s.accuracy[1] == pytest.approx((rewards[0] + rewards[1]) / 2)


def test_collapse_signature_on_a_known_curve(tmp_path):
    """A hand-made run: reward 0.6 for 10 steps then 0.05 (the 5-step mean falls below half of
    0.6 at step 13), KL ×10 from step 11, and a format-error ending only from step 30 (rate 0.9
    from there: the 5-step mean first reaches 0.5 at step 32)."""
    run = tmp_path / "run"
    run.mkdir()
    template = json.loads(next((ROOT / "reports" / "study-fresh").rglob("metrics.jsonl"))
                          .read_text().splitlines()[0])  # a real step record's other fields
    recs = [{**template, "step": s, "reward": 0.6 if s <= 10 else 0.05,
             "kl": 1e-4 if s <= 10 else 1e-3, "format_error_rate": 0.02 if s < 30 else 0.9}
            for s in range(1, 41)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    s = summarize_run(run)
    assert s.halved_step == 13  # (2×0.6 + 3×0.05)/5 = 0.27 ≤ 0.3; step 12: 0.38
    assert s.kl_growth_at_collapse == pytest.approx(10.0)
    assert s.format_at_collapse == pytest.approx(0.02)  # not by step 18
    assert s.format_ending_step == 32  # (2×0.02 + 3×0.9)/5 = 0.548 ≥ 0.5
    assert s.first_critical is None and s.heldout == {}


def test_known_good_baselines_let_the_monitor_judge_from_the_first_steps():
    """A run that breaks at step 6 (KL ×100, reward 0.5 → 0.05): a live monitor measures its
    baselines over steps 4-13 and judges nothing before step 14; replayed with a known-good
    run's baselines it alerts within the first smoothing windows. The known-good run replayed
    with its own baselines raises nothing."""
    from mismatch.probes.monitor import CollapseMonitor

    good = [{"step": s, "kl": 1e-4 * (1 + 0.1 * (s % 3)), "reward": 0.5 + 0.02 * (s % 2),
             "format_error_rate": 0.01} for s in range(1, 31)]
    bad = [dict(r, kl=1e-2, reward=0.05) if r["step"] >= 6 else dict(r) for r in good]
    live = CollapseMonitor()
    first_live = next(a.step for r in bad for a in live.update(r) if a.severity == "critical")
    assert first_live >= 14
    replayed = replayed_alert(bad, good)
    assert replayed is not None and 6 <= replayed < 14
    assert replayed_alert(good, good) is None
    assert replayed_alert(bad, good[:5]) is None  # too short for baselines: no judgement


def test_the_full_grid_answers_every_claim_before_it_adds_seeds():
    cfg = STUDY_PRESETS["full"]()
    names = [c.name for c in sorted(cells(cfg), key=lambda c: run_order(cfg, c))]
    assert len(names) == 36
    # the central pair over two seeds first, seed by seed, the fast L0 fleet first
    assert names[:8] == [f"{f}-k8-{a}-s{s}" for s in (0, 1) for f in ("L0", "L2")
                         for a in ("grpo", "sc_mis")]
    seed0 = names[8:16]  # then every other cell of seed 0: the other arms, then the controls
    assert seed0 == ["L0-k8-mis-s0", "L0-k8-sc-s0", "L0-k8-sc_mis_topp-s0", "L2-k8-mis-s0",
                     "L2-k8-sc-s0", "L2-k8-sc_mis_topp-s0", "L0-sync-grpo-s0",
                     "L0-sync-sc_mis-s0"]
    assert all(n.endswith("-s1") for n in names[16:24]) and all(n.endswith("-s2") for n in names[24:])


def test_finished_runs_are_never_rerun(ci_study):
    out, report, _ = ci_study
    logs = {p: p.stat().st_mtime_ns for p in out.glob("*/metrics.jsonl")}
    proc = _cli(["study", "--preset", "ci", "--out", str(out), "--report", str(report),
                 "--quiet"])
    assert proc.returncode == 0, proc.stderr
    assert "0 run(s) finished, 3 already done" in proc.stdout
    assert {p: p.stat().st_mtime_ns for p in logs} == logs


def test_report_only_rebuilds_from_the_saved_grid(ci_study, tmp_path):
    out, _, _ = ci_study
    report = tmp_path / "again.md"
    logs = tmp_path / "logs"
    proc = _cli(["study", "--out", str(out), "--report-only", "--report", str(report),
                 "--export", str(logs)])
    assert proc.returncode == 0, proc.stderr
    assert "exported the logs of 3 run(s)" in proc.stdout
    assert sorted(p.name for p in (logs / "L2-k2-grpo-s0").iterdir()) == [
        "alerts.jsonl", "command.txt", "config.json", "eval.json", "metrics.jsonl"]
    # the exported logs alone (no checkpoints, no weights) give the same report
    again = _cli(["study", "--out", str(logs), "--report-only", "--report",
                  str(tmp_path / "from-logs" / "again.md")])
    assert again.returncode == 0, again.stderr
    body = lambda p: p.read_text().split("## The study's claims")[1]  # noqa: E731
    assert body(tmp_path / "from-logs" / "again.md") == body(report)
    text = report.read_text()
    assert "| L2 | 2 | grpo | 1 |" in text and "| L0 |" not in text  # the saved grid, not "full"
    png = (tmp_path / "again-reward.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000  # a drawn figure


def test_a_new_machine_adopts_the_finished_runs_of_an_export(ci_study, tmp_path):
    """`--adopt DIR`: a grid on a machine holding only the committed logs reruns none of the
    finished runs; a run whose export stops short runs again, to the same numbers; a finished
    export made with other settings is refused before anything is written."""
    out, _, _ = ci_study
    logs = tmp_path / "logs"
    export = _cli(["study", "--out", str(out), "--report-only", "--export", str(logs)])
    assert export.returncode == 0, export.stderr
    cut = logs / "L2-k2-sc_mis-s0" / "metrics.jsonl"
    cut.write_text("".join(cut.read_text().splitlines(keepends=True)[:2]))
    grid = ["study", "--preset", "ci", "--sync-arms", "", "--quiet"]
    new = tmp_path / "new"
    proc = _cli(grid + ["--out", str(new), "--adopt", str(logs)])
    assert proc.returncode == 0, proc.stderr
    assert "1 run(s) finished, 1 already done (1 adopted)" in proc.stdout
    adopted, rerun = new / "L2-k2-grpo-s0", new / "L2-k2-sc_mis-s0"
    assert (adopted / "adopted.json").is_file() and run_state(adopted, 3) == "done"
    assert latest_checkpoint(adopted) is None and not (adopted / "final").exists()
    for name in ("metrics.jsonl", "eval.json", "config.json"):
        assert (adopted / name).read_bytes() == (out / adopted.name / name).read_bytes()
    assert not (rerun / "adopted.json").exists() and (rerun / "final").is_dir()
    reexported = tmp_path / "reexported"  # the marker travels with an export of the new grid
    export_logs(STUDY_PRESETS["ci"](), new, reexported)
    assert (reexported / adopted.name / "adopted.json").is_file()
    assert not (reexported / rerun.name / "adopted.json").exists()
    keys = ("step", "reward", "kl", "grad_norm")
    assert ([[r[k] for k in keys] for r in read_metrics(rerun / "metrics.jsonl")]
            == [[r[k] for k in keys] for r in read_metrics(out / rerun.name / "metrics.jsonl")])
    again = _cli(grid + ["--out", str(new), "--adopt", str(logs)])
    assert "0 run(s) finished, 2 already done (0 adopted)" in again.stdout
    # another grid's settings, or no such folder: one line, exit 2, no run written
    for args, match in ((["--lr", "0.01", "--adopt", str(logs)], "lr=0.0003"),
                        (["--adopt", str(tmp_path / "none")], "no such directory")):
        other = tmp_path / "other"
        bad = _cli(grid + ["--out", str(other)] + args)
        lines = [x for x in bad.stderr.splitlines() if x.strip()]
        assert bad.returncode == 2 and len(lines) == 1 and match in lines[0], bad.stderr
        assert not other.exists() or not any(p.name.startswith("L2") for p in other.iterdir())


def test_an_export_keeps_a_longer_log_than_the_run_it_copies(ci_study, tmp_path):
    """A rerun still behind an earlier export of the same run does not overwrite it."""
    out, _, _ = ci_study
    dest = tmp_path / "logs"
    longer = dest / "L2-k2-grpo-s0" / "metrics.jsonl"
    longer.parent.mkdir(parents=True)
    recs = read_metrics(out / longer.parent.name / "metrics.jsonl")
    recs.append(dict(recs[-1], step=recs[-1]["step"] + 1))
    longer.write_text("".join(json.dumps(r) + "\n" for r in recs))
    before = longer.read_bytes()
    copied = export_logs(STUDY_PRESETS["ci"](), out, dest)
    assert longer.read_bytes() == before and "L2-k2-grpo-s0" not in copied
    shorter = "L2-k2-sc_mis-s0/metrics.jsonl"
    assert (dest / shorter).read_bytes() == (out / shorter).read_bytes()


def test_a_killed_study_resumes_its_runs(tmp_path):
    out = tmp_path / "grid"
    args = ["study", "--preset", "ci", "--arms", "grpo", "--sync-arms", "", "--eval-tasks", "0",
            "--steps", "6", "--out", str(out), "--quiet"]
    proc = subprocess.Popen(CLI + args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run = out / "L2-k2-grpo-s0"
    deadline = time.time() + 300
    try:
        while latest_checkpoint(run) is None if run.exists() else True:
            assert proc.poll() is None, "the study ended before its first checkpoint"
            assert time.time() < deadline
            time.sleep(0.2)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    time.sleep(1.0)  # the run's process gets SIGKILL with its parent (PR_SET_PDEATHSIG)
    steps_at_kill = read_metrics(run / "metrics.jsonl")[-1]["step"]
    assert steps_at_kill < 6 and not (run / "final").exists()
    time.sleep(1.0)
    assert read_metrics(run / "metrics.jsonl")[-1]["step"] == steps_at_kill  # no orphan writes
    assert run_state(run, 6) == "resume"
    done = _cli(args)
    assert done.returncode == 0, done.stderr
    assert "1 resumed" in done.stdout
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert run_state(run, 6) == "done"


def test_bad_input_exits_2_in_one_line(tmp_path, ci_study):
    out, _, _ = ci_study
    cases = [
        (["study", "--preset", "nope", "--out", str(tmp_path / "x")], "unknown study preset"),
        (["study", "--fleets", "L9", "--out", str(tmp_path / "x")], "unknown fleet"),
        (["study", "--arms", "ppo", "--out", str(tmp_path / "x")], "unknown arm"),
        (["study", "--seeds", "a,b", "--out", str(tmp_path / "x")], "comma-separated"),
        (["study", "--out", str(tmp_path / "none"), "--report-only"], "no study"),
        (["study", "--preset", "ci", "--lr", "0.1", "--out", str(out)], "lr="),
        (["study", "--jobs", "0", "--out", str(tmp_path / "x")], "--jobs"),
    ]
    for args, match in cases:
        proc = _cli(args)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = [x for x in proc.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and match in lines[0], (args, proc.stderr)
    assert not (tmp_path / "x").exists()  # nothing written on bad input


def _run_summary(**given):
    """A hand-made RunSummary: the figures a test gives, neutral values (empty curves, zeros,
    None) for the rest."""
    from dataclasses import fields

    from mismatch.study.runs import RunSummary

    def neutral(kind: str):
        if "None" in kind:
            return None
        return {"list": [], "dict": {}, "int": 0, "float": 0.0}[kind.split("[")[0]]

    return RunSummary(**{f.name: given[f.name] if f.name in given else neutral(f.type)
                         for f in fields(RunSummary)})


def test_the_kl_ratio_is_given_at_step_1_and_as_the_studys_run_average():
    """Hand-made summaries: at step 1 L2 holds 100× L0's KL (numerics alone); averaged over the
    run the stable arm's KL is 3× (the study's measure: staleness adds to both fleets). A run
    short of the last step counts at step 1 but not in the run average."""
    from mismatch.study.cells import Cell
    from mismatch.study.aggregate import _kl_ratio

    cfg = STUDY_PRESETS["full"]()
    full = list(range(1, cfg.steps + 1))
    runs = {}
    for seed, scale in ((0, 1.0), (1, 2.0)):
        runs[Cell("L0", 8, "sc+mis", seed)] = _run_summary(kl_first=1e-5 * scale,
                                                           kl_mean=1e-3 * scale, steps=full)
        runs[Cell("L2", 8, "sc+mis", seed)] = _run_summary(kl_first=1e-3 * scale,
                                                           kl_mean=3e-3 * scale, steps=full)
    runs[Cell("L2", 8, "sc+mis", 2)] = _run_summary(kl_first=2e-3, kl_mean=1.0, steps=full[:40])
    lines = _kl_ratio(cfg, runs)
    step1 = next(x for x in lines if "at step 1, full-distribution" in x)
    # geometric means: (1e-3 · 2e-3 · 2e-3)^(1/3) / (1e-5 · 2e-5)^(1/2) = 112.2
    assert "= 112.2×" in step1 and "3 and 2 seed(s)" in step1  # the short run counts here
    mean = next(x for x in lines if "averaged over the run" in x)
    assert "sc+mis at staleness 8" in mean and "= 3.0×" in mean and "2 and 2 run(s)" in mean
    assert "95% interval 3.0–3.0×" not in mean  # two seeds each side: a real interval
    assert not any("sc+mis+topp" in x for x in lines)  # no such runs: no line


def test_a_run_short_of_its_steps_is_not_judged_a_false_alarm():
    """Hand-made summaries: a finished run that never halved with a critical alert is a false
    alarm; a run still short of its steps that has not halved yet (with an alert, say, on its
    way to a collapse) is listed as not judged, live and replayed."""
    from mismatch.study.cells import Cell
    from mismatch.study.aggregate import _monitor

    steps = 150
    good = [{"step": s, "kl": 1e-4 * (1 + 0.1 * (s % 3)), "reward": 0.5 + 0.02 * (s % 2),
             "format_error_rate": 0.01} for s in range(1, steps + 1)]
    breaking = [dict(r, kl=1e-2, reward=0.3) if r["step"] >= 6 else dict(r) for r in good[:30]]

    def summary(records, alert=None):
        return _run_summary(halved_step=None, steps=[r["step"] for r in records],
                            records=records, critical_alerts=1 if alert else 0,
                            first_critical=alert, alert_signals=["kl"] if alert else [])

    runs = {Cell("L0", 8, "sc+mis", 0): summary(good),
            Cell("L0", 8, "sc+mis+topp", 0): summary(good, alert=150),
            Cell("L0", 8, "sc", 1): summary(breaking, alert=17)}
    text = "\n".join(_monitor(runs, steps))
    assert ("Runs whose reward never halved: 2; with a critical alert (false alarms; goal: "
            "none): 1 (L0-k8-sc_mis_topp-s0 at step 150 on kl).") in text
    assert "Not judged, short of 150 steps and not halved so far: L0-k8-sc-s1." in text
    assert "runs that never halved with a critical alert: 0 (runs short of" in text
    # the short run is replayed (its row is there) but not counted
    assert "| L0-k8-sc-s1 | L0-k8-sc_mis-s0 | – | 17 |" in text


def test_a_fleet_file_is_a_study_fleet(tmp_path):
    """`mismatch study --fleets L0,FILE.toml`: a fleet file (what `mismatch plan` writes) runs
    beside the presets, named by its stem, trained with `--fleet` on its absolute path; a
    missing or malformed file, or two fleets of one name, is refused in one line."""
    from dataclasses import replace

    from mismatch.study.cells import fleet_label, fleet_of
    from mismatch.study.grid import _command

    plan = tmp_path / "plan.toml"
    plan.write_text('[[group]]\ngpu = "b200"\ndtype = "bf16"\nkv_cache = "bf16"\nshare = 0.75\n\n'
                    '[[group]]\ngpu = "h100"\ndtype = "fp8"\nkv_cache = "bf16"\nshare = 0.25\n')
    cfg = replace(STUDY_PRESETS["full"](), fleets=("L0", str(plan)), sync_fleets=())
    names = [c.name for c in cells(cfg)]
    assert "plan-k8-sc_mis-s2" in names and "L0-k8-sc_mis-s2" in names and len(names) == 30
    assert fleet_label(str(plan)) == "plan" and fleet_of(str(plan)) == str(plan.resolve())
    cell = next(c for c in cells(cfg) if c.name == "plan-k8-sc_mis-s0")
    cmd = _command(cfg, cell, tmp_path / cell.name, resume=False)
    assert cmd[cmd.index("--fleet") + 1] == str(plan.resolve())
    l0 = _command(cfg, cells(cfg)[0], tmp_path / "x", resume=False)
    assert "--fleet" not in l0 and l0[l0.index("--preset") + 1] == "homogeneous"
    order = sorted(cells(cfg), key=lambda c: run_order(cfg, c))
    assert [c.name for c in order[:4]] == ["L0-k8-grpo-s0", "L0-k8-sc_mis-s0",
                                           "plan-k8-grpo-s0", "plan-k8-sc_mis-s0"]

    bad = tmp_path / "bad.toml"
    bad.write_text('[[group]]\ngpu = "z900"\ndtype = "bf16"\nshare = 1.0\n')
    twin = tmp_path / "other"
    twin.mkdir()
    (twin / "plan.toml").write_text(plan.read_text())
    for fleets, match in ((("L0", str(tmp_path / "none.toml")), "does not exist"),
                          (("L0", str(bad)), "z900"), (("L0", "L7"), "unknown fleet"),
                          ((str(plan), str(twin / "plan.toml")), "share a name")):
        with pytest.raises(ValueError, match=match):
            replace(cfg, fleets=fleets)
