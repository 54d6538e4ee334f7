"""Metrics against float64 references written plainly here, with masked positions."""

from __future__ import annotations

import math

import pytest
import torch

from mismatch.metrics import (
    divergence_summary,
    exact_kl,
    kl_estimators,
    logprob_diff_stats,
    masked_quantiles,
    per_sequence,
    ratio_stats,
    top1_agreement,
)


def _records(seed=0, b=3, t=40):
    g = torch.Generator().manual_seed(seed)
    sampler = -torch.rand(b, t, generator=g) * 4  # log-probs in (-4, 0]
    trainer = sampler + torch.randn(b, t, generator=g) * 0.3
    trainer = trainer.clamp(max=0)
    mask = (torch.rand(b, t, generator=g) > 0.25).float()
    return trainer.float(), sampler.float(), mask


def _ref_tokens(trainer, sampler, mask):
    return [(float(t), float(s)) for t, s, m in zip(trainer.flatten(), sampler.flatten(),
                                                     mask.flatten()) if m > 0]


def test_kl_estimators_match_reference():
    trainer, sampler, mask = _records()
    toks = _ref_tokens(trainer, sampler, mask)
    rs = [t - s for t, s in toks]
    ref = {"kl_k1": sum(-r for r in rs) / len(rs),
           "kl_k2": sum(r * r / 2 for r in rs) / len(rs),
           "kl_k3": sum(math.exp(r) - 1 - r for r in rs) / len(rs)}
    got = kl_estimators(trainer, sampler, mask)
    for k, v in ref.items():
        assert got[k].item() == pytest.approx(v, rel=1e-12, abs=1e-15), k


def test_ratio_and_diff_stats_match_reference():
    trainer, sampler, mask = _records(1)
    toks = _ref_tokens(trainer, sampler, mask)
    w = sorted(math.exp(t - s) for t, s in toks)
    n = len(w)
    got = ratio_stats(trainer, sampler, mask, low=0.8, high=1.25)
    assert got["ratio_mean"].item() == pytest.approx(sum(w) / n, rel=1e-12)
    assert got["mis_masked_fraction"].item() == pytest.approx(
        sum(1 for x in w if x < 0.8 or x > 1.25) / n)
    assert got["ess"].item() == pytest.approx(sum(w) ** 2 / (n * sum(x * x for x in w)), rel=1e-12)
    # linear-interpolated quantile, as numpy's default
    pos = 0.5 * (n - 1)
    lo = int(math.floor(pos))
    p50 = w[lo] + (w[min(lo + 1, n - 1)] - w[lo]) * (pos - lo)
    assert got["ratio_p50"].item() == pytest.approx(p50, rel=1e-12)
    d = [abs(t - s) for t, s in toks]
    dp = [abs(math.exp(t) - math.exp(s)) for t, s in toks]
    got = logprob_diff_stats(trainer, sampler, mask)
    assert got["abs_logprob_diff_mean"].item() == pytest.approx(sum(d) / n, rel=1e-12)
    assert got["abs_logprob_diff_max"].item() == pytest.approx(max(d), rel=1e-12)
    assert got["abs_prob_diff_max"].item() == pytest.approx(max(dp), rel=1e-12)


def test_masked_positions_do_not_change_results():
    trainer, sampler, mask = _records(2)
    garbage_t = torch.where(mask.bool(), trainer, torch.full_like(trainer, -50.0))
    garbage_s = torch.where(mask.bool(), sampler, torch.full_like(sampler, 3.0))
    a = divergence_summary(trainer, sampler, mask)
    b = divergence_summary(garbage_t, garbage_s, mask)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_identical_sides_give_zero():
    _, sampler, mask = _records(3)
    s = divergence_summary(sampler, sampler, mask)
    assert s["kl_k3"].item() == 0 and s["kl_k1"].item() == 0
    assert s["mis_masked_fraction"].item() == 0 and s["ess"].item() == pytest.approx(1.0)


def test_per_sequence_matches_reference():
    trainer, sampler, mask = _records(4)
    got = per_sequence(trainer, sampler, mask)
    for b in range(trainer.shape[0]):
        rs = [float(trainer[b, t]) - float(sampler[b, t]) for t in range(trainer.shape[1])
              if mask[b, t] > 0]
        assert got["seq_log_ratio_sum"][b].item() == pytest.approx(sum(rs), rel=1e-12)
        assert got["seq_ratio_geomean"][b].item() == pytest.approx(
            math.exp(sum(rs) / len(rs)), rel=1e-12)


