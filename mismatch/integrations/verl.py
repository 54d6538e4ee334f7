"""The project's correction arms as verl policy losses: importing this module registers them.

    import mismatch.integrations.verl   # or nothing: installing the project registers them
    actor_rollout_ref.actor.policy_loss.loss_mode=mismatch_sc+mis

Names: `mismatch_mis`, `mismatch_sc`, `mismatch_sc+mis`, `mismatch_sc+mis+topp` — the arms of
`train.loss.ARMS` with the same definition (token weight, score centering, top-p replay).
verl's registry is `POLICY_LOSS_REGISTRY`, filled by the decorator `register_policy_loss(name)`
and read by `get_policy_loss_fn(name)` (volcengine/verl@v0.9.1:verl/trainer/ppo/core_algos.py;
the PyPI wheel verl-0.9.1, whose commit the stored mirror lacks). The actor calls the loss with
keywords old_log_prob, log_prob, advantages, response_mask ([batch, response_len] each),
loss_agg_mode, config (the ActorConfig) and rollout_is_weights, and expects (loss, {name: float})
(verl@v0.9.1:verl/workers/utils/losses.py ppo_loss). verl imports every `verl.plugins` entry point
when it is itself imported (verl@v0.9.1:verl/__init__.py); the project declares this module as
one (pyproject.toml), so driver and Ray workers alike find the names once the project is
installed. `VERL_USE_EXTERNAL_MODULES=mismatch.integrations.verl` does the same explicitly.

What the losses read:
- `old_log_prob` is the sampler's log μ(y): the batch's old_log_probs must be the rollout's
  log-probs (`rollout.calculate_log_probs=true`; verl's bypass semantics, where
  `apply_bypass_mode` sets old_log_probs = rollout_log_probs, verl@v0.9.1:
  verl/trainer/ppo/rollout_corr_helper.py). The arms weigh tokens themselves, so verl's own IS
  weights must be off (`algorithm.rollout_correction.rollout_is=null`): a loss handed
  `rollout_is_weights` raises rather than correct twice.
- `loss_agg_mode` must be "token-mean" (the arms' definition); the micro-batch mean is rescaled
  to verl's global token mean with `config.global_batch_info` (batch_num_tokens, dp_size) as
  verl's `agg_loss` does.
- The MIS band [low, high]: `policy_loss.rollout_correction.rollout_rs_threshold` in verl's
  "low_high" form (the form of its token_k1 rejection), else the arm's own (train.loss.ARMS:
  MIS_LOW, MIS_HIGH).

Score centering needs the sampler's top-k candidates, which stock verl 0.9.1 does not carry to
the loss. The rollout must return, per response position, the top-k token ids and their log-probs
(vLLM/SGLang `logprobs=k`); the batch carries them as [batch, response_len, k] tensors, the way
verl's distillation carries a teacher's (fields teacher_ids / teacher_logprobs,
verl@v0.9.1:verl/trainer/distillation/losses.py); the actor's forward gathers its own log-softmax
at those ids (differentiable) and passes three keywords to the loss: `cand_log_prob` (trainer log π
at the candidates), `rollout_cand_log_probs` (sampler log μ there, -inf = padding) and, for the
top-p arm, `rollout_support_mask` (the candidates inside the sampler's nucleus). verl's ppo_loss
passes none of them, so without that change the SC arms raise a one-line ValueError; they never
fall back to an uncentered loss. `mismatch_mis` needs only what verl passes.

Metrics (floats, as verl's own losses return): the project's `policy_loss` metrics under
"rollout_corr/" — verl's own names where the quantity is the same (rollout_corr/kl = mean
log μ − log π, rollout_corr/k3_kl, rollout_corr/rollout_rs_masked_fraction for the MIS-masked
share; verl@v0.9.1:verl/trainer/ppo/rollout_corr_helper.py), the project's names otherwise
(rollout_corr/sc_tail_ratio, rollout_corr/ratio_p50, …). `mismatch monitor --format verl` reads
k3_kl and rollout_rs_masked_fraction from verl's file logger.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from mismatch.train.loss import ARMS, Arm, policy_loss

__all__ = ["LOSSES", "verl_loss"]

LOSSES: dict[str, str] = {f"mismatch_{arm}": arm for arm in ("mis", "sc", "sc+mis", "sc+mis+topp")}
"""verl loss name → `train.loss.ARMS` arm"""

_VERL_NAMES = {"kl_k1": "rollout_corr/kl", "kl_k3": "rollout_corr/k3_kl"}


def _get(config: Any, key: str, default: Any = None) -> Any:
    """config[key] for verl's BaseConfig / OmegaConf DictConfig / dict, else default."""
    if config is None:
        return default
    getter = getattr(config, "get", None)
    value = getter(key, default) if getter is not None else getattr(config, key, default)
    return default if value is None else value


