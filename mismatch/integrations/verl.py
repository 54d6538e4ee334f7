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

The settings (docs/verl.md): verl's v1 trainer (the default, `trainer.use_v1=true`) in bypass
mode, with the rollout's log-probs and without verl's IS weights:

    algorithm.rollout_correction.bypass_mode=true  actor_rollout_ref.rollout.calculate_log_probs=true
    # optional, the MIS band in verl's own terms (its token_k1 rejection):
    algorithm.rollout_correction.rollout_rs=token_k1  algorithm.rollout_correction.rollout_rs_threshold=0.5_5.0

`check_config` reads them on the composed config and fails in one line naming the override to
set; the plug-in wraps verl's `validate_config` with it, so `python -m verl.trainer.main_ppo`
checks before anything starts (verl@v0.9.1:verl/trainer/main_ppo.py main). Why each:
- bypass mode: without it `old_log_prob` is verl's recomputed π_old, not the sampler's μ, and
  the arms would weigh by π/π_old (verl@v0.9.1:verl/trainer/ppo/v1/trainer_base.py
  _compute_old_log_prob). In bypass mode the v1 trainer copies rollout_log_probs to
  old_log_probs, which needs `rollout.calculate_log_probs=true`.
- the v1 trainer: the legacy one (`trainer.use_v1=false`) calls `apply_bypass_mode`, which
  overwrites `policy_loss.loss_mode` with "bypass_mode" (verl@v0.9.1:
  verl/trainer/ppo/rollout_corr_helper.py), so a mismatch loss would never run.
- `rollout_is=null`: the arms weigh tokens themselves; a loss handed `rollout_is_weights`
  raises rather than correct twice.
- `loss_agg_mode` "token-mean" (the arms' definition); the micro-batch mean is rescaled to
  verl's global token mean with `config.global_batch_info` (batch_num_tokens, dp_size) as
  verl's `agg_loss` does.

The MIS band. A loss sees only the actor's config (the Ray worker builds it from
actor_rollout_ref.actor, verl@v0.9.1:verl/workers/engine_workers.py), and verl's v1 trainer never
copies algorithm.rollout_correction there (only the legacy `apply_bypass_mode` does).
`check_config` copies it to actor_rollout_ref.actor.policy_loss.rollout_correction, as
`apply_bypass_mode` would, and the loss reads it there; a loss whose copy is missing (a config
that `check_config` never saw, or bypass off) raises. `rollout_rs_threshold` means what it means
to verl's token_k1 rejection (verl@v0.9.1: rollout_corr_helper.py compute_rollout_rejection_mask):
verl keeps a token when low <= μ/π <= high (its token_k1 statistic is −log(π/μ)), that is
π/μ in [1/high, 1/low], and that is the band the arms apply to x = π/μ; the threshold is parsed
by verl's own parser (a single value v means the band 1/v_v). So the plug-in masks the
tokens that verl's bypass-mode REINFORCE with token IS and token_k1 rejection masks, and
`mismatch_mis` computes that loss (tests/test_integration_verl.py). Without rollout_rs the
arm's own band applies (train.loss.ARMS: x = π/μ in [MIS_LOW, MIS_HIGH]).

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

import functools
from dataclasses import replace
from typing import Any

import torch

from mismatch.train.loss import ARMS, Arm, policy_loss

__all__ = ["LOSSES", "check_config", "verl_loss"]

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


def _corr_key(key: str) -> str:
    return f"algorithm.rollout_correction.{key}"


def _band(name: str, corr: Any) -> tuple[float, float] | None:
    """π/μ band of verl's token_k1 rejection as `corr` sets it, None when rollout_rs is off."""
    rs, spec = _get(corr, "rollout_rs"), _get(corr, "rollout_rs_threshold")
    if rs is None:
        if spec is not None:
            raise ValueError(f"{name}: {_corr_key('rollout_rs_threshold')}={spec} is a band only "
                             f"with {_corr_key('rollout_rs')}=token_k1 (verl ignores it otherwise)")
        return None
    if str(rs).strip() != "token_k1":
        raise ValueError(f"{name} masks by the token ratio only: set {_corr_key('rollout_rs')}"
                         f"=token_k1 (or null), got {rs!r}")
    if spec is None:
        raise ValueError(f"{name}: set {_corr_key('rollout_rs_threshold')}=<low>_<high> with "
                         f"{_corr_key('rollout_rs')}=token_k1")
    from verl.trainer.ppo.rollout_corr_helper import _parse_rollout_rs_thresholds
    try:  # verl's own parser: "low_high", or a single v read as low = 1/v, high = v
        parsed = _parse_rollout_rs_thresholds(["token_k1"], spec)["token_k1"]
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name}: {_corr_key('rollout_rs_threshold')}={spec!r}: {err}") from None
    # verl keeps log(low) <= -log(π/μ) <= log(high): π/μ in [1/high, 1/low]
    return 1.0 / parsed["upper"], 1.0 / parsed["lower"]


