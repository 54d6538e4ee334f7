"""The source probes' own figures as typed records (probes/source_figures.py): read back from a
committed `--sources all --ladder` results.json (tests/data/probe-results), each record's
to_json() is exactly the entries of the source's block it names, in the block's order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mismatch.probes.base import SourceResult
from mismatch.probes.kl_summary import KLSummary
from mismatch.probes.source_figures import (AcceleratorFigures, FleetWeighted, LadderFigures,
                                            LadderRung, RoutingFlips, SamplingFigures,
                                            StalenessByLag)
from mismatch.probes.summary import ProbeSummary

DATA = Path(__file__).parent / "data" / "probe-results"


@pytest.fixture(scope="module")
def record() -> ProbeSummary:
    return ProbeSummary.from_json(json.loads((DATA / "sources-results.json").read_text()))


@pytest.mark.parametrize("name, cls", [("accelerator", AcceleratorFigures),
                                       ("routing", RoutingFlips),
                                       ("staleness", StalenessByLag),
                                       ("sampling", SamplingFigures),
                                       ("ladder", LadderFigures)])
def test_records_give_back_the_blocks_entries_in_order(record, name, cls):
    src = record.ladder if name == "ladder" else record.sources[name]
    figures = cls.of(src)
    assert isinstance(figures, cls)
    out = figures.to_json()
    assert out == {k: v for k, v in src.extra.items() if k in out}
    assert json.dumps(out) == json.dumps({k: v for k, v in src.extra.items() if k in out})
    assert cls.from_json(out) == figures


def test_typed_fields(record):
    lad = LadderFigures.of(record.ladder)
    assert all(isinstance(r, LadderRung) for r in lad.rungs)
    assert [r.rung for r in lad.rungs] == [r["rung"] for r in record.ladder.extra["rungs"]]
    acc = AcceleratorFigures.of(record.sources["accelerator"])
    assert isinstance(acc.fleet_weighted, FleetWeighted)
    assert acc.fleet_weighted.kl_exact == record.sources["accelerator"].extra[
        "fleet_weighted"]["kl_exact"]
    st = StalenessByLag.of(record.sources["staleness"])
    assert st.lags == sorted(int(k) for k in st.kl_exact_by_lag)
    assert st.kl_exact_at(st.lags[-1]) == st.kl_exact_by_lag[str(st.lags[-1])]
    assert SamplingFigures.of(record.sources["sampling"]).tokens is None  # the headline's


def test_missing_or_not_applying_sources_have_no_record(record):
    assert RoutingFlips.of(None) is None
    assert RoutingFlips.of(KLSummary(kl_exact=0.1)) is None
    assert RoutingFlips.of(SourceResult(name="routing", headline=None)) is None
    assert RoutingFlips.of(record.sources["kernels"]) is None
    assert LadderFigures.of(record.sources["routing"]) is None


def test_optional_figures_are_left_out_while_unset():
    st = StalenessByLag(kl_k3_by_lag={}, kl_exact_by_lag={}, kl_exact_ci95_by_lag={},
                        tokens_by_lag={}, lr=None, steps=0, source="s",
                        bf16_changed_fraction_by_step=[],
                        bf16_changed_fraction_vs_trainer_by_lag={}, mean_reward_by_step=[])
    out = st.to_json()
    assert "informative_groups_by_step" not in out and out["lr"] is None
    assert SamplingFigures(top_p=0.9, sampler_mass_outside=0, outside_trainer_top_p_fraction=0,
                           trainer_mass_on_support=1, processed_minus_raw_mean=0,
                           bias_bound=0.1, tokens=3).to_json()["tokens"] == 3


def test_fleet_report_reads_the_accelerator_record(record):
    from mismatch.app.sources_report import fleet_markdown

    body = json.loads((DATA / "sources-results.json").read_text())
    text = fleet_markdown(record, "cmd", "fleet.png")
    assert text == fleet_markdown(body, "cmd", "fleet.png")
    w = AcceleratorFigures.of(record.sources["accelerator"]).fleet_weighted
    assert f"| **fleet (capacity-weighted)** | | | 1.000 | | **{w.kl_exact:.3e}** |" in text
    with pytest.raises(ValueError, match="no accelerator source"):
        fleet_markdown({k: v for k, v in body.items() if k != "sources"} | {"sources": {}},
                       "cmd")
