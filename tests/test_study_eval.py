"""A top-p arm's held-out evaluation, both ways: through its nucleus (as it samples) and from the
full vocabulary (as the study evaluated), by the run itself and, for a run that predates that,
afterwards by `mismatch study --eval-full-vocab`, with the same figures; the report shows both.
A one-cell grid of two steps on the mixed fleet."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mismatch.study.full_vocab import evaluate_full_vocab, needs_full_vocab_eval

CLI = [sys.executable, "-m", "mismatch.cli"]


def _study(out, *extra):
    return subprocess.run(CLI + ["study", "--preset", "ci", "--arms", "sc+mis+topp",
                                 "--sync-arms", "", "--steps", "2", "--out", str(out),
                                 "--quiet", *extra],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def topp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("study-eval") / "grid"
    proc = _study(out)
    assert proc.returncode == 0, proc.stderr
    return out, out / "L2-k2-sc_mis_topp-s0"


def _figures(e):
    return e["reward"], e["end_reasons"], e["episodes"], e["sampling"]


def test_a_top_p_run_evaluates_through_its_nucleus_and_from_the_full_vocabulary(topp_run,
                                                                                 tmp_path):
    _, run = topp_run
    ev = json.loads((run / "eval.json").read_text())
    full = ev["full_vocab"]
    assert list(ev["during"]) == list(full["during"]) == ["1"]
    for e in (ev["base"], ev["during"]["1"], ev["final"]):
        assert e["sampling"] == "top-p 0.97, top-k 64" and e["episodes"] == 8
    for e in (full["base"], full["during"]["1"], full["final"]):
        assert e["sampling"] == "full" and e["episodes"] == 8
    assert full["final"]["step"] == ev["final"]["step"] == 2
    assert not needs_full_vocab_eval(run)  # nothing left to add afterwards
    said = (run / "train.log").read_text()  # `mismatch train`'s summary, both ways
    for label, e, how in (("", ev, "top-p 0.97, top-k 64"), (" from the full vocabulary", full,
                                                             "full")):
        assert (f"held-out reward{label}: base {e['base']['reward']:.3f} -> step 1 "
                f"{e['during']['1']['reward']:.3f} -> final {e['final']['reward']:.3f} "
                f"(2 tasks x 4, {how} sampling)") in said
    # `mismatch report`'s table of the run, both ways
    rep = subprocess.run(CLI + ["report", str(run), "--out", str(tmp_path / "report")],
                         capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr
    assert (f"| {ev['base']['reward']:.3f} → {ev['final']['reward']:.3f} (full vocabulary: "
            f"{full['base']['reward']:.3f} → {full['final']['reward']:.3f}) |"
            ) in (tmp_path / "report" / "report.md").read_text()


def test_afterwards_gives_the_runs_own_figures_and_the_report_shows_both(topp_run, tmp_path):
    out, run = topp_run
    own = json.loads((run / "eval.json").read_text())
    old = dict(own)
    del old["full_vocab"]  # as a run made before `mismatch train` evaluated both ways
    (run / "eval.json").write_text(json.dumps(old))
    assert needs_full_vocab_eval(run)
    proc = _study(out, "--report-only", "--eval-full-vocab")
    assert proc.returncode == 0, proc.stderr
    full = json.loads((run / "eval.json").read_text())["full_vocab"]
    # the saved final/ policy and the base, on the same episode streams: the run's own figures
    for key in ("base", "final"):
        assert _figures(full[key]) == _figures(own["full_vocab"][key])
    assert full["final"]["step"] == 2
    line = (f"{run.name}: held-out from the full vocabulary, base {full['base']['reward']:.3f} "
            f"→ final {full['final']['reward']:.3f}")
    assert line in proc.stdout
    text = (out / "study.md").read_text()
    assert (f"(from the full vocabulary, the study's evaluation: base "
            f"{full['base']['reward']:.2f} → final {full['final']['reward']:.2f})") in text
    assert (f"(full vocabulary: {full['base']['reward']:.2f} → "
            f"{full['final']['reward']:.2f})") in text
    # done once: a second pass evaluates nothing and leaves eval.json as it was
    before = (run / "eval.json").read_text()
    again = _study(out, "--report-only", "--eval-full-vocab")
    assert again.returncode == 0 and "held-out from the full vocabulary" not in again.stdout
    assert (run / "eval.json").read_text() == before
    (run / "eval.json").write_text(json.dumps(own))  # as the run wrote it


def test_a_full_distribution_run_or_an_unfinished_one_is_refused(tmp_path, topp_run):
    _, run = topp_run
    cfg = json.loads((run / "config.json").read_text())
    other = tmp_path / "grpo"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(dict(cfg, correction="grpo")))
    (other / "eval.json").write_text((run / "eval.json").read_text())
    assert not needs_full_vocab_eval(other)
    with pytest.raises(ValueError, match="already samples its held-out episodes from the full"):
        evaluate_full_vocab(other)
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no final/ policy yet"):
        evaluate_full_vocab(other)
