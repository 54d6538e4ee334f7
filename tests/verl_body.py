"""The body of tests/test_integration_verl.py, run by the verl venv's python: prints one JSON.

Verl-shaped inputs ([batch, response_len] masks, log-probs, advantages; [batch, response_len, k]
candidates) go through verl's own lookup, `get_policy_loss_fn(name)`, after a bare `import verl`
(the project's `verl.plugins` entry point must register the losses). Each loss is compared with
`train.loss.policy_loss` on the same inputs and with a float64 reference written here from the
arms' definition (train/loss.py docstring), loss value and gradient with respect to the logits.

The configs are verl's own: Hydra composes the packaged ppo_trainer.yaml with a user's overrides
(`compose_config`), verl's main() validates it (`validate_config`, which the plug-in wraps) and the
worker turns actor_rollout_ref.actor into the ActorConfig the loss gets (`omega_conf_to_dataclass`,
verl@v0.9.1:verl/workers/engine_workers.py). Ray, the model and the GPU are the parts left out:
the losses are called the way verl's ppo_loss calls them (verl/workers/utils/losses.py).

The MIS band against verl's own loss (`band_case`): the legacy trainer's bypass mode with
REINFORCE, token IS (no truncation: rollout_is_threshold 1e6) and token_k1 rejection — verl's
`apply_bypass_mode` and `bypass_mode` loss — on the same tensors, for asymmetric bands.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import verl  # noqa: F401  (loads the verl.plugins entry points)
from verl.trainer.ppo.core_algos import get_policy_loss_fn

B, T, V, K, TOP_P = 6, 9, 16, 6, 0.9
LOW, HIGH = 0.5, 5.0       # the project's MIS band (mismatch.metrics MIS_LOW, MIS_HIGH)
BAND = "0.8_1.6"           # verl's token_k1 band: μ/π in [0.8, 1.6], π/μ in [0.625, 1.25]
BAND_X = (1 / 1.6, 1 / 0.8)
BANDS = ("0.5_5.0", "0.2_1.5", "0.9_3.0")  # asymmetric: read upside down they mask other tokens
CORR = "algorithm.rollout_correction."
# what every composed config needs besides the point at hand (no critic, micro-batch sizes)
BASE = ("algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2")
# the settings docs/verl.md asks for
USER = (CORR + "bypass_mode=true", "actor_rollout_ref.rollout.calculate_log_probs=true")


def compose_config(*overrides: str):
    """verl's ppo_trainer config as `python -m verl.trainer.main_ppo ...overrides` composes it."""
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"),
                               version_base=None):
        return compose(config_name="ppo_trainer", overrides=[*BASE, *overrides])


def validate(cfg) -> None:
    """What verl's main() does with the composed config before it starts anything."""
    from verl.trainer import main_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    main_ppo.validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg),
                             use_critic=need_critic(cfg))


def actor_config(cfg):
    """The ActorConfig a worker builds from the config (engine_workers.py) and passes the loss."""
    from verl.utils.config import omega_conf_to_dataclass
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def trainer_config(name: str, *overrides: str):
    """The ActorConfig loss `name` gets on verl's default (v1) trainer with the user's overrides."""
    cfg = compose_config(f"actor_rollout_ref.actor.policy_loss.loss_mode={name}", *USER, *overrides)
    validate(cfg)
    return actor_config(cfg)


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
    """The loss through verl's lookup, on float32 verl-shaped tensors; grad w.r.t. logits.
    config: the ActorConfig (by default the one verl's default trainer builds for `name`)."""
    logits = d["logits"].float().requires_grad_(True)
    log_pi = logits.log_softmax(-1)
    kwargs = dict(old_log_prob=d["log_mu"].gather(-1, d["y"][..., None]).squeeze(-1).float(),
                  log_prob=log_pi.gather(-1, d["y"][..., None]).squeeze(-1),
                  advantages=d["adv"].float(), response_mask=d["mask"],
                  loss_agg_mode="token-mean", rollout_is_weights=None,
                  config=trainer_config(name) if config is None else config)
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


