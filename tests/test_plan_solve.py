"""mismatch.plan.solve against brute force, and the fleet file's validation.

Serverless plans are checked against an exhaustive vertex enumeration of the same linear program
(an LP over a box attains its optimum at a vertex: each variable at 0, at its cap, or free, with
as many active constraints as free variables); reserved plans against every integer fleet."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from mismatch.plan import PlanInfeasible, PlanInputError
from mismatch.plan.solve import equal_capacity_plan, frontier, homogeneous_plan, solve_numbers
from mismatch.plan.spec import parse_spec

U, R = 1_000_000.0, 6.0


def _spec(groups, *, kl=None, kl_ratio=None, masked=0.01, billing="serverless", tokens=U,
          rate=R):
    budget = {"masked": masked, "billing": billing}
    budget.update({"kl": kl} if kl is not None else {"kl_ratio": kl_ratio})
    return parse_spec({"update": {"tokens": tokens, "updates_per_hour": rate}, "budget": budget,
                       "group": groups})


def _random_groups(rng, m, max_gpus=4):
    gpus = [("b200", "bf16", "bf16"), ("h100", "fp8", "fp8"), ("b200", "nvfp4", "fp8"),
            ("a100", "bf16", "fp8"), ("h200", "fp8", "fp8")]
    out = []
    for gpu, dtype, kv in gpus[:m]:
        out.append({"gpu": gpu, "dtype": dtype, "kv_cache": kv,
                    "price_per_hour": float(rng.uniform(1, 8)),
                    "tokens_per_s": float(rng.uniform(2e4, 2e5)),
                    "kl": float(10 ** rng.uniform(-4.5, -2.5)),
                    "masked": float(rng.uniform(0, 0.02)),
                    "max_gpus": int(rng.integers(0, max_gpus + 1))})
    return out


def _arrays(spec):
    g = spec.groups
    return (np.array([x.price_per_hour for x in g]), np.array([x.tokens_per_s for x in g]),
            np.array([x.max_gpus for x in g], float), np.array([x.kl for x in g]),
            np.array([x.masked for x in g]))


def _brute_serverless(spec, B, Bm):
    """min Σ x p/(3600 r) by enumerating the LP's vertices; None if infeasible."""
    p, r, n, k, q = _arrays(spec)
    caps = n * r * 3600 / R
    cost = p / (3600 * r)
    rows = [k - B, q - Bm]
    best = None
    m = len(p)
    for status in itertools.product((0, 1, 2), repeat=m):  # 0: zero, 1: cap, 2: free
        free = [i for i in range(m) if status[i] == 2]
        fixed = np.array([caps[i] if status[i] == 1 else 0.0 for i in range(m)])
        for active in itertools.combinations(range(2), len(free) - 1 if free else 0):
            x = fixed.copy()
            if free:
                A = [[1 - q[i] for i in free]] + [[rows[a][i] for i in free] for a in active]
                b = [spec.tokens - fixed @ (1 - q)] + [-(fixed @ rows[a]) for a in active]
                try:
                    x[free] = np.linalg.solve(np.array(A), np.array(b))
                except np.linalg.LinAlgError:
                    continue
            tol = 1e-7
            if np.any(x < -tol * spec.tokens) or np.any(x > caps * (1 + tol) + tol):
                continue
            if abs(x @ (1 - q) - spec.tokens) > tol * spec.tokens:
                continue
            if x @ k > B * x.sum() * (1 + tol) or x @ q > Bm * x.sum() * (1 + tol) + tol:
                continue
            c = float(x @ cost)
            best = c if best is None else min(best, c)
    return best


def _brute_reserved(spec, B, Bm):
    p, r, n, k, q = _arrays(spec)
    best = None
    for m in itertools.product(*[range(int(x) + 1) for x in n]):
        m = np.array(m, float)
        cap = m * r
        if cap.sum() <= 0 or cap @ (1 - q) < spec.tokens * R / 3600:
            continue
        if cap @ k > B * cap.sum() or cap @ q > Bm * cap.sum():
            continue
        c = float(m @ p / R)
        best = c if best is None else min(best, c)
    return best


