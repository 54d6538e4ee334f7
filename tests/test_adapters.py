"""The monitor's framework adapters against what each framework's logging code writes.

Every fixture below is built from the writer it cites (repository @ commit: path, function):
the line layout, the keys and the step fields are the ones that code emits.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from mismatch.cli.monitor import monitor_command
from mismatch.probes.monitor import follow_state
from mismatch.probes.monitor.formats import ADAPTERS, RecordReader, get_adapter


def _run(*args: str):
    app = typer.Typer()
    app.command("monitor")(monitor_command)
    app.callback()(lambda: None)
    return CliRunner().invoke(app, ["monitor", *args])


def _alerts(res) -> list[dict]:
    return [x for x in map(json.loads, res.stdout.splitlines()) if "signal" in x]


def _summary(res) -> dict:
    return json.loads(res.stdout.splitlines()[-1])["summary"]


# -- slime: console lines ---------------------------------------------------------------------
# THUDM/slime@624b824: slime/observability/logging_utils.py configure_logger (line layout);
# slime/backends/megatron_utils/model.py train_one_step: logger.info(f"{role_tag}step
# {accumulated_step_id}: {log_dict}") with train/<loss key> keys and train/step =
# rollout_id * num_steps_per_rollout + step_id; slime/observability/train_metric_utils.py
# gather_log_data: logger.info(f"{metric_name} {rollout_id}: {reduced_log_dict}") with
# rollout/<key>; slime/observability/rollout_metrics.py log_rollout_data: "perf N" with
# rollout/response_len/... and perf/...; log_eval_rollout_data: "eval N".


def _slime_console(n_rollouts: int, per_rollout: int, abs_diff, reward=0.5) -> list[str]:
    lines = []
    for r in range(n_rollouts):
        t = f"[2026-08-21 10:{r // 60:02d}:{r % 60:02d}]"
        lines.append(f"{t} rollout_metrics.py:268 - perf {r}: "
                     f"{ {'rollout/response_len/mean': 310.0, 'perf/rollout_time': 41.2} }")
        lines.append(f"{t} train_metric_utils.py:135 - rollout {r}: "
                     f"{ {'rollout/raw_reward': reward, 'rollout/rewards': 0.0, 'rollout/entropy': 0.41} }")
        for i in range(per_rollout):
            s = r * per_rollout + i
            lines.append(f"{t} model.py:918 - step {s}: " + repr({
                "train/loss": -0.01, "train/pg_loss": -0.01, "train/entropy_loss": 0.4,
                "train/pg_clipfrac": 0.002, "train/ppo_kl": 1e-4,
                "train/train_rollout_logprob_abs_diff": abs_diff(r), "train/grad_norm": 0.3,
                "train/lr-pg_0": 1e-6, "train/global_batch_size": 256, "train/step": s}))
        if r % 10 == 9:
            lines.append(f"{t} rollout_metrics.py:247 - eval {r}: {{'eval/gsm8k': 0.7}}")
    return lines


def test_slime_console_lines_are_read_on_the_rollout_axis():
    reader = RecordReader(get_adapter("slime"))
    lines = _slime_console(3, 4, lambda r: 0.01)
    records = [rec for rec in map(reader.feed, lines) if rec is not None]
    assert records[0] == {"step": 0, "response_length": 310.0}  # perf 0
    assert records[1] == {"step": 0, "reward": 0.5, "entropy": 0.41}  # rollout 0
    train = [r for r in records if "kl" in r]
    assert [r["step"] for r in train] == [0] * 4 + [1] * 4 + [2] * 4
    assert train[0]["kl"] == pytest.approx(1e-4) and train[0]["entropy"] == 0.4  # squared proxy
    assert reader.tally["console_lines"] == len(lines) and reader.tally["malformed"] == 0
    notes = reader.notices()
    assert any(n.startswith("slime logs two step axes (train/step = rollout × 4 + i)")
               and "train step 11 → step 2" in n for n in notes)
    assert any("squared" in n for n in notes)
    # eval and critic lines are other events; nan / inf (repr's bare names) parse
    assert reader.feed("[t] model.py:918 - critic-step 3: {'train/critic-loss': 1.0}") is None
    assert reader.feed("[t] rollout_metrics.py:247 - eval 9: {'eval/gsm8k': 0.7}") is None
    assert reader.tally["other_events"] == 2  # the critic and the eval line above
    nan = reader.feed("[t] model.py:918 - step 12: {'train/mis_k3_kl': nan, 'train/step': 12}")
    assert nan["step"] == 3 and math.isnan(nan["kl"])


def test_slime_console_proxy_growing_1_87x_is_a_kl_warning_on_the_rollout_axis(tmp_path):
    # the log-ratio's scale grows 1.87× at rollout 20: mean |Δ log p| 1.87×, the KL 3.5×; a KL
    # growth alone (no reward fall, no format errors) is a warning below 10× (docs/monitor-rules.md)
    path = tmp_path / "slime.log"
    path.write_text("\n".join(_slime_console(30, 2, lambda r: 0.01 if r < 20 else 0.0187)) + "\n")
    res = _run(str(path), "--format", "slime", "--json")
    assert res.exit_code == 0, res.output
    assert _run(str(path), "--format", "slime", "--fail-on", "warning").exit_code == 1
    first = _alerts(res)[0]
    assert (first["signal"], first["severity"], first["step"]) == ("kl", "warning", 20)
    assert first["value"] / first["baseline"] == pytest.approx(1.87 ** 2)
    assert _summary(res)["notes"] == {"kl_squared": 60, "zero_unset": 0, "train_steps_moved": 59}
    assert "slime logs two step axes" in res.stderr
    # judged unsquared (--map), the same proxy stays under the 2× warning: the under-reaction
    raw = _run(str(path), "--format", "slime", "--json",
               "--map", "kl=train/train_rollout_logprob_abs_diff")
    assert raw.exit_code == 0 and _alerts(raw) == []


def test_slime_tis_clipfrac_is_masked_only_when_mapped():
    # loss.py vanilla_tis_function: tis_clipfrac = share of *clipped* weights (still trained on)
    line = {"train/step": 5, "train/tis_clipfrac": 0.2, "train/mis_k3_kl": 1e-3}
    assert "mis_masked_fraction" not in ADAPTERS["slime"].record(line)
    assert "mis_masked_fraction" not in ADAPTERS["miles"].record(line)
    # mis.py mask(): the masked share in halves, prefixed mis_tis_ (tis_mode=mask)
    halves = {"train/step": 5, "train/mis_tis_mask_fraction_low": 0.01,
              "train/mis_tis_mask_fraction_high": 0.02}
    assert ADAPTERS["slime"].record(halves)["mis_masked_fraction"] == pytest.approx(0.03)
    # icepop_function zeroes them: under IcePop the user maps it
    icepop = get_adapter("slime", ["mis_masked_fraction=train/tis_clipfrac"])
    assert icepop.record(line)["mis_masked_fraction"] == 0.2


# -- Miles: event files -----------------------------------------------------------------------
# radixark/miles@31f1ca9: miles/utils/audit_utils/event_logger/logger.py EventLogger.log
# (event.model_dump_json() per line, context fields merged), models.py MetricEvent,
# process_identity.py TrainProcessIdentity; miles/utils/tracking_utils/tracking.py log;
# miles/backends/megatron_utils/actor.py train's event_logger_context(rollout_id, attempt);
# miles/backends/training_utils/log_utils.py log_train_step (train/step) and gather_log_data
# (rollout/<key>, rollout/step); loss_hub/losses.py: train_rollout_kl, entropy_loss = 0.0.


def _miles_event(rollout_id, metrics, component="actor", type_="metric"):
    source = ({"component": component, "cell_index": 0, "rank_within_cell": 0}
              if component == "actor" else {"component": component})
    event = {"timestamp": "2026-08-21T10:00:00Z", "source": source, "type": type_,
             "rollout_id": rollout_id}
    if type_ == "metric":
        event |= {"attempt": 0, "metrics": metrics}
    return json.dumps(event)


def test_miles_events_read_the_true_kl_one_axis_and_skip_a_constant_zero_entropy(tmp_path):
    lines = []
    for r in range(20):
        lines.append(_miles_event(r, {"rollout/raw_reward": 0.5, "rollout/step": r,
                                      "rollout/response_lengths": 300.0}))
        for i in range(2):
            kl = 1e-3 if r < 12 else 4e-3
            lines.append(_miles_event(r, {
                "train/loss": 0.0, "train/pg_loss": 0.0, "train/entropy_loss": 0.0,
                "train/pg_clipfrac": 0.0, "train/ppo_kl": 0.0, "train/ess_ratio": 1.0,
                "train/train_rollout_logprob_abs_diff": 0.05,  # flat: a proxy would see nothing
                "train/train_rollout_kl": kl, "train/grad_norm": 0.2,
                "train/step": 2 * r + i}))
        lines.append(_miles_event(r, {}, type_="train_group_step_end"))
    lines.append(_miles_event(None, {"perf/rollout_time": 40.0, "rollout/step": 20,
                                     "rollout/response_len/mean": 320.0}, "rollout_manager"))
    reader = RecordReader(get_adapter("miles"))
    records = [rec for rec in map(reader.feed, lines) if rec is not None]
    assert records[1] == {"step": 0, "kl": 1e-3}  # train_rollout_kl, no entropy from 0.0
    assert records[-1] == {"step": 20, "response_length": 320.0}
    assert reader.tally["other_events"] == 20
    assert reader.notes["zero_unset"] == 40 and reader.notes["kl_squared"] == 0
    path = tmp_path / "actor_cell0_rank0.jsonl"
    path.write_text("\n".join(lines) + "\n")
    res = _run(str(path), "--format", "miles", "--json", "--fail-on", "warning")
    assert res.exit_code == 1
    first = _alerts(res)[0]
    assert (first["signal"], first["severity"], first["step"]) == ("kl", "warning", 12)
    assert "entropy: 40 values of 0.0 skipped" in res.stderr


# -- prime-rl ---------------------------------------------------------------------------------
# PrimeIntellect-ai/prime-rl@559b447: src/prime_rl/monitors/file.py FileMonitor.log_metrics
# ({"step", "time", **metrics}); src/prime_rl/orchestrator/metrics.py TraceMetrics.to_dict:
# <agent>/reward/mean, and <agent>/rewards/<rubric fn>/mean, <agent>/metrics/<name>/mean.


def test_prime_rl_star_is_one_segment():
    line = {"step": 4, "time": 1.7e9, "train/agg/effective/solver/reward/mean": 0.6,
            "train/agg/effective/solver/rewards/reward/mean": 0.0,
            "train/agg/effective/solver/metrics/reward/mean": 0.0,
            "mismatch_kl/all/mean": 2e-3}
    assert ADAPTERS["prime-rl"].record(line) == {"step": 4, "reward": 0.6, "kl": 2e-3}
    two = {"step": 4, "train/agg/effective/a/reward/mean": 0.2,
           "train/agg/effective/b/reward/mean": 0.4}
    assert ADAPTERS["prime-rl"].record(two)["reward"] == pytest.approx(0.3)


# -- verl -------------------------------------------------------------------------------------
# volcengine/verl@b178a3c: verl/utils/tracking.py FileLogger.log ({"step", "data": {...}}).


def test_verl_reads_k3_then_the_squared_probs_diff_and_never_ppo_kl():
    k3 = {"step": 7, "data": {"critic/score/mean": 0.4, "critic/rewards/mean": 0.3,
                              "rollout_corr/k3_kl": 2e-3, "actor/ppo_kl": -9.0,
                              "training/rollout_probs_diff_mean": 0.03}}
    assert ADAPTERS["verl"].record(k3) == {"step": 7, "reward": 0.4, "kl": 2e-3}
    del k3["data"]["rollout_corr/k3_kl"]
    assert ADAPTERS["verl"].record(k3)["kl"] == pytest.approx(9e-4)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    help_text = _run("--help").stdout
    assert "ppo_kl" not in help_text and "kl=actor/ppo_kl" not in readme


# -- TRL --------------------------------------------------------------------------------------
# huggingface/trl@f2cd577: trl/trainer/grpo_trainer.py GRPOTrainer.log (metric names) →
# transformers Trainer.log ({**logs, "step": global_step} into state.log_history); the file is
# written by transformers' own TrainerState.save_to_json, called here.


def _trl_log(step: int, logp_diff: float) -> dict:
    return {"loss": 0.01, "grad_norm": 0.3, "learning_rate": 1e-6, "num_tokens": 1e5 * step,
            "completions/mean_length": 210.0, "completions/clipped_ratio": 0.0,
            "rewards/accuracy/mean": 0.5, "reward": 0.5, "reward_std": 0.3, "kl": 0.0,
            "entropy": 0.4, "sampling/sampling_logp_difference/mean": logp_diff,
            "sampling/importance_sampling_ratio/mean": 1.0, "clip_ratio/region_mean": 0.0,
            "epoch": step / 100, "step": step}


def _proxy_run(n=40, onset=20, grow=1.87, seed=0) -> tuple[list[float], list[float]]:
    """Per step: mean |Δ log p| (the proxy) and k3 (the KL) of Gaussian log-ratios whose scale
    grows `grow`× at `onset`."""
    rng = np.random.default_rng(seed)
    proxy, k3 = [], []
    for step in range(n):
        d = rng.normal(0.0, 0.02 * (grow if step >= onset else 1.0), 200_000)
        proxy.append(float(np.abs(d).mean()))
        k3.append(float(np.mean(np.exp(d) - d - 1)))
    return proxy, k3


def test_trl_proxy_whose_log_ratio_scale_grows_1_87x_raises_the_kl_alert(tmp_path):
    from transformers import TrainerState

    proxy, k3 = _proxy_run()
    assert np.mean(k3[20:]) / np.mean(k3[:20]) == pytest.approx(3.5, rel=0.03)
    assert np.mean(proxy[20:]) / np.mean(proxy[:20]) == pytest.approx(1.87, rel=0.01)
    state = TrainerState(global_step=40, log_history=[_trl_log(s + 1, p)
                                                      for s, p in enumerate(proxy)])
    ckpt = tmp_path / "out" / "checkpoint-40"
    ckpt.mkdir(parents=True)
    state.save_to_json(str(ckpt / "trainer_state.json"))
    for target in (ckpt / "trainer_state.json", ckpt, tmp_path / "out"):
        res = _run(str(target), "--format", "trl", "--json", "--fail-on", "warning")
        assert res.exit_code == 1, res.output
        first = _alerts(res)[0]
        assert (first["signal"], first["severity"]) == ("kl", "warning")
        assert 21 <= first["step"] <= 24
        assert _summary(res)["records"] == 40
    empty = tmp_path / "empty"
    empty.mkdir()
    res = _run(str(empty), "--format", "trl")
    assert res.exit_code == 2 and "no trainer_state.json" in res.output


def test_trl_state_file_is_re_read_when_it_changes(tmp_path):
    from transformers import TrainerState

    out = tmp_path / "out"
    first = out / "checkpoint-10"
    first.mkdir(parents=True)
    TrainerState(global_step=10, log_history=[_trl_log(s, 0.01) for s in range(1, 11)]
                 ).save_to_json(str(first / "trainer_state.json"))

    def later():
        time.sleep(0.3)
        second = out / "checkpoint-20"
        second.mkdir()
        TrainerState(global_step=20, log_history=[_trl_log(s, 0.01) for s in range(1, 21)]
                     ).save_to_json(str(second / "trainer_state.json"))

    writer = threading.Thread(target=later)
    writer.start()
    got = list(follow_state(out, follow=True, poll_interval=0.05, max_idle=1.0))
    writer.join()
    assert [e["step"] for e in got] == list(range(1, 21))  # each entry once


def test_trl_callback_writes_one_flushed_line_per_log_that_the_monitor_follows(tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from mismatch.integrations.trl import MonitorLogCallback

    path = tmp_path / "metrics.jsonl"
    callback = MonitorLogCallback(path)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[])
    state, control = TrainerState(), TrainerControl()
    proxy, _ = _proxy_run()
    for step, p in enumerate(proxy, start=1):
        state.global_step = step
        logs = {k: v for k, v in _trl_log(step, p).items() if k != "step"}
        callback.on_log(args, state, control, logs=logs)
        if step == 1:  # flushed: readable before the run ends
            assert json.loads(path.read_text())["step"] == 1
    other = TrainerState(is_world_process_zero=False, global_step=99)
    callback.on_log(args, other, control, logs={"reward": 0.0})
    callback.on_train_end(args, state, control)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 41))
    assert lines[0]["sampling/sampling_logp_difference/mean"] == proxy[0]
    res = _run(str(path), "--format", "trl", "--follow", "--max-idle", "0", "--json",
               "--fail-on", "warning")
    assert res.exit_code == 1 and _alerts(res)[0]["signal"] == "kl"


def test_mismatch_imports_without_transformers():
    import subprocess
    import sys

    probe = subprocess.run([sys.executable, "-c", "import sys, mismatch, mismatch.integrations.trl,"
                            " mismatch.cli.monitor; print('transformers' in sys.modules)"],
                           capture_output=True, text=True)
    assert probe.stdout.strip() == "False", probe.stderr


# -- nothing readable -------------------------------------------------------------------------


def test_a_file_with_nothing_readable_is_exit_2_with_what_was_expected(tmp_path):
    junk = tmp_path / "console.log"
    junk.write_text("".join(f"[2026-08-21 10:00:00] rollout.py:{i} - Timer generate end\n"
                            for i in range(120)))
    res = _run(str(junk), "--format", "slime")
    assert res.exit_code == 2
    assert ("read 120 lines, none is a JSON object or a console metrics line; --format slime "
            "expects slime's console lines") in res.output
    state = tmp_path / "trainer_state.json"
    from transformers import TrainerState

    TrainerState(global_step=2, log_history=[_trl_log(1, 0.01), _trl_log(2, 0.01)]
                 ).save_to_json(str(state))
    res = _run(str(state), "--format", "verl")
    assert res.exit_code == 2 and "none is a JSON object; --format verl expects" in res.output
    fields = tmp_path / "other.jsonl"
    fields.write_text('{"step": 1, "loss": 0.3}\n' * 5)
    res = _run(str(fields), "--format", "prime-rl")
    assert res.exit_code == 2 and "read 5 objects, none has a field --format prime-rl reads" \
        in res.output
    not_state = tmp_path / "config.json"
    not_state.write_text('{\n  "lr": 1e-6\n}\n')
    res = _run(str(not_state), "--format", "trl")
    assert res.exit_code == 2 and "not a trainer_state.json" in res.output
    assert _run(str(tmp_path / "blank.jsonl"), "--format", "slime").exit_code == 2  # no file
    (tmp_path / "blank.jsonl").write_text("")
    blank = _run(str(tmp_path / "blank.jsonl"), "--format", "slime")  # a gate never passes on
    assert blank.exit_code == 2 and "empty" in blank.output                 # nothing
