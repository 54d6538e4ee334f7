"""`mismatch study --eval-full-vocab`: a finished top-p run's base and final policy evaluated from
the full vocabulary, as the study evaluated, beside its own evaluation through the nucleus; the
report shows both. A one-cell grid of two steps on the mixed fleet."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mismatch.train.study_eval import evaluate_full_vocab, needs_full_vocab_eval

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


def test_full_vocabulary_evaluation_is_added_and_reported(topp_run):
    out, run = topp_run
    ev = json.loads((run / "eval.json").read_text())
    assert "full_vocab" not in ev and ev["base"]["sampling"].startswith("top-p")
    assert needs_full_vocab_eval(run)
    proc = _study(out, "--report-only", "--eval-full-vocab")
    assert proc.returncode == 0, proc.stderr
    ev = json.loads((run / "eval.json").read_text())
    full = ev["full_vocab"]
    assert full["base"]["sampling"] == full["final"]["sampling"] == "full"
    assert full["base"]["episodes"] == full["final"]["episodes"] == ev["base"]["episodes"] == 8
    assert full["final"]["step"] == ev["final"]["step"] == 2
    line = (f"{run.name}: held-out from the full vocabulary, base {full['base']['reward']:.3f} "
            f"→ final {full['final']['reward']:.3f}")
    assert line in proc.stdout
    text = (out / "study.md").read_text()
    assert (f"(from the full vocabulary, the study's evaluation: base "
            f"{full['base']['reward']:.2f} → final {full['final']['reward']:.2f})") in text
    assert (f"(full vocabulary: {full['base']['reward']:.2f} → "
            f"{full['final']['reward']:.2f})") in text
    # done once: a second pass evaluates nothing and leaves eval.json as it was
    assert not needs_full_vocab_eval(run)
    before = (run / "eval.json").read_text()
    again = _study(out, "--report-only", "--eval-full-vocab")
    assert again.returncode == 0 and "held-out from the full vocabulary" not in again.stdout
    assert (run / "eval.json").read_text() == before


def test_the_saved_final_policy_is_the_one_the_run_evaluated(topp_run):
    """Re-evaluated through the nucleus, final/ gives the run's own final figures episode for
    episode: the full-vocabulary figure is of the same policy, on the same episode streams."""
    from mismatch.runtime import torch_threads
    from mismatch.train.evaluation import evaluate
    from mismatch.train.study_eval import _config
    from mismatch.zoo import load_model, load_tokenizer

    _, run = topp_run
    ev = json.loads((run / "eval.json").read_text())
    cfg = _config(run)
    with torch_threads(cfg.threads):
        again = evaluate(load_model(run / "final"), load_tokenizer(run / "final"), cfg)
    assert again["reward"] == ev["final"]["reward"]
    assert again["end_reasons"] == ev["final"]["end_reasons"]


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
