"""mismatch.train.loss against a plain float64 reference: losses and gradients of every arm, the zero
expected update of score centering, masking, top-p renormalization, non-finite sampler values."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mismatch.train.loss import (ARMS, arm_named, group_advantages, policy_loss,
                                  renormalize_over_support)

# Tolerances against the float64 reference. float64 inputs follow the same formula in another
# order of operations: agreement to ~1e-15 relative, so 1e-10 leaves room for sums over K.
# float32 inputs: log-probs carry ~6e-8 relative error, sums over ≤ 15 tokens and K ≤ 8
# candidates keep the loss and gradients within ~1e-6; 2e-5 is that with margin.
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-6)}
MIS_LOW, MIS_HIGH = 0.5, 5.0
TIS_CAP = 1.0  # below the default 2 so that truncation bites on the reference batch


def _w(arm: str, x: float) -> float:
    if "mis" in arm or arm == "icepop":
        return x if MIS_LOW <= x <= MIS_HIGH else 0.0
    if "tis" in arm:
        return min(x, TIS_CAP)
    return 1.0


def _reference_loss(arm, logits, sampler_logits, y, idx, support, adv, mask):
    """Plain loops in float64. Top-p renormalizes by a log_softmax over the vocabulary with
    everything outside the support set to −inf (a different path from train.loss)."""
    B, T, V = logits.shape
    total, n = logits.new_zeros(()), 0
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            lg, slg, H = logits[b, t], sampler_logits[b, t].double(), idx[b, t].tolist()
            if "topp" in arm:
                S = [v for v, s in zip(H, support[b, t].tolist()) if s]
                outside = torch.ones(V, dtype=torch.bool)
                outside[S] = False
                lg, slg, H = lg.masked_fill(outside, float("-inf")), slg.masked_fill(
                    outside, float("-inf")), S
            log_pi, log_mu = torch.log_softmax(lg, -1), torch.log_softmax(slg, -1)
            pi, mu = log_pi.detach().exp(), log_mu.exp()
            yy = int(y[b, t])
            term = _w(arm, float(pi[yy] / mu[yy])) * log_pi[yy]
            if arm.startswith("sc"):
                tail_mu, tail_pi = 1 - float(mu[H].sum()), 1 - float(pi[H].sum())
                alpha = 0.0
                if tail_mu > 1e-6:
                    rho = tail_mu / tail_pi
                    alpha = rho * _w(arm, 1 / rho)
                for v in H:
                    coef = float(mu[v]) * _w(arm, float(pi[v] / mu[v])) - alpha * float(pi[v])
                    term = term - coef * log_pi[v]
            total = total + float(adv[b]) * term
            n += 1
    return -total / n


def _batch(seed=0, B=3, T=5, V=8, K=5, p=0.8, shift=0.6, dtype=torch.float64):
    """Trainer logits (a leaf), sampler logits, y drawn from the sampler's top-p nucleus, the
    sampler's top-K candidates and which of them are in the nucleus."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 1.5
    sampler_logits = logits + shift * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    mu = torch.softmax(sampler_logits, -1)
    idx = mu.argsort(-1, descending=True)[..., :K]                            # (B, T, K)
    mu_k = mu.gather(-1, idx)
    support = (mu_k.cumsum(-1) - mu_k) < p                                    # (B, T, K)
    nucleus = torch.where(support, mu_k, 0)
    y = idx.gather(-1, torch.multinomial(nucleus.view(-1, K), 1, generator=g).view(B, T, 1))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, -1] = mask[2, -2:] = False
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return dict(logits=logits.to(dtype).requires_grad_(), sampler_logits=sampler_logits.to(dtype),
                y=y.squeeze(-1), idx=idx, support=support, adv=adv.to(dtype), mask=mask)


def _run(arm, d, **params):
    """policy_loss of arm `arm` (a name; `params` override its parameters) on batch `d`."""
    log_pi = torch.log_softmax(d["logits"], -1)
    log_mu = torch.log_softmax(d["sampler_logits"], -1)
    y = d["y"].unsqueeze(-1)
    return policy_loss(log_pi.gather(-1, y).squeeze(-1), log_mu.gather(-1, y).squeeze(-1),
                       d["adv"], d["mask"], arm=replace(arm_named(arm), **params),
                       cand_logp=log_pi.gather(-1, d["idx"]),
                       cand_sampler_logp=log_mu.gather(-1, d["idx"]), support_mask=d["support"])


