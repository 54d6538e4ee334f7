"""The shipped adapters, one per framework, each field citing the code that logs it
(repository @ commit read, path, function).

A field the framework logs under the native name is picked up as the last candidate of the
signals no framework logs itself (format_error_rate, sc_tail_ratio): log them yourself, with the
native names, and any adapter reads them.
"""

from __future__ import annotations

from mismatch.probes.monitor.signals import SIGNALS
from mismatch.probes.monitor.formats.adapter import Adapter

__all__ = ["ADAPTERS"]

_NATIVE_ONLY = {"format_error_rate": ("format_error_rate",), "sc_tail_ratio": ("sc_tail_ratio",)}

_MIS_MASKED = ("train/mis_tis_mask_fraction_low+train/mis_tis_mask_fraction_high",
               "train/mis_rs_mask_fraction_low+train/mis_rs_mask_fraction_high")
"""slime and Miles: the MIS helper's masked share, logged in halves (mis.py mask(), prefix tis_
when tis_mode=mask, rs_ for rejection sampling; prefixed mis_ and logged under train/).
`train/tis_clipfrac` is left out on purpose: THUDM/slime@624b824:slime/backends/megatron_utils/
loss.py vanilla_tis_function (the default TIS) logs as tis_clipfrac the share of *clipped*
weights, still trained on; only icepop_function (chosen with --custom-tis-function-path) zeroes
them. Under IcePop, `--map mis_masked_fraction=train/tis_clipfrac` reads it as a masked share."""