def _with_mis_band(arm: Arm, config: Any) -> Arm:
    """The arm with verl's MIS band, when the config sets one (the arm's own otherwise)."""
    corr = _get(_get(config, "policy_loss"), "rollout_correction")
    spec = _get(corr, "rollout_rs_threshold")
    if spec is None:
        return arm
    try:
        low, high = (float(x) for x in str(spec).split("_"))
    except ValueError:
        raise ValueError(f"rollout_rs_threshold must be 'low_high' (e.g. '0.5_2.0') for the "
                         f"mismatch losses, got {spec!r}") from None
    if not 0 <= low < high:
        raise ValueError(f"rollout_rs_threshold needs 0 <= low < high, got {spec!r}")
    return replace(arm, mis_low=low, mis_high=high)


def verl_loss(name: str, old_log_prob: torch.Tensor, log_prob: torch.Tensor,
              advantages: torch.Tensor, response_mask: torch.Tensor,
              loss_agg_mode: str = "token-mean", config: Any = None,
              rollout_is_weights: torch.Tensor | None = None, *,
              cand_log_prob: torch.Tensor | None = None,
              rollout_cand_log_probs: torch.Tensor | None = None,
              rollout_support_mask: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss registered as `name` (module docstring), on verl's arguments."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; mismatch losses: {', '.join(LOSSES)}")
    arm = ARMS[LOSSES[name]]
    if loss_agg_mode != "token-mean":
        raise ValueError(f"{name} is a token mean: set loss_agg_mode=token-mean, "
                         f"got {loss_agg_mode!r}")
    if rollout_is_weights is not None:
        raise ValueError(f"{name} weighs tokens itself: turn verl's IS weights off "
                         f"(algorithm.rollout_correction.rollout_is=null)")
    if arm.centered and (cand_log_prob is None or rollout_cand_log_probs is None
                         or (arm.top_p and rollout_support_mask is None)):
        needed = "cand_log_prob, rollout_cand_log_probs" + (
            ", rollout_support_mask" if arm.top_p else "")
        raise ValueError(f"{name} needs the sampler's top-k candidates ({needed}); verl's "
                         f"ppo_loss passes none: see mismatch.integrations.verl")
    loss, metrics = policy_loss(
        log_prob, old_log_prob, advantages, response_mask, arm=_with_mis_band(arm, config),
        cand_logp=cand_log_prob, cand_sampler_logp=rollout_cand_log_probs,
        support_mask=rollout_support_mask)
    info = _get(config, "global_batch_info", {}) or {}
    dp_size = int(info.get("dp_size", 1) or 1)
    batch_num_tokens = info.get("batch_num_tokens")
    if batch_num_tokens is not None:
        # the micro-batch's token mean → its share of the global token mean (verl's agg_loss)
        loss = loss * (metrics["valid_tokens"].to(loss.dtype) / float(batch_num_tokens) * dp_size)
    elif dp_size > 1:
        raise ValueError(f"{name} with dp_size {dp_size} needs global_batch_info.batch_num_tokens")
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key == "mis_masked_fraction" and arm.weight == "mis":
            key = "rollout_rs_masked_fraction"
        out[_VERL_NAMES.get(key, f"rollout_corr/{key}")] = float(value)
    return loss, out


def _register() -> None:
    try:
        from verl.trainer.ppo.core_algos import register_policy_loss
    except ImportError as err:
        raise ImportError(f"mismatch.integrations.verl needs verl (0.9.x): {err}") from None

    def make(name: str):
        def loss_fn(old_log_prob, log_prob, advantages, response_mask,
                    loss_agg_mode="token-mean", config=None, rollout_is_weights=None, **kwargs):
            return verl_loss(name, old_log_prob, log_prob, advantages, response_mask,
                             loss_agg_mode, config, rollout_is_weights, **kwargs)
        loss_fn.__name__ = loss_fn.__qualname__ = name.replace("+", "_")
        loss_fn.__doc__ = f"mismatch arm {LOSSES[name]!r} as a verl policy loss"
        return loss_fn

    for name in LOSSES:
        register_policy_loss(name)(make(name))


_register()
