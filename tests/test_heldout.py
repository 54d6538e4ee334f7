"""eval.json through its typed record (train/heldout.py): every committed eval.json reads back
and writes out to the same object, and the readers see the figures the file holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mismatch.train.heldout import HeldOut, HeldOutScore

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = sorted((ROOT / "reports").rglob("eval.json"))


def test_committed_eval_files_exist():
    assert len(COMMITTED) >= 10, "the study's committed runs hold eval.json files"


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_committed_eval_json_round_trips(path):
    raw = json.loads(path.read_text())
    held = HeldOut.from_json(raw)
    assert held.to_json() == raw
    if "final" in raw:
        assert held.final.reward == raw["final"]["reward"]
    if raw.get("during"):
        first = min(raw["during"], key=int)
        assert held.mid.reward == raw["during"][first]["reward"]
    if raw.get("full_vocab"):
        assert held.full_vocab.tasks is None and held.full_vocab.base is not None


def test_a_top_p_run_with_full_vocabulary_and_the_readers():
    score = HeldOutScore(reward=0.5, episodes=256, sampling="top-p 0.9, top-k 64",
                         format_error_rate=0.01, end_reasons={"answered": 250, "format_errors": 6})
    full = HeldOut(base=HeldOutScore(reward=0.4, episodes=256, sampling="full",
                                     format_error_rate=0.0), final=None)
    held = HeldOut(tasks=64, samples=4, base=score,
                   during={75: HeldOutScore(reward=0.55, episodes=256, sampling="full",
                                            format_error_rate=0.0, step=75)},
                   final=HeldOutScore(reward=0.6, episodes=256, sampling="full",
                                      format_error_rate=0.0, step=150), full_vocab=full)
    raw = held.to_json()
    assert list(raw) == ["tasks", "samples", "full_vocab", "base", "during", "final"]
    assert raw["during"]["75"]["step"] == 75 and "step" not in raw["base"]
    assert HeldOut.from_json(json.loads(json.dumps(raw))) == held
    assert held.complete and not full.complete and held.mid.reward == 0.55
    assert HeldOut.from_json({}) == HeldOut() and not HeldOut().complete


def test_study_and_report_readers_go_through_the_record(tmp_path):
    from mismatch.study.runs import _heldout
    from mismatch.train.report import _heldout as report_heldout

    run = tmp_path / "run"
    run.mkdir()
    ev = {"tasks": 2, "samples": 1,
          "full_vocab": {"base": {"reward": 0.25, "episodes": 2, "sampling": "full",
                                  "format_error_rate": 0.0, "end_reasons": {}}},
          "base": {"reward": 0.5, "episodes": 2, "sampling": "top-p 0.9, top-k 64",
                   "format_error_rate": 0.0, "end_reasons": {}},
          "during": {"10": {"reward": 0.75, "episodes": 2, "sampling": "top-p 0.9, top-k 64",
                            "format_error_rate": 0.0, "end_reasons": {}, "step": 10},
                     "5": {"reward": 0.6, "episodes": 2, "sampling": "top-p 0.9, top-k 64",
                           "format_error_rate": 0.0, "end_reasons": {}, "step": 5}}}
    (run / "eval.json").write_text(json.dumps(ev))
    assert _heldout(run) == {"base": 0.5, "mid": 0.6, "base_full": 0.25}
    assert report_heldout(HeldOut.from_json(ev)) == "—"  # no final yet
    ev["final"] = dict(ev["base"], reward=1.0, step=20)
    assert report_heldout(HeldOut.from_json(ev)) == "0.500 → 1.000"


METRICS = sorted((ROOT / "reports").rglob("metrics.jsonl"))


@pytest.mark.parametrize("path", METRICS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_committed_metrics_line_reads_as_a_step_record(path):
    """metrics.jsonl through StepRecord.from_json and back: the same object, except that a log
    written before nonfinite_tokens / group_tokens existed reads None there (written back as
    null)."""
    from mismatch.step_record import StepRecord

    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    assert lines
    for raw in lines:
        rec = StepRecord.from_json(raw)
        assert rec.step == raw["step"] and rec.kl == raw["kl"] and rec.reward == raw["reward"]
        back = rec.to_json()
        assert {k: v for k, v in back.items() if k in raw} == raw
        assert set(back) - set(raw) <= {"nonfinite_tokens", "group_tokens"}


def test_a_step_record_with_an_unknown_or_missing_key_is_named():
    from mismatch.step_record import StepRecord

    raw = json.loads(METRICS[0].read_text().splitlines()[0])
    with pytest.raises(ValueError, match=r"unknown keys \['klx'\]"):
        StepRecord.from_json({**raw, "klx": 1.0})
    with pytest.raises(ValueError, match="'kl'"):
        StepRecord.from_json({k: v for k, v in raw.items() if k != "kl"})
