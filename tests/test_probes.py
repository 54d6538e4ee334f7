"""The source probes and the ladder: known answers (identical configurations give exactly 0, an
injected perturbation is recovered, routing replay removes the routing term) and the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import build_tiny_model
from mismatch.cli.main import app
from mismatch.probes.config import ProbeConfig
from mismatch.probes import SOURCES, parse_sources
from mismatch.fleets import fleet_groups
from mismatch.probes.accelerator import AcceleratorProbe
from mismatch.probes.base import Evaluation, Variant, with_spec
from mismatch.probes.context import ProbeContext
from mismatch.probes.tally import Tally
from mismatch.probes.kernels import KernelsProbe
from mismatch.probes.ladder import LadderProbe
from mismatch.probes.routing import RoutingProbe, routing_flips
from mismatch.probes.sampling import SamplingConfig

runner = CliRunner()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "moe", kind="moe", tokenizer=True,
                            seed=3)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("p") / "prompts.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": f"the quick brown fox {'jumps ' * (i % 4)}"
                                                 f"over {i} hello world"})
                           for i in range(8)) + "\n")
    return p


def _ctx(moe_dir, prompt_file, **kw) -> ProbeContext:
    base = dict(gpu="h100", dtype="fp8", model=moe_dir, prompts=prompt_file, n_prompts=8,
                max_new_tokens=10, batch_size=4, subset_prompts=4)
    base.update(kw)
    return ProbeContext(ProbeConfig(**base))


@pytest.fixture(scope="module")
def ctx(moe_dir, prompt_file) -> ProbeContext:
    return _ctx(moe_dir, prompt_file)


@pytest.fixture(scope="module")
def batch(ctx):
    return ctx.sample_batch(0)


def test_replayed_decode_equals_the_sampled_rollout(ctx, batch):
    """Feeding the sampled tokens back through the same decode path reproduces every log-prob."""
    again = ctx.evaluator._evaluate(ctx.sampler, batch)
    sampled = batch.cache[ctx.sampler.key()]
    assert torch.equal(again.logprobs, sampled.logprobs)
    assert torch.equal(again.full, sampled.full)
    assert torch.equal(again.routing, sampled.routing)


@pytest.mark.parametrize("variant", ["sampler", "reference", "alone"])
def test_identical_configurations_give_exactly_zero(ctx, batch, variant):
    v = {"sampler": ctx.sampler, "reference": ctx.reference,
         "alone": Variant(spec=ctx.trainer, alone=True)}[variant]
    tally = Tally()
    tally.add(ctx.evaluator._evaluate(v, batch), ctx.evaluate(v, batch), batch.mask)
    s = tally.summary()
    assert s.tokens > 0
    assert s.kl_exact == 0 and s.kl_k3 == 0 and s.abs_logprob_diff_max == 0


def test_injected_logit_shift_is_recovered_against_float64():
    """Shift one token's logit by c on the sampler side: KL(μ‖π) = c·μ_j − log(1 + π_j(e^c − 1))
    exactly; the tally's exact KL and its k1 on that token must recover it."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=g, dtype=torch.float64) * 2
    c, j = 0.3, 7
    shifted = logits.clone()
    shifted[..., j] += c
    pi, mu = torch.log_softmax(logits, -1), torch.log_softmax(shifted, -1)
    tokens = torch.full((3, 5), j)
    ref = Evaluation(logprobs=pi.gather(-1, tokens[..., None])[..., 0].float(), full=pi.float())
    oth = Evaluation(logprobs=mu.gather(-1, tokens[..., None])[..., 0].float(), full=mu.float())
    tally = Tally()
    tally.add(ref, oth, torch.ones(3, 5))
    expected = (c * mu[..., j].exp() - torch.log1p(pi[..., j].exp() * math.expm1(c))).mean()
    s = tally.summary()
    assert s.kl_exact == pytest.approx(float(expected), rel=1e-4)
    # on token j, log μ − log π = c − log(1 + π_j(e^c − 1)) = k1
    k1 = (c - torch.log1p(pi[..., j].exp() * math.expm1(c))).mean()
    assert s.kl_k1 == pytest.approx(float(k1), rel=1e-4)


def test_kernels_probe_known_answers(moe_dir, prompt_file):
    ctx = _ctx(moe_dir, prompt_file, batch_size=1, n_prompts=2)
    probe = KernelsProbe(ctx)
    for i in range(len(ctx.batches)):
        probe.on_batch(ctx.sample_batch(i))
    r = probe.finish()
    # a batch of one *is* the sequence alone: exactly 0
    assert r.parts["batch"].kl_exact == 0 and r.parts["batch"].abs_logprob_diff_max == 0
    # every kernel habit that changes a reduction order or a rounding shows up
    for name in ("decode", "attention", "router_fp32"):
        assert r.parts[name].abs_logprob_diff_max > 0, name
    assert r.headline.kl_exact > 0
    out = r.to_json()
    assert (out["kl_exact"], out["kl_k3"]) == (r.headline.kl_exact, r.headline.kl_k3)
    assert out["kl_exact_ci95"] == r.headline.kl_exact_ci95
    assert out["parts"] == {name: s.to_json() for name, s in r.parts.items()}
    assert out["notes"] == r.notes and all(isinstance(n, str) and n for n in out["notes"])


