"""Lanes: a mixed fleet's sequences in one engine batch, each with its own group's numerics.

The contract (mismatch/engines/lanes.py): every computation a row sees is the one its own
group's numerics give it in a batch of the same composition. Checked on the embedded model (a
Qwen3-MoE: fused experts, whose input rows are tokens) with lanes that differ in weight format,
activation quantization, accumulation model, attention kernel family and KV-cache format (FP8
and not) in one batch: bit for bit against the same batch under each lane's numerics, and
against each group's episodes served alone.
"""

from __future__ import annotations

import pytest
import torch

from mismatch.engines.lanes import batch_lanes, lanes_possible, rows_by_lane
from mismatch.profiles import resolve
from mismatch.train.batch import task_of
from mismatch.train.config import TrainConfig
from mismatch.train.fleet import SamplerGroup, fleet
from mismatch.train.pipeline import Pipeline
from mismatch.train.rollout import calibration_scales, run_episodes
from mismatch.train.unit_sampling import sample_units, scales_at


def _groups() -> list[SamplerGroup]:
    """The mixed fleet's groups and the homogeneous BF16 group (its KV cache in BF16)."""
    return fleet("mixed") + fleet("homogeneous")


def test_rows_by_lane_follows_the_batch():
    assert rows_by_lane() == [(0, None)]
    with batch_lanes([2, 0, 2, 1]):
        parts = rows_by_lane()
        assert [lane for lane, _ in parts] == [0, 1, 2]
        assert [r.tolist() for _, r in parts] == [[1], [3], [0, 2]]
        with batch_lanes([1, 1]):
            assert rows_by_lane() == [(1, None)]  # one lane: the whole batch, nothing sliced
        assert len(rows_by_lane()) == 3
    assert rows_by_lane() == [(0, None)]


def test_lanes_need_one_compute_dtype_and_one_router_dtype():
    bf16, fp8 = resolve("h100", "bf16", "bf16"), resolve("h100", "fp8", "fp8")
    assert lanes_possible([bf16, fp8])
    assert not lanes_possible([bf16, resolve("h100", "fp16", "bf16")])
    fp32_router = resolve("h100", "bf16", "bf16").__class__(
        **{**bf16.__dict__, "router_dtype": "fp32"})
    assert not lanes_possible([bf16, fp32_router])
    # the pipeline batches what can share a batch, and splits by group what cannot
    a = SamplerGroup(name="a", spec=bf16, share=0.5)
    b = SamplerGroup(name="b", spec=fp8, share=0.5)
    c = SamplerGroup(name="c", spec=resolve("h100", "fp16", "bf16"), share=0.5)
    batches = Pipeline.__new__(Pipeline)._batches
    assert batches([(0, a), (1, b), (2, a)]) == [[(0, a), (1, b), (2, a)]]
    assert batches([(0, a), (1, c), (2, a)]) == [[(0, a), (2, a)], [(1, c)]]


def _scales(model, tok, groups) -> dict:
    cal = [task_of(100 + i, 0, ("arith",)) for i in range(8)]
    return {g.name: calibration_scales(model, tok, g.spec, cal) for g in groups}


@pytest.mark.parametrize("names", [("b200-nvfp4", "h100-fp8", "rtx-pro-6000-bf16", "b200-bf16"),
                                   ("b200-nvfp4", "h100-fp8", "h100-bf16", "b200-bf16")],
                         ids=["four-attention-families", "two-lanes-share-fa3"])
