"""`mismatch train --fleet FILE`: a planned fleet's groups and shares drive the router, and every
step logs what its sampling cost on those GPUs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mismatch.train.config import TrainConfig
from mismatch.train.fleet import Router, fleet

PLANNED = """
[[group]]
name = "h100-fp8-kvfp8"
gpu = "h100"
dtype = "fp8"
kv_cache = "fp8"
share = 0.75
price_per_hour = 3.95
tokens_per_s = 2500
[[group]]
name = "b200-nvfp4-kvfp8"
gpu = "b200"
dtype = "nvfp4"
kv_cache = "fp8"
share = 0.25
price_per_hour = 6.25
tokens_per_s = 7000
"""


def test_a_fleet_file_resolves_to_its_groups_and_shares(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text(PLANNED)
    groups = fleet(str(path))
    assert [(g.name, g.spec.gpu, g.spec.dtype, g.spec.kv_cache, g.share) for g in groups] == [
        ("h100-fp8-kvfp8", "h100", "fp8", "fp8", 0.75),
        ("b200-nvfp4-kvfp8", "b200", "nvfp4", "fp8", 0.25)]
    assert groups[0].cost_per_token == pytest.approx(3.95 / 3600 / 2500)
    router = Router(groups, seed=0)
    picks = [router.assign(i) for i in range(400)]
    assert sum(p.name == "h100-fp8-kvfp8" for p in picks) == 300
    assert TrainConfig(fleet=str(path)).fleet == str(path)


@pytest.mark.parametrize("text, message", [
    ("[[group]]\ngpu = 'h100'\ndtype = 'fp8'\n", "needs gpu, dtype and share"),
    ("[[group]]\ngpu = 'a100'\ndtype = 'nvfp4'\nshare = 1\n", "NVFP4"),
    ("[[group]]\ngpu = 'h100'\ndtype = 'fp8'\nshare = 1\nprice_per_hour = -2\n", "positive"),
    ("[[group\n", "not valid TOML"),
    ("", r"has no \[\[group\]\]"),
])
def test_bad_fleet_files_are_refused(tmp_path, text, message):
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        TrainConfig(fleet=str(path))


def test_train_on_a_planned_fleet_logs_the_sampling_cost(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text(PLANNED)
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "mismatch.cli", "train", "--preset", "smoke",
                          "--fleet", str(path), "--out", str(out), "--steps", "2",
                          "--n-prompts", "2", "--samples", "4", "--sampler-processes", "0",
                          "-q"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_token = {"h100-fp8-kvfp8": 3.95 / 3600 / 2500, "b200-nvfp4-kvfp8": 6.25 / 3600 / 7000}
    for rec in records:
        assert set(rec["group_tokens"]) <= set(per_token)
        assert sum(rec["group_tokens"].values()) == rec["sampled_tokens"]
        assert rec["sampling_cost_usd"] == pytest.approx(
            sum(n * per_token[g] for g, n in rec["group_tokens"].items()), rel=1e-12)
    assert json.loads((out / "config.json").read_text())["fleet"] == str(path.resolve())
    # a fleet file that is not there: one line, exit 2, before any work
    res = subprocess.run([sys.executable, "-m", "mismatch.cli", "train", "--fleet",
                          str(tmp_path / "missing.toml"), "--out", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "cannot read fleet file" in res.stderr
