"""NaN and ±inf never poison a figure (issue 32, item 3).

Masked-out positions may hold anything, on any side: every metric of mismatch/metrics.py that
takes log-probs and a mask, and every arm's loss, metrics and gradient (train/loss.py ARMS), must
equal the clean run's bit for bit (torch.equal). A NaN or ±inf at a masked-in position is counted
(`nonfinite_tokens`: the metrics' summary, the probe's tally, the trainer's step metrics and its
metrics.jsonl record), never dropped silently.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import mismatch.metrics as metrics
from mismatch.metrics import divergence_summary, nonfinite_tokens
from mismatch.probes.tally import Tally
from mismatch.train.batch import Batch, Unit
from mismatch.train.loss import ARMS, policy_loss
from mismatch.train.record import step_record
from mismatch.train.trainer import arm_loss, step_metrics

# every public function of mismatch.metrics that takes (trainer_logprobs, sampler_logprobs, mask)
LOGPROB_METRICS = sorted(
    name for name in metrics.__all__ if callable(getattr(metrics, name))
    and list(inspect.signature(getattr(metrics, name)).parameters)[:3]
    == ["trainer_logprobs", "sampler_logprobs", "mask"])
POISONS = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
SIDES = ("trainer", "sampler", "both")


def test_the_parametrization_covers_every_logprob_metric():
    assert {"kl_estimators", "ratio_stats", "logprob_diff_stats", "per_sequence",
            "divergence_summary"} <= set(LOGPROB_METRICS)
    assert len(ARMS) >= 9 and {"grpo", "tis", "mis", "sc", "sc+mis"} <= set(ARMS)


def _records(seed=0, b=4, t=60, mask_dtype=torch.bool):
    """float32 log-probs with ratios on both sides of the MIS band, a right-padded mask with
    holes in the middle."""
    g = torch.Generator().manual_seed(seed)
    sampler = -torch.rand(b, t, generator=g) * 4
    trainer = (sampler + torch.randn(b, t, generator=g) * 0.8).clamp(max=0)
    lengths = torch.tensor([t, t - 7, t // 2, t - 1])[:b]
    mask = (torch.arange(t)[None] < lengths[:, None]) & (torch.rand(b, t, generator=g) > 0.2)
    return trainer, sampler, mask.to(mask_dtype)


def _poisoned(x: torch.Tensor, where: torch.Tensor, value: float) -> torch.Tensor:
    while where.dim() < x.dim():
        where = where.unsqueeze(-1)
    return torch.where(where, torch.full_like(x, value), x)


def _assert_same(got: dict, clean: dict):
    assert got.keys() == clean.keys()
    for k in clean:
        assert torch.equal(got[k], clean[k]), (k, got[k], clean[k])


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32], ids=["bool", "float"])
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("name", LOGPROB_METRICS)
def test_masked_poison_changes_no_metric_bit(name, poison, side, mask_dtype):
    fn = getattr(metrics, name)
    trainer, sampler, mask = _records(mask_dtype=mask_dtype)
    out = ~mask.bool()
    clean = fn(trainer, sampler, mask)
    for k, v in clean.items():  # a clean run with NaN in it would make torch.equal fail anyway
        assert torch.isfinite(v).all(), (k, v)
    t = _poisoned(trainer, out, POISONS[poison]) if side != "sampler" else trainer
    s = _poisoned(sampler, out, POISONS[poison]) if side != "trainer" else sampler
    _assert_same(fn(t, s, mask), clean)


def _arm_inputs(dtype, seed=0, B=3, T=7, V=12, K=5):
    """Trainer log-probs of the tokens and candidates (leaves), the sampler's, advantages, a
    mask with holes, the sampler's top-p support (a padded candidate slot at (0, 1))."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 1.5
    sampler_logits = logits + 1.2 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    log_pi, log_mu = logits.log_softmax(-1), sampler_logits.log_softmax(-1)
    idx = log_mu.argsort(-1, descending=True)[..., :K]
    mu_k = log_mu.gather(-1, idx).exp()
    support = (mu_k.cumsum(-1) - mu_k) < 0.8
    y = idx.gather(-1, torch.multinomial(torch.where(support, mu_k, 0).view(-1, K), 1,
                                         generator=g).view(B, T, 1))
    cand_mu = log_mu.gather(-1, idx)
    cand_mu[0, 1, -1] = float("-inf")
    support[0, 1, -1] = False
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, -1] = mask[1, 2] = mask[2, -3:] = False
    return dict(logp=log_pi.gather(-1, y).squeeze(-1).to(dtype),
                sampler_logp=log_mu.gather(-1, y).squeeze(-1).to(dtype),
                advantages=torch.randn(B, generator=g, dtype=torch.float64).to(dtype),
                mask=mask, cand_logp=log_pi.gather(-1, idx).to(dtype),
                cand_sampler_logp=cand_mu.to(dtype), support_mask=support)