def test_split_k_changes_only_the_fp32_summation_order():
    """Split-K sums the same exact products in another order: FP32 results differ in some
    elements, by no more than FP32 rounding of a K-term sum, against a float64 reference."""
    from mismatch.engines.numerics import _Emulator
    from mismatch.engines.served_weights import ServedLinear as _Linear
    from mismatch.profiles import trainer_spec

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4096, generator=g).bfloat16().float()
    w = torch.randn(32, 4096, generator=g).bfloat16().float()
    entry = _Linear(weight=w, act_key="a")
    one = _Emulator({}, trainer_spec(), {}, None).gemm(x, entry)
    four = _Emulator({}, with_spec(trainer_spec(), split_k=4), {}, None).gemm(x, entry)
    exact = x.double() @ w.double().t()
    assert not torch.equal(one, four)
    bound = 4096 * 2 ** -24 * (x.double().abs() @ w.double().abs().t())
    assert bool(((four.double() - exact).abs() <= bound).all())
    assert bool(((one.double() - exact).abs() <= bound).all())


def test_batch_composition_is_seen_in_mixed_batches(ctx, batch):
    tally = Tally()
    ctx.compare(tally, Variant(spec=ctx.trainer, alone=True), ctx.reference, batch)
    assert tally.summary().abs_logprob_diff_max > 0  # padding and neighbours change sums


def test_split_k_of_one_is_the_reference(ctx, batch):
    tally = Tally()
    tally.add(ctx.evaluator._evaluate(Variant(spec=with_spec(ctx.trainer, split_k=1)), batch),
              ctx.evaluate(ctx.reference, batch), batch.mask)
    assert tally.summary().abs_logprob_diff_max == 0


def test_routing_replay_removes_the_routing_term(ctx, batch):
    """A sampler that differs from the trainer *only* in its routing (layer 0's experts swapped
    at every third position). Without replay the trainer routes by itself: its own experts, so
    the forged ones are flipped and its log-probs are the plain trainer's. With replay it uses
    the sampler's experts: no flips, and the log-probs move by exactly the routing term."""
    trainer = ctx.evaluate(ctx.reference, batch)
    routing = trainer.routing.clone()
    n_exp = 8
    flip = torch.zeros(routing.shape[:2], dtype=torch.bool)
    flip[:, ::3] = True
    routing[:, :, 0][flip] = (routing[:, :, 0][flip] + 1) % n_exp  # swap experts, layer 0
    ok = (routing[:, :, 0].sort(-1).values[..., :-1] != routing[:, :, 0].sort(-1).values[..., 1:])
    assert bool(ok.all())  # still k distinct experts
    forged = type(batch)(index=99, prompts=batch.prompts, rollout=batch.rollout, mask=batch.mask)
    forged.rollout = type(batch.rollout)(**{**batch.rollout.__dict__, "routed_experts": routing})
    without = ctx.evaluator._evaluate(Variant(spec=ctx.trainer, replay=False), forged)
    replayed = ctx.evaluator._evaluate(Variant(spec=ctx.trainer, replay=True), forged)
    real = batch.rollout.attention_mask
    # what replay changes: the experts (the sampler's instead of the trainer's own) ...
    _, flips_without, n = routing_flips(routing, without.routing, real)
    _, flips_replayed, _ = routing_flips(routing, replayed.routing, real)
    assert 0 < flips_without <= n and flips_replayed == 0
    assert torch.equal(without.routing, trainer.routing)
    # ... and through them the log-probs; without replay nothing differs from the trainer
    same, moved = Tally(), Tally()
    same.add(trainer, without, batch.mask)
    moved.add(without, replayed, batch.mask)
    assert same.summary().kl_exact == 0 and same.summary().abs_logprob_diff_max == 0
    assert moved.summary().kl_exact > 0 and moved.summary().abs_logprob_diff_max > 0
    per_layer, any_layer, n = routing_flips(routing, trainer.routing, real)
    assert per_layer[0] > 0 and per_layer[1] == 0 and 0 < any_layer <= n