def test_top1_agreement():
    a = torch.tensor([[1, 2, 3, 4]])
    b = torch.tensor([[1, 0, 3, 9]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert top1_agreement(a, b, m).item() == pytest.approx(2 / 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("noise", [1.0, 0.2, 3e-3, 1e-4])
def test_exact_kl_matches_float64_reference(dtype, noise):
    """Relative error ≤ 1e-5 (absolute floor 1e-15) from KL ~0.4 down to ~1e-12 (a direct float32 log μ − log π
    would be off by ~1e-6 absolute, i.e. by 100% at the small end)."""
    g = torch.Generator().manual_seed(5)
    ls = (torch.randn(37, 1000, generator=g) * 3).to(dtype)
    lt = (ls.float() + torch.randn(37, 1000, generator=g) * noise).to(dtype)
    ref_mu = torch.log_softmax(ls.double(), -1)
    ref_pi = torch.log_softmax(lt.double(), -1)
    ref = (ref_mu.exp() * (ref_mu - ref_pi)).sum(-1)
    got = exact_kl(ls, lt, row_chunk=8, vocab_chunk=128)  # chunks that don't divide evenly
    ok = ref > 0
    assert torch.allclose(got[ok], ref[ok], rtol=1e-5, atol=1e-15)
    assert torch.allclose(got, exact_kl(ls, lt), rtol=1e-5, atol=1e-15)  # chunking: float order


def test_empty_mask_and_shape_errors():
    trainer, sampler, _ = _records()
    empty = torch.zeros_like(trainer)
    assert math.isnan(ratio_stats(trainer, sampler, empty)["ratio_mean"].item())
    with pytest.raises(ValueError, match="shape mismatch"):
        kl_estimators(trainer, sampler[:, :3], empty)


def test_bootstrap_ci_matches_the_normal_interval_on_iid_data():
    """Per-sequence ratio of sums with one token per sequence is a plain mean: the bootstrap
    interval must match mean ± 1.96·σ/√n (float64 reference) within a few percent."""
    from mismatch.metrics import bootstrap_ci

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, generator=g, dtype=torch.float64) + 3.0
    lo, hi = bootstrap_ci(x, torch.ones(4000, dtype=torch.float64), seed=1, n_boot=2000)
    half = 1.959964 * float(x.std()) / math.sqrt(4000)
    assert lo < float(x.mean()) < hi
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.08)
    # sequences of unequal length: the statistic is Σsums/Σcounts, not a mean of means
    counts = torch.tensor([1.0, 9.0] * 50, dtype=torch.float64)
    sums = counts * torch.tensor([0.0, 1.0] * 50, dtype=torch.float64)
    lo, hi = bootstrap_ci(sums, counts)
    assert lo < 0.9 < hi and hi - lo < 0.2
    assert bootstrap_ci(torch.zeros(5, dtype=torch.float64), torch.ones(5)) == [0.0, 0.0]


def test_token_multiplicative_error_is_mean_exp_abs_diff():
    t = torch.tensor([[-1.0, -2.0, -0.5]])
    s = torch.tensor([[-1.1, -1.8, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    got = float(logprob_diff_stats(t, s, mask)["token_multiplicative_error"])
    assert got == pytest.approx((math.exp(0.1) + math.exp(0.2)) / 2, rel=1e-6)


@pytest.mark.parametrize("seed", range(24))
def test_masked_quantiles_equal_torch_quantile_bit_for_bit(seed):
    """The figures' quantiles (ratio p01/p50/p99, |Δ log p| p99, the loss's p05/p50/p95) are
    torch.quantile's values exactly: sizes from 1 to ~6000, ties, float32 and float64."""
    g = torch.Generator().manual_seed(seed)
    n = [1, 2, 3, 100, 101][seed] if seed < 5 else int(torch.randint(2, 6000, (1,), generator=g))
    dtype = torch.float64 if seed % 2 else torch.float32
    x = torch.randn(2, n, generator=g, dtype=dtype).exp()
    if seed % 3 == 0:
        x = x.round(decimals=1)  # many ties
    valid = torch.rand(2, n, generator=g) > 0.3
    valid[0, 0] = True
    for q in ((0.01, 0.5, 0.99), (0.05, 0.5, 0.95), (0.99,), (0.0, 1.0)):
        ref = torch.quantile(x[valid], torch.tensor(q, dtype=dtype))
        assert torch.equal(masked_quantiles(x, valid, q), ref), (n, q)
    empty = masked_quantiles(x, torch.zeros_like(valid), (0.5,))
    assert empty.shape == (1,) and torch.isnan(empty).all()


@pytest.mark.parametrize("numpy_path", [True, False])
def test_published_comparison_figures_match_reference(monkeypatch, numpy_path):
    """RMS and standard deviation of Δ log p (nats) and the share of ratios outside [0.9, 1.1],
    as published trainer-vs-sampler comparisons report them, against float64 references computed
    here token by token; on the numpy path (CPU) and the torch path (other devices) alike."""
    import mismatch.metrics as metrics

    monkeypatch.setattr(metrics, "_NUMPY_ON_CPU", numpy_path)
    trainer, sampler, mask = _records(2)
    trainer[0, 0], mask[0, 0] = float("nan"), 0.0  # a masked NaN changes nothing
    toks = _ref_tokens(trainer, sampler, mask)
    r = [t - s for t, s in toks]
    n = len(r)
    mean = sum(r) / n
    got = divergence_summary(trainer, sampler, mask)
    assert got["logprob_diff_rms"].item() == pytest.approx(math.sqrt(sum(x * x for x in r) / n),
                                                           rel=1e-12)
    assert got["logprob_diff_sd"].item() == pytest.approx(
        math.sqrt(sum((x - mean) ** 2 for x in r) / n), rel=1e-12)
    outside = sum(1 for x in r if math.exp(x) < 0.9 or math.exp(x) > 1.1) / n
    assert got["ratio_outside_10pct"].item() == pytest.approx(outside, rel=1e-12)
    # Fast-LLM's "RMS rel": RMS(Δ log p) / RMS(the reference's log p), the trainer's here
    rel = math.sqrt(sum(x * x for x in r) / sum(t * t for t, _ in toks))
    assert got["logprob_rel_rms"].item() == pytest.approx(rel, rel=1e-12)
    assert 0 < outside < 1  # the records straddle the band: the check can fail
