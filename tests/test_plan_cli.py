"""`mismatch plan FLEET.toml`: exit codes, outputs, JSON contract, and figures filled from the
default price table, the throughput model and the probe (cached)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

GIVEN = """
[update]
tokens = 1048576
updates_per_hour = 6
[budget]
kl_ratio = 4.7
masked = 0.01
billing = "serverless"
[[group]]
gpu = "b200"
dtype = "bf16"
price_per_hour = 6.25
tokens_per_s = 3000
kl = 1e-4
masked = 0.001
max_gpus = 16
[[group]]
gpu = "h100"
dtype = "fp8"
kv_cache = "fp8"
price_per_hour = 3.95
tokens_per_s = 2500
kl = 2e-4
masked = 0.002
max_gpus = 16
[[group]]
gpu = "b200"
dtype = "nvfp4"
kv_cache = "fp8"
price_per_hour = 6.25
tokens_per_s = 7000
kl = 1.2e-3
masked = 0.004
max_gpus = 16
"""


def _plan(*args, cwd=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mismatch.cli", "plan", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_a_plan_with_given_figures(tmp_path):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(GIVEN)
    out = tmp_path / "out"
    res = _plan(fleet, "--out", out, "--json")
    assert res.returncode == 0, res.stderr
    body = json.loads(res.stdout)
    for key in ("billing", "cost_per_update_usd", "kl", "masked", "groups"):
        assert key in body
    assert body["billing"] == "serverless" and body["kl"] <= 4.7 * 1e-4 * (1 + 1e-12)
    for g in body["groups"]:
        assert {"name", "share", "gpus", "tokens_per_update", "cost_per_update_usd"} <= set(g)
    assert sum(g["share"] for g in body["groups"]) == pytest.approx(1.0)
    assert sum(g["cost_per_update_usd"] for g in body["groups"]) == \
        pytest.approx(body["cost_per_update_usd"])
    hom = body["compare"]["homogeneous"]
    assert hom["cost_per_update_usd"] > body["cost_per_update_usd"] and hom["saving"] > 0
    assert sorted(p.name for p in out.iterdir()) == [".mismatch-output", "fleet.toml",
                                                     "frontier.png", "plan.json", "report.md"]
    import tomllib

    planned = tomllib.loads((out / "fleet.toml").read_text())["group"]
    assert {g["name"] for g in planned} == {g["name"] for g in body["groups"] if g["share"] > 0}
    # the table, reserved billing, an earlier output replaced without --force
    res = _plan(fleet, "--out", out, "--billing", "reserved")
    assert res.returncode == 0, res.stderr
    assert "reserved billing" in res.stdout and "homogeneous (trainer-matched)" in res.stdout


def test_infeasible_is_exit_1_with_the_binding_constraint(tmp_path):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(GIVEN)
    res = _plan(fleet, "--out", tmp_path / "out", "--kl", "1e-5")
    assert res.returncode == 1
    (line,) = res.stderr.strip().splitlines()
    assert "KL budget binds" in line and "raise budget.kl to ≥ 0.0001" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, message", [
    ("[update\ntokens = 1", "is not valid TOML"),
    (GIVEN.replace('gpu = "h100"', 'gpu = "h800"'), "unknown gpu 'h800'"),
    (GIVEN.replace("price_per_hour = 3.95", "price_per_hour = -3.95"), "must be > 0"),
    (GIVEN.replace('dtype = "nvfp4"', 'dtype = "int3"'), "int3"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, text, message):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(text)
    res = _plan(fleet, "--out", tmp_path / "out")
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("mismatch: error:") and message in line


def test_b300_without_a_price_asks_for_one(tmp_path):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(GIVEN + '[[group]]\ngpu = "b300"\ndtype = "nvfp4"\nkv_cache = "fp8"\n'
                     'tokens_per_s = 8000\nkl = 1e-3\nmasked = 0.004\nmax_gpus = 4\n')
    res = _plan(fleet, "--out", tmp_path / "out")
    assert res.returncode == 2
    (line,) = res.stderr.strip().splitlines()
    assert "b300" in line and "price_per_hour" in line


def test_figures_left_out_are_filled_and_the_probe_is_cached(tmp_path):
    """Prices from the default table, tokens/s from the throughput model, KL and masked share
    from the emulated probe on the embedded model; the second plan reads the cache."""
    fleet = tmp_path / "fleet.toml"
    fleet.write_text("""
[update]
tokens = 65536
updates_per_hour = 60
[budget]
kl_ratio = 4.7
masked = 0.05
[[group]]
gpu = "b200"
dtype = "bf16"
max_gpus = 8
[[group]]
gpu = "h100"
dtype = "fp8"
kv_cache = "fp8"
max_gpus = 8
""")
    env = {**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    res = _plan(fleet, "--out", tmp_path / "a", "--json", "--n-prompts", "8", env=env)
    assert res.returncode == 0, res.stderr
    first = json.loads(res.stdout)
    groups = {g["name"]: g for g in first["compare"]["equal_capacity"]["groups"]} \
        if first["compare"]["equal_capacity"] else {g["name"]: g for g in first["groups"]}
    for g in groups.values():
        assert g["sources"]["price_per_hour"] == "default table"
        assert g["sources"]["tokens_per_s"] == "throughput model"
        assert g["sources"]["kl"] == "probe (emulated)"
        assert g["kl"] > 0 and 0 <= g["masked"] <= 1
    assert groups["h100-fp8-kvfp8"]["kl"] > groups["b200-bf16"]["kl"]
    assert len(list((tmp_path / "cache" / "mismatch" / "plan-probes").glob("*.json"))) == 2
    res = _plan(fleet, "--out", tmp_path / "b", "--json", "--n-prompts", "8", env=env)
    assert res.returncode == 0, res.stderr
    second = json.loads(res.stdout)
    assert second["cost_per_update_usd"] == first["cost_per_update_usd"]
    assert all(g["sources"]["kl"] == "probe (emulated, cached)" for g in second["groups"])


def test_simulate_runs_the_plan_over_a_capacity_trace(tmp_path):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(GIVEN)
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,group,gpus\n0,h100-fp8-kvfp8,4\n0,b200-nvfp4-kvfp8,2\n"
                     "1800,h100-fp8-kvfp8,1\n")
    out = tmp_path / "out"
    res = _plan(fleet, "--out", out, "--json", "--simulate", trace, "--sim-hours", "1")
    assert res.returncode == 0, res.stderr
    sim = json.loads(res.stdout)["simulation"]
    assert sim["updates"] and (out / "simulation.png").is_file()
    res = _plan(fleet, "--out", out, "--simulate", trace, "--sim-hours", "1")
    assert res.returncode == 0 and "staleness mean" in res.stdout
    trace.write_text("time_s,group,gpus\n0,z100-bf16,4\n")
    res = _plan(fleet, "--out", out, "--simulate", trace)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
