"""The quick probe's split on the embedded model: each column's headline is the exact KL of its
pair of configurations, no source exceeds the total beyond the intervals, and the per-position
figures equal a float64 reference from the configurations' own log-softmax rows (three probes
of 16 prompts × 24 tokens)."""

from __future__ import annotations

import pytest
import torch

from mismatch.app.probe import SPLIT, ProbeConfig, run_probe

SMALL = dict(n_prompts=16, max_new_tokens=24, batch_size=16, threads=1, emulate=True)


def _half(col: dict) -> float:
    lo, hi = col["kl_exact_ci95"]
    return (hi - lo) / 2


@pytest.fixture(scope="module")
def nvfp4():
    """A b200 nvfp4 probe of one batch, with the rollout it scored, each configuration's rows at
    the completion positions [B, W, V] and the per-position exact KL [B, W] of each column, as
    the tallies computed them (exact_kl is called once per column, in SPLIT order)."""
    import mismatch.engines.scorer as scorer
    import mismatch.probes.tally as tally_mod

    seen: dict = {"rollouts": [], "exact": []}
    real_exact, real_score = tally_mod.exact_kl, scorer.score

    def exact_spy(mu_rows, pi_rows):
        out = real_exact(mu_rows, pi_rows)
        seen["exact"].append((mu_rows.clone(), pi_rows.clone(), out))
        return out

    def score_spy(model, rollout, **kw):
        seen["rollouts"].append(rollout)
        return real_score(model, rollout, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tally_mod, "exact_kl", exact_spy)
        mp.setattr(scorer, "score", score_spy)  # the context imports it at call time
        result = run_probe(ProbeConfig(gpu="b200", dtype="nvfp4", **SMALL))
    assert len(seen["exact"]) == 3 and len(seen["rollouts"]) == 2  # one batch, two scorings
    rollout = seen["rollouts"][0]
    b, w = rollout.token_ids.shape[0], SMALL["max_new_tokens"]
    calls = dict(zip(SPLIT, seen["exact"]))
    full = {"sampler": calls["total"][0], "trainer": calls["total"][1],
            "precision": calls["precision"][0]}
    full = {k: v.view(b, w, -1) for k, v in full.items()}
    assert torch.equal(calls["accelerator"][0], calls["total"][0])  # μ: the sampler's rows
    assert torch.equal(calls["accelerator"][1], calls["precision"][0])  # π: the precision's
    exact = {name: out.view(b, w) for name, (_, _, out) in calls.items()}
    return result, rollout, full, exact


@pytest.fixture(scope="module")
def fp8():
    return run_probe(ProbeConfig(gpu="h100", dtype="fp8", **SMALL)).summary


def _reference_kl(mu_rows: torch.Tensor, pi_rows: torch.Tensor) -> torch.Tensor:
    """KL(μ‖π) per position in float64 straight from the definition, Σ μ (log μ − log π)."""
    log_mu = torch.log_softmax(mu_rows.double(), dim=-1)
    log_pi = torch.log_softmax(pi_rows.double(), dim=-1)
    return (log_mu.exp() * (log_mu - log_pi)).sum(-1)


def test_sources_stay_within_the_total(nvfp4, fp8):
    for s in (nvfp4[0].summary, fp8):
        total = s["total"]
        assert total["kl_exact"] > 0
        assert total["kl_exact_ci95"][0] <= total["kl_exact"] <= total["kl_exact_ci95"][1]
        for name, col in s["sources"].items():
            assert col["kl_exact"] <= total["kl_exact"] + _half(total) + _half(col), \
                (s["gpu"], s["dtype"], name, col["kl_exact"], total["kl_exact"])
        assert s["sources"]["precision"]["kl_exact"] > 0  # the formats cost something
        # the k-estimators count only where the tokens came from the column's own sampler side
        assert total["k_estimators_valid"] and s["sources"]["accelerator"]["k_estimators_valid"]
        assert not s["sources"]["precision"]["k_estimators_valid"]


def test_exact_kl_per_position_equals_a_float64_reference(nvfp4):
    result, rollout, full, exact = nvfp4
    pw = rollout.prompt_width
    ids = rollout.token_ids[:, pw:]
    mask = rollout.completion_mask[:, pw:].bool()
    b, n = ids.shape
    assert all(rows.shape[0] == b and rows.shape[1] >= n for rows in full.values())
    full = {k: rows[:, :n] for k, rows in full.items()}
    # the rows line up with the tokens: at each sampled token they give its log-prob
    at = {k: rows.gather(-1, ids[..., None])[..., 0] for k, rows in full.items()}
    assert torch.allclose(at["sampler"][mask], rollout.sampler_logprobs[:, pw:][mask],
                          atol=1e-5)
    m = mask.double()
    for name, (ref, other) in SPLIT.items():
        want = _reference_kl(full[other], full[ref]) * m  # [B, n] float64
        got = exact[name][:, :n] * m
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-9), \
            (name, float((got - want).abs().max()))
        per_pos = want.sum(0) / m.sum(0)
        assert result.per_position[name][:n] == pytest.approx(per_pos.tolist(), rel=1e-4,
                                                              abs=1e-9), name
        col = result.summary["total"] if name == "total" else result.summary["sources"][name]
        assert col["kl_exact"] == pytest.approx(float(want.sum() / m.sum()), rel=1e-4), name
        assert col["kl_exact_ci95"][0] <= col["kl_exact"] <= col["kl_exact_ci95"][1], name


def test_bf16_precision_column_is_exactly_zero():
    s = run_probe(ProbeConfig(gpu="a100", dtype="bf16", **SMALL)).summary
    p = s["sources"]["precision"]
    assert p["kl_exact"] == 0 and p["kl_exact_ci95"] == [0.0, 0.0]  # the trainer's own formats
    assert s["total"]["kl_exact"] > 0  # the decode path and FA2 tiling still differ
    assert s["sources"]["accelerator"]["kl_exact"] == pytest.approx(s["total"]["kl_exact"])


def test_the_footnote_names_the_columns_without_token_estimators():
    """The † note names exactly the columns whose k1/k3/ESS do not apply (not a reference
    column that is not there)."""
    from mismatch.app.report import format_table

    fig = {"kl_exact": 1e-5, "kl_k3": 1e-5, "kl_k1": 1e-5, "tokens": 10}
    summary = {"total": dict(fig), "sources": {"precision": dict(fig, k_estimators_valid=False),
                                               "accelerator": dict(fig)}}
    note = format_table(summary).splitlines()[-1]
    assert note.startswith("†") and "the precision column drew none" in note
    assert "FP32" not in note and "only its exact KL" in note
    summary["references"] = {"trainer": dict(fig, k_estimators_valid=False)}
    note = format_table(summary).splitlines()[-1]
    assert "the precision and trainer columns drew none" in note and "their exact KL" in note
    summary = {"total": dict(fig), "sources": {"accelerator": dict(fig)}}
    assert "†" not in format_table(summary)