@pytest.mark.parametrize("billing", ["serverless", "reserved"])
def test_the_optimum_equals_brute_force_and_meets_the_budgets(billing):
    rng = np.random.default_rng(7)
    brute = _brute_serverless if billing == "serverless" else _brute_reserved
    seen = {"feasible": 0, "infeasible": 0}
    for trial in range(60):
        groups = _random_groups(rng, int(rng.integers(2, 5)))
        kls = sorted(g["kl"] for g in groups)
        B = float(rng.uniform(kls[0], kls[-1]))
        Bm = float(rng.uniform(0.002, 0.02))
        spec = _spec(groups, kl=B, masked=Bm, billing=billing)
        expected = brute(spec, B, Bm)
        try:
            plan = solve_numbers(spec)
        except PlanInfeasible:
            assert expected is None, f"trial {trial}: solver says infeasible, brute force " \
                                     f"found {expected}"
            seen["infeasible"] += 1
            continue
        assert expected is not None, f"trial {trial}: brute force found no feasible fleet"
        assert plan.cost_per_update_usd == pytest.approx(expected, rel=1e-7)
        # the budgets, in float64, never exceeded; the update's tokens are there
        assert plan.kl <= B and plan.masked <= Bm
        useful = sum(x.tokens_per_update * (1 - x.group.masked) for x in plan.parts)
        assert useful == pytest.approx(spec.tokens, rel=1e-9) if billing == "serverless" \
            else useful >= spec.tokens * (1 - 1e-12)
        for x in plan.parts:
            assert 0 <= x.gpus <= x.group.max_gpus * (1 + 1e-9)
            if billing == "reserved":
                assert x.gpus == int(x.gpus)
        seen["feasible"] += 1
    assert seen["feasible"] >= 15 and seen["infeasible"] >= 3, seen


@pytest.mark.parametrize("billing", ["serverless", "reserved"])
def test_raising_the_budget_never_raises_the_cost(billing):
    rng = np.random.default_rng(3)
    for _ in range(8):
        groups = _random_groups(rng, 5, max_gpus=6)
        spec = _spec(groups, kl=1.0, masked=0.02, billing=billing)
        costs = [c for _, c in frontier(spec, billing, points=16)]
        known = [c for c in costs if c is not None]
        assert known, "the frontier holds no feasible budget"
        first = costs.index(known[0])
        assert all(c is not None for c in costs[first:]), "feasible, then infeasible"
        assert all(b <= a * (1 + 1e-9) for a, b in zip(known, known[1:])), known


def test_infeasible_names_the_binding_constraint_and_the_value_that_fixes_it():
    groups = [{"gpu": "b200", "dtype": "bf16", "price_per_hour": 6.25, "tokens_per_s": 1000.0,
               "kl": 1e-4, "masked": 0.0, "max_gpus": 2},
              {"gpu": "b200", "dtype": "nvfp4", "kv_cache": "fp8", "price_per_hour": 6.25,
               "tokens_per_s": 4000.0, "kl": 2e-3, "masked": 0.0, "max_gpus": 8}]
    # capacity: 2·1000 + 8·4000 tokens/s → 34000·600 s = 2.04e7 tokens per update at 6/hour
    spec = _spec(groups, kl=1e-2, tokens=3e7)
    with pytest.raises(PlanInfeasible, match=r"capacity binds.*≤ 4\.08"):
        solve_numbers(spec)
    # KL: the b200-bf16 group alone samples 1.2e6 of the 2e6 tokens; the rest must come from
    # NVFP4, so the least KL is (1.2e6·1e-4 + 0.8e6·2e-3) / 2e6 = 8.6e-4
    spec = _spec(groups, kl=5e-4, tokens=2e6)
    with pytest.raises(PlanInfeasible, match="KL budget binds") as err:
        solve_numbers(spec)
    least = float(re.search(r"raise budget\.kl to ≥ ([0-9.e+-]+)", str(err.value)).group(1))
    assert least == pytest.approx(8.6e-4, rel=2e-4) and least >= 8.6e-4 * (1 - 1e-9)
    solve_numbers(spec, kl_budget=least)  # the value it names is feasible
    with pytest.raises(PlanInfeasible):
        solve_numbers(spec, kl_budget=least * 0.99)