def band_batch(seed: int = 1) -> dict:
    """64 sequences of up to 256 tokens drawn from a sampler that is a perturbed trainer."""
    b, t, v = 64, 256, 32
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g) * 1.5
    sampler = logits + 0.3 * torch.randn(b, t, v, generator=g)
    y = torch.multinomial(sampler.softmax(-1).reshape(-1, v), 1, generator=g).reshape(b, t)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=g)
    sign = torch.where(torch.rand(b, generator=g) < 0.5, -1.0, 1.0)
    adv = sign * (0.2 + 1.3 * torch.rand(b, generator=g))   # |A| > 0: a kept token has a gradient
    return dict(logits=logits, y=y, mask=torch.arange(t)[None, :] < lengths[:, None],
                adv=adv[:, None].expand(b, t).contiguous(),
                log_mu=sampler.log_softmax(-1).gather(-1, y[..., None]).squeeze(-1))


def run_loss(d: dict, name: str, config) -> dict:
    """loss `name` as verl's ppo_loss calls it, global batch = this batch; the token mask it
    applied (kept = a non-zero gradient on log π(y)) and its gradient w.r.t. the logits."""
    logits = d["logits"].clone().requires_grad_(True)
    log_prob = logits.log_softmax(-1).gather(-1, d["y"][..., None]).squeeze(-1)
    log_prob.retain_grad()
    config.global_batch_info.update(dp_size=1, batch_num_tokens=int(d["mask"].sum()),
                                    global_batch_size=len(d["mask"]), loss_scale_factor=None)
    loss, metrics = get_policy_loss_fn(name)(
        old_log_prob=d["log_mu"], log_prob=log_prob, advantages=d["adv"],
        response_mask=d["mask"], loss_agg_mode=config.loss_agg_mode, config=config,
        rollout_is_weights=None)
    loss.backward()
    return dict(loss=loss.item(), kept=(log_prob.grad != 0) & d["mask"], grad=logits.grad,
                masked_metric=metrics["rollout_corr/rollout_rs_masked_fraction"])


def band_case(d: dict, band: str) -> dict:
    from verl import DataProto
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode, compute_rollout_rejection_mask
    # verl's own: the legacy trainer's bypass mode, REINFORCE + token IS + token_k1 rejection
    cfg = compose_config("trainer.use_v1=false", *USER, CORR + "loss_type=reinforce",
                         CORR + "rollout_is=token", CORR + "rollout_is_threshold=1000000.0",
                         CORR + "rollout_rs=token_k1", CORR + f"rollout_rs_threshold={band}")
    batch = DataProto.from_dict(tensors={"rollout_log_probs": d["log_mu"],
                                         "response_mask": d["mask"].long()})
    apply_bypass_mode(batch, cfg.algorithm.rollout_correction, cfg.actor_rollout_ref.actor.policy_loss)
    assert torch.equal(batch.batch["old_log_probs"], d["log_mu"])
    verls = actor_config(cfg)
    theirs = run_loss(d, verls.policy_loss.loss_mode, verls)
    lp = d["logits"].log_softmax(-1).gather(-1, d["y"][..., None]).squeeze(-1)
    rs_mask, _ = compute_rollout_rejection_mask(lp - d["log_mu"], d["mask"].long(), "token_k1", band)
    # ours on the very ActorConfig verl's loss got (the band apply_bypass_mode copied)
    same = run_loss(d, "mismatch_mis", actor_config(cfg))
    # ours on verl's default trainer, the band set where the user sets it
    user = run_loss(d, "mismatch_mis", trainer_config(
        "mismatch_mis", CORR + "rollout_rs=token_k1", CORR + f"rollout_rs_threshold={band}"))
    low, high = map(float, band.split("_"))
    x, n = (lp - d["log_mu"]).double().exp()[d["mask"]], int(d["mask"].sum())

    def compare(ours: dict) -> dict:
        return {"masked": 1 - ours["kept"].sum().item() / n, "masked_metric": ours["masked_metric"],
                "tokens_differing": (ours["kept"] != theirs["kept"]).sum().item(),
                "loss": ours["loss"],
                "grad_max_abs_diff": (ours["grad"] - theirs["grad"]).abs().max().item()}
    return {"verl": {"masked": 1 - theirs["kept"].sum().item() / n, "loss": theirs["loss"],
                     "masked_metric": theirs["masked_metric"],
                     "grad_max_abs": theirs["grad"].abs().max().item(),
                     "rs_mask_equals_loss_mask": torch.equal(rs_mask.bool(), theirs["kept"])},
            "same_config": compare(same), "default_trainer": compare(user),
            # the band read the other way round (π/μ in [low, high]): the mask before the fix
            "upside_down_masked": ((x < low) | (x > high)).double().mean().item()}


