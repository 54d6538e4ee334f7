"""results.json files written by `mismatch probe` (tests/data/probe-results: the quick probe with
--fp32-reference, and --sources all --ladder, both on the embedded model) read back through the
typed records: `ProbeSummary.from_json(...).to_json()` gives the same JSON, key order included,
and the reports made from the records are byte for byte the reports written with the files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mismatch.probes.base import SourceResult
from mismatch.probes.kl_summary import KLSummary
from mismatch.probes.summary import CITarget, Figures, ProbeSummary

DATA = Path(__file__).parent / "data" / "probe-results"
PLOTS = ["ladder.png", "log_ratio_hist.png", "routing.png", "source_kl.png", "staleness.png"]


def _load(name: str) -> dict:
    return json.loads((DATA / f"{name}-results.json").read_text())


@pytest.mark.parametrize("name", ["quick", "sources"])
def test_results_json_round_trips_through_the_record(name):
    body = _load(name)
    body.pop("command")
    record = ProbeSummary.from_json(body)
    assert record.to_json() == body
    assert json.dumps(record.to_json(), indent=2) == json.dumps(body, indent=2)  # key order
    assert isinstance(record.total, KLSummary) and record.total.kl_exact == body["total"][
        "kl_exact"]
    want = KLSummary if name == "quick" else SourceResult
    assert all(isinstance(s, want) for s in record.sources.values())


def test_typed_figures_of_a_sources_run():
    record = ProbeSummary.from_json(_load("sources"))
    assert isinstance(record.ci_target, CITarget) and record.ci_target.target == 0.5
    assert isinstance(record.ladder, SourceResult) and record.ladder.headline is not None
    routing = record.sources["routing"]
    assert isinstance(routing, SourceResult) and routing.applies
    assert routing.figure("flip_rate_any_layer") == routing.extra["flip_rate_any_layer"]
    assert routing.figure("kl_exact") == routing.headline.kl_exact
    assert all(isinstance(p, KLSummary) for p in routing.parts.values())
    cols = Figures.of(record).columns
    assert [n for n, _ in cols] == ["total", *record.sources]


def test_quick_probe_columns_keep_their_flag():
    record = ProbeSummary.from_json(_load("quick"))
    assert record.sources["precision"].k_estimators_valid is False
    assert record.references["sampler vs fp32"].k_estimators_valid is True
    assert record.total.figure("no_such_figure") is None


def test_reports_regenerate_byte_identical():
    from mismatch.app.report import format_table, markdown_report
    from mismatch.app.sources_report import format_sources_table, sources_markdown

    quick = _load("quick")
    record = ProbeSummary.from_json(quick)
    assert markdown_report(record, quick["command"]) == (DATA / "quick-report.md").read_text()
    assert markdown_report(quick, quick["command"]) == (DATA / "quick-report.md").read_text()
    assert format_table(quick) == format_table(record)
    sources = _load("sources")
    record = ProbeSummary.from_json(sources)
    want = (DATA / "sources-report.md").read_text()
    assert sources_markdown(record, sources["command"], PLOTS) == want
    assert sources_markdown(sources, sources["command"], PLOTS) == want
    assert format_sources_table(sources) == format_sources_table(record)


def test_qualify_reads_the_record_and_the_file_alike():
    from mismatch.app.qualify import dominant_source, evaluate, load_policy

    policy = load_policy()
    body = _load("sources")
    record = ProbeSummary.from_json(body)
    assert [c.to_json() for c in evaluate(policy, body)] == \
        [c.to_json() for c in evaluate(policy, record)]
    assert dominant_source(body) == dominant_source(record) != "–"


def test_unknown_figure_is_an_error():
    with pytest.raises(ValueError, match="unknown keys"):
        KLSummary.from_json({"kl_exact": 0.1, "kl_exactt": 0.2})
