"""The staleness probe: generated AdamW steps on the embedded model (the train layer's ladder, as
`mismatch probe --sources staleness` wires it), checkpoint directories of a tiny random
Qwen3-MoE, and the one-line errors for bad checkpoint directories and options."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model

from mismatch.probes import staleness
from mismatch.probes.config import ProbeConfig
from mismatch.probes.context import ProbeContext
from mismatch.probes.errors import ProbeError
from mismatch.probes.staleness import StalenessConfig
from mismatch.train.staleness_ladder import PolicyGradientLadder
from mismatch.zoo import load_model

STALENESS_FIELDS = ("max_lag", "lr", "checkpoints")


def _context(progress=None, **fields) -> ProbeContext:
    own = {k: fields.pop(f"staleness_{k}") for k in STALENESS_FIELDS if f"staleness_{k}" in fields}
    return ProbeContext(ProbeConfig(gpu="b200", dtype="bf16", sources=("staleness",),
                                    staleness=StalenessConfig(**own), **fields),
                        progress=progress)


def _run(ctx: ProbeContext):
    return staleness.run(ctx, ladder=PolicyGradientLadder)


def _kl(result, key: str = "kl_exact_by_lag") -> dict[int, float]:
    return {int(k): v for k, v in result.extra[key].items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """(model directory with tokenizer, prompt file)."""
    root = tmp_path_factory.mktemp("stale")
    model = build_tiny_model(root / "model", kind="moe", tokenizer=True)
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"the quick brown fox {i}"})
                                 for i in range(4)) + "\n")
    return model, prompts


def _tiny_context(tiny, checkpoints: Path, **fields) -> ProbeContext:
    model, prompts = tiny
    return _context(model=model, prompts=prompts, n_prompts=4, batch_size=4, max_new_tokens=6,
                    staleness_checkpoints=checkpoints, **fields)


def _perturbed(source: Path, dest: Path) -> Path:
    """`source` with every matrix scaled by 1 + 2⁻⁴ (changes each nonzero BF16 element)."""
    model = load_model(source, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(1.0625)
    model.save_pretrained(str(dest))
    return dest


def test_generated_steps_grow_kl_and_lag_zero_is_exact():
    # lr 1e-4 (the default): at 1e-5 a step moves ~5% of the BF16 elements and rounding jitter
    # can reorder the lags (the probe's note says so); 1e-4 gives steady growth to test against
    calls: list[tuple[str, int, int]] = []
    ctx = _context(progress=lambda *a: calls.append(a), n_prompts=16, subset_prompts=16,
                   batch_size=8, max_new_tokens=16, staleness_max_lag=3, staleness_lr=1e-4)
    shared = {n: p.detach().clone() for n, p in ctx.model("bf16").named_parameters()}
    res = _run(ctx)
    kl, k3 = _kl(res), _kl(res, "kl_k3_by_lag")
    assert kl[0] == 0.0 and k3[0] == 0.0
    assert res.parts["lag 0"].abs_logprob_diff_max == 0.0
    assert kl[3] > kl[1] > 0 and k3[1] > 0
    assert res.headline == res.parts["lag 1"]
    assert res.log_ratio.numel() == res.headline.tokens > 0
    x = res.extra
    assert (x["source"], x["steps"], x["lr"]) == ("generated AdamW steps", 3, 1e-4)
    assert len(x["bf16_changed_fraction_by_step"]) == 3
    assert all(0 < f < 1 for f in x["bf16_changed_fraction_by_step"])
    assert len(x["mean_reward_by_step"]) == 3
    assert all(0 <= r <= 1 for r in x["mean_reward_by_step"])
    moved = x["bf16_changed_fraction_vs_trainer_by_lag"]
    assert moved["0"] == 0 and moved["3"] > 0
    assert set(x["tokens_by_lag"]) == {"0", "1", "2", "3"}
    assert json.loads(json.dumps(res.to_json()))["steps"] == 3
    assert "lr 0.0001" in res.notes[0]
    assert calls[-1][0] == "staleness" and calls[-1][1] == calls[-1][2] == 3 + 4 * 2
    after = dict(ctx.model("bf16").named_parameters())
    assert all(torch.equal(after[n], t) for n, t in shared.items())  # shared model untouched


def test_default_learning_rate_moves_the_served_weights():
    ctx = _context(n_prompts=8, subset_prompts=8, max_new_tokens=8, staleness_max_lag=1)
    res = _run(ctx)
    assert res.extra["lr"] == 1e-4
    assert 0 < res.extra["bf16_changed_fraction_by_step"][0] < 0.5
    assert _kl(res)[0] == 0.0 and _kl(res)[1] > 0


def test_identical_checkpoints_give_zero(tiny, tmp_path):
    for name in ("ckpt_a", "ckpt_b"):
        shutil.copytree(tiny[0], tmp_path / name)
    res = _run(_tiny_context(tiny, tmp_path))
    assert res.extra["steps"] == 1 and res.extra["source"] == f"checkpoints: {tmp_path}"
    assert res.extra["lr"] is None and res.extra["mean_reward_by_step"] == []
    assert res.extra["bf16_changed_fraction_by_step"] == [0.0]
    assert _kl(res) == {0: 0.0, 1: 0.0} and _kl(res, "kl_k3_by_lag") == {0: 0.0, 1: 0.0}
    assert res.headline.tokens > 0


def test_different_checkpoints_in_natural_order(tiny, tmp_path):
    # natural order step_2 (A), step_9 (B), step_10 (A): the trainer is A, lag 1 is B, lag 2 is
    # A again (0); sorted as text (step_10, step_2, step_9) the trainer would be B
    shutil.copytree(tiny[0], tmp_path / "step_2")
    _perturbed(tiny[0], tmp_path / "step_9")
    shutil.copytree(tiny[0], tmp_path / "step_10")
    res = _run(_tiny_context(tiny, tmp_path))
    kl = _kl(res)
    assert res.extra["steps"] == 2
    assert kl[0] == 0.0 and kl[1] > 1e-6 and kl[2] == 0.0
    assert _kl(res, "kl_k3_by_lag")[1] > 0
    first, second = res.extra["bf16_changed_fraction_by_step"]
    assert first == second > 0.5
    assert res.extra["bf16_changed_fraction_vs_trainer_by_lag"] == {"0": 0.0, "1": first,
                                                                    "2": 0.0}


def test_max_lag_keeps_the_last_checkpoints(tiny, tmp_path):
    _perturbed(tiny[0], tmp_path / "a")
    shutil.copytree(tiny[0], tmp_path / "b")
    shutil.copytree(tiny[0], tmp_path / "c")
    res = _run(_tiny_context(tiny, tmp_path, staleness_max_lag=1))
    assert res.extra["steps"] == 1 and _kl(res) == {0: 0.0, 1: 0.0}  # "a" is 2 behind: unused


def _check_one_line_error(ctx: ProbeContext, needle: str) -> None:
    with pytest.raises(ProbeError) as err:
        _run(ctx)
    assert "\n" not in str(err.value) and needle in str(err.value), str(err.value)


def test_bad_checkpoint_directories(tiny, tmp_path):
    _check_one_line_error(_tiny_context(tiny, tmp_path / "missing"), "is not a directory")
    (tmp_path / "file").write_text("x")
    _check_one_line_error(_tiny_context(tiny, tmp_path / "file"), "is not a directory")
    one = tmp_path / "one"
    shutil.copytree(tiny[0], one / "only")
    _check_one_line_error(_tiny_context(tiny, one), "need at least 2")
    (tmp_path / "empty").mkdir()
    _check_one_line_error(_tiny_context(tiny, tmp_path / "empty"), "holds 0 checkpoint")

    no_weights = tmp_path / "no_weights"
    shutil.copytree(tiny[0], no_weights / "1")
    (no_weights / "2").mkdir()
    shutil.copy(tiny[0] / "config.json", no_weights / "2")
    _check_one_line_error(_tiny_context(tiny, no_weights), "checkpoint 2 is not loadable")

    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny[0], corrupt / "1")
    shutil.copytree(tiny[0], corrupt / "2")
    (corrupt / "2" / "model.safetensors").write_bytes(b"not a safetensors file")
    _check_one_line_error(_tiny_context(tiny, corrupt), "checkpoint 2 is not loadable")

    mixed = tmp_path / "mixed"
    build_tiny_model(mixed / "1", kind="dense")
    shutil.copytree(tiny[0], mixed / "2")
    _check_one_line_error(_tiny_context(tiny, mixed), "architecture")


def test_generated_steps_need_a_chat_template(tiny):
    _check_one_line_error(_tiny_context(tiny, None), "need a tokenizer with a chat template")


def test_options_are_checked_where_the_probe_owns_them():
    with pytest.raises(ProbeError, match="largest lag must be >= 1, got 0; pass --staleness-max"):
        StalenessConfig(max_lag=0)
    with pytest.raises(ProbeError, match="learning rate must be > 0, got -1.0; pass"):
        StalenessConfig(lr=-1.0)


def test_generated_steps_come_from_the_train_layer():
    """Without checkpoints or a ladder the probes layer has no way to train: a one-line error."""
    ctx = _context(n_prompts=4, subset_prompts=4, max_new_tokens=4, staleness_max_lag=1)
    _check_one_line_error_plain(ctx, "pass --staleness-checkpoints")


def _check_one_line_error_plain(ctx: ProbeContext, needle: str) -> None:
    with pytest.raises(ProbeError) as err:
        staleness.run(ctx)
    assert "\n" not in str(err.value) and needle in str(err.value), str(err.value)


def test_the_ladder_steps_through_train_s_trainer_and_skips_a_non_finite_gradient(monkeypatch):
    """The ladder's steps are `Trainer.step`'s: a step whose gradient is not finite (NaN
    advantages here) leaves the master as it was, as in a training run, and the next one moves
    it again."""
    import mismatch.train.staleness_ladder as ladder_module
    from mismatch.train.trainer import Trainer

    steps: list = []
    real_step, real_adv = Trainer.step, ladder_module.group_advantages
    monkeypatch.setattr(Trainer, "step", lambda self, b: steps.append(real_step(self, b))
                        or steps[-1])
    calls = iter(range(100))
    monkeypatch.setattr(ladder_module, "group_advantages",
                        lambda r: real_adv(r) * (float("nan") if next(calls) == 0 else 1.0))
    ctx = _context(n_prompts=4, subset_prompts=4, max_new_tokens=4, staleness_max_lag=2,
                   staleness_lr=1e-3)
    ladder = PolicyGradientLadder(ctx)
    ladder.prepare(lambda: None)
    assert len(steps) == 2
    assert steps[0].skipped_nonfinite and not steps[1].skipped_nonfinite
    assert ladder.changed_fraction[0] == 0.0 and ladder.changed_fraction[1] > 0
