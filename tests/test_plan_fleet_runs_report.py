"""scripts/make_plan_fleet_runs_report.py: a step's sampling cost, priced from a plan's groups, by
each of its three routes (logged, exact from the groups' tokens, the equal-share estimate), and
the committed three-fleet runs behind reports/plan-fleet-runs.md where they are present."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location(
        "plan_fleet_runs", ROOT / "scripts" / "make_plan_fleet_runs_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _group(name, gpu, dtype, kv, price, rate):
    return {"name": name, "gpu": gpu, "dtype": dtype, "kv_cache": kv, "price_per_hour": price,
            "tokens_per_s": rate}


PLAN = {"groups": [_group("b200-bf16", "b200", "bf16", "bf16", 6.25, 8000.0)],
        "compare": {"equal_capacity": {"groups": [
            _group("b200-bf16", "b200", "bf16", "bf16", 6.25, 8000.0),
            _group("h200-fp8-kvfp8", "h200", "fp8", "fp8", 4.54, 10000.0)]}}}


def test_prices_per_token_come_from_every_group_of_the_plan():
    prices = _script().price_per_token(PLAN)
    assert prices[("b200", "bf16", "bf16")] == pytest.approx(6.25 / 3600 / 8000, rel=1e-15)
    assert prices[("h200", "fp8", "fp8")] == pytest.approx(4.54 / 3600 / 10000, rel=1e-15)


def test_step_costs_by_route():
    s = _script()
    per_token = {"a": 1e-6, "b": 3e-6}
    logged = [{"sampling_cost_usd": 0.5, "group_tokens": {"a": 1}, "sampled_tokens": 1}]
    assert s.step_costs(logged, per_token) == ([0.5], "logged")
    exact = [{"group_tokens": {"a": 1000, "b": 3000}, "sampled_tokens": 4000}]
    costs, how = s.step_costs(exact, per_token)
    assert how == "exact" and math.isclose(costs[0], 1000e-6 + 9000e-6, rel_tol=1e-15)
    older = [{"sampled_tokens": 4000}]
    costs, how = s.step_costs(older, per_token)  # the groups' mean price per token
    assert how == "estimated" and math.isclose(costs[0], 4000 * 2e-6, rel_tol=1e-15)
    costs, how = s.step_costs(older, {"a": 1e-6})  # one group: exact whatever the log holds
    assert how == "exact" and math.isclose(costs[0], 4000e-6, rel_tol=1e-15)
    assert s.cumulative([1.0, 2.0, 3.5]) == [1.0, 3.0, 6.5]


def test_preset_fleets_are_priced_by_their_groups():
    s = _script()
    prices = {("b200", "bf16", "bf16"): 2e-7}
    assert s.fleet_prices("L0", prices) == {"b200-bf16": 2e-7}
    with pytest.raises(SystemExit, match="prices no group"):
        s.fleet_prices("L2", prices)


RUNS = ROOT / "reports" / "plan-fleet-runs"


@pytest.mark.skipif(not (RUNS / "study.json").is_file(), reason="no committed three-fleet runs")
def test_committed_runs_cost_what_their_logs_say():
    """Every committed planned-fleet step's logged cost is its groups' tokens at the plan's
    prices (the route the report's L2 estimate is checked against)."""
    s = _script()
    plan = json.loads((RUNS / "plan.json").read_text())
    prices = s.price_per_token(plan)
    per_token = {g["name"]: prices[(g["gpu"], g["dtype"], g["kv_cache"])]
                 for g in plan["groups"]}
    runs = sorted(RUNS.glob("planned-*/metrics.jsonl"))
    assert runs
    for path in runs:
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            want = sum(n * per_token[g] for g, n in rec["group_tokens"].items())
            # the run priced from fleet.toml, which writes the plan's figures to 9 digits
            assert math.isclose(rec["sampling_cost_usd"], want, rel_tol=1e-8), path
