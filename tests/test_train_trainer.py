"""The trainer and the asynchronous loop on the embedded model: the metrics log is the monitor's
native format, staleness is what the mode says, a kill -9 mid-run resumes with no lost or
duplicated optimizer step (bit-identical weights in --sync mode), bad input exits 2 in one line,
and --stop-on ends the run with a checkpoint."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import grpo_batch

from mismatch.probes.monitor import MonitorConfig
from mismatch.train.batch import Unit, build_batch
from mismatch.train.config import TrainConfig, preset_config
from mismatch.train.loop import run
from mismatch.train.pipeline import Publisher
from mismatch.train.rundir import latest_checkpoint, read_metrics

REQUIRED = ("step", "reward", "kl", "format_error_rate", "mis_masked_fraction", "sc_tail_ratio",
            "entropy", "grad_norm", "staleness_mean", "tokens_per_s", "group_kl")
SMALL = dict(steps=3, prompts_per_step=2, samples_per_prompt=2, max_turns=2, max_new_tokens=40,
             candidates=16, checkpoint_every=1)
CLI = [sys.executable, "-m", "mismatch.cli"]


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, model, tok):
    out = tmp_path_factory.mktemp("async") / "run"
    cfg = preset_config("smoke", **SMALL)
    return out, cfg, run(cfg, out, model=model, tokenizer=tok, log_alerts=False)


def _master(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(latest_checkpoint(out) / "state.pt", weights_only=False)["master"]


def test_metrics_log_has_every_required_field_once_per_step(async_run):
    out, cfg, result = async_run
    recs = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, cfg.steps + 1))
    assert result.steps_done == cfg.steps
    for r in recs:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        assert r["n_episodes"] == cfg.prompts_per_step * cfg.samples_per_prompt
        assert set(r["group_kl"]) == set(r["group_reward"])
        assert 0 <= r["format_error_rate"] <= 1 and r["tokens_per_s"] > 0
        assert r["units_claimed"] >= cfg.prompts_per_step * r["step"]
        # every consumed token's staleness, as counts per lag
        assert sum(r["staleness_tokens"].values()) == r["sampled_tokens"]
        assert max(int(k) for k in r["staleness_tokens"]) == r["staleness_max"]
    from mismatch.zoo import check_model_dir, default_model_dir

    check_model_dir(out / "final")  # a whole model directory: config, weights, tokenizer
    final_config = json.loads((out / "final" / "config.json").read_text())
    assert final_config["architectures"] == \
        json.loads((default_model_dir() / "config.json").read_text())["architectures"]
    assert json.loads((out / "config.json").read_text())["steps"] == cfg.steps
    assert latest_checkpoint(out).name == f"step-{cfg.steps:06d}"


# metrics.jsonl's keys in order (record.StepRecord.to_json), for an arm that centers and replays
# top-p (its head and support masses) on the local backend
RECORD_KEYS = [
    "step", "reward", "kl", "kl_k1", "nonfinite_tokens", "format_error_rate",
    "mis_masked_fraction", "sc_tail_ratio", "entropy", "grad_norm", "staleness_mean",
    "staleness_max", "staleness_tokens",
    "tokens_per_s", "response_length", "group_kl", "group_reward", "group_tokens_per_s",
    "group_tokens", "end_reasons", "loss", "ratio_p05", "ratio_p50", "ratio_p95", "n_episodes",
    "sampled_tokens", "units", "units_claimed", "stale_units_dropped", "step_seconds",
    "trainer_wait_seconds", "train_seconds", "trainer_idle_share", "head_mass_sampler",
    "support_mass_sampler", "support_mass_trainer", "queue_depth", "backend",
    "sampler_restarts", "requeued_units"]


def test_metrics_records_keep_their_keys_in_order(async_run):
    out, cfg, _ = async_run
    assert cfg.correction == "sc+mis+topp"
    for line in (out / "metrics.jsonl").read_text().splitlines():
        assert list(json.loads(line)) == RECORD_KEYS


def test_units_are_each_consumed_once(async_run):
    out, cfg, _ = async_run
    units = [u for r in read_metrics(out / "metrics.jsonl") for u in r["units"]]
    assert len(units) == len(set(units)) == cfg.steps * cfg.prompts_per_step


def test_monitor_cli_reads_the_metrics_log(async_run):
    out, _, _ = async_run
    proc = subprocess.run(CLI + ["monitor", str(out / "metrics.jsonl"), "--format", "native"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr
    assert "monitored 3 records (steps 1–3)" in proc.stdout
    assert "skipped" not in proc.stdout  # every field it reads is usable


def test_report_draws_curves(async_run, tmp_path):
    from mismatch.train.report import write_report

    out, _, _ = async_run
    path = write_report([out, out], tmp_path / "rep")
    text = path.read_text()
    assert "| run |" in text and "curves.png" in text
    assert (tmp_path / "rep" / "curves.png").stat().st_size > 10_000
    assert (tmp_path / "rep" / "group_kl.png").stat().st_size > 5_000 and "group_kl.png" in text
    for name in ("group_tokens_per_s.png", "staleness.png"):
        assert (tmp_path / "rep" / name).stat().st_size > 5_000 and name in text


def test_sync_mode_is_on_policy(tmp_path, model, tok):
    cfg = preset_config("smoke", sync=True, **SMALL)
    run(cfg, tmp_path / "s", model=model, tokenizer=tok, log_alerts=False)
    recs = read_metrics(tmp_path / "s" / "metrics.jsonl")
    assert all(r["staleness_max"] == 0 for r in recs)
    # step s trains on units [s·P, (s+1)·P)
    assert [r["units"] for r in recs] == [[0, 1], [2, 3], [4, 5]]


def test_forced_staleness_is_exact(tmp_path, model, tok):
    cfg = preset_config("smoke", staleness=2, **dict(SMALL, steps=4))
    run(cfg, tmp_path / "f", model=model, tokenizer=tok, log_alerts=False)
    recs = read_metrics(tmp_path / "f" / "metrics.jsonl")
    # step s (0-based) trains on version max(0, s − 2): every token of it has that lag
    assert [list(r["staleness_tokens"]) for r in recs] == [["0"], ["1"], ["2"], ["2"]]
    assert [r["units"] for r in recs] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_the_newest_checkpoints_are_kept_or_every_one(async_run, tmp_path, model, tok):
    names = lambda out: sorted(p.name for p in (out / "checkpoints").iterdir())  # noqa: E731
    assert names(async_run[0]) == ["step-000002", "step-000003"]  # the default: newest 2
    cfg = preset_config("smoke", keep_checkpoints=0, **SMALL)
    run(cfg, tmp_path / "all", model=model, tokenizer=tok, log_alerts=False)
    assert names(tmp_path / "all") == ["step-000001", "step-000002", "step-000003"]
    with pytest.raises(ValueError, match="keep-checkpoints"):
        TrainConfig.flat(keep_checkpoints=-1)


def test_bounded_staleness_is_respected(tmp_path, model, tok):
    cfg = preset_config("smoke", max_staleness=1, workers=2, **SMALL)
    run(cfg, tmp_path / "b", model=model, tokenizer=tok, log_alerts=False)
    recs = read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert all(r["staleness_max"] <= 1 for r in recs)


def test_publisher_is_monotonic():
    pub = Publisher(0, {})
    pub.publish(1, {"w": torch.ones(1)})
    assert pub.latest()[0] == 1
    with pytest.raises(RuntimeError, match="monotonic"):
        pub.publish(1, {})
    lagged = Publisher(0, {"v": torch.zeros(1)}, keep=2)
    for v in range(1, 5):
        lagged.publish(v, {"v": torch.full((1,), float(v))})
        want = max(0, v - 2)
        got, weights = lagged.latest(2)
        assert got == want and weights["v"].item() == want
    assert sorted(lagged.older()) == [2, 3]  # what a checkpoint saves to resume the lag


def test_batch_places_candidates_and_advantages(async_run, model, tok):
    from mismatch.train.fleet import fleet
    from mismatch.train.rollout import run_episodes
    from mismatch.train.batch import task_of

    group = fleet("mixed")[3]
    eps = run_episodes(model, tok, [task_of(0, 0)] * 2 + [task_of(1, 0)] * 2, group, version=2,
                       max_turns=2, max_new_tokens=24, top_k_candidates=8, seed=1)
    eps[0].reward, eps[1].reward, eps[2].reward, eps[3].reward = 1.0, 0.0, 1.0, 1.0
    units = [Unit(index=0, group=group.name, version=2, episodes=eps[:2], seconds=0.0),
             Unit(index=1, group=group.name, version=2, episodes=eps[2:], seconds=0.0)]
    b = build_batch(units, step=5, pad_id=0)
    assert b.advantages.tolist() == [0.5, -0.5, 0.0, 0.0]
    for i, ep in enumerate(eps):
        pos = ep.sampled_positions
        assert b.mask[i].nonzero()[:, 0].tolist() == pos
        assert b.cand_ids[i, pos].tolist() == ep.candidate_ids.tolist()
        assert torch.equal(b.sampler_logp[i, pos], torch.tensor(ep.sampler_logprobs)[pos])
        assert torch.all(b.staleness[i, pos] == 3)
        assert torch.isinf(b.cand_sampler_logp[i, ~b.mask[i]]).all()


def test_stop_on_critical_ends_with_a_checkpoint(tmp_path, model, tok):
    # a KL baseline far below the run's KL, and no probe floor taken from the first step (which
    # would judge the growth only above 5× that step's KL): the growth rule goes critical
    mon = MonitorConfig(baselines={"kl": 1e-12}, probe_from_first_step=False)
    cfg = preset_config("smoke", **dict(SMALL, steps=6, checkpoint_every=10))
    res = run(cfg, tmp_path / "stop", model=model, tokenizer=tok, log_alerts=False,
              stop_on="critical", monitor_config=mon)
    assert res.stopped and "critical" in res.stopped
    assert res.steps_done < 6
    assert latest_checkpoint(tmp_path / "stop").name == f"step-{res.steps_done:06d}"
    alerts = read_metrics(tmp_path / "stop" / "alerts.jsonl")
    assert any(a["severity"] == "critical" and a["signal"] == "kl" for a in alerts)


def _cli(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=300, **kw)


def _kill_mid_run(args: list[str], out: Path, after_step: int) -> None:
    """Start `mismatch train`, SIGKILL it once metrics.jsonl holds `after_step` steps."""
    proc = subprocess.Popen(CLI + args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            recs = read_metrics(out / "metrics.jsonl")
            if recs and recs[-1]["step"] >= after_step:
                break
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.05)
        else:
            pytest.fail("the run never reached the kill point")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("mode", ["sync", "stale", "async"])
def test_kill_9_and_resume(tmp_path, mode):
    extra = {"sync": ["--sync"], "stale": ["--staleness", "2"], "async": []}[mode]
    args = ["train", "--preset", "smoke", "--steps", "5", "--checkpoint-every", "2", "--quiet",
            "--eval-tasks", "0", "--n-prompts", "2", "--samples", "4"] + extra
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    _kill_mid_run(args + ["--out", str(killed)], killed, after_step=3)
    assert read_metrics(killed / "metrics.jsonl")[-1]["step"] >= 3
    proc = _cli(args + ["--out", str(killed), "--resume"])
    assert proc.returncode == 0, proc.stderr
    assert "resuming" in proc.stderr and "discarded and regenerated" in proc.stderr
    steps = [r["step"] for r in read_metrics(killed / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5]  # no gap, no duplicate
    state = torch.load(latest_checkpoint(killed) / "state.pt", weights_only=False)
    assert state["step"] == 5
    assert state["optimizer"]["state"][0]["step"].item() == 5  # AdamW's own step count
    if mode != "async":  # deterministic: the resumed run equals an uninterrupted one exactly
        assert _cli(args + ["--out", str(whole)]).returncode == 0
        a, b = _master(killed), _master(whole)
        assert all(torch.equal(a[k], b[k]) for k in a)
        ra, rb = read_metrics(killed / "metrics.jsonl"), read_metrics(whole / "metrics.jsonl")
        assert [r["units"] for r in ra] == [r["units"] for r in rb]
        assert [r["reward"] for r in ra] == [r["reward"] for r in rb]


def test_bad_input_exits_2_in_one_line(tmp_path, async_run):
    out, _, _ = async_run
    cases = [
        (["train", "--preset", "nope", "--out", str(tmp_path / "x")], "unknown preset"),
        (["train", "--preset", "smoke", "--correction", "ppo", "--out", str(tmp_path / "x")],
         "unknown correction"),
        (["train", "--preset", "smoke", "--out", str(out)], "already holds a run"),
        (["train", "--preset", "smoke", "--correction", "grpo", "--out", str(out), "--resume"],
         "started with correction"),
        (["train", "--preset", "smoke", "--out", str(tmp_path / "empty"), "--resume"],
         "no run to resume"),
        (["train", "--preset", "smoke", "--lr", "-1", "--out", str(tmp_path / "x")], "lr"),
        (["report", str(tmp_path / "missing")], "no metrics.jsonl"),
        (["train", "--preset", "smoke", "--model", str(tmp_path / "nomodel"), "--out",
          str(tmp_path / "x")], "nomodel does not exist"),
        (["train", "--preset", "smoke", "--eval-every", "-1", "--out", str(tmp_path / "x")],
         "eval-every must be >= 0"),
    ]
    for args, match in cases:
        proc = _cli(args)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and match in lines[0], (args, proc.stderr)
    assert not (tmp_path / "x").exists()


def test_corrupt_checkpoint_is_one_line_error(tmp_path, async_run):
    import shutil

    out, _, _ = async_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (latest_checkpoint(copy) / "state.pt").write_bytes(b"not a checkpoint")
    (copy / "config.json").unlink()  # reach the checkpoint (the CLI cannot repeat SMALL)
    proc = _cli(["train", "--preset", "smoke", "--out", str(copy), "--resume", "--steps", "4"])
    assert proc.returncode == 2 and "unreadable" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_config_checks():
    with pytest.raises(ValueError, match="samples-per-prompt"):
        TrainConfig(samples_per_prompt=1)
    with pytest.raises(ValueError, match="max-staleness"):
        TrainConfig.flat(max_staleness=-1)
    with pytest.raises(ValueError, match="unknown fleet"):
        TrainConfig(fleet="tpu")
    assert TrainConfig.flat(sync=True).pipeline.staleness_bound == 0
    with pytest.raises(ValueError, match="cannot be combined"):
        TrainConfig.flat(staleness=2, sync=True)
    with pytest.raises(ValueError, match="unknown task kind 'chess'"):
        TrainConfig(tasks="arith,chess")
    with pytest.raises(ValueError, match="eval-every"):
        TrainConfig.flat(eval_every=-2)


def test_task_mix_takes_kinds_in_turn():
    from mismatch.train.batch import task_of

    kinds = ("arith", "table")
    assert [task_of(u, 0, kinds).kind for u in range(4)] == ["arith", "table"] * 2
    assert task_of(5, 0).seed == task_of(5, 0, kinds).seed  # same seeds, kind forced
    assert {task_of(u, 0).kind for u in range(40)} == {"arith", "word", "table", "two_step"}
    assert json.loads(json.dumps(preset_config("mixed").to_json()))["fleet"] == "mixed"


@pytest.mark.parametrize("arm", ["grpo", "sc+mis+topp"])
def test_trainer_steps_raise_rewarded_and_lower_unrewarded_sequences(model, tok, arm):
    from mismatch.train.fleet import fleet
    from mismatch.train.rollout import run_episodes
    from mismatch.train.batch import task_of
    from mismatch.train.trainer import Trainer

    group = fleet("mixed")[5]  # a BF16 group
    eps = run_episodes(model, tok, [task_of(1, 0, ("arith",))] * 4, group, version=0,
                       max_turns=2, max_new_tokens=40, top_k_candidates=32, seed=3,
                       top_p=0.97, top_k=64)
    rewarded = torch.tensor([ep.reward for ep in eps]) > 0  # the environment's rewards
    assert rewarded.any() and not rewarded.all()  # a group with something to learn
    b = build_batch([Unit(index=0, group=group.name, version=0, episodes=eps, seconds=0.0)],
                    step=0, pad_id=0)
    trainer = Trainer(model, TrainConfig.flat(correction=arm, lr=1e-4))

    def seq_logp() -> torch.Tensor:
        with torch.no_grad():
            logits = trainer.compute(input_ids=b.ids, attention_mask=b.attention).logits
            lsm = torch.log_softmax(logits.float()[:, :-1], -1)
            return (lsm.gather(-1, b.ids[:, 1:, None])[..., 0] * b.mask[:, 1:]).sum(-1)

    before = seq_logp()
    for _ in range(3):
        m = trainer.step(b)
    delta = seq_logp() - before
    # shared tokens are pushed both ways; what the advantage guarantees is the contrast: the
    # rewarded sequences gain on the unrewarded ones, and the unrewarded lose on average
    assert m.grad_norm > 0 and delta[rewarded].min() > delta[~rewarded].max(), delta
    assert delta[~rewarded].mean() < 0, delta
    # the master moved and the published BF16 weights are its cast
    master = dict(trainer.master.named_parameters())
    for name, w in trainer.published().items():
        if name in master:
            assert torch.equal(w, master[name].detach().to(torch.bfloat16))


def _old_batch_loss(model, b, arm, attention):
    """The trainer's loss as it was first written: the whole [B, T-1, V] FP32 log-softmax
    gathered at the tokens and candidates, autograd through it, the loss over [B, T]."""
    from mismatch.train.loss import ARMS, policy_loss

    logits = model(input_ids=b.ids, attention_mask=attention, use_cache=False).logits.float()
    lsm = torch.log_softmax(logits[:, :-1], dim=-1)
    logp = torch.cat([torch.zeros(b.ids.shape[0], 1),
                      lsm.gather(-1, b.ids[:, 1:, None])[..., 0]], dim=1)
    cand = torch.cat([torch.zeros(b.cand_ids.shape[0], 1, b.cand_ids.shape[-1]),
                      lsm.gather(-1, b.cand_ids[:, 1:])], dim=1)
    mask = b.mask.clone()
    mask[:, 0] = False
    kwargs = {}
    if ARMS[arm].centered or ARMS[arm].top_p:
        kwargs = dict(cand_logp=cand, cand_sampler_logp=b.cand_sampler_logp)
        if ARMS[arm].top_p:
            kwargs["support_mask"] = b.support
    loss, m = policy_loss(logp, b.sampler_logp, b.advantages, mask, arm=ARMS[arm], **kwargs)
    return loss, m, -(lsm.exp() * lsm).sum(-1).detach(), logp, cand


@pytest.fixture(scope="module")
def padded_batch(model, tok):
    from mismatch.train.fleet import fleet
    from mismatch.train.rollout import run_episodes
    from mismatch.train.batch import task_of

    group = fleet("mixed")[5]
    eps = run_episodes(model, tok, [task_of(2, 0, ("arith",))] * 4, group, version=0,
                       max_turns=2, max_new_tokens=40, top_k_candidates=16, seed=5,
                       top_p=0.97, top_k=64)
    for ep, r in zip(eps, (1.0, 0.0, 1.0, 0.0)):
        ep.reward = r
    b = build_batch([Unit(index=0, group=group.name, version=0, episodes=eps, seconds=0.0)],
                    step=0, pad_id=tok.pad_token_id)
    assert not b.attention.bool().all()  # rows of different lengths: padding to skip
    return b


@pytest.mark.parametrize("arm", ["grpo", "tis", "sc+mis", "sc+mis+topp"])
def test_fused_scores_equal_the_full_log_softmax(model, padded_batch, arm):
    """The chunked scoring of the sampled positions (train.scoring.token_scores) and the loss
    over them alone (arm_loss) give the log-probs and the entropy of the full-vocabulary
    log-softmax of every position bit for bit, its gradients bit for bit but the output head's
    (to BF16 rounding), the loss and its metrics to float rounding (summed in another order);
    the unmasked forward of a right-padded batch gives the masked forward's loss bit for bit
    and its gradients to BF16 rounding (the attention backward's summation order)."""
    from mismatch.train.scoring import token_scores
    from mismatch.train.trainer import batch_loss

    b = padded_batch
    net = copy.deepcopy(model).train()

    def run_grads(fn):
        net.zero_grad(set_to_none=True)
        res = fn()
        res[0].backward()
        return res, {n: p.grad.clone() for n, p in net.named_parameters()}

    (loss, m, ent, logp, cand, mask), grads = run_grads(
        lambda: batch_loss(net, b, arm, share_prefix=False))
    (ref_loss, ref_m, ref_ent, ref_logp, ref_cand), ref = run_grads(
        lambda: _old_batch_loss(net, b, arm, None))
    at = b.mask.clone()
    at[:, 0] = False  # the sampled tokens: scored there, 0 elsewhere
    assert torch.equal(ent[at[:, 1:]], ref_ent[at[:, 1:]]) and not ent[~at[:, 1:]].any()
    assert torch.equal(logp[at], ref_logp[at]) and not logp[~at].any()
    assert torch.equal(cand[at], ref_cand[at]) and not cand[~at].any()
    # the loss over the packed sampled tokens: the same terms summed in another order
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=1e-9)
    # the output head runs on the sampled rows alone: its weight gradient sums them in another
    # order (BF16 rounding of a few elements); every other gradient is the same bit for bit
    assert [k for k in ref if not torch.equal(grads[k], ref[k])] in ([], ["lm_head.weight"])
    head = grads["lm_head.weight"].float() - ref["lm_head.weight"].float()
    assert head.norm() <= 1e-5 * ref["lm_head.weight"].float().norm()
    assert set(m) == set(ref_m)
    for k in ref_m:
        assert torch.allclose(m[k].double(), ref_m[k].double(), rtol=1e-6, atol=1e-12), k
    for k in ("ratio_p05", "ratio_p50", "ratio_p95", "valid_tokens"):
        assert torch.equal(m[k], ref_m[k])
    scores = token_scores(net, b, share_prefix=False)  # the same, unpacked, for other callers
    assert all(torch.equal(x.detach(), y) for x, y in zip(scores, (logp, cand, ent)))
    (masked_loss, *_), masked = run_grads(lambda: _old_batch_loss(net, b, arm, b.attention))
    assert torch.equal(ref_loss, masked_loss)
    for k in masked:
        diff = (grads[k].float() - masked[k].float()).norm()
        assert diff <= 0.02 * masked[k].float().norm() + 1e-6, k