def config_errors(d: dict) -> dict:
    mis = "actor_rollout_ref.actor.policy_loss.loss_mode=mismatch_mis"
    legacy = compose_config(mis, *USER, "trainer.use_v1=false")
    from verl import DataProto
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode
    apply_bypass_mode(DataProto.from_dict(tensors={"rollout_log_probs": d["log_mu"]}),
                      legacy.algorithm.rollout_correction, legacy.actor_rollout_ref.actor.policy_loss)
    return {
        # verl's legacy trainer swaps the loss out: why use_v1=false must fail up front
        "legacy_loss_mode_after_bypass": legacy.actor_rollout_ref.actor.policy_loss.loss_mode,
        # what verl's default trainer hands the loss of the user's band, without the plug-in's copy
        "default_actor_threshold": actor_config(compose_config(
            mis, *USER, CORR + "rollout_rs=token_k1", CORR + "rollout_rs_threshold=0.5_5.0")
        ).policy_loss.rollout_correction.rollout_rs_threshold,
        "legacy": error(lambda: validate(compose_config(mis, *USER, "trainer.use_v1=false"))),
        "no_bypass": error(lambda: validate(compose_config(
            mis, "actor_rollout_ref.rollout.calculate_log_probs=true"))),
        "no_rollout_log_probs": error(lambda: validate(compose_config(
            mis, CORR + "bypass_mode=true", "actor_rollout_ref.rollout.calculate_log_probs=false"))),
        "verl_is_on": error(lambda: validate(compose_config(mis, *USER, CORR + "rollout_is=token"))),
        "other_rs": error(lambda: validate(compose_config(
            mis, *USER, CORR + "rollout_rs=seq_mean_k3", CORR + "rollout_rs_threshold=0.01"))),
        "bad_band": error(lambda: trainer_config(
            "mismatch_mis", CORR + "rollout_rs=token_k1", CORR + "rollout_rs_threshold=2.0_0.5")),
        # a worker whose config the driver never checked (another entry point, bypass off)
        "loss_without_check": error(lambda: verl_call(d, "mismatch_mis", config=actor_config(
            compose_config(mis, *USER)))),
        "seq_mean": error(lambda: verl_call(d, "mismatch_mis", loss_agg_mode="seq-mean-token-mean")),
        "is_weights": error(lambda: verl_call(
            d, "mismatch_mis", rollout_is_weights=torch.ones(B, T))),
        "sc_without_candidates": error(lambda: verl_call(
            d, "mismatch_sc+mis", cand_log_prob=None, rollout_cand_log_probs=None)),
        "unknown_name": error(lambda: get_policy_loss_fn("mismatch_nope")),
    }


def main() -> None:
    from mismatch.train.loss import ARMS, policy_loss
    d = inputs()
    out: dict = {"registered_by_import_verl": "mismatch.integrations.verl" in sys.modules,
                 "verl_version": verl.__version__, "arms": {}}
    band = (CORR + "rollout_rs=token_k1", CORR + f"rollout_rs_threshold={BAND}")
    for name in ("mismatch_mis", "mismatch_sc", "mismatch_sc+mis", "mismatch_sc+mis+topp"):
        arm = name.removeprefix("mismatch_")
        loss, metrics, grad, kw = verl_call(d, name)
        own, own_metrics = policy_loss(
            kw["log_prob"].detach(), kw["old_log_prob"], kw["advantages"], kw["response_mask"],
            arm=ARMS[arm], cand_logp=kw.get("cand_log_prob"),
            cand_sampler_logp=kw.get("rollout_cand_log_probs"),
            support_mask=kw.get("rollout_support_mask"))
        ref, ref_grad = reference(d, arm)
        band_loss, band_metrics, _, _ = verl_call(d, name, config=trainer_config(name, *band))
        band_ref, _ = reference(d, arm, *BAND_X)
        # verl's global token mean: this micro-batch is a third of the batch's tokens
        n, config = int(d["mask"].sum()), trainer_config(name)
        config.global_batch_info.update(batch_num_tokens=3 * n, dp_size=1)
        scaled, _, _, _ = verl_call(d, name, config=config)
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
            "ref_outside_band": ((x < BAND_X[0]) | (x > BAND_X[1])).double().mean().item(),
            "band_metrics": band_metrics,
        }
    big = band_batch()
    out["bands"] = {band: band_case(big, band) for band in BANDS}
    out["errors"] = config_errors(d)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
