"""The step record is the one reader of a run's metrics.jsonl: the collapse monitor (live and
over a log, the native format), the run report and the study read steps through
`mismatch.step_record.StepRecord`, whose schema imports no torch."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest

from mismatch.probes.monitor import SIGNALS, CollapseMonitor, read_alerts
from mismatch.probes.monitor.formats import ADAPTERS, get_adapter
from mismatch.probes.monitor.signals import STALENESS_FIELDS, Alert, alert_json, native_record
from mismatch.step_record import StepRecord, read_steps

ROOT = Path(__file__).resolve().parents[1]
METRICS = sorted((ROOT / "reports").rglob("metrics.jsonl"))
RUN = ROOT / "reports" / "study-runs" / "L0-k8-grpo-s0"
"""A committed run that collapsed (critical alerts on KL, reward and format errors)."""


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_the_schema_imports_without_torch():
    code = ("import sys, mismatch.step_record, mismatch.probes.monitor; "
            "assert 'torch' not in sys.modules, 'torch loaded'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_monitor_s_view_of_a_step_is_every_signal_by_attribute():
    names = {f.name for f in fields(StepRecord)}
    rec = StepRecord.from_json(_lines(RUN / "metrics.jsonl")[0])
    view = native_record(rec)
    assert set(view) == {"step", *SIGNALS, *STALENESS_FIELDS}
    assert set(view) <= names  # every signal is a field of the schema
    assert all(view[k] == getattr(rec, k) for k in view)


@pytest.mark.parametrize("path", METRICS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_native_format_reads_committed_logs_through_the_record(path):
    """Each committed line reads as a StepRecord, and the native adapter's record of it is the
    one it read field by field before (a signal an older log lacks is None: not observed)."""
    typed = ADAPTERS["native"]
    by_field = replace(typed, step_records=False)
    for line in _lines(path):
        via_record = typed.record(line)
        assert via_record == native_record(StepRecord.from_json(line))
        assert {k: v for k, v in via_record.items() if v is not None} == by_field.record(line)


def test_lines_that_are_not_step_records_are_read_field_by_field():
    native = ADAPTERS["native"]
    partial = {"step": 4, "kl": 2e-3, "entropy": 0.4, "mine": "x"}
    assert native.record(partial) == {"step": 4, "kl": 2e-3, "entropy": 0.4}
    whole = _lines(RUN / "metrics.jsonl")[0]
    assert native.record({**whole, "extra": 1})["kl"] == whole["kl"]  # not a record: by field
    mapped = get_adapter("native", ["kl=kl_k1"])  # an override reads the field it names
    assert not mapped.step_records and mapped.record(whole)["kl"] == whole["kl_k1"]


def test_the_monitor_judges_a_record_as_its_json():
    """A run's alerts, fed its StepRecords (what `mismatch train` does live) and fed its JSON
    lines (what `mismatch monitor` reads): the same alerts, and those the run logged."""
    lines = _lines(RUN / "metrics.jsonl")
    typed, plain = CollapseMonitor(), CollapseMonitor()
    a = [x for line in lines for x in typed.update(StepRecord.from_json(line))]
    b = [x for line in lines for x in plain.update(line)]
    assert a == b and any(x.severity == "critical" for x in a)
    assert typed.counts == plain.counts
    logged = read_alerts(RUN / "alerts.jsonl")
    assert [(x.step, x.signal, x.severity) for x in logged] == \
        [(x.step, x.signal, x.severity) for x in a]


def test_alerts_read_back_as_written(tmp_path):
    alerts = [Alert(step=3, signal="kl", severity="warning", value=2.5e-3, baseline=1e-3,
                    message="kl 0.0025 is 2.5x its baseline 0.001 for 2 steps"),
              Alert(step=9, signal="nonfinite_tokens", severity="critical",
                    value=float("inf"), baseline=None, message="count")]
    path = tmp_path / "alerts.jsonl"
    path.write_text("".join(alert_json(a) + "\n" for a in alerts) + '{"step": 1')  # torn
    back = read_alerts(path)
    assert back[0] == alerts[0]
    assert back[1].baseline is None and math.isnan(back[1].value)  # written as null
    assert read_alerts(tmp_path / "none.jsonl") == []
    with pytest.raises(ValueError, match="'message'"):
        Alert.from_json({"step": 1, "signal": "kl", "severity": "warning", "value": 1.0,
                         "baseline": None})
    with pytest.raises(ValueError, match="severity must be one of"):
        Alert.from_json({**alerts[0].to_json(), "severity": "bad"})
    path.write_text('{"step": 1, "signal": "kl"}\n')  # JSON, but not an alert: named
    with pytest.raises(ValueError, match=r"alerts.jsonl: .*no 'value'.*damaged"):
        read_alerts(path)


def test_read_steps_names_a_damaged_line(tmp_path):
    lines = (RUN / "metrics.jsonl").read_text().splitlines()
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines[:3]) + "\n" + lines[3][:40])  # a kill mid-write
    assert [r.step for r in read_steps(path)] == [1, 2, 3]
    path.write_text(lines[0] + "\nnot json\n" + lines[1] + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not JSON"):
        read_steps(path)
    path.write_text(json.dumps({**json.loads(lines[0]), "klx": 1}) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: .*unknown keys \['klx'\]"):
        read_steps(path)


def test_the_report_s_panels_are_fields_of_the_record():
    from mismatch.train.report import PANELS, load_run

    names = {f.name for f in fields(StepRecord)}
    assert {key for key, _, _ in PANELS} <= names
    run = load_run(RUN)
    assert run.steps == read_steps(RUN / "metrics.jsonl") and run.steps[-1].step == 150
    assert run.alerts == read_alerts(RUN / "alerts.jsonl") and run.heldout.complete
