"""The body of tests/test_integration_verl.py, run by the verl venv's python: prints one JSON.

Verl-shaped inputs ([batch, response_len] masks, log-probs, advantages; [batch, response_len, k]
candidates) go through verl's own lookup, `get_policy_loss_fn(name)`, after a bare `import verl`
(the project's `verl.plugins` entry point must register the losses). Each loss is compared with
`train.loss.policy_loss` on the same inputs and with a float64 reference written here from the
arms' definition (train/loss.py docstring), loss value and gradient with respect to the logits.
"""

from __future__ import annotations

import json
import sys

import torch

import verl  # noqa: F401  (loads the verl.plugins entry points)
from verl.trainer.ppo.core_algos import get_policy_loss_fn

B, T, V, K, TOP_P = 6, 9, 16, 6, 0.9
LOW, HIGH = 0.5, 5.0       # the project's MIS band (mismatch.metrics MIS_LOW, MIS_HIGH)
BAND = "0.8_1.25"          # a narrower band through verl's rollout_rs_threshold


def inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 1.5
    sampler = logits + 0.6 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    log_mu = sampler.log_softmax(-1)
    top = log_mu.topk(K, dim=-1)
    ids, cand_mu = top.indices, top.values.clone()
    # the sampler's nucleus inside its top-k: the smallest prefix whose mass reaches TOP_P
    mass_before = cand_mu.exp().cumsum(-1) - cand_mu.exp()
    support = mass_before < TOP_P
    y_pos = torch.multinomial(torch.where(support, cand_mu.exp(), 0).reshape(-1, K), 1,
                              generator=g).reshape(B, T)
    y = ids.gather(-1, y_pos[..., None]).squeeze(-1)
    cand_mu[0, 1, -1] = float("-inf")      # a padded candidate slot (never the drawn token)
    support[0, 1, -1] = False
    lengths = torch.tensor([9, 7, 5, 9, 3, 8])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.75, 0.0], dtype=torch.float64)
    return dict(logits=logits, log_mu=log_mu, ids=ids, cand_mu=cand_mu, support=support, y=y,
                mask=mask, adv=adv[:, None].expand(B, T).contiguous())


def weight(x: torch.Tensor, arm: str, low: float, high: float) -> torch.Tensor:
    return x * ((x >= low) & (x <= high)) if "mis" in arm else torch.ones_like(x)


def reference(d: dict, arm: str, low: float = LOW, high: float = HIGH) -> tuple[float, torch.Tensor]:
    """float64 loss and d loss / d logits, from the definition, position by position."""
    logits = d["logits"].clone().requires_grad_(True)
    log_pi = logits.log_softmax(-1)
    total, n = 0.0, 0
    for b in range(B):
        for t in range(T):
            if not d["mask"][b, t]:
                continue
            n += 1
            keep = torch.isfinite(d["cand_mu"][b, t])
            if arm.endswith("topp"):
                keep = keep & d["support"][b, t]
            ids = d["ids"][b, t][keep]
            lp_y, lm_y = log_pi[b, t, d["y"][b, t]], d["log_mu"][b, t, d["y"][b, t]]
            lp_c, lm_c = log_pi[b, t, ids], d["cand_mu"][b, t][keep]
            if arm.endswith("topp"):   # both sides renormalized over the nucleus
                z_pi, z_mu = torch.logsumexp(lp_c, 0), torch.logsumexp(lm_c, 0)
                lp_y, lp_c, lm_y, lm_c = lp_y - z_pi, lp_c - z_pi, lm_y - z_mu, lm_c - z_mu
            x = (lp_y - lm_y).detach().exp()
            objective = weight(x, arm, low, high) * lp_y
            if arm.startswith("sc"):
                pi, mu = lp_c.detach().exp(), lm_c.exp()
                tail_mu = 1 - mu.sum()
                if arm.endswith("topp") or tail_mu <= 1e-6:
                    alpha = 0.0
                else:
                    rho = tail_mu / (1 - pi.sum()).clamp_min(1e-6)
                    alpha = rho * weight(1 / rho, arm, low, high)
                coef = mu * weight(pi / mu, arm, low, high) - alpha * pi
                objective = objective - (coef * lp_c).sum()
            total = total - d["adv"][b, t] * objective
    loss = total / n
    loss.backward()
    return loss.item(), logits.grad