def test_the_comparison_fleets():
    groups = [{"gpu": "b200", "dtype": "bf16", "price_per_hour": 6.0, "tokens_per_s": 1000.0,
               "kl": 1e-4, "masked": 0.0, "max_gpus": 10},
              {"gpu": "h100", "dtype": "fp8", "kv_cache": "fp8", "price_per_hour": 3.0,
               "tokens_per_s": 1000.0, "kl": 3e-4, "masked": 0.0, "max_gpus": 10}]
    spec = _spec(groups, kl_ratio=2.0, tokens=1.2e6, rate=6.0)  # B = 2e-4
    assert spec.kl_budget() == pytest.approx(2e-4)
    plan = solve_numbers(spec)
    # serverless: half from each (the KL is then exactly 2e-4): 6e5·6/(3.6e6) + 6e5·3/(3.6e6)
    assert plan.cost_per_update_usd == pytest.approx(1.5) and plan.kl <= 2e-4
    hom = homogeneous_plan(spec)
    assert hom.cost_per_update_usd == pytest.approx(1.2e6 * 6 / 3.6e6)
    eq = equal_capacity_plan(spec)
    assert eq.cost_per_update_usd == pytest.approx(1.5) and eq.kl == pytest.approx(2e-4)
    # reserved: 1.2e6 tokens × 6 / 3600 s = 2000 tokens/s → 2 GPUs; KL ≤ 2e-4 allows 1 + 1
    plan = solve_numbers(spec, "reserved")
    assert [x.gpus for x in plan.parts] == [1.0, 1.0]
    assert plan.cost_per_update_usd == pytest.approx((6 + 3) / 6)
    assert homogeneous_plan(spec, "reserved").cost_per_update_usd == pytest.approx(12 / 6)


@pytest.mark.parametrize("change, message", [
    ({"group": [{"gpu": "z100", "dtype": "bf16", "max_gpus": 1}]}, "unknown gpu 'z100'"),
    ({"group": [{"gpu": "a100", "dtype": "nvfp4", "max_gpus": 1}]}, "NVFP4 W4A4 needs"),
    ({"group": [{"gpu": "b200", "dtype": "bf16", "max_gpus": 1, "price_per_hour": -1}]},
     "price_per_hour must be > 0"),
    ({"group": [{"gpu": "b200", "dtype": "bf16", "max_gpus": 1.5}]}, "whole number"),
    ({"group": [{"gpu": "b200", "dtype": "bf16", "max_gpus": 1, "speed": 3}]},
     "unknown key 'speed'"),
    ({"budget": {"kl": 1e-3, "kl_ratio": 2, "masked": 0.01}}, "one of them"),
    ({"budget": {"kl": 1e-3, "masked": 1.5}}, r"in \[0, 1\]"),
    ({"budget": {"kl": 1e-3, "masked": 0.01, "billing": "spot"}}, "serverless or reserved"),
    ({"budget": {"kl_ratio": 4.7, "masked": 0.01},
      "group": [{"gpu": "h100", "dtype": "fp8", "max_gpus": 1}]}, "trainer-matched group"),
    ({"update": {"tokens": 0, "updates_per_hour": 6}}, "update.tokens must be > 0"),
    ({"extra": {}}, r"unknown table \[extra\]"),
])
def test_bad_fleet_files_are_one_line(change, message):
    data = {"update": {"tokens": 1e6, "updates_per_hour": 6},
            "budget": {"kl": 1e-3, "masked": 0.01},
            "group": [{"gpu": "b200", "dtype": "bf16", "max_gpus": 1}]}
    data.update(change)
    with pytest.raises(PlanInputError, match=message) as err:
        parse_spec(data, "fleet.toml")
    assert "\n" not in str(err.value) and str(err.value).startswith("fleet.toml: ")


def test_measured_throughput_comes_from_qualify_json(tmp_path):
    import json

    (tmp_path / "verdict.json").write_text(json.dumps({
        "verdict": "pass", "throughput": {"tokens_per_s": 9000.0, "requests": 64},
        "checks": [{"metric": "kl_k3", "value": 3e-4, "source": "precision"},
                   {"metric": "mis_masked_fraction", "value": 0.002, "source": "precision"}]}))
    spec = parse_spec({"update": {"tokens": 1e6, "updates_per_hour": 6},
                       "budget": {"kl": 1e-3, "masked": 0.01},
                       "group": [{"gpu": "h100", "dtype": "fp8", "max_gpus": 4,
                                  "measured": "verdict.json", "measured_gpus": 2,
                                  "masked": 0.001}]}, "f.toml", tmp_path)
    (g,) = spec.groups
    assert g.tokens_per_s == 4500.0 and g.kl == 3e-4 and g.masked == 0.001
    assert g.sources == {"tokens_per_s": "measured", "kl": "measured", "masked": "given"}
