"""mismatch.train.fleet: the presets, the router's proportionality bound |count − N·share| < 1 at every N,
stickiness, determinism, thread safety, and the errors."""

from __future__ import annotations

import math
import threading
from dataclasses import replace

import pytest

from mismatch.fleets import FLEETS, natural_pairs
from mismatch.profiles import resolve
from mismatch.train.fleet import Router, SamplerGroup, fleet

# shares are floats normalized once more inside the router; 1e-9 absorbs the float rounding of
# N·share in the check, not any slack in the schedule (which is exact)
EPS = 1e-9


def _groups(weights) -> list[SamplerGroup]:
    total = sum(weights) or 1
    spec = resolve("b200", "bf16")
    return [SamplerGroup(name=f"g{i}", spec=spec, share=w / total) for i, w in enumerate(weights)]


def _check_bound(router: Router, sessions: int) -> float:
    """Assign `sessions` new sessions, checking the bound after each; returns the worst lag."""
    shares = {g.name: g.share for g in router.groups}
    counts = dict.fromkeys(shares, 0)
    worst = 0.0
    for n in range(1, sessions + 1):
        counts[router.assign(("s", n)).name] += 1
        for name, share in shares.items():
            lag = abs(counts[name] - n * share)
            assert lag < 1 + EPS, (name, n, counts[name], n * share)
            worst = max(worst, lag)
    assert counts == router.counts()
    assert router.assigned == sessions
    return worst


def test_presets():
    assert set(FLEETS) == {"homogeneous", "precision", "mixed"}
    mixed = fleet("mixed")
    assert [g.name for g in mixed] == [f"{g}-{d}" for g, d in natural_pairs()]
    assert len(mixed) == 8
    for grp, (gpu, dtype) in zip(mixed, natural_pairs()):
        assert grp.spec == resolve(gpu, dtype, "fp8")
        assert grp.spec.kv_cache == "fp8" and grp.spec.kv_codec == "fp8-act"
        assert grp.share == pytest.approx(1 / 8)
    assert math.isclose(sum(g.share for g in mixed), 1.0)
    assert {g.name for g in mixed} >= {"b200-nvfp4", "b300-nvfp4", "h100-fp8", "h200-bf16",
                                       "a100-bf16", "rtx-pro-6000-bf16"}

    (home,) = fleet("homogeneous")
    assert home.name == "b200-bf16" and home.share == 1.0
    assert home.spec == resolve("b200", "bf16", "bf16")
    assert home.spec.gpu == "b200" and home.spec.dtype == "bf16" and home.spec.kv_cache == "bf16"
    assert home.spec.kv_codec is None
    assert fleet("homogeneous", {"b200-bf16": 2.0}) == [home]

    (low,) = fleet("precision")  # the study's L1: NVFP4 weights, BF16 activations, FP8 KV
    assert low.name == "b200-w4a16-nvfp4" and low.share == 1.0
    assert low.spec == resolve("b200", "w4a16-nvfp4", "fp8")
    assert low.spec.weight_codec == "w4a16-nvfp4" and low.spec.activation_codec is None
    assert low.spec.kv_codec == "fp8-act" and low.spec.compute_dtype == "bf16"
    with pytest.raises(ValueError, match="fleet precision: unknown group"):
        fleet("precision", {"b200-bf16": 1.0})


def test_mixed_shares():
    groups = fleet("mixed", {"b200-nvfp4": 3, "h100-fp8": 1})
    shares = {g.name: g.share for g in groups}
    assert shares["b200-nvfp4"] == pytest.approx(0.75)
    assert shares["h100-fp8"] == pytest.approx(0.25)
    assert sum(v for k, v in shares.items() if k not in ("b200-nvfp4", "h100-fp8")) == 0
    assert fleet("mixed", [("b200-nvfp4", 3), ("h100-fp8", 1)]) == groups
    router = Router(groups)
    for n in range(100):
        router.assign(n)
    counts = router.counts()
    assert counts["b200-nvfp4"] == 75 and counts["h100-fp8"] == 25
    assert sum(counts.values()) == 100


@pytest.mark.parametrize("weights", [
    [1],
    [1, 1],
    [3, 1],
    [1, 1, 1],
    [1] * 8,
    [3, 1, 1, 1, 1, 1, 1, 1],
    [5, 3, 2, 1, 1, 1, 1, 0.5],
    [1000, 1, 1, 1],
    [0.7, 0.2, 0.1],
    [2, 1000, 83, 3, 3],
    [65, 1000, 3, 1, 3, 54, 1000, 1000],  # the largest-deficit rule lags by > 1 on these two
    [22, 21, 1000, 3, 2, 1000, 41, 1000, 2],
    [1, 0, 2],
])
def test_proportions_within_one(weights):
    router = Router(_groups(weights), seed=3)
    worst = _check_bound(router, 600)
    assert worst < 1
    counts = router.counts()
    for g in router.groups:
        if g.share == 0:
            assert counts[g.name] == 0