def test_routing_probe_reports_flips_and_replay(ctx, batch):
    probe = RoutingProbe(ctx)
    probe.on_batch(batch)
    r = probe.finish().to_json()
    assert len(r["flip_rate_by_layer"]) == 2
    assert 0 <= r["flip_rate_mean"] <= r["flip_rate_any_layer"] <= 1
    assert r["kl_exact_replay"] <= r["kl_exact_no_replay"] + 1e-12
    assert r["routing_kl_share"] == pytest.approx(r["kl_exact_no_replay"] - r["kl_exact_replay"])
    assert r["parts"]["routing_alone"]["kl_exact"] == r["kl_exact"]


def test_routing_does_not_apply_to_dense_models(tmp_path, prompt_file):
    dense = build_tiny_model(tmp_path / "dense", kind="dense", tokenizer=True)
    ctx = ProbeContext(ProbeConfig(gpu="a100", dtype="bf16", model=dense, prompts=prompt_file,
                                   n_prompts=2, max_new_tokens=4))
    r = RoutingProbe(ctx).finish().to_json()
    assert r["applies"] is False and "no MoE" in r["notes"][0]


def test_accelerator_probe_twins_and_fleet(ctx, batch):
    probe = AcceleratorProbe(ctx)
    probe.on_batch(batch)
    r = probe.finish()
    by_gpu = r.extra["kl_exact_by_gpu"]
    assert by_gpu["h100"] == by_gpu["h200"] and by_gpu["b200"] == by_gpu["b300"]
    assert r.headline.kl_exact > 0  # B200's W8A8 FP32 sums vs H100's fast accumulation
    shares = r.extra["fleet_shares"]
    assert len(shares) == 8 and sum(shares.values()) == pytest.approx(1)
    w = r.extra["fleet_weighted"]["kl_exact"]
    groups = [r.parts[f"fleet {g}"].kl_exact for g in shares]
    assert min(groups) <= w <= max(groups)


def test_accelerator_alone_is_zero_on_the_trainers_own_gpu(moe_dir, prompt_file):
    ctx = _ctx(moe_dir, prompt_file, gpu="b200", dtype="fp8", n_prompts=4)
    probe = AcceleratorProbe(ctx)
    probe.on_batch(ctx.sample_batch(0))
    r = probe.finish()
    assert r.headline.kl_exact == 0 and r.headline.abs_logprob_diff_max == 0
    assert r.extra["kl_exact_by_gpu"]["b200"] > 0  # the full sampler still differs


def test_fleet_shares_parsing():
    g = fleet_groups((("b200-nvfp4", 3.0), ("a100-bf16", 1.0)))
    share = {f"{a}-{b}": s for a, b, s in g}
    assert share["b200-nvfp4"] == 0.75 and share["a100-bf16"] == 0.25 and share["h100-fp8"] == 0
    with pytest.raises(ValueError, match="unknown group"):
        fleet_groups((("v100-bf16", 1.0),))
    with pytest.raises(ValueError, match="> 0"):
        fleet_groups((("b200-nvfp4", 0.0),))


def test_ladder_of_the_trainer_configuration_is_flat(moe_dir, prompt_file):
    """Target = the trainer's own GPU and precision: no precision and no accelerator rung."""
    ctx = _ctx(moe_dir, prompt_file, gpu="b200", dtype="bf16", n_prompts=4)
    probe = LadderProbe(ctx)
    probe.on_batch(ctx.sample_batch(0))
    r = probe.finish().extra
    kernels, precision, accelerator = r["rungs"]
    assert kernels["kl_exact"] > 0
    assert precision["increment"] == 0 and accelerator["increment"] == 0
    assert r["alone"]["precision"] == 0 and r["alone"]["accelerator"] == 0


def test_sampling_probe_top_p_one_is_raw(moe_dir, prompt_file):
    from mismatch.probes import sampling

    ctx = _ctx(moe_dir, prompt_file, gpu="b200", dtype="bf16", sampling=SamplingConfig(top_p=1.0), n_prompts=4)
    r = sampling.run(ctx)
    assert r.extra["sampler_mass_outside"] == pytest.approx(0, abs=1e-6)
    assert r.extra["processed_minus_raw_mean"] == pytest.approx(0, abs=1e-6)
    assert r.parts["processed"].kl_exact == pytest.approx(r.parts["raw"].kl_exact, rel=1e-3)


def test_sampling_probe_top_p_bias_is_bounded(moe_dir, prompt_file):
    from mismatch.probes import sampling

    ctx = _ctx(moe_dir, prompt_file, gpu="b200", dtype="bf16", sampling=SamplingConfig(top_p=0.5), n_prompts=4)
    r = sampling.run(ctx).extra
    assert 0 < r["processed_minus_raw_mean"] <= r["bias_bound"] + 1e-9
    assert 0 < r["sampler_mass_outside"] < 0.5 + 1e-6
    assert 0 < r["trainer_mass_on_support"] <= 1