def _with_native(fields: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    return {s: fields.get(s, ()) + _NATIVE_ONLY.get(s, ()) for s in SIGNALS
            if fields.get(s) or s in _NATIVE_ONLY}


ADAPTERS: dict[str, Adapter] = {a.name: a for a in (
    Adapter(
        name="native",
        fields={s: (s,) for s in SIGNALS},
        step_records=True,
        description="this project's field names (mismatch.probes.monitor.SIGNALS), `step`, "
                    "`episodes`",
    ),
    # verl: volcengine/verl@b178a3c. Its file logger (trainer.logger includes "file") writes
    # {"step": N, "data": {...}} per step to $VERL_FILE_LOGGER_PATH, else
    # $VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl: verl/utils/tracking.py FileLogger.log.
    Adapter(
        name="verl",
        step=("step", "training/global_step"),
        envelope=("data",),
        fields=_with_native({
            # verl/trainer/ppo/metric_utils.py compute_data_metrics: critic/score/mean is the task
            # score; critic/rewards/mean also carries the KL penalty when use_kl_in_reward is on
            # (equal to it otherwise), so the score comes first.
            "reward": ("critic/score/mean", "critic/rewards/mean"),
            # verl/trainer/ppo/rollout_corr_helper.py compute_offpolicy_metrics: k3 of
            # KL(rollout || training), logged with the "rollout_corr/" prefix (bypass mode too);
            # then verl/utils/debug/metrics.py calculate_debug_metrics: mean |p_rollout - p_actor|,
            # a proxy linear in the mismatch, squared (see adapter.py). actor/ppo_kl is a signed
            # k1 of the PPO update's old→new drift, not read.
            "kl": ("rollout_corr/k3_kl", "training/rollout_probs_diff_mean^2"),
            # verl/workers/actor/dp_actor.py and verl/trainer/ppo/ray_trainer.py: actor/entropy
            "entropy": ("actor/entropy",),
            # verl/trainer/ppo/metric_utils.py compute_data_metrics
            "response_length": ("response_length/mean",),
            # verl/trainer/ppo/rollout_corr_helper.py compute_rollout_rejection_mask: share of
            # tokens the rejection sampling (mask) removed
            "mis_masked_fraction": ("rollout_corr/rollout_rs_masked_fraction",),
        }),
        description="verl's file logger lines {step, data: {...}}",
    ),
    # slime: THUDM/slime@624b824. Writes no metrics file of its own: wandb / tensorboard, and
    # console lines `[time] file:line - <kind> <n>: {dict repr}` (console.py).
    # Two step axes: rollout lines carry the rollout id (slime/observability/
    # train_metric_utils.py gather_log_data; rollout/step in wandb), train lines train/step =
    # rollout_id * num_steps_per_rollout + step_id (slime/backends/megatron_utils/model.py
    # train_one_step's log); RecordReader puts both on the rollout axis.
    Adapter(
        name="slime",
        step=("rollout_id", "rollout/step"),
        train_step=("train/step",),
        fields=_with_native({
            # slime/ray/rollout.py _convert_samples_to_train_data: raw_reward is the task reward
            # ("rewards" are group-normalized, mean ~0 under GRPO); logged as rollout/raw_reward
            # by train_metric_utils.py log_rollout_data.
            "reward": ("rollout/raw_reward",),
            # examples/train_infer_mismatch_helper/mis.py: k3_kl (prefixed mis_, train/); then
            # slime/backends/megatron_utils/loss.py policy_loss_function:
            # train_rollout_logprob_abs_diff, mean |Δ log p|, a proxy: squared.
            "kl": ("train/mis_k3_kl", "train/train_rollout_logprob_abs_diff^2"),
            # loss.py policy_loss_function: entropy_loss, the mean token entropy (always computed)
            "entropy": ("train/entropy_loss", "rollout/entropy"),
            # slime/observability/rollout_metrics.py compute_metrics_from_samples: response_len/
            "response_length": ("rollout/response_len/mean", "rollout/response_lengths"),
            "mis_masked_fraction": _MIS_MASKED,
        }),
        description="slime's console lines `[time] file:line - rollout 7: {...}` (or its "
                    "metric dicts as JSON lines)",
    ),
    # Miles: radixark/miles@31f1ca9. With --save-debug-event-data DIR its event logger appends
    # one JSON event per line to DIR/<process>.jsonl: actor_cell<C>_rank<K>.jsonl (training),
    # rollout_manager.jsonl, main.jsonl (miles/utils/logging_utils.py configure_logger;
    # miles/utils/audit_utils/process_identity.py to_name). Metrics are
    # {"type": "metric", "rollout_id": R|null, "attempt": .., "metrics": {...}, ...}
    # (miles/utils/tracking_utils/tracking.py log; event_logger/models.py MetricEvent); events
    # logged inside the actor's train() carry rollout_id (megatron_utils/actor.py
    # event_logger_context). Console lines as slime's. Two step axes, as slime's.
    Adapter(
        name="miles",
        step=("rollout_id", "rollout/step"),
        train_step=("train/step",),
        envelope=("metrics",),
        event_type="metric",
        zero_is_unset=frozenset({"train/entropy_loss"}),
        fields=_with_native({
            # miles/backends/training_utils/log_utils.py gathers rollout data as "rollout/<key>";
            # raw_reward: miles/ray/rollout/train_data_conversion.py
            "reward": ("rollout/raw_reward",),
            # miles/backends/training_utils/loss_hub/losses.py: train_rollout_kl, k3 of
            # KL(rollout || train) at the sampled tokens; then the MIS helper's k3_kl
            # (examples/infra_features/train_infer_mismatch_helper/mis.py); then mean |Δ log p|
            # (train_rollout_logprob_abs_diff, same function), a proxy: squared.
            "kl": ("train/train_rollout_kl", "train/mis_k3_kl",
                   "train/train_rollout_logprob_abs_diff^2"),
            # log_utils.py: "entropy" is a per-rollout mean key; losses.py: entropy_loss is
            # new_zeros(()) unless entropy is calculated, so its 0.0 is skipped (zero_is_unset)
            "entropy": ("rollout/entropy", "train/entropy_loss"),
            # miles/ray/rollout/metrics.py _compute_metrics_from_samples: response_len/
            "response_length": ("rollout/response_len/mean", "rollout/response_lengths"),
            "mis_masked_fraction": _MIS_MASKED,
        }),
        description="Miles event files (--save-debug-event-data DIR: actor_cell0_rank0.jsonl) "
                    "or its console lines",
    ),
    # TRL: huggingface/trl@f2cd577, trl/trainer/grpo_trainer.py GRPOTrainer.log → transformers'
    # Trainer.log, which appends {**logs, "step": global_step} to state.log_history, in memory;
    # it is written only at checkpoints, as <output_dir>/checkpoint-N/trainer_state.json
    # (TrainerState.save_to_json: indented JSON). mismatch.integrations.trl writes JSON lines.
    Adapter(
        name="trl",
        step=("step", "global_step"),
        fields=_with_native({
            "reward": ("reward",),
            # sampling/sampling_logp_difference/mean: mean |Δ log p| between the trainer and
            # vLLM's sampled log-probs, a proxy: squared. TRL's "kl" is KL(policy || reference)
            # (beta > 0): policy drift, not the sampler–trainer mismatch, so it is not mapped.
            "kl": ("sampling/sampling_logp_difference/mean^2",),
            "entropy": ("entropy",),
            "response_length": ("completions/mean_length",),
        }),
        description="TRL's trainer_state.json (or a checkpoint dir), or the JSON lines of "
                    "mismatch.integrations.trl.MonitorLogCallback",
    ),
    # prime-rl: PrimeIntellect-ai/prime-rl@559b447. Its file monitor writes
    # {"step": N, "time": ..., **metrics} (src/prime_rl/monitors/file.py FileMonitor.log_metrics).
    Adapter(
        name="prime-rl",
        step=("step",),
        fields=_with_native({
            # src/prime_rl/orchestrator/metrics.py TraceMetrics.to_dict under
            # EpisodeMetrics.to_wandb(prefix="train/agg"): one reward series per agent
            # (<agent>/reward/mean) → their mean; `*` is one segment, so an agent's rubric
            # functions (<agent>/rewards/<fn>/mean) and custom metrics (<agent>/metrics/...) are
            # not averaged in. Then older releases' reward/mean.
            "reward": ("train/agg/effective/*/reward/mean", "reward/mean"),
            # src/prime_rl/trainer/rl/train.py: mismatch_kl/all (k3 of inference vs trainer
            # log-probs, trainer/rl/loss.py compute_importance_ratio_and_mismatch_kl), with
            # /mean from trainer/utils.py compute_stats
            "kl": ("mismatch_kl/all/mean",),
            # src/prime_rl/trainer/rl/train.py: entropy/all
            "entropy": ("entropy/all/mean",),
            # src/prime_rl/trainer/rl/loss.py: is_masked, share of loss tokens masked
            "mis_masked_fraction": ("is_masked/mean",),
            # orchestrator/metrics.py EpisodeMetrics.to_wandb: output tokens per episode
            "response_length": ("train/agg/effective/num_output_tokens/mean",),
        }),
        description="prime-rl file monitor lines {step, time, ...}",
    ),
)}