def test_each_row_of_a_lane_batch_is_its_lanes_own(model, tok, names):
    """Bit for bit: the same batch (same sequences, same forced tokens, hence the same padded
    prefill and the same longest context at every decode step) run once with lanes, and once per
    lane with that lane's numerics on every row; row i of the lane run equals row i of its own
    lane's run — prefill, the engine's KV cache (FP8 for some lanes, BF16 for one), decode.
    In the second set H100 FP8 and H100 BF16 attend alike (FA3, FP8 cache): their rows share one
    attention call, which must not change a bit of either."""
    from mismatch.engines.engine import Engine
    from mismatch.engines.lane_numerics import apply_lane_numerics
    from mismatch.engines.numerics import apply_numerics
    from mismatch.engines.requests import Request
    from mismatch.engines.logits import SamplingParams

    groups = [next(g for g in _groups() if g.name == name) for name in names]
    scales = _scales(model, tok, groups)
    prompts = [list(range(5, 5 + n)) for n in (9, 14, 6, 11, 17, 8, 12, 10)]
    forced = [[40 + i, 41, 42 + i, 43, 44] for i in range(len(prompts))]
    lanes = [i % len(groups) for i in range(len(prompts))]
    params = SamplingParams(max_new_tokens=5, candidates=16)

    def run(lane_of):
        engine = Engine(model, pad_id=0, eos_ids=[], slots=len(prompts))
        reqs = [Request(prompt=p, params=params, forced=f, lane=lane_of(i), keep_full=True)
                for i, (p, f) in enumerate(zip(prompts, forced))]
        return [c.full_logprobs for c in engine.run(reqs)]

    with apply_lane_numerics(model, [(g.spec, scales[g.name]) for g in groups]):
        mixed = run(lanes.__getitem__)
    for lane, g in enumerate(groups):
        with apply_numerics(model, g.spec, scales[g.name] or None):
            alone = run(lambda i: 0)
        for i, x in enumerate(lanes):
            if x == lane:
                assert torch.equal(mixed[i], alone[i]), (g.name, i)
    # the lanes computed differently: NVFP4 rows are not BF16 rows
    b200_bf16 = next(g for g in groups if g.name == "b200-bf16")
    with apply_numerics(model, b200_bf16.spec):
        bf16 = run(lambda i: 0)
    assert not torch.equal(mixed[0], bf16[0])