@pytest.fixture(scope="module")
def grouped_batch(model, tok):
    """Two prompts, three episodes each (two GRPO groups), right-padded."""
    return grpo_batch(model, tok, 3)


def _grads_of(net, fn):
    net.zero_grad(set_to_none=True)
    loss, m, ent, logp, cand, mask = fn()
    loss.backward()
    grads = torch.cat([p.grad.double().flatten() for p in net.parameters()
                       if p.grad is not None])
    return loss.detach().double(), logp.double(), cand.double(), mask, grads


def test_a_shared_prompt_is_scored_once_and_gives_the_per_row_forwards_numbers(model,
                                                                              grouped_batch):
    """Each group's prompt runs once (train.scoring.shared_prefix), its rows continue on its
    keys and values. In FP32 that is the per-row forward to FP32 rounding (log-probs, loss and
    every gradient); in BF16 it rounds otherwise, no further from a float64 reference than the
    per-row forward (on a 16 × 8 step's first 4 groups: mean |Δ log π| 4.86e-4 against 4.90e-4,
    gradient 5.00e-2 against 5.02e-2 relative)."""
    from mismatch.engines.hf_attention import eager_experts
    from mismatch.train.scoring import sampled_positions, shared_prefix
    from mismatch.train.trainer import batch_loss

    b = grouped_batch
    p, first, which = shared_prefix(b, sampled_positions(b)[1])
    assert len(first) == 2 and which.tolist() in ([0, 0, 0, 1, 1, 1], [1, 1, 1, 0, 0, 0])
    assert first[which].tolist() == [0, 0, 0, 3, 3, 3]  # each group's prompt, run from its row
    assert p >= 16 and not b.mask[:, :p + 1].any()
    runs = {}
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        net = copy.deepcopy(model).to(dtype).train()
        with eager_experts(net):  # float64 has no grouped GEMM
            runs[dtype] = [_grads_of(net, lambda s=s: batch_loss(net, b, "sc+mis", share_prefix=s))
                           for s in (False, True)]
    (loss, logp, cand, mask, grads), (s_loss, s_logp, s_cand, _, s_grads) = runs[torch.float32]
    assert torch.allclose(s_logp[mask], logp[mask], rtol=0, atol=2e-5)
    assert torch.allclose(s_cand[mask], cand[mask], rtol=0, atol=2e-5)
    assert torch.allclose(s_loss, loss, rtol=1e-5, atol=1e-7)
    assert float((s_grads - grads).norm()) <= 1e-5 * float(grads.norm())
    ref_logp, ref_grads = runs[torch.float64][0][1], runs[torch.float64][0][4]
    assert torch.allclose(runs[torch.float64][1][1], ref_logp, rtol=0, atol=1e-10)
    (_, logp, _, _, grads), (_, s_logp, _, _, s_grads) = runs[torch.bfloat16]
    err = float((logp - ref_logp)[mask].abs().mean())
    s_err = float((s_logp - ref_logp)[mask].abs().mean())
    assert 0 < s_err <= 1.25 * err, (s_err, err)
    g_err = float((grads - ref_grads).norm())
    assert float((s_grads - ref_grads).norm()) <= 1.25 * g_err


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_shared_prompt_on_other_architectures(grouped_batch, arch, monkeypatch):
    """Llama (SmolLM2's) and Gemma 3 (sliding-window layers shorter than the shared prompt,
    final logit soft-capping) take the shared prefix too, to FP32 rounding of the per-row
    forward (small random models, FP32)."""
    from transformers import (Gemma3TextConfig, Gemma3ForCausalLM, LlamaConfig,
                              LlamaForCausalLM)

    from mismatch.train.trainer import batch_loss

    torch.manual_seed(0)
    vocab = int(max(grouped_batch.ids.max(), grouped_batch.cand_ids.max())) + 1
    common = dict(vocab_size=vocab, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)
    if arch == "llama":
        net = LlamaForCausalLM(LlamaConfig(**common))
    else:
        net = Gemma3ForCausalLM(Gemma3TextConfig(**common, sliding_window=32,
                                                 layer_types=["sliding_attention",
                                                              "full_attention"],
                                                 final_logit_softcapping=30.0))
    net.train()
    from mismatch.train import scoring

    on_cache, logits_at = [], scoring._logits_at
    monkeypatch.setattr(scoring, "_logits_at", lambda *a, **kw: on_cache.append(
        "past_key_values" in kw) or logits_at(*a, **kw))
    (loss, logp, cand, mask, grads), (s_loss, s_logp, s_cand, _, s_grads) = [
        _grads_of(net, lambda s=s: batch_loss(net, grouped_batch, "sc+mis", share_prefix=s))
        for s in (False, True)]
    assert on_cache == [False, True]  # the second run continued from the shared prompt's cache
    assert torch.allclose(s_logp[mask], logp[mask], rtol=0, atol=2e-5)
    assert torch.allclose(s_cand[mask], cand[mask], rtol=0, atol=2e-5)
    assert float((s_grads - grads).norm()) <= 1e-5 * float(grads.norm())