def _loss_and_grads(arm: str, d: dict):
    logp = d["logp"].clone().requires_grad_()
    cand = d["cand_logp"].clone().requires_grad_()
    loss, m = policy_loss(logp, d["sampler_logp"], d["advantages"], d["mask"], arm=ARMS[arm],
                          cand_logp=cand, cand_sampler_logp=d["cand_sampler_logp"],
                          support_mask=d["support_mask"])
    g_logp, g_cand = torch.autograd.grad(loss, (logp, cand), allow_unused=True)
    return loss.detach(), m, g_logp, g_cand


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("arm", list(ARMS))
def test_masked_poison_changes_no_loss_metric_or_gradient_bit(arm, poison, side, dtype):
    d = _arm_inputs(dtype)
    loss, m, g_logp, g_cand = _loss_and_grads(arm, d)
    assert torch.isfinite(loss) and torch.isfinite(g_logp).all()
    assert g_logp[d["mask"]].ne(0).any()
    if arm == "mis":
        assert 0 < m["mis_masked_fraction"] < 1, "the test wants MIS to bite"
    out, bad = ~d["mask"], dict(d)
    if side != "sampler":
        for k in ("logp", "cand_logp"):
            bad[k] = _poisoned(d[k], out, POISONS[poison])
    if side != "trainer":
        for k in ("sampler_logp", "cand_sampler_logp"):
            bad[k] = _poisoned(d[k], out, POISONS[poison])
    loss2, m2, g_logp2, g_cand2 = _loss_and_grads(arm, bad)
    assert torch.equal(loss2, loss)
    _assert_same(m2, m)
    assert torch.equal(g_logp2, g_logp)
    if g_cand is None:
        assert g_cand2 is None
    else:
        assert torch.isfinite(g_cand).all() and torch.equal(g_cand2, g_cand)


def test_unmasked_nonfinite_is_counted_and_left_out_of_the_figures():
    trainer, sampler, mask = _records(1)
    at = mask.nonzero()[[3, 17, 40]]
    t, s = trainer.clone(), sampler.clone()
    t[tuple(at[0])] = float("nan")
    s[tuple(at[1])] = float("inf")
    t[tuple(at[2])] = s[tuple(at[2])] = float("-inf")
    got = divergence_summary(t, s, mask)
    assert got["nonfinite_tokens"] == 3 and got["tokens"] == mask.sum()
    assert nonfinite_tokens(mask, t, s) == 3 and nonfinite_tokens(mask.float(), t) == 2
    fewer = mask.clone()
    fewer[tuple(at.T)] = False
    clean = divergence_summary(trainer, sampler, fewer)
    assert clean["nonfinite_tokens"] == 0
    for k in clean:
        if k not in ("tokens", "nonfinite_tokens"):
            assert torch.equal(got[k], clean[k]), k


def test_tally_counts_nonfinite_tokens_and_ignores_masked_poison():
    trainer, sampler, mask = _records(2)
    exact = torch.rand(trainer.shape, dtype=torch.float64) * 1e-3

    def summary(t, s, e):
        tally = Tally()
        tally.add(t[:2], s[:2], mask[:2].float(), exact=e[:2])
        tally.add(t[2:], s[2:], mask[2:].float(), exact=e[2:])
        return tally.summary(n_boot=200)

    clean = summary(trainer, sampler, exact)
    assert clean.nonfinite_tokens == 0 and math.isfinite(clean.kl_exact)
    out = ~mask
    assert summary(_poisoned(trainer, out, float("nan")), _poisoned(sampler, out, float("inf")),
                   _poisoned(exact, out, float("nan"))) == clean
    t, s, e = trainer.clone(), sampler.clone(), exact.clone()
    at = mask.nonzero()
    t[tuple(at[5])] = float("nan")
    e[tuple(at[9])] = float("inf")
    got = summary(t, s, e)
    assert got.nonfinite_tokens == 2 and got.tokens == clean.tokens
    assert all(math.isfinite(got.figure(k)) for k in ("kl_k3", "kl_k1", "kl_exact", "ess"))