def test_bound_for_many_seeds_and_random_shares():
    import random

    rng = random.Random(7)
    for seed in range(12):
        weights = [rng.choice([rng.randint(1, 100), rng.randint(1, 3), 1000])
                   for _ in range(rng.randint(2, 9))]
        assert _check_bound(Router(_groups(weights), seed=seed), 200) < 1


def test_sticky_and_release():
    router = Router(fleet("mixed"))
    first = {s: router.assign(s) for s in range(40)}
    assert router.counts() == dict.fromkeys([g.name for g in router.groups], 5)
    for _ in range(3):
        for s in range(40):
            assert router.assign(s) is first[s]
    assert router.assigned == 40
    assert sum(router.live().values()) == 40

    assert router.release(7) is first[7]
    assert router.release(7) is None
    assert router.release("never") is None
    assert sum(router.counts().values()) == 40  # the released session still counts
    assert router.live()[first[7].name] == 4
    router.assign(7)  # a new episode under a reused id is a new session
    assert router.assigned == 41
    assert sum(router.counts().values()) == 41


def test_deterministic_given_seed():
    groups = fleet("mixed", {"b200-nvfp4": 3, "b300-nvfp4": 3, "h100-fp8": 2, "a100-bf16": 1})

    def sequence(seed):
        r = Router(groups, seed=seed)
        return [r.assign(i).name for i in range(300)]

    assert sequence(0) == sequence(0)
    assert sequence(5) == sequence(5)
    seqs = {tuple(sequence(s)) for s in range(6)}
    assert len(seqs) > 1  # the seed breaks ties, so it changes the order
    for seq in seqs:  # but never the proportions
        assert set(seq) == {"b200-nvfp4", "b300-nvfp4", "h100-fp8", "a100-bf16"}
        assert seq.count("b200-nvfp4") == seq.count("b300-nvfp4") == 100
        assert abs(seq.count("h100-fp8") - 300 * 2 / 9) < 1
        assert abs(seq.count("a100-bf16") - 300 / 9) < 1


def test_thread_safety():
    router = Router(_groups([3, 1, 1, 2, 1]), seed=1)
    per_thread, threads = 400, 12
    results: dict[int, list] = {}
    barrier = threading.Barrier(threads)

    def worker(k):
        barrier.wait()
        out = []
        for i in range(per_thread):
            out.append((f"t{k}-{i}", router.assign(f"t{k}-{i}").name))
            shared = f"shared-{i % 50}"  # every thread also hits the same 50 sessions
            out.append((shared, router.assign(shared).name))
            if i % 7 == 0:
                router.release(f"t{k}-{i}")
        results[k] = out

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    total = threads * per_thread + 50
    counts = router.counts()
    assert sum(counts.values()) == total == router.assigned
    for g in router.groups:
        assert abs(counts[g.name] - total * g.share) < 1 + EPS
    shared = {}
    for out in results.values():
        for sid, name in out:
            if sid.startswith("shared-"):
                assert shared.setdefault(sid, name) == name  # sticky across threads
    assert len(shared) == 50
    released = threads * len(range(0, per_thread, 7))
    assert sum(router.live().values()) == total - released


@pytest.mark.parametrize("call, match", [
    (lambda: fleet("nope"), "presets: homogeneous, precision, mixed"),
    (lambda: fleet("mixed", {"z100-fp8": 1}), "unknown group"),
    (lambda: fleet("mixed", {"b200-nvfp4": -1}), ">= 0"),
    (lambda: fleet("mixed", {"b200-nvfp4": float("nan")}), "finite"),
    (lambda: fleet("mixed", {"b200-nvfp4": 0}), "> 0"),
    (lambda: fleet("mixed", [("b200-nvfp4", "x")]), "pairs"),
    (lambda: fleet("homogeneous", {"h100-fp8": 1}), "unknown group"),
    (lambda: fleet("homogeneous", {"b200-bf16": 0}), "> 0"),
    (lambda: Router([]), "no sampler groups"),
    (lambda: Router(_groups([0, 0])), "> 0"),
    (lambda: Router([replace(g, share=-0.5) for g in _groups([1, 1])]), ">= 0"),
    (lambda: Router(_groups([1, 1]) + _groups([1])), "duplicate"),
])
def test_errors_one_line(call, match):
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert "\n" not in str(info.value)


def test_fleet_table():
    from mismatch.fleets import register_fleet

    assert {f.name: f.level for f in FLEETS.values()} == {
        "homogeneous": "L0", "precision": "L1", "mixed": "L2"}
    with pytest.raises(ValueError, match="registered twice"):
        register_fleet(FLEETS["mixed"])