def test_rows_that_share_too_little_are_scored_whole(grouped_batch):
    from dataclasses import replace

    from mismatch.train.scoring import sampled_positions, shared_prefix

    b = grouped_batch
    at = sampled_positions(b)[1]
    ids = b.ids.clone()
    ids[:, 3] += torch.arange(6)  # six distinct prefixes: nothing to share
    assert shared_prefix(replace(b, ids=ids), at) is None
    left = replace(b, attention=b.attention.flip(1))  # not right-padded
    assert shared_prefix(left, at) is None
    early = b.mask.clone()
    early[0, 5] = True  # a scored position before the 16th
    assert shared_prefix(b, sampled_positions(replace(b, mask=early))[1]) is None


def test_suffix_buckets_are_the_cheapest_split_of_the_rows_by_length():
    """suffix_buckets partitions the rows into at most 3 runs of the sorted lengths, the
    modelled cost's minimum (checked against every split), and splits off a long outlier."""
    import itertools
    import random

    from mismatch.train import scoring

    p = 100
    outlier = torch.tensor([p + 20] * 40 + [p + 90])
    assert [r.tolist() for r in scoring.suffix_buckets(outlier, p)] == [list(range(40)), [40]]
    assert [r.tolist() for r in scoring.suffix_buckets(torch.full((8,), p + 30), p)] == [
        list(range(8))]
    assert len(scoring.suffix_buckets(outlier, p, max_buckets=1)) == 1

    def cost(need, bucket_rows):
        return sum(len(r) * (int(need[r].max()) - p) * (int(need[r].max())
                                                        + scoring._BUCKET_KEYS_PER_TOKEN)
                   + scoring._BUCKET_FIXED for r in bucket_rows)

    rng = random.Random(0)
    for _ in range(30):
        need = torch.tensor([p + rng.choice([1, 5, 30, 31, 60, 140, 141]) for _ in range(24)])
        got = scoring.suffix_buckets(need, p)
        rows = torch.cat(got).sort().values
        assert torch.equal(rows, torch.arange(24))  # every row once
        assert all(torch.equal(r, r.sort().values) for r in got) and len(got) <= 3
        assert all(int(need[a].max()) < int(need[b].min()) for a, b in zip(got, got[1:]))
        values = need.unique().tolist()
        best = min(
            cost(need, [torch.nonzero((need >= values[i]) & (need <= values[j - 1]))[:, 0]
                        for i, j in zip((0,) + cuts, cuts + (len(values),))])
            for k in range(3) for cuts in itertools.combinations(range(1, len(values)), k))
        assert cost(need, got) == pytest.approx(best)