def test_registry_and_parse_sources():
    assert set(SOURCES) == {"kernels", "precision", "accelerator", "routing", "staleness",
                            "retokenization", "sampling"}
    assert parse_sources("all") == tuple(SOURCES)
    assert parse_sources("routing, kernels") == ("kernels", "routing")
    with pytest.raises(ValueError, match="unknown source 'vibes'"):
        parse_sources("kernels,vibes")


def _check_one_line_error(res, *needles: str) -> None:
    assert res.exit_code == 2, res.output
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mismatch: error:"), res.stderr
    for n in needles:
        assert n in err[0], err[0]


def test_cli_bad_sources_and_shares():
    _check_one_line_error(runner.invoke(app, ["probe", "--gpu", "h100", "--dtype", "fp8",
                                              "--sources", "vibes"]), "unknown source")
    _check_one_line_error(runner.invoke(app, ["probe", "--gpu", "h100", "--dtype", "fp8",
                                              "--sources", "all", "--fleet-shares", "b200"]),
                          "GROUP=SHARE")
    _check_one_line_error(runner.invoke(app, ["probe", "--gpu", "h100", "--dtype", "fp8",
                                              "--sources", "all", "--trainer-gpu", "v100"]),
                          "unknown gpu")


def test_cli_sources_json_and_report(moe_dir, prompt_file, tmp_path):
    out = tmp_path / "run"
    res = runner.invoke(app, ["probe", "--gpu", "h100", "--dtype", "fp8", "--model", str(moe_dir),
                              "--prompts", str(prompt_file), "--n-prompts", "4",
                              "--max-new-tokens", "8", "--subset-prompts", "4", "--sources",
                              "kernels,precision,accelerator,routing,sampling", "--ladder",
                              "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout.strip().splitlines()[-1])
    for name in ("kernels", "precision", "accelerator", "routing", "sampling"):
        src = s["sources"][name]
        for key in ("kl_k3", "kl_exact", "abs_logprob_diff_mean", "mis_masked_fraction"):
            assert math.isfinite(src[key]) and src[key] >= 0, (name, key, src[key])
        assert math.isfinite(src["kl_k1"]), name  # k1 is unbiased, not positive
        assert src["tokens"] > 0 and len(src["kl_k3_ci95"]) == len(src["kl_exact_ci95"]) == 2
        lo, hi = src["kl_exact_ci95"]
        assert lo <= src["kl_exact"] <= hi or src["kl_exact"] == 0
    assert 0 <= s["sources"]["routing"]["flip_rate_any_layer"] <= 1
    assert [r["rung"] for r in s["ladder"]["rungs"]] == ["L0 kernels", "L1 + precision",
                                                         "L2 + accelerator"]
    assert s["ladder"]["rungs"][-1]["kl_exact"] == pytest.approx(s["total"]["kl_exact"])
    report = (out / "report.md").read_text()
    assert "EMULATED" in report and "## Ladder" in report
    for png in ("source_kl.png", "log_ratio_hist.png", "routing.png", "ladder.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    written = json.loads((out / "results.json").read_text())
    assert written["total"] == s["total"] and written["sources"] == s["sources"]
    assert not list(tmp_path.glob(".run.tmp-*"))


def test_tally_of_one_sequence_has_no_interval_but_a_value():
    tally = Tally()
    tally.add(torch.zeros(1, 3), torch.full((1, 3), -0.1), torch.ones(1, 3),
              exact=torch.full((1, 3), 0.01))
    s = tally.summary()
    assert s.kl_exact == pytest.approx(0.01) and s.tokens == 3
    assert all(math.isnan(v) for v in s.kl_exact_ci95) and s.ci_target_met is False


def test_ci_target_draws_more_prompts_until_met_or_capped(monkeypatch):
    """An unreachable target draws held-out prompts up to --max-prompts and says it was not
    met; once met, nothing more is drawn."""
    from mismatch.probes import runner
    from mismatch.probes.runner import run_sources

    base = dict(gpu="b200", dtype="bf16", n_prompts=4, batch_size=4, max_new_tokens=6,
                sources=("kernels",))
    strict = run_sources(ProbeConfig(**base, ci_target=1e-6, max_prompts=12)).summary
    assert strict["prompts"] == 12 and strict["ci_target"]["met"] is False
    assert "total" in strict["ci_target"]["unmet"] and strict["total"]["tokens"] > 0
    monkeypatch.setattr(runner, "_unmet", lambda *a: [])
    met = run_sources(ProbeConfig(**base, ci_target=0.2, max_prompts=12)).summary
    assert met["prompts"] == 4 and met["ci_target"] == {"target": 0.2, "met": True, "unmet": []}

