"""The FP32 LM head and the FP32 trainer reference (issue: fidelity against published figures).

The head in FP32 is checked against a float64 reference of the same GEMM; the probe's sides are
checked end to end on a tiny random Qwen3-MoE (`--lm-head`, `--lm-head-side`,
`--trainer-dtype fp32`), and their bad input gives one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mismatch.cli.main import app
from mismatch.engines.head import head_numerics
from mismatch.engines.lanes import lanes_possible
from mismatch.probes.config import ProbeConfig
from mismatch.probes.errors import ProbeError
from mismatch.profiles import ProfileError, resolve, trainer_spec

runner = CliRunner()


class _Tiny(torch.nn.Module):
    """A model whose output embedding is a BF16 linear layer, as a Hugging Face LM's."""

    def __init__(self, v: int = 300, h: int = 64) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(h, v, bias=False, dtype=torch.bfloat16)

    def get_output_embeddings(self):
        return self.lm_head


def test_fp32_head_is_the_float64_gemm_of_the_bf16_values_kept_in_fp32():
    torch.manual_seed(0)
    model = _Tiny()
    x = (torch.randn(32, 64) * 3).to(torch.bfloat16)
    exact = x.double() @ model.lm_head.weight.double().t()  # the float64 reference
    compute = model.lm_head(x)
    with head_numerics(model, "fp32"):
        fp32 = model.lm_head(x)
    assert compute.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    err32 = (fp32.double() - exact).abs().max().item()
    err16 = (compute.double() - exact).abs().max().item()
    # FP32 accumulation of 64 exact BF16 products: within a few FP32 ulps of the logits' size
    assert err32 <= 64 * 2 ** -24 * exact.abs().max().item()
    # the BF16 head's error is its output rounding: up to half a BF16 ulp, ~2^-9 relative
    assert err16 > 100 * err32
    assert err16 <= 2 ** -8 * exact.abs().max().item()
    # the patch is gone after the block, and "compute" patches nothing
    assert "forward" not in vars(model.lm_head)
    with head_numerics(model, "compute"):
        assert "forward" not in vars(model.lm_head)
    with pytest.raises(ValueError, match="LM head dtype"):
        with head_numerics(model, "fp8"):
            pass


def test_fp32_head_passes_the_gradient_to_the_weight():
    torch.manual_seed(1)
    model = _Tiny(v=50, h=16)
    x = torch.randn(4, 16).to(torch.bfloat16)
    g = torch.randn(4, 50)
    with head_numerics(model, "fp32"):
        (model.lm_head(x) * g).sum().backward()
    # d/dW of sum(g * x W^T) = g^T x, in FP32 then stored in the weight's BF16
    want = (g.double().t() @ x.double()).to(torch.bfloat16)
    assert model.lm_head.weight.grad is not None
    assert torch.equal(model.lm_head.weight.grad, want)


def test_specs_carry_the_head_and_fp32_trainer():
    t = trainer_spec("fp32")
    assert (t.compute_dtype, t.kv_cache, t.lm_head) == ("fp32", "fp32", "compute")
    h = trainer_spec("bf16", "fp32")
    assert h.lm_head == "fp32" and "FP32 LM head" in h.kernel_path
    assert h.numerics_key() != trainer_spec("bf16").numerics_key()
    with pytest.raises(ProfileError, match="trainer dtype"):
        trainer_spec("fp8")
    a100 = resolve("a100", "bf16")
    from dataclasses import replace

    assert not lanes_possible([a100, replace(a100, lm_head="fp32")])
    assert lanes_possible([a100, replace(a100, kv_cache="fp8")])


def test_probe_config_checks_the_head_options():
    with pytest.raises(ProbeError, match="--lm-head must"):
        ProbeConfig(gpu="a100", dtype="bf16", lm_head="fp16")
    with pytest.raises(ProbeError, match="--lm-head-side"):
        ProbeConfig(gpu="a100", dtype="bf16", lm_head="fp32", lm_head_side="neither")
    with pytest.raises(ProbeError, match="quick probe"):
        ProbeConfig(gpu="a100", dtype="bf16", trainer_dtype="fp32", sources=("precision",))
    cfg = ProbeConfig(gpu="a100", dtype="bf16", lm_head="fp32", lm_head_side="trainer")
    assert (cfg.head_on("trainer"), cfg.head_on("sampler")) == ("fp32", "compute")