def test_suffixes_in_buckets_give_the_one_batch_numbers(model, grouped_batch, monkeypatch):
    """Rows run in buckets of their own length (every bucket split taken here) give the numbers
    of one batch of whole-length rows: log-probs, loss and gradients to FP32 rounding in FP32;
    in BF16 no further from a float64 reference."""
    from mismatch.engines.hf_attention import eager_experts
    from mismatch.train import scoring
    from mismatch.train.trainer import batch_loss

    splits, buckets = [], scoring.suffix_buckets

    def spied(need, p, max_buckets=None):
        out = buckets(need, p, max_buckets)
        splits.append([len(r) for r in out])
        return out

    monkeypatch.setattr(scoring, "suffix_buckets", spied)
    b = grouped_batch
    runs = {}
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        net = copy.deepcopy(model).to(dtype).train()
        with eager_experts(net):
            runs[dtype] = []
            for fixed, most in ((0.0, 3), (0.0, 1)):  # buckets wherever lengths differ; one
                monkeypatch.setattr(scoring, "_BUCKET_FIXED", fixed)
                monkeypatch.setattr(scoring, "_MAX_BUCKETS", most)
                runs[dtype].append(_grads_of(net, lambda: batch_loss(net, b, "sc+mis")))
    assert splits[0] != [6] and sum(splits[0]) == 6 and splits[1] == [6], splits
    (s_loss, s_logp, s_cand, mask, s_grads), (loss, logp, cand, _, grads) = runs[torch.float32]
    assert torch.allclose(s_logp[mask], logp[mask], rtol=0, atol=2e-5)
    assert torch.allclose(s_cand[mask], cand[mask], rtol=0, atol=2e-5)
    assert torch.allclose(s_loss, loss, rtol=1e-5, atol=1e-7)
    assert float((s_grads - grads).norm()) <= 1e-5 * float(grads.norm())
    ref_logp, ref_grads = runs[torch.float64][1][1], runs[torch.float64][1][4]
    assert torch.allclose(runs[torch.float64][0][1], ref_logp, rtol=0, atol=1e-10)
    (_, s_logp, _, _, s_grads), (_, logp, _, _, grads) = runs[torch.bfloat16]
    err = float((logp - ref_logp)[mask].abs().mean())
    assert 0 < float((s_logp - ref_logp)[mask].abs().mean()) <= 1.25 * err
    assert float((s_grads - ref_grads).norm()) <= 1.25 * float((grads - ref_grads).norm())