def verl_call(d: dict, name: str, config=None, **extra):
    """The loss through verl's lookup, on float32 verl-shaped tensors; grad w.r.t. logits."""
    logits = d["logits"].float().requires_grad_(True)
    log_pi = logits.log_softmax(-1)
    kwargs = dict(old_log_prob=d["log_mu"].gather(-1, d["y"][..., None]).squeeze(-1).float(),
                  log_prob=log_pi.gather(-1, d["y"][..., None]).squeeze(-1),
                  advantages=d["adv"].float(), response_mask=d["mask"],
                  loss_agg_mode="token-mean", config=config, rollout_is_weights=None)
    if "sc" in name:
        kwargs.update(cand_log_prob=log_pi.gather(-1, d["ids"]),
                      rollout_cand_log_probs=d["cand_mu"].float())
        if name.endswith("topp"):
            kwargs.update(rollout_support_mask=d["support"])
    kwargs.update(extra)
    loss, metrics = get_policy_loss_fn(name)(**kwargs)
    loss.backward()
    return loss, metrics, logits.grad, kwargs


def error(fn) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return ""


def main() -> None:
    from omegaconf import OmegaConf

    from mismatch.train.loss import ARMS, policy_loss
    d = inputs()
    out: dict = {"registered_by_import_verl": "mismatch.integrations.verl" in sys.modules,
                 "verl_version": verl.__version__, "arms": {}}
    band_config = OmegaConf.create(
        {"policy_loss": {"rollout_correction": {"rollout_rs_threshold": BAND}}})
    for name in ("mismatch_mis", "mismatch_sc", "mismatch_sc+mis", "mismatch_sc+mis+topp"):
        arm = name.removeprefix("mismatch_")
        loss, metrics, grad, kw = verl_call(d, name)
        own, own_metrics = policy_loss(
            kw["log_prob"].detach(), kw["old_log_prob"], kw["advantages"], kw["response_mask"],
            arm=ARMS[arm], cand_logp=kw.get("cand_log_prob"),
            cand_sampler_logp=kw.get("rollout_cand_log_probs"),
            support_mask=kw.get("rollout_support_mask"))
        ref, ref_grad = reference(d, arm)
        band_loss, band_metrics, _, _ = verl_call(d, name, config=band_config)
        band_ref, _ = reference(d, arm, *map(float, BAND.split("_")))
        # verl's global token mean: this micro-batch is a third of the batch's tokens
        n = int(d["mask"].sum())
        scaled, _, _, _ = verl_call(d, name, config=OmegaConf.create(
            {"global_batch_info": {"batch_num_tokens": 3 * n, "dp_size": 1}}))
        lp, lm = kw["log_prob"].detach().double(), kw["old_log_prob"].double()
        if arm.endswith("topp"):  # the arm's metrics are on π, μ renormalized over the nucleus
            cand_pi = d["logits"].log_softmax(-1).gather(-1, d["ids"])
            lp = lp - torch.logsumexp(cand_pi.masked_fill(~d["support"], float("-inf")), -1)
            lm = lm - torch.logsumexp(d["cand_mu"].masked_fill(~d["support"], float("-inf")), -1)
        r = (lp - lm)[d["mask"]]
        x = r.exp()
        out["arms"][name] = {
            "loss": loss.item(), "policy_loss": own.item(), "reference": ref,
            "grad_max_abs_diff": (grad.double() - ref_grad).abs().max().item(),
            "grad_max_abs": ref_grad.abs().max().item(),
            "band_loss": band_loss.item(), "band_reference": band_ref,
            "scaled_loss": scaled.item(), "metrics": metrics,
            "own_metrics": {k: float(v) for k, v in own_metrics.items()},
            "ref_kl": (-r).mean().item(), "ref_k3": (torch.expm1(r) - r).mean().item(),
            "ref_outside": ((x < LOW) | (x > HIGH)).double().mean().item(),
            "ref_outside_band": ((x < 0.8) | (x > 1.25)).double().mean().item(),
            "band_metrics": band_metrics,
        }
    out["errors"] = {
        "sc_without_candidates": error(lambda: verl_call(
            d, "mismatch_sc+mis", cand_log_prob=None, rollout_cand_log_probs=None)),
        "seq_mean": error(lambda: verl_call(d, "mismatch_mis", loss_agg_mode="seq-mean-token-mean")),
        "is_weights": error(lambda: verl_call(
            d, "mismatch_mis", rollout_is_weights=torch.ones(B, T))),
        "bad_band": error(lambda: verl_call(d, "mismatch_mis", config=OmegaConf.create(
            {"policy_loss": {"rollout_correction": {"rollout_rs_threshold": 2.0}}}))),
        "unknown_name": error(lambda: get_policy_loss_fn("mismatch_nope")),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