def _grad(loss, leaf, retain_graph=False):
    (g,) = torch.autograd.grad(loss, leaf, retain_graph=retain_graph)
    return g


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("arm", list(ARMS))
def test_matches_float64_reference(arm, dtype):
    d = _batch(seed=2, shift=1.2, dtype=dtype)
    loss, m = _run(arm, d, tis_cap=TIS_CAP)
    assert m["mis_masked_fraction"] > 0.2 and m["ratio_p95"] > TIS_CAP, "corrections must bite"
    ref_logits = d["logits"].detach().double().requires_grad_()
    ref = _reference_loss(arm, ref_logits, d["sampler_logits"], d["y"], d["idx"], d["support"],
                          d["adv"], d["mask"])
    torch.testing.assert_close(loss.double(), ref.detach(), **TOL[dtype])
    torch.testing.assert_close(_grad(loss, d["logits"]).double(), _grad(ref, ref_logits),
                               **TOL[dtype])


@pytest.mark.parametrize("arm", ["sc", "sc+mis", "sc+tis"])
def test_sc_equals_reinforce_when_pi_equals_mu(arm):
    d = _batch(seed=2)
    d["sampler_logits"] = d["logits"].detach().clone()
    sc, _ = _run(arm, d)
    grpo, _ = _run("grpo", d)
    torch.testing.assert_close(sc, grpo, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(_grad(sc, d["logits"]), _grad(grpo, d["logits"]),
                               rtol=1e-10, atol=1e-13)


def _expected_update(arm, theta, mu, cands, support=None, advantage=1.7):
    """E_{y~μ}[∇θ loss(y)] exactly: the sum over every token y the sampler can draw, one position
    each, weighted by μ_y (by μ renormalized over the support for top-p arms)."""
    draw = mu if support is None else torch.zeros_like(mu).index_fill(0, cands[support], 1) * mu
    draw = draw / draw.sum()
    supp = (torch.ones_like(cands, dtype=torch.bool) if support is None else support)
    total = torch.zeros_like(theta)
    for y in range(len(mu)):
        if draw[y] == 0:
            continue
        log_pi = torch.log_softmax(theta, -1)
        loss, _ = policy_loss(log_pi[y].view(1, 1), mu[y].log().view(1, 1),
                              torch.tensor([advantage], dtype=torch.float64),
                              torch.ones(1, 1, dtype=torch.bool), arm=ARMS[arm],
                              cand_logp=log_pi[cands].view(1, 1, -1),
                              cand_sampler_logp=mu[cands].log().view(1, 1, -1),
                              support_mask=supp.view(1, 1, -1))
        total = total + draw[y] * _grad(loss, theta)
    return total


def _pi_mu_with_modeled_tail(seed, V=8, head=(0, 2, 3, 6), head_mass=0.75):
    """π from random logits; μ arbitrary on the head H (ratios in and out of the MIS range) and
    π rescaled to μ's tail mass outside it — the tail model SC assumes, so its centering is
    exact."""
    g = torch.Generator().manual_seed(seed)
    theta = (torch.randn(V, generator=g, dtype=torch.float64) * 1.5).requires_grad_()
    pi = torch.softmax(theta.detach(), -1)
    H = torch.tensor(head)
    mu = pi.clone()
    raw = torch.rand(len(head), generator=g, dtype=torch.float64) ** 3 + 0.01
    mu[H] = head_mass * raw / raw.sum()
    tail = torch.ones(V, dtype=torch.bool)
    tail[H] = False
    mu[tail] = pi[tail] * (1 - head_mass) / pi[tail].sum()
    return theta, pi, mu, H


@pytest.mark.parametrize("arm", ["sc", "sc+mis", "sc+tis"])
@pytest.mark.parametrize("head", [tuple(range(8)), (0, 2, 3, 6)])
def test_sc_expected_update_is_zero_for_constant_advantage(arm, head):
    theta, pi, mu, H = _pi_mu_with_modeled_tail(3, head=head, head_mass=0.75 if len(head) < 8
                                                else 1.0)
    ratios = pi[H] / mu[H]
    assert ((ratios < MIS_LOW) | (ratios > MIS_HIGH)).any(), "the test wants MIS to bite"
    assert _expected_update(arm, theta, mu, H).abs().max() < 1e-12
    assert _expected_update("grpo", theta, mu, H).abs().max() > 1e-2


def test_sc_topp_expected_update_is_zero_under_the_nucleus():
    theta, pi, mu, _ = _pi_mu_with_modeled_tail(4, head=tuple(range(8)), head_mass=1.0)
    cands = mu.argsort(descending=True)[:6]
    support = torch.tensor([True] * 4 + [False] * 2)
    assert _expected_update("sc+mis+topp", theta, mu, cands, support).abs().max() < 1e-12
    assert _expected_update("topp", theta, mu, cands, support).abs().max() > 1e-3


@pytest.mark.parametrize("arm", list(ARMS))
def test_masked_positions_get_zero_gradient(arm):
    d = _batch(seed=5, shift=0.2)  # ratios inside the MIS range: only the mask zeroes
    d["mask"][1, 2] = False
    loss, _ = _run(arm, d)
    g = _grad(loss, d["logits"])
    assert torch.all(g[1, 2] == 0) and torch.all(g[~d["mask"]] == 0)
    assert g[d["mask"]].abs().sum(-1).gt(0).all()


@pytest.mark.parametrize("arm", ["mis", "icepop", "sc+mis"])
def test_mis_out_of_range_tokens_get_zero_gradient(arm):
    d = _batch(seed=6)
    log_pi = torch.log_softmax(d["logits"], -1)
    log_mu = torch.log_softmax(d["sampler_logits"], -1)
    logp = log_pi.gather(-1, d["y"].unsqueeze(-1)).squeeze(-1).detach().requires_grad_()
    sampler_logp = log_mu.gather(-1, d["y"].unsqueeze(-1)).squeeze(-1)
    sampler_logp = torch.where(sampler_logp - logp.detach() > 3, logp.detach() - 0.1, sampler_logp)
    sampler_logp[0, 1] = logp.detach()[0, 1] - 3.0      # ratio e^3 ≈ 20 > 5
    sampler_logp[1, 0] = logp.detach()[1, 0] + 1.0      # ratio e^-1 ≈ 0.37 < 0.5
    loss, m = policy_loss(logp, sampler_logp, d["adv"], d["mask"], arm=ARMS[arm],
                          cand_logp=log_pi.gather(-1, d["idx"]).detach(),
                          cand_sampler_logp=log_mu.gather(-1, d["idx"]))
    g = _grad(loss, logp)
    assert g[0, 1] == 0 and g[1, 0] == 0
    assert m["mis_masked_fraction"] > 0
    ratio = (logp.detach() - sampler_logp).exp()
    inside = d["mask"] & (ratio >= MIS_LOW) & (ratio <= MIS_HIGH)
    assert torch.all(g[inside] != 0)


def test_topp_renormalized_pi_sums_to_one_over_the_support():
    d = _batch(seed=7)
    cand_logp = torch.log_softmax(d["logits"], -1).gather(-1, d["idx"])
    renorm = renormalize_over_support(cand_logp, d["support"])
    torch.testing.assert_close(renorm.exp().sum(-1), torch.ones(renorm.shape[:2],
                                                                dtype=torch.float64))
    assert torch.all(renorm[~d["support"]] == float("-inf"))
    for b, t in [(0, 0), (1, 3), (2, 4)]:
        s = d["support"][b, t]
        pi_s = cand_logp[b, t][s].detach().exp()
        torch.testing.assert_close(renorm[b, t][s].exp(), pi_s / pi_s.sum())


@pytest.mark.parametrize("arm", list(ARMS))
def test_non_finite_sampler_logprobs_leave_mask_and_denominator(arm):
    d = _batch(seed=8)
    log_pi = torch.log_softmax(d["logits"], -1)
    log_mu = torch.log_softmax(d["sampler_logits"], -1)
    logp = log_pi.gather(-1, d["y"].unsqueeze(-1)).squeeze(-1)
    sampler_logp = log_mu.gather(-1, d["y"].unsqueeze(-1)).squeeze(-1)
    cand = dict(cand_logp=log_pi.gather(-1, d["idx"]),
                cand_sampler_logp=log_mu.gather(-1, d["idx"]), support_mask=d["support"])
    bad = torch.zeros_like(d["mask"])
    bad[0, 0] = bad[1, 1] = bad[2, 2] = True
    broken = sampler_logp.clone()
    broken[0, 0], broken[1, 1], broken[2, 2] = float("nan"), float("inf"), float("-inf")
    loss, m = policy_loss(logp, broken, d["adv"], d["mask"], arm=ARMS[arm], **cand)
    clean, m_clean = policy_loss(logp, sampler_logp, d["adv"], d["mask"] & ~bad, arm=ARMS[arm],
                                 **cand)
    torch.testing.assert_close(loss, clean, rtol=1e-14, atol=0)
    g = _grad(loss, d["logits"], retain_graph=True)  # both losses share the log_softmax graph
    g_clean = _grad(clean, d["logits"])
    assert torch.isfinite(g).all()
    torch.testing.assert_close(g, g_clean, rtol=1e-14, atol=0)
    assert m["valid_tokens"] == (d["mask"] & ~bad).sum() == m_clean["valid_tokens"]


@pytest.mark.parametrize("arm", ["sc", "sc+mis", "sc+mis+topp"])
def test_padding_candidates_change_nothing(arm):
    d = _batch(seed=9)
    loss, _ = _run(arm, d)
    g = _grad(loss, d["logits"])
    log_pi = torch.log_softmax(d["logits"], -1)
    log_mu = torch.log_softmax(d["sampler_logits"], -1)
    y = d["y"].unsqueeze(-1)
    pad = torch.full(d["idx"].shape[:2] + (1,), float("nan"), dtype=torch.float64)
    padded, _ = policy_loss(
        log_pi.gather(-1, y).squeeze(-1), log_mu.gather(-1, y).squeeze(-1), d["adv"], d["mask"],
        arm=ARMS[arm],
        cand_logp=torch.cat([log_pi.gather(-1, d["idx"]), torch.full_like(pad, -1e30)], -1),
        cand_sampler_logp=torch.cat([log_mu.gather(-1, d["idx"]), pad], -1),
        support_mask=torch.cat([d["support"], torch.ones_like(pad, dtype=torch.bool)], -1))
    torch.testing.assert_close(padded, loss, rtol=1e-14, atol=0)
    torch.testing.assert_close(_grad(padded, d["logits"]), g, rtol=1e-14, atol=0)


def test_group_advantages_center_without_std_normalization():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 3.0]], dtype=torch.float64)
    adv = group_advantages(rewards)
    torch.testing.assert_close(adv.mean(-1), torch.zeros(2, dtype=torch.float64))
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5],
                                                  [-0.75, -0.75, -0.75, 2.25]],
                                                 dtype=torch.float64))
    torch.testing.assert_close(group_advantages(10 * rewards), 10 * adv)
    with pytest.raises(ValueError, match="G, n"):
        group_advantages(rewards.view(-1))