def test_lockstep_trainer_takes_the_idle_samplers_threads(model, monkeypatch):
    from mismatch.train.trainer import PipelineConfig, Trainer, lockstep_threads

    cpus = len(os.sched_getaffinity(0))
    assert lockstep_threads(PipelineConfig()) is None  # pipelined: samplers run while it steps
    assert lockstep_threads(PipelineConfig(sync=True)) == min(cpus, 2)
    assert lockstep_threads(PipelineConfig(staleness=1, workers=3, threads=2)) == max(
        2, min(cpus, 8))
    trainer = Trainer(model, TrainConfig.flat(sync=True, threads=1, workers=1))
    seen = []
    monkeypatch.setattr(trainer, "_step", lambda batch: seen.append(torch.get_num_threads()))
    held = torch.get_num_threads()
    trainer.threads = held + 1
    trainer.step(None)
    assert seen == [held + 1] and torch.get_num_threads() == held  # restored after the step


def test_the_smoke_preset_learns_and_stays_quiet(tmp_path):
    """Its groups' rewards differ, so the policy gets a gradient within 3 steps (the 2 × 4
    preset shared one reward per group: grad_norm 0 every step), and no alert is critical."""
    out = tmp_path / "smoke"
    proc = _cli(["train", "--preset", "smoke", "--sync", "--quiet", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["n_episodes"] == 32 for r in records)
    assert any(r["grad_norm"] > 0 for r in records), [r["grad_norm"] for r in records]
    alerts = [json.loads(x) for x in (out / "alerts.jsonl").read_text().splitlines()] \
        if (out / "alerts.jsonl").exists() else []
    assert [a for a in alerts if a["severity"] == "critical"] == []