def _probe(moe_dir: Path, prompts: Path, *args: str) -> dict:
    res = runner.invoke(app, ["probe", "--gpu", "a100", "--dtype", "bf16", "--model",
                              str(moe_dir), "--prompts", str(prompts), "--max-new-tokens", "8",
                              "--emulate", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_probe_sides_of_the_head_and_the_fp32_reference(moe_dir, prompt_file):
    def _probe_(*args):
        return _probe(moe_dir, prompt_file, *args)

    base = _probe_()
    assert "lm_head" not in base and base["trainer_dtype"] == "bf16"
    both = _probe_("--lm-head", "fp32")
    assert both["lm_head"] == {"sampler": "fp32", "trainer": "fp32"}
    trainer = _probe_("--lm-head", "fp32", "--lm-head-side", "trainer")
    assert trainer["lm_head"] == {"sampler": "compute", "trainer": "fp32"}
    # the sampler's tokens are the same with a head change on the trainer side only: the
    # comparison moves, the sampled tokens do not
    assert trainer["tokens"] == base["tokens"]
    assert trainer["total"]["kl_exact"] != base["total"]["kl_exact"]
    ref = _probe_("--trainer-dtype", "fp32")
    assert ref["trainer_dtype"] == "fp32" and ref["tokens"] == base["tokens"]
    for s in (base, both, trainer, ref):
        t = s["total"]
        assert t["kl_exact"] >= 0 and t["logprob_diff_rms"] > 0
        assert 0 <= t["ratio_outside_10pct"] <= 1


def test_fp32_reference_columns(moe_dir, prompt_file, tmp_path):
    """--fp32-reference: the sampler and the trainer each against an FP32 forward of the same
    tokens, in results.json's `references` and as two more report columns; with an FP32 trainer
    the trainer's column is exactly 0."""
    s = _probe(moe_dir, prompt_file, "--fp32-reference")
    refs = s["references"]
    assert set(refs) == {"sampler vs fp32", "trainer vs fp32"}
    assert refs["sampler vs fp32"]["k_estimators_valid"] is True
    assert refs["trainer vs fp32"]["k_estimators_valid"] is False  # the trainer drew nothing
    assert refs["sampler vs fp32"]["kl_exact"] > 0 and refs["trainer vs fp32"]["kl_exact"] > 0
    assert "references" not in _probe(moe_dir, prompt_file)
    same = _probe(moe_dir, prompt_file, "--fp32-reference", "--trainer-dtype", "fp32")
    assert same["references"]["trainer vs fp32"]["kl_exact"] == 0
    assert same["references"]["trainer vs fp32"]["abs_logprob_diff_max"] == 0
    assert same["references"]["sampler vs fp32"]["kl_exact"] == pytest.approx(
        same["total"]["kl_exact"], rel=1e-9)  # the same comparison, tallied twice
    from mismatch.app.report import format_table

    header = format_table(s).splitlines()[0]
    assert "sampler vs fp32" in header and "trainer vs fp32" in header


@pytest.mark.parametrize("args, says", [
    (["--fp32-reference", "--ladder"], "--fp32-reference is a column of the quick probe"),
    (["--lm-head", "fp16"], "--lm-head must be compute or fp32"),
    (["--lm-head", "fp32", "--lm-head-side", "nowhere"], "--lm-head-side"),
    (["--trainer-dtype", "fp8"], "trainer dtype"),
    (["--trainer-dtype", "fp32", "--sources", "precision"], "quick probe"),
])
def test_bad_head_options_are_one_line_and_exit_2(args, says):
    res = runner.invoke(app, ["probe", "--gpu", "a100", "--dtype", "bf16", *args])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mismatch: error:") and says in lines[0]


def test_ladder_and_accelerator_rungs_carry_the_sampler_head(moe_dir, prompt_file):
    """With the head in FP32 on the sampler side only, every sampler deployment the source
    probes compare (the ladder's rungs, each GPU and fleet group) runs it too; the trainer side
    keeps its BF16 head. On the trainer's own GPU and precision (b200 bf16) the ladder's
    precision and accelerator rungs still add nothing."""
    from mismatch.probes.accelerator import AcceleratorProbe
    from mismatch.probes.context import ProbeContext
    from mismatch.probes.ladder import LadderProbe

    ctx = ProbeContext(ProbeConfig(gpu="b200", dtype="bf16", model=moe_dir, prompts=prompt_file,
                                   n_prompts=4, max_new_tokens=8, batch_size=4, subset_prompts=4,
                                   lm_head="fp32", lm_head_side="sampler"))
    assert (ctx.spec.lm_head, ctx.trainer.lm_head) == ("fp32", "compute")
    ladder = LadderProbe(ctx)
    for name, (ref, other) in ladder.pairs.items():
        assert ref.spec.lm_head == ("fp32" if name == "accelerator alone" else "compute"), name
        assert other.spec.lm_head == "fp32", name
    ladder.on_batch(ctx.sample_batch(0))
    r = ladder.finish().extra
    kernels, precision, accelerator = r["rungs"]
    assert kernels["kl_exact"] > 0
    assert precision["increment"] == 0 and accelerator["increment"] == 0
    accel = AcceleratorProbe(ctx)
    assert {v.spec.lm_head for v in (*accel.gpus.values(), *accel.fleet.values())} == {"fp32"}


def test_training_with_an_fp32_head(tmp_path, model, tok):
    """`mismatch train --lm-head fp32`: every sampler group and the trainer run the head in FP32;
    the head's weight gets its gradient through the upcast (it moves), the trainer's log-probs
    differ from the BF16 head's, and a short run completes with the head in its config."""
    from mismatch.train.batch import Unit, build_batch, task_of
    from mismatch.train.config import TrainConfig, preset_config
    from mismatch.train.fleet import run_fleet
    from mismatch.train.loop import run
    from mismatch.train.rollout import run_episodes
    from mismatch.train.trainer import Trainer, batch_loss

    cfg = TrainConfig.flat(correction="grpo", lr=1e-3, lm_head="fp32", fleet="mixed")
    groups = run_fleet(cfg)
    assert groups and all(g.spec.lm_head == "fp32" for g in groups)
    assert all(g.spec.lm_head == "compute" for g in run_fleet(TrainConfig()))
    group = groups[5]  # a BF16 group (as test_train_trainer's learning test)
    eps = run_episodes(model, tok, [task_of(1, 0, ("arith",))] * 4, group, version=0,
                       max_turns=2, max_new_tokens=40, top_k_candidates=32, seed=3,
                       top_p=0.97, top_k=64)
    rewards = torch.tensor([ep.reward for ep in eps])
    assert bool((rewards != rewards[0]).any())  # a group with an advantage to learn from
    b = build_batch([Unit(index=0, group=group.name, version=0, episodes=eps, seconds=0.0)],
                    step=0, pad_id=0)
    trainer = Trainer(model, cfg)
    head = trainer.compute.get_output_embeddings()
    with torch.no_grad():
        _, _, _, lp_bf16, _, mask = batch_loss(trainer.compute, b, "grpo")
        with head_numerics(trainer.compute, "fp32"):
            _, _, _, lp_fp32, _, _ = batch_loss(trainer.compute, b, "grpo")
    assert not torch.equal(lp_bf16[mask], lp_fp32[mask])
    assert (lp_bf16[mask] - lp_fp32[mask]).abs().max() < 0.1  # a rounding, not a change
    before = head.weight.detach().clone()
    m = trainer.step(b)
    assert m.grad_norm > 0 and not torch.equal(head.weight.detach(), before)
    assert "forward" not in vars(head)  # the step's patch is gone
    out = tmp_path / "run"
    small = dict(steps=2, prompts_per_step=2, samples_per_prompt=2, max_turns=2,
                 max_new_tokens=24, candidates=16, checkpoint_every=1, eval_tasks=0)
    run(preset_config("smoke", lm_head="fp32", **small), out, model=model, tokenizer=tok,
        log_alerts=False)
    assert json.loads((out / "config.json").read_text())["lm_head"] == "fp32"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


def test_train_refuses_an_unknown_head(tmp_path):
    res = runner.invoke(app, ["train", "--preset", "smoke", "--lm-head", "fp8", "--out",
                              str(tmp_path / "x")])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "--lm-head must be compute or fp32" in lines[0]


def test_training_with_an_fp32_trainer(tmp_path, model, tok):
    """`mismatch train --trainer-dtype fp32`: the trainer computes in FP32 (its master), the
    samplers still load BF16 weights, and a short run (in-process samplers) completes."""
    from mismatch.train.config import TrainConfig, preset_config
    from mismatch.train.loop import run
    from mismatch.train.trainer import Trainer

    trainer = Trainer(model, TrainConfig(trainer_dtype="fp32"))
    assert next(trainer.compute.parameters()).dtype == torch.float32
    published = trainer.published()
    assert {w.dtype for w in published.values() if w.is_floating_point()} == {torch.bfloat16}
    master = dict(trainer.master.named_parameters())
    for name, w in published.items():
        if name in master:
            assert torch.equal(w, master[name].detach().to(torch.bfloat16))
    assert next(trainer.policy().parameters()).dtype == torch.bfloat16
    assert next(Trainer(model, TrainConfig()).compute.parameters()).dtype == torch.bfloat16
    out = tmp_path / "run"
    small = dict(steps=2, prompts_per_step=2, samples_per_prompt=2, max_turns=2,
                 max_new_tokens=24, candidates=16, checkpoint_every=1, eval_tasks=0)
    run(preset_config("smoke", trainer_dtype="fp32", **small), out, model=model,
        tokenizer=tok, log_alerts=False)
    assert json.loads((out / "config.json").read_text())["trainer_dtype"] == "fp32"
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["kl"] >= 0 for r in records)


def test_train_refuses_an_unknown_trainer_dtype(tmp_path):
    res = runner.invoke(app, ["train", "--preset", "smoke", "--trainer-dtype", "fp16", "--out",
                              str(tmp_path / "x")])
    assert res.exit_code == 2, res.output
    assert "--trainer-dtype must be bf16 or fp32" in res.output.strip().splitlines()[0]