@pytest.mark.parametrize("arm", ["grpo", "sc+mis"])
def test_policy_loss_counts_unmasked_nonfinite_log_probs(arm):
    d = _arm_inputs(torch.float32, seed=3)
    loss, m, g, _ = _loss_and_grads(arm, d)
    assert m["nonfinite_tokens"] == 0
    bad = dict(d, sampler_logp=d["sampler_logp"].clone())
    bad["sampler_logp"][1, 0] = float("nan")
    loss2, m2, g2, _ = _loss_and_grads(arm, bad)
    assert m2["nonfinite_tokens"] == 1 and m2["valid_tokens"] == m["valid_tokens"] - 1
    fewer = dict(d, mask=d["mask"].clone())
    fewer["mask"][1, 0] = False
    loss3, m3, g3, _ = _loss_and_grads(arm, fewer)  # the same as leaving the token out
    assert torch.equal(loss2, loss3) and torch.equal(g2, g3)
    _assert_same({k: v for k, v in m2.items() if k != "nonfinite_tokens"},
                 {k: v for k, v in m3.items() if k != "nonfinite_tokens"})
    # a NaN log π stays in the loss (it turns NaN: the trainer skips the step) and is counted
    bad = dict(d, logp=d["logp"].clone())
    bad["logp"][2, 1] = float("nan")
    loss4, m4, _, _ = _loss_and_grads(arm, bad)
    assert m4["nonfinite_tokens"] == 1 and torch.isnan(loss4)
    assert torch.isfinite(m4["kl_k3"]) and torch.isfinite(m4["ratio_p50"])


def test_trainer_step_metrics_and_record_carry_nonfinite_tokens():
    g = torch.Generator().manual_seed(4)
    B, T, K = 3, 8, 4
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, :2] = False
    mask[2, -2:] = False
    sampler = -torch.rand(B, T, generator=g) * 3
    batch = Batch(ids=torch.zeros(B, T, dtype=torch.long),
                  attention=torch.ones(B, T, dtype=torch.long), mask=mask,
                  sampler_logp=sampler, cand_ids=torch.zeros(B, T, K, dtype=torch.long),
                  cand_sampler_logp=-torch.rand(B, T, K, generator=g) * 3 - 1,
                  support=torch.ones(B, T, K, dtype=torch.bool),
                  advantages=torch.tensor([1.0, -0.5, 0.25]),
                  staleness=torch.zeros(B, T), groups=["a", "a", "b"])
    logp = sampler + 0.1 * torch.randn(B, T, generator=g)
    cand = -torch.rand(B, T, K, generator=g) * 3 - 1
    ent = torch.rand(B, T - 1, generator=g)
    _, m, used = arm_loss(logp, cand, batch, "grpo")
    assert step_metrics(m, ent, logp, cand, batch, used).nonfinite_tokens == 0
    batch.sampler_logp = sampler.clone()
    batch.sampler_logp[0, 4] = float("nan")
    batch.sampler_logp[1, 0] = float("nan")          # not a sampled token: not counted
    logp = logp.clone()
    logp[2, 6] = float("-inf")                       # masked out: not counted
    _, m, used = arm_loss(logp, cand, batch, "grpo")
    out = step_metrics(m, ent, logp, cand, batch, used)
    assert out.nonfinite_tokens == 1 and math.isfinite(out.kl)
    # the step's metrics.jsonl line carries it, on every step (0 included)
    eps = [SimpleNamespace(reward=1.0, end_reason="stop", sampled_mask=row.tolist())
           for row in mask]
    units = [Unit(index=0, group="a", version=0, episodes=eps[:2], seconds=1.0),
             Unit(index=1, group="b", version=0, episodes=eps[2:], seconds=1.0)]
    for count in (1, 0):
        rec = step_record(3, units, batch, replace(out, nonfinite_tokens=count, loss=0.1,
                                                   grad_norm=1.0),
                          waited=0.0, train_s=1.0, wall=2.0, stale_dropped=0, claimed=2,
                          queue_depth=0, backend="local",
                          faults={"sampler_restarts": 0, "requeued_units": 0}).to_json()
        assert rec["nonfinite_tokens"] == count and list(rec)[:5] == [
            "step", "reward", "kl", "kl_k1", "nonfinite_tokens"]