@pytest.mark.parametrize("arm", list(ARMS))
def test_every_arm_gives_finite_loss_and_metrics(arm):
    d = _batch(seed=10, dtype=torch.float32, V=64, K=16, T=12)
    loss, m = _run(arm, d)
    assert loss.dim() == 0 and torch.isfinite(loss)
    for key in ("loss", "valid_tokens", "kl_k1", "kl_k3", "mis_masked_fraction",
                "ratio_p05", "ratio_p50", "ratio_p95"):
        assert key in m
    if arm.startswith("sc"):
        assert {"sc_tail_ratio", "head_mass_sampler", "head_mass_trainer"} <= m.keys()
    for key, value in m.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0, key
        assert torch.isfinite(value), (key, value)
    assert m["valid_tokens"] == d["mask"].sum()


def test_unknown_arm_and_missing_candidates_raise():
    d = _batch(seed=11)
    with pytest.raises(ValueError, match="arms: grpo, mis.*sc\\+mis\\+topp"):
        _run("ppo", d)
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="needs cand_logp, cand_sampler_logp"):
        policy_loss(logp, logp, torch.zeros(2), torch.ones(2, 3), arm=ARMS["sc"])
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, logp, torch.zeros(3), torch.ones(2, 3), arm=ARMS["grpo"])
    with pytest.raises(TypeError, match="must be an Arm"):
        policy_loss(logp, logp, torch.zeros(2), torch.ones(2, 3), arm="grpo")


def test_every_arm_states_its_parameters():
    """IcePop is MIS under another name: the same row, stated in full."""
    from dataclasses import asdict

    assert {k: v for k, v in asdict(ARMS["icepop"]).items() if k != "name"} == \
        {k: v for k, v in asdict(ARMS["mis"]).items() if k != "name"}
    assert all(a.name == n for n, a in ARMS.items())
