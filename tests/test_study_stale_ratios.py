"""scripts/study_stale_ratios.py, the study's targeted measurement of a stale sampler's ratios:
on a real two-step forced-lag run on the mixed fleet (the embedded model), the log-ratio of
the loss splits exactly into the lag's part and the numerics' part, each part's figures are
what their definitions say (checked against float64 recomputations), and a lag the checkpoint
does not hold is refused."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "mismatch.cli"]


def _script():
    spec = importlib.util.spec_from_file_location("study_stale_ratios",
                                                  ROOT / "scripts" / "study_stale_ratios.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("stale") / "run"
    proc = subprocess.run(CLI + ["train", "--out", str(out), "--preset", "mixed",
                                 "--correction", "sc+mis", "--staleness", "1", "--steps", "2",
                                 "--prompts", "2", "--samples", "2", "--checkpoint-every", "2",
                                 "--eval-tasks", "0", "--lr", "0.003", "--quiet",
                                 "--sampler-processes", "0"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return out / "checkpoints" / "step-000002"


@pytest.fixture(scope="module")
def got(checkpoint):
    return _script().ratios(checkpoint, prompts=1)


def test_the_loss_ratio_splits_into_the_lag_and_the_numerics(got):
    assert (got["step"], got["sampler_version"], got["fleet"]) == (2, 1, "mixed")
    parts = got["parts"]
    n_eps = len(parts["total"][0])
    assert n_eps == 2 * len(got["groups"])  # one prompt × 2 samples per sampler group
    for total, lag, num in zip(parts["total"][0], parts["lag"][0], parts["numerics"][0]):
        assert torch.allclose(total, lag + num, atol=1e-5)
    lag_all = torch.cat(parts["lag"][0])
    assert lag_all.abs().max() > 0  # two steps at lr 3e-3 moved the policy
    # each group's total is the same tokens as the fleet's, in group order
    flat = torch.cat([r for _, rs in got["groups"].values() for r in rs])
    assert torch.equal(flat, torch.cat(parts["total"][0]))


def test_the_summary_is_what_its_definitions_say(got):
    rs, turns = got["parts"]["total"]
    s = _script().summarize(rs, turns)
    r = torch.cat(rs).double()
    assert s["tokens"] == r.numel() == sum(v["tokens"] for v in s["by_turn"].values())
    assert s["kl_k3"] == pytest.approx(float((r.exp() - 1 - r).mean()), rel=1e-9)
    assert s["kl_k3"] >= 0
    outside = ((r.exp() < 0.5) | (r.exp() > 5)).double().mean()
    assert s["token_outside"] == pytest.approx(float(outside))
    seq = torch.tensor([float(x.double().sum()) for x in rs], dtype=torch.float64)
    w = seq.exp()
    assert s["seq_ess"] == pytest.approx(float(w.sum() ** 2 / (w * w).sum()) / len(rs))
    assert 0 < s["seq_ess"] <= 1 + 1e-12
    assert s["seq_outside"] == pytest.approx(float(((w < 0.5) | (w > 5)).double().mean()))
    first = torch.cat([x[t == 0] for x, t in zip(rs, turns)]).double()
    assert s["by_turn"][1]["mean_abs_r"] == pytest.approx(float(first.abs().mean()))
    # turns 2+ split by their prefix's ratio: every such token counted once, the means weighted
    split = s["later_turns_by_prefix"]
    later = torch.cat([x[t >= 1] for x, t in zip(rs, turns)]).double()
    assert split["outside"]["tokens"] + split["inside"]["tokens"] == later.numel()
    if later.numel():
        mean = sum((v["mean_abs_r"] or 0) * v["tokens"] for v in split.values()) / later.numel()
        assert mean == pytest.approx(float(later.abs().mean()))


def test_the_command_writes_its_table_and_json_and_refuses_a_lag_not_held(checkpoint,
                                                                           tmp_path):
    script = [sys.executable, str(ROOT / "scripts" / "study_stale_ratios.py")]
    dest = tmp_path / "ratios.json"
    proc = subprocess.run(script + [str(checkpoint), "--prompts", "1", "--preset", "homogeneous",
                                    "--out", str(dest)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(dest.read_text())
    assert [r["step"] for r in rows] == [2] and rows[0]["fleet"] == "homogeneous"
    for part in ("total", "lag", "numerics"):
        assert f"| run | 2 (1) | {part} | {rows[0][part]['kl_k3']:.2e} |" in proc.stdout
    bad = subprocess.run(script + [str(checkpoint), "--lag", "2"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    assert "holds versions [1] besides 2, not 0" in bad.stderr


def test_a_missing_or_corrupt_checkpoint_is_one_line_and_exits_non_zero(tmp_path):
    script = [sys.executable, str(ROOT / "scripts" / "study_stale_ratios.py")]
    corrupt = tmp_path / "step-000010"
    corrupt.mkdir()
    (corrupt / "state.pt").write_text("not a checkpoint")
    for path in (tmp_path / "missing", corrupt):
        proc = subprocess.run(script + [str(path)], capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0
        assert "Traceback" not in proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert "not a readable checkpoint of `mismatch train`" in last


def test_the_trainer_models_are_the_runs_own(checkpoint):
    """The script's trainer policy at a checkpoint is the run's: the run's Trainer, restored from
    the same checkpoint, holds the same tensors (the rotary frequencies' dtype included) and
    gives the same logits. A model freshly loaded in BF16 keeps its rotary frequencies in FP32
    and would not."""
    from mismatch.train.trainer import Trainer
    from mismatch.zoo import load_model

    mod = _script()
    cfg, state, step, old_v, old_w = mod.load(checkpoint, None)
    base = load_model(cfg.model, dtype="bfloat16")
    new, _ = mod.trainer_models(base, state, step, old_v, old_w)
    run = Trainer(base, cfg)
    run.load(state)
    ours = dict(new.named_buffers()) | dict(new.named_parameters())
    theirs = dict(run.compute.named_buffers()) | dict(run.compute.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
    ids = torch.randint(0, base.config.vocab_size, (1, 48),
                        generator=torch.Generator().manual_seed(0))
    run.compute.eval()
    with torch.no_grad():
        assert torch.equal(new(ids).logits, run.compute(ids).logits)
    fresh = dict(load_model(cfg.model, dtype="bfloat16").named_buffers())
    assert any(b.dtype != ours[n].dtype for n, b in fresh.items())
