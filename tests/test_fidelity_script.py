"""scripts/fidelity.py: its figures' definitions against float64 arithmetic, and the committed
SmolLM2-135M figures (reports/fidelity-smollm2.json) behind reports/fidelity.md's claims."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("fidelity", ROOT / "scripts" / "fidelity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_figures_follow_their_definitions():
    f = _script()
    ref = torch.tensor([-1.0, -2.0, -3.0, -4.0], dtype=torch.float64)
    lp = ref + torch.tensor([0.1, -0.1, 0.1, -0.1], dtype=torch.float64)
    got = f.figures(lp, ref)
    rms_ref = math.sqrt((1 + 4 + 9 + 16) / 4)
    assert math.isclose(got["rms_rel"], 0.1 / rms_ref, rel_tol=1e-6)
    assert abs(got["bias_rel"]) < 1e-9 and math.isclose(got["rms"], 0.1, rel_tol=1e-6)
    # exp(±0.1) = 1.105 / 0.905: every ratio is outside [0.9, 1.1] on the high side only
    assert got["outside_10pct"] == 0.5
    # a pure scale: slope 1.1, correlation 1
    scaled = f.figures(ref * 1.1, ref)
    assert math.isclose(scaled["slope"], 1.1, rel_tol=1e-9)
    assert math.isclose(scaled["corr"], 1.0, rel_tol=1e-12)


def test_committed_smollm2_figures_back_the_report():
    f = _script()
    res = json.loads((ROOT / "reports" / "fidelity-smollm2.json").read_text())
    rows = res["precision"]["text, random labels"]
    for name, published in f.FAST_LLM.items():
        ratio = rows[name]["rms_rel"] / published["rms_rel"]
        assert 1 / 1.5 <= ratio <= 1.5, (name, ratio)  # reports/fidelity.md: within 1.5x
    assert all(v["rms"] == 0 for kind in res["batch_shape"].values() for v in kind.values())
    text = f.tables(res)
    assert "0.444%" in text and "0.94x" in text
    report = (ROOT / "reports" / "fidelity.md").read_text()
    assert text in report  # the report's table is this JSON's


def test_off_grid_moves_4bit_weights_within_half_a_step():
    spec = importlib.util.spec_from_file_location("off_grid", ROOT / "scripts" / "off_grid.py")
    og = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(og)
    gen = torch.Generator().manual_seed(0)
    # a Q4_1-like tensor: per block of 32, d·q + m with q in 0..15
    q = torch.randint(0, 16, (8, 64), generator=gen).double()
    d = torch.rand(16, 1, generator=gen, dtype=torch.float64) * 0.01 + 1e-3
    m = torch.randn(16, 1, generator=gen, dtype=torch.float64) * 0.01
    w = (q.reshape(-1, 32) * d + m).reshape(8, 64).to(torch.bfloat16)
    assert og.on_grid(w)
    assert not og.on_grid(torch.randn(8, 64, generator=gen).to(torch.bfloat16))
    assert not og.on_grid(torch.zeros(8, 30))  # not a whole number of blocks
    moved = og.off_grid(w, gen)
    assert moved.dtype == w.dtype and not og.on_grid(moved)
    blocks, after = w.double().reshape(-1, 32), moved.double().reshape(-1, 32)
    step = (blocks.max(1, keepdim=True).values - blocks.min(1, keepdim=True).values) / 15
    # within half a step, plus the BF16 rounding of the result (half an ulp, 2^-9 relative)
    assert ((after - blocks).abs() <= step / 2 + after.abs() * 2 ** -8).all()