def test_lanes_that_attend_alike_read_the_kv_cache_in_place(model, tok, monkeypatch):
    """H100 FP8 and H100 BF16 rows attend alike (FA3, FP8 cache): their lane batch attends in
    one call per layer, on the KV cache's own store (a view: the batch's slots are consecutive),
    not on a gather of every row; lanes that attend differently get one call each, on their own
    rows. Bits: test_each_row_of_a_lane_batch_is_its_lanes_own."""
    import mismatch.engines.hf_attention as hf
    from mismatch.engines.engine import Engine
    from mismatch.engines.lane_numerics import apply_lane_numerics
    from mismatch.engines.logits import SamplingParams
    from mismatch.engines.requests import Request

    calls = []
    attend = hf._attend

    def spy(query, key, *args):
        calls.append((query.shape[0], key))
        return attend(query, key, *args)

    monkeypatch.setattr(hf, "_attend", spy)
    params = SamplingParams(max_new_tokens=3, candidates=4)
    prompts = [list(range(5, 5 + n)) for n in (9, 14, 6, 11)]
    for names, per_forward in ((("h100-fp8", "h100-bf16"), 1), (("h100-fp8", "a100-bf16"), 2)):
        groups = [next(g for g in _groups() if g.name == name) for name in names]
        scales = _scales(model, tok, groups)
        calls.clear()
        engine = Engine(model, pad_id=0, eos_ids=[], slots=len(prompts))
        with apply_lane_numerics(model, [(g.spec, scales[g.name]) for g in groups]):
            engine.run([Request(prompt=p, params=params, forced=[40, 41, 42], lane=i % 2)
                        for i, p in enumerate(prompts)])
        layers = model.config.num_hidden_layers
        assert len(calls) == engine.stats.steps * layers * per_forward
        if per_forward == 1:
            store = {t.untyped_storage().data_ptr() for t in engine._cache.keys}
            assert all(rows == len(prompts) and key.untyped_storage().data_ptr() in store
                       for rows, key in calls)
        else:
            assert all(rows == len(prompts) // 2 for rows, _ in calls)


def test_a_mixed_batch_samples_what_each_group_alone_samples(model, tok):
    """Episodes of every group in one batch, interleaved, against each group's episodes served
    alone. Up to the batch's composition, the same: the same tokens, log-probs equal at most
    positions and elsewhere within what one BF16 rounding of a hidden state moves them (the
    decode attention's split-KV partition covers the longest context in the batch, and a GEMM
    over more rows may block its reduction differently: engine.py; trainer-side batch 1 vs 8
    moves BF16 log-probs by 0.055 nats sd, huggingface/trl issue #6789). How far depends on the
    CPU's BF16 GEMM: on an AMD EPYC with AVX-512-BF16 (oneDNN's native BF16 kernels, whose
    reduction blocking follows the row count) the BF16 lanes moved 54 of ~2,100 positions, by at
    most 0.12 nats, and flipped one near-tie's argmax; on a Xeon without it, under 0.05."""
    groups = _groups()
    scales = _scales(model, tok, groups)
    assert scales["h100-fp8"] and scales["b200-nvfp4"] and not scales["a100-bf16"]
    per = 2
    tasks = [task_of(u, 0, ("arith",)) for u in range(len(groups)) for _ in range(per)]
    owners = [g for g in groups for _ in range(per)]
    seeds = list(range(len(tasks)))
    order = sorted(range(len(tasks)), key=lambda i: (i % per, i))  # no lane's rows contiguous
    merged = run_episodes(model, tok, [tasks[i] for i in order], [owners[i] for i in order],
                          version=3, scales=scales, max_new_tokens=24,
                          episode_seeds=[seeds[i] for i in order])
    by_index = dict(zip(order, merged))
    same = exact = total = top1_same = top1_total = 0
    for k, g in enumerate(groups):
        alone = run_episodes(model, tok, tasks[k * per:(k + 1) * per], g, version=3,
                             scales=scales[g.name] or None, max_new_tokens=24,
                             episode_seeds=seeds[k * per:(k + 1) * per])
        for j, a in enumerate(alone):
            m = by_index[k * per + j]
            assert m.group == g.name and m.policy_version == a.policy_version
            if m.token_ids != a.token_ids:
                continue
            same += 1
            diff = torch.tensor(m.sampler_logprobs) - torch.tensor(a.sampler_logprobs)
            exact += int((diff == 0).sum())
            total += diff.numel()
            assert diff.abs().max() < 0.25, g.name  # a few sd of batch 1 vs 8 (0.055)
            top1_same += int((m.candidate_ids[:, 0] == a.candidate_ids[:, 0]).sum())
            top1_total += len(a.candidate_ids)
    assert same >= len(tasks) - 1
    assert exact >= 0.95 * total  # most positions bit for bit; the rest moved by the batch
    assert top1_same >= 0.99 * top1_total  # the same argmax but for near-ties


def test_the_same_context_differs_by_lane(model, tok):
    """One task sampled by every group in one batch: the first sampled token's context is the
    same prompt, so its log-prob differs only by the lane's numerics."""
    groups = _groups()
    scales = _scales(model, tok, groups)
    task = task_of(7, 0, ("arith",))
    eps = run_episodes(model, tok, [task] * len(groups), groups, version=0, scales=scales,
                       max_new_tokens=4, temperature=0.0, episode_seeds=[5] * len(groups))
    prompt = len(eps[0].token_ids) - sum(eps[0].sampled_mask)
    firsts = {e.group: e.candidate_logprobs[0] for e in eps}
    assert all(sum(e.sampled_mask) >= 1 for e in eps)
    # groups with equal numerics (B200 and B300 NVFP4) agree exactly; different numerics differ
    assert torch.equal(firsts["b200-nvfp4"], firsts["b300-nvfp4"])
    assert torch.equal(firsts["h100-fp8"], firsts["h200-fp8"])
    assert not torch.equal(firsts["b200-nvfp4"], firsts["b200-bf16"])
    assert not torch.equal(firsts["h100-fp8"], firsts["b200-bf16"])
    assert prompt > 0


def test_scales_are_calibrated_once_per_version(model, tok, monkeypatch):
    import mismatch.train.unit_sampling as sampling

    cfg = TrainConfig.flat(fleet="mixed", prompts_per_step=2, samples_per_prompt=2, tasks="arith",
                           max_new_tokens=4, max_turns=1)
    calls = []
    real = sampling.calibration_scales

    def counted(*args):
        calls.append(args[2].label)
        return real(*args)

    monkeypatch.setattr(sampling, "calibration_scales", counted)
    h100, h200 = (next(g for g in fleet("mixed") if g.name == n) for n in ("h100-fp8", "h200-fp8"))
    cache: dict = {}
    first = scales_at(cache, model, tok, cfg, h100, 0)
    assert scales_at(cache, model, tok, cfg, h200, 0) is first  # same numerics: one calibration
    assert len(calls) == 1
    scales_at(cache, model, tok, cfg, h100, 1)  # a new version: calibrated again
    assert len(calls) == 2
    a100 = next(g for g in fleet("mixed") if g.name == "a100-bf16")
    assert scales_at(cache, model, tok, cfg, a100, 1) == {} and len(calls) == 2
    # a batch of several groups calibrates each numerics once, whatever units it holds
    eps = sample_units(model, tok, cfg, [h100, h200, a100], [4, 5, 6], 1, scales=cache)
    assert len(calls) == 2
    assert [e.group for e in eps] == ["h100-fp8"] * 2 + ["h200-fp8"] * 2 + ["a100-bf16"] * 2


def test_groups_and_tasks_must_match(model, tok):
    with pytest.raises(ValueError, match="2 sampler groups for 1 tasks"):
        run_episodes(model, tok, [task_of(0, 0)], fleet("mixed")[:2], version=0)
