"""`mismatch.plan.simulate`: an asynchronous RL run on a sampler fleet over time, checked against
closed forms and hand-computed bills."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mismatch.plan import PlanInputError
from mismatch.plan.simulate import (CapacityTrace, episode_lengths_from_metrics, load_trace, plot,
                                    simulate)
from mismatch.plan.spec import PlanGroup

ROOT = Path(__file__).resolve().parents[1]


def _group(name: str, gpus: int, rate: float, price: float = 10.0, masked: float = 0.0
           ) -> PlanGroup:
    return PlanGroup(name=name, gpu="b200", dtype="bf16", kv_cache="bf16", max_gpus=gpus,
                     price_per_hour=price, tokens_per_s=rate, masked=masked)


def _staleness(updates) -> tuple[float, set[int]]:
    """Useful-token-weighted mean staleness over `updates`, and the values seen."""
    tokens = sum(v for u in updates for v in u.staleness_tokens.values())
    mean = sum(k * v for u in updates for k, v in u.staleness_tokens.items()) / tokens
    return mean, {k for u in updates for k in u.staleness_tokens}


def _pace(updates) -> float:
    """Updates per hour between the first and last publication of `updates`."""
    return 3600.0 * (len(updates) - 1) / (updates[-1].time_s - updates[0].time_s)


def test_steady_fleet_staleness_matches_the_closed_form():
    """Sampling-bound steady fleet, every episode L tokens.

    Group g decodes n_g r_g tokens/s, (1 − q_g) of them useful: S = Σ n_g r_g (1 − q_g) useful
    tokens/s, so the trainer (faster than that: τ < T) takes U tokens every T = U / S seconds, at
    c_j = c_0 + jT, and publishes version j + 1 at c_j + τ. An episode on g lasts D_g = L·batch_g
    / r_g. A token started at t (holding version v(t) = #{k: c_k + τ ≤ t}) arrives at t + D_g and
    is consumed at the first c_j ≥ t + D_g, so with x = (t − c_0)/T its staleness is

        ceil(x + D_g/T) − floor(x − τ/T) − 1,

    an integer in {floor(s_g), ceil(s_g)}, s_g = (D_g + τ)/T, whose mean over a uniform phase x is
    exactly s_g (E ceil(y) = y + ½, E floor(y) = y − ½). Token-weighted over the groups'
    useful shares w_g = n_g r_g (1 − q_g) / S:

        mean staleness = Σ_g w_g (D_g + τ) / T.

    The simulation delivers whole episodes rather than a fluid, so it matches up to the
    granularity of an episode's tokens against U: with 16·32 + 8·16 slots, to 1e-3 (measured
    2.4e-4).
    """
    a = _group("a", 16, 2000.0, masked=0.1)
    b = _group("b", 8, 900.0, masked=0.02)
    batch = {"a": 32, "b": 16}
    L, U, tau = 1000.0, 140000.0, 1.7
    res = simulate([a, b], [L], tokens_per_update=U, trainer_step_s=tau, updates=260,
                   batch=batch)
    S = sum(g.max_gpus * g.tokens_per_s * (1 - g.masked) for g in (a, b))
    T = U / S
    assert tau < T  # sampling-bound
    expected = sum(g.max_gpus * g.tokens_per_s * (1 - g.masked) / S
                   * (L * batch[g.name] / g.tokens_per_s + tau) / T for g in (a, b))
    mean, seen = _staleness(res.updates[20:])
    assert mean == pytest.approx(expected, rel=1e-3)
    s_a, s_b = ((L * batch[n] / g.tokens_per_s + tau) / T for n, g in (("a", a), ("b", b)))
    assert seen <= {math.floor(s_a), math.ceil(s_a), math.floor(s_b), math.ceil(s_b)}
    # the pace: U / S seconds an update
    assert _pace(res.updates[20:]) == pytest.approx(3600.0 / T, rel=1e-3)


def test_steady_fleet_pace_is_the_slower_of_sampling_and_training():
    """Updates/hour = min(3600 S / U, 3600 / τ): the sampling-bound and the trainer-bound case.
    Trainer-bound without max_staleness, the samplers never wait, the buffer grows by S τ − U
    tokens an update, and staleness grows by 1 − U/(S τ) an update: update j consumes tokens that
    arrived at a = jU/S, sampled from a − D with version (a − D)/τ, so its staleness is
    ≈ j (1 − U/(S τ)) + D/τ."""
    g = _group("a", 4, 2000.0)
    S = 8000.0
    for tau, U in ((1.0, 16000.0), (3.0, 16000.0)):  # T = 2 s: sampling- then trainer-bound
        res = simulate([g], [1000.0], tokens_per_update=U, trainer_step_s=tau, updates=150,
                       batch=8)
        assert _pace(res.updates[10:]) == pytest.approx(min(3600 * S / U, 3600 / tau), rel=2e-3)
        assert res.updates_per_hour == pytest.approx(min(3600 * S / U, 3600 / tau), rel=1e-2)
    slope = 1 - U / (S * tau)
    late, early = res.updates[140], res.updates[40]
    assert (late.staleness_mean - early.staleness_mean) / 100 == pytest.approx(slope, rel=2e-2)
    assert late.staleness_mean == pytest.approx(141 * slope + 4.0 / tau, abs=1.0)
    assert late.buffered_tokens == pytest.approx(141 * (S * tau - U), rel=2e-2)
    # with max_staleness the samplers wait instead: staleness ≤ η (episodes finish in the order
    # they start here), and the GPUs sit partly idle
    bounded = simulate([g], [1000.0], tokens_per_update=U, trainer_step_s=tau, updates=100,
                       batch=8, max_staleness=2)
    assert bounded.staleness_max == 2
    assert _pace(bounded.updates[10:]) == pytest.approx(3600 / tau, rel=2e-3)
    assert bounded.groups[0].utilisation < 0.9


def test_capacity_drop_halves_the_pace_and_scale_up_waits_for_the_cold_start():
    """8 GPUs → 4 at t = 600 s (8 slots' episodes lost and resampled), back to 8 at 1200 s with a
    120 s cold start: the pace halves after the drop and doubles only from 1320 s."""
    g = _group("a", 8, 1000.0)
    trace = CapacityTrace({"a": ((600.0, 4), (1200.0, 8))})
    res = simulate([g], [500.0], tokens_per_update=40000.0, trainer_step_s=1.0,
                   duration_s=2000.0, trace=trace, cold_start_s=120.0, batch=4)
    full = 3600.0 * 8000.0 / 40000.0  # 720 updates/hour on 8 GPUs

    def window(t0, t1):
        return [u for u in res.updates if t0 <= u.time_s <= t1]

    assert _pace(window(20, 600)) == pytest.approx(full, rel=1e-2)
    assert _pace(window(620, 1200)) == pytest.approx(full / 2, rel=1e-2)
    assert _pace(window(1200, 1320)) == pytest.approx(full / 2, rel=3e-2)  # still cold
    assert _pace(window(1340, 2000)) == pytest.approx(full, rel=1e-2)
    usage = res.groups[0]
    assert usage.lost_episodes == 16  # 4 GPUs × 4 slots, all busy
    assert usage.held_gpu_s == pytest.approx(8 * 600 + 4 * 600 + 8 * 800)
    assert usage.productive_gpu_s == pytest.approx(usage.held_gpu_s - 4 * 120)
    assert (1200.0, "a", 8, 4) in res.capacity and (1320.0, "a", 8, 8) in res.capacity


def test_router_shares_follow_capacity():
    """Every free slot pulls the next episode, so group g starts episodes at rate n_g r_g / L:
    its token share is n_g r_g / Σ n r whatever its batch, masked share or the lengths."""
    groups = [_group("a", 3, 2000.0, masked=0.05), _group("b", 5, 700.0, masked=0.2),
              _group("c", 2, 1500.0)]
    res = simulate(groups, [300.0, 800.0, 1500.0, 2600.0], tokens_per_update=50000.0,
                   trainer_step_s=0.5, duration_s=3000.0, batch={"a": 16, "b": 4, "c": 8},
                   seed=3)
    total = sum(g.max_gpus * g.tokens_per_s for g in groups)
    for g in groups:
        assert res.token_shares()[g.name] == pytest.approx(
            g.max_gpus * g.tokens_per_s / total, rel=1e-2)
        assert next(u for u in res.groups if u.name == g.name).utilisation > 0.99
    # what each update consumed is useful tokens, U of them, from every group
    u = res.updates[-1]
    assert sum(u.group_tokens.values()) == pytest.approx(50000.0)
    assert set(u.group_tokens) == {"a", "b", "c"}


def test_replanned_shares_are_enforced():
    """replan(capacity) -> shares: 50/50 on groups of capacity 2000 and 1000 tokens/s runs the
    larger group at half its slots (4 of 8), the pace being set by the smaller one."""
    groups = [_group("a", 2, 1000.0), _group("b", 1, 1000.0)]
    calls = []

    def replan(capacity):
        calls.append(dict(capacity))
        return {"a": 0.5, "b": 0.5}

    res = simulate(groups, [500.0], tokens_per_update=10000.0, trainer_step_s=0.5,
                   duration_s=600.0, batch=4, replan=replan)
    assert calls == [{"a": 2, "b": 1}]
    assert res.token_shares()["a"] == pytest.approx(0.5, rel=1e-2)
    assert res.groups[0].utilisation == pytest.approx(0.5, rel=1e-2)
    assert res.groups[1].utilisation == pytest.approx(1.0, rel=1e-2)


def test_serverless_and_reserved_cost_by_hand():
    """One GPU per group, 100 tokens/s, 100-token episodes (1 s each), U = 200 (an update every
    2 s). a costs $36/h ($0.01/s), b $72/h ($0.02/s); replan sends every token to a, so b is
    held but idle: an update costs 2 s × $0.01 = $0.02 serverless, 2 s × ($0.01 + $0.02) = $0.06
    reserved; over 20 s, $0.20 and $0.60.

    Then a alone, a second GPU added at t = 10 s with a 5 s cold start: reserved pays for it
    from 10 s (an update published in (10, 15] costs $0.04), serverless from 15 s, when it
    decodes — at 200 tokens/s the update then takes 1 s, and costs $0.02 again either way. Over
    30 s: reserved (30 + 20) × $0.01 = $0.50, serverless (30 + 15) × $0.01 = $0.45."""
    a = _group("a", 1, 100.0, price=36.0)
    b = _group("b", 1, 100.0, price=72.0)
    res = simulate([a, b], [100.0], tokens_per_update=200.0, trainer_step_s=0.5,
                   duration_s=20.0, replan=lambda capacity: {"a": 1.0})
    assert res.cost_usd("serverless") == pytest.approx(0.20)
    assert res.cost_usd("reserved") == pytest.approx(0.60)
    for u in res.updates[1:]:
        assert (u.cost_serverless_usd, u.cost_reserved_usd) == pytest.approx((0.02, 0.06))
    assert res.groups[1].sampled_tokens == 0 and res.groups[1].utilisation == 0

    res = simulate([a], [100.0], tokens_per_update=200.0, trainer_step_s=0.5, duration_s=30.0,
                   trace=CapacityTrace({"a": ((10.0, 2),)}), cold_start_s=5.0)
    assert res.cost_usd("reserved") == pytest.approx(0.50)
    assert res.cost_usd("serverless") == pytest.approx(0.45)
    by_time = dict(res.cost_per_update("reserved"))
    assert by_time[12.0] == pytest.approx(0.04) and by_time[14.0] == pytest.approx(0.04)
    assert dict(res.cost_per_update("serverless"))[14.0] == pytest.approx(0.02)
    assert by_time[8.0] == pytest.approx(0.02) and by_time[20.0] == pytest.approx(0.02)
    assert [u.time_s for u in res.updates[-3:]] == pytest.approx([27.0, 28.0, 29.0])


@pytest.mark.parametrize("text, line, words", [
    ("time_s,group,gpus\n0,a,2\n10,zz,3\n", 3, "unknown group 'zz'"),
    ("time_s,group,gpus\n0,a,-1\n", 2, "whole number ≥ 0"),
    ("time_s,group,gpus\n0,a,1.5\n", 2, "whole number ≥ 0"),
    ("time_s,group,gpus\n10,a,2\n5,b,1\n", 3, "sort the rows by time"),
    ("time_s,group,gpus\nten,a,2\n", 2, "not a number"),
    ("time_s,group,gpus\n0,a,two\n", 2, "not a number"),
    ("time_s,group,gpus\n0,a\n", 2, "3 fields"),
    ("time,group,count\n0,a,2\n", 1, "write time_s,group,gpus"),
    ("time_s,group,gpus\n0,a,2\n0,a,3\n", 3, "one row per group and time"),
    ("time_s,group,gpus\n-5,a,2\n", 2, "≥ 0"),
])
def test_bad_trace_files_are_one_line(tmp_path, text, line, words):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    groups = [_group("a", 2, 100.0), _group("b", 2, 100.0)]
    with pytest.raises(PlanInputError) as exc:
        load_trace(path, groups)
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg and f"line {line}" in msg and words in msg
    with pytest.raises(PlanInputError):  # simulate reads a path the same way
        simulate(groups, [10.0], tokens_per_update=10.0, trainer_step_s=1.0, updates=1,
                 trace=path)


def test_bad_inputs_are_one_line(tmp_path):
    g = _group("a", 1, 100.0)
    for kwargs in (dict(tokens_per_update=0.0, trainer_step_s=1.0, updates=1),
                   dict(tokens_per_update=10.0, trainer_step_s=1.0),
                   dict(tokens_per_update=10.0, trainer_step_s=1.0, updates=1, gpus={"zz": 1}),
                   dict(tokens_per_update=10.0, trainer_step_s=1.0, updates=1, batch=0),
                   dict(tokens_per_update=10.0, trainer_step_s=1.0, updates=1, gpus={"a": 0})):
        with pytest.raises(PlanInputError) as exc:
            simulate([g], [10.0], **kwargs)
        assert "\n" not in str(exc.value)
    no_rate = PlanGroup(name="x", gpu="b200", dtype="bf16", kv_cache="bf16", max_gpus=1,
                        price_per_hour=1.0)
    with pytest.raises(PlanInputError, match="tokens_per_s"):
        simulate([no_rate], [10.0], tokens_per_update=10.0, trainer_step_s=1.0, updates=1)
    with pytest.raises(PlanInputError, match="unknown group"):
        simulate([g], [10.0], tokens_per_update=10.0, trainer_step_s=1.0, updates=1,
                 replan=lambda capacity: {"zz": 1.0})
    with pytest.raises(PlanInputError, match="cannot read"):
        load_trace(tmp_path / "missing.csv", [g])


def test_episode_lengths_from_metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (
        {"step": 1, "sampled_tokens": 11401, "n_episodes": 128},
        {"step": 2, "sampled_tokens": 12800, "n_episodes": 128}, {"step": 3})) + "\n")
    assert episode_lengths_from_metrics(path) == pytest.approx([11401 / 128, 100.0])
    bare = tmp_path / "bare.jsonl"
    bare.write_text('{"step": 1, "reward": 0.5}\n')
    assert episode_lengths_from_metrics(bare, fallback=[7, 9]) == [7.0, 9.0]
    with pytest.raises(PlanInputError, match="sampled_tokens"):
        episode_lengths_from_metrics(bare)


def test_example_trace_json_and_plot(tmp_path):
    """The example trace on three of the study fleet's groups: the reclaimed H100s lose their
    in-flight episodes, the H200s scale up after the cold start; the result is JSON and a
    figure."""
    groups = [_group("b200-nvfp4-kvfp8", 16, 5200.0, price=6.25, masked=0.004),
              _group("h100-fp8-kvfp8", 16, 2100.0, price=3.95, masked=0.006),
              _group("h200-fp8-kvfp8", 16, 2600.0, price=4.54, masked=0.006)]
    trace = load_trace(ROOT / "examples" / "plan" / "capacity-trace.csv", groups)
    assert trace.at("h100-fp8-kvfp8", 2000.0, 0) == 8
    assert trace.at("h200-fp8-kvfp8", 6000.0, 0) == 16
    res = simulate(groups, [4000.0, 8000.0, 16000.0], tokens_per_update=1048576.0,
                   trainer_step_s=60.0, duration_s=7800.0, trace=trace, cold_start_s=300.0,
                   batch=64, max_staleness=4)
    usage = {g.name: g for g in res.groups}
    assert usage["h100-fp8-kvfp8"].lost_episodes > 0
    assert usage["h200-fp8-kvfp8"].held_gpu_s == pytest.approx(8 * 5400 + 16 * 2400)
    assert usage["h200-fp8-kvfp8"].productive_gpu_s == pytest.approx(
        usage["h200-fp8-kvfp8"].held_gpu_s - 8 * 300)
    assert res.cost_usd("serverless") < res.cost_usd("reserved")
    data = json.loads(json.dumps(res.to_json()))
    assert data["updates"] == len(res.updates) > 50
    assert set(data["token_shares"]) == {g.name for g in groups}
    out = tmp_path / "sim.png"
    assert plot(res, out) == "sim.png" and out.stat().st_size > 10000