def _with_mis_band(name: str, arm: Arm, config: Any) -> Arm:
    """The arm with the band of algorithm.rollout_correction, which `check_config` copied to
    the actor's policy_loss; a config without that copy (bypass mode off) raises."""
    corr = _get(_get(config, "policy_loss"), "rollout_correction")
    if not _get(corr, "bypass_mode", False):
        raise ValueError(f"{name} needs verl's bypass mode (old_log_prob = the rollout's "
                         f"log-probs, not π_old): set {_corr_key('bypass_mode')}=true and start "
                         f"verl.trainer.main_ppo (or call mismatch.integrations.verl.check_config)")
    band = _band(name, corr)
    if band is None:
        return arm
    try:
        return replace(arm, mis_low=band[0], mis_high=band[1])
    except ValueError as err:
        raise ValueError(f"{name}: {_corr_key('rollout_rs_threshold')}: {err}") from None


def check_config(config: Any) -> None:
    """Check a composed verl config (OmegaConf) whose actor loss is a mismatch loss and copy
    algorithm.rollout_correction to actor_rollout_ref.actor.policy_loss.rollout_correction, where
    the loss reads it (module docstring). One-line ValueError naming the overrides to set; a
    config with another loss_mode is left alone."""
    from omegaconf import OmegaConf, open_dict

    actor = config.actor_rollout_ref.actor
    name = actor.policy_loss.get("loss_mode")
    if name not in LOSSES:
        return
    corr = config.algorithm.get("rollout_correction")
    need = []
    if not config.trainer.get("use_v1", True):
        need.append("trainer.use_v1=true (the legacy trainer's bypass mode replaces loss_mode "
                    "with bypass_mode)")
    if not _get(corr, "bypass_mode", False):
        need.append(f"{_corr_key('bypass_mode')}=true (without it old_log_prob is verl's "
                    f"recomputed π_old, not the sampler's μ)")
    if not config.actor_rollout_ref.rollout.get("calculate_log_probs", False):
        need.append("actor_rollout_ref.rollout.calculate_log_probs=true (the sampler's log μ)")
    if _get(corr, "rollout_is") is not None:
        need.append(f"{_corr_key('rollout_is')}=null ({name} weighs tokens itself)")
    if actor.get("loss_agg_mode") != "token-mean":
        need.append("actor_rollout_ref.actor.loss_agg_mode=token-mean (the arms' token mean)")
    if need:
        raise ValueError(f"{name} needs: " + "; ".join(need))
    _band(name, corr)  # a bad band fails here, on the driver
    corr = OmegaConf.to_container(corr, resolve=True)
    old = actor.policy_loss.get("rollout_correction")
    if old is not None and OmegaConf.to_container(old, resolve=True) != corr:
        raise ValueError(f"{name} reads its band from algorithm.rollout_correction only: remove "
                         f"actor_rollout_ref.actor.policy_loss.rollout_correction")
    with open_dict(actor.policy_loss):
        actor.policy_loss.rollout_correction = corr


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
    arm = _with_mis_band(name, arm, config)
    loss, metrics = policy_loss(
        log_prob, old_log_prob, advantages, response_mask, arm=arm,
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


def _wrap_validate_config() -> None:
    """verl's `validate_config` runs `check_config` first: main_ppo imports the function by name
    (verl@v0.9.1:verl/trainer/main_ppo.py), after `import verl` has loaded this plug-in."""
    import verl.utils
    import verl.utils.config as verl_config

    original = verl_config.validate_config
    if getattr(original, "mismatch_check_config", False):
        return

    @functools.wraps(original)
    def validate_config(config, *args, **kwargs):
        check_config(config)
        return original(config, *args, **kwargs)

    validate_config.mismatch_check_config = True
    verl_config.validate_config = verl.utils.validate_config = validate_config


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
    _wrap_validate_config()


_register()
