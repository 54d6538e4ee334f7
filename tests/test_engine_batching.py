"""The rollout engine: continuous batching, slot KV cache, KV reuse across turns, random streams."""

from __future__ import annotations

import contextlib

import pytest
import torch
from padded_generate import padded_generate

from mismatch.engines.engine import Engine
from mismatch.engines.episodes import Session, drive_sessions, render_chat
from mismatch.engines.numerics import apply_numerics, calibrate
from mismatch.engines.requests import Request
from mismatch.engines.logits import SamplingParams
from mismatch.engines.generation import generate
from mismatch.engines.streams import stream_uniform
from mismatch.profiles import resolve


@pytest.fixture(scope="module")
def prompts(tok):
    from mismatch.zoo.tasks import generate_tasks

    return [render_chat(tok, t.prompt_messages(), generation=True)
            for t in generate_tasks("heldout", 48)]


def _numerics(model, prompts, gpu, dtype, kv=None):
    if gpu is None:
        return contextlib.nullcontext()
    spec = resolve(gpu, dtype, kv)
    scales = None
    if spec.activation_codec:
        scales = calibrate(model, spec, [(torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long))
                                         for p in prompts[:4]])
    return apply_numerics(model, spec, scales)


@pytest.mark.parametrize("gpu,dtype,kv", [(None, None, None), ("a100", "bf16", None),
                                          ("h100", "fp8", None), ("b200", "nvfp4", "fp8")])
def test_a_batch_alone_is_bit_identical_to_the_padded_sampler(model, tok, prompts, gpu, dtype,
                                                               kv):
    """Prompts of one length, all in the engine from the first step: the same decode path as
    the static padded batch, so the same log-probs, candidates and routing to the bit."""
    by_len: dict[int, list] = {}
    for p in prompts:
        by_len.setdefault(len(p), []).append(p)
    same = max(by_len.values(), key=len)[:4]
    assert len(same) >= 2
    params = SamplingParams(max_new_tokens=20, candidates=16, seed=5)
    eos, pad = {tok.eos_token_id}, tok.pad_token_id
    with _numerics(model, same, gpu, dtype, kv):
        ours = generate(model, same, params, pad_id=pad, eos_ids=eos, label="x", keep_full=True)
        pw = ours.prompt_width
        ref = padded_generate(model, same, params, pad_id=pad, eos_ids=eos, label="x",
                              forced=ours.token_ids[:, pw:], keep_full=True)
        greedy = SamplingParams(max_new_tokens=20, temperature=0, candidates=4)
        g_ours = generate(model, same, greedy, pad_id=pad, eos_ids=eos, label="x")
        g_ref = padded_generate(model, same, greedy, pad_id=pad, eos_ids=eos, label="x")
    m = ours.completion_mask.bool()
    assert torch.equal(ref.completion_mask, ours.completion_mask)
    assert torch.equal(ref.sampler_logprobs[m], ours.sampler_logprobs[m])
    assert torch.equal(ref.sampler_logprobs_processed[m], ours.sampler_logprobs_processed[m])
    assert torch.equal(ref.candidate_ids[m], ours.candidate_ids[m])
    assert torch.equal(ref.candidate_logprobs[m], ours.candidate_logprobs[m])
    assert torch.equal(ref.full_logprobs[m[:, pw:]], ours.full_logprobs[m[:, pw:]])
    fed = ours.attention_mask.bool().clone()
    fed[torch.arange(len(same)), fed.long().cumsum(1).argmax(1)] = False  # last token: unfed
    assert torch.equal(ref.routed_experts[fed], ours.routed_experts[fed])
    assert torch.equal(g_ref.token_ids, g_ours.token_ids)  # greedy: the same tokens


def test_a_sequence_does_not_change_when_others_join_or_leave(model, tok, prompts):
    """Its own random stream: the same tokens alone, in a full batch, or joining mid-run."""
    params = SamplingParams(max_new_tokens=24, candidates=4)
    eos, pad = {tok.eos_token_id}, tok.pad_token_id
    target = Request(prompt=prompts[0], params=params, seed=77)
    others = [Request(prompt=p, params=SamplingParams(max_new_tokens=3 + 5 * i, candidates=4),
                      seed=i) for i, p in enumerate(prompts[1:9])]
    with _numerics(model, prompts, "h100", "bf16"):
        alone = Engine(model, pad_id=pad, eos_ids=eos, slots=1).run([target])[0]
        together = Engine(model, pad_id=pad, eos_ids=eos, slots=9).run(others + [target])[-1]
        # three slots: the target waits, then joins as short requests leave
        engine = Engine(model, pad_id=pad, eos_ids=eos, slots=3)
        joined = engine.run(others + [target])[-1]
    assert together.tokens == alone.tokens and joined.tokens == alone.tokens
    assert engine.stats.steps < sum(len(c) for c in [alone.tokens]) + 9 * 40
    for other in (together, joined):  # numerics may move with the batch, only in the last bits
        assert (other.logprobs - alone.logprobs).abs().max() < 0.05


def test_continuous_batching_serves_more_requests_than_slots(model, tok, prompts):
    params = SamplingParams(max_new_tokens=16, candidates=2)
    reqs = [Request(prompt=p, params=params, seed=i) for i, p in enumerate(prompts[:12])]
    engine = Engine(model, pad_id=tok.pad_token_id, eos_ids={tok.eos_token_id}, slots=4)
    out = engine.run(reqs)
    assert [c.request for c in out] == reqs  # in order of submission
    lens = [len(c.tokens) for c in out]
    assert all(1 <= n <= 16 for n in lens)
    assert all(c.finish_reason in ("eos", "length") for c in out)
    assert all((c.finish_reason == "eos") == (c.tokens[-1] == tok.eos_token_id) for c in out)
    # nobody decodes padding: generated tokens = the steps each sequence was in the batch
    assert engine.stats.decode_tokens == sum(lens)
    # with 4 slots, three static batches of 4 would take sum of each batch's longest reply
    static = sum(max(lens[i:i + 4]) for i in range(0, 12, 4))
    assert engine.stats.steps <= static


def test_sampling_draws_from_the_processed_distribution(tiny_model_factory):
    """Inverse-CDF draws on per-sequence streams: over 4000 streams the first token's frequencies
    match the processed distribution (top-6 at temperature 1.5, renormalized; chi-square p >
    1e-4), on a random model whose distributions are flat enough to test."""
    from scipy.stats import chi2 as dist
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_factory("qwen3moe", kind="moe",
                                                                        seed=1)))
    n = 4000
    params = SamplingParams(max_new_tokens=1, candidates=8, temperature=1.5, top_k=6)
    reqs = [Request(prompt=[3, 17, 42], params=params, seed=s) for s in range(n)]
    out = Engine(model, pad_id=0, eos_ids={1}, slots=n).run(reqs)
    ids = out[0].candidate_ids[0][:6].tolist()
    assert out[0].candidate_in_support[0].tolist() == [True] * 6 + [False] * 2
    probs = torch.softmax(out[0].candidate_logprobs[0][:6].double() / 1.5, dim=0)
    assert float(probs.max()) < 0.6  # a distribution worth testing
    counts = torch.zeros(6, dtype=torch.float64)
    for c in out:
        j = ids.index(c.tokens[0])  # every draw lies in the top-6
        counts[j] += 1
        assert abs(c.logprobs_processed[0].item() - probs[j].log().item()) < 1e-4
    expected = probs * n
    chi2 = float((((counts - expected) ** 2) / expected).sum())
    assert dist.sf(chi2, 5) > 1e-4


def test_stream_uniforms_are_uniform_and_independent_of_order():
    us = torch.tensor([stream_uniform(s, j) for s in range(200) for j in range(50)],
                      dtype=torch.float64)
    assert 0 <= float(us.min()) and float(us.max()) < 1
    assert abs(float(us.mean()) - 0.5) < 0.01 and abs(float(us.var()) - 1 / 12) < 0.003
    assert stream_uniform(123, 4) == stream_uniform(123, 4) != stream_uniform(124, 4)
    from scipy.stats import kstest

    assert kstest(us.numpy(), "uniform").pvalue > 1e-3


def _two_turns(model, tok, prompts, *, reuse: bool, forced: list[list[int]] | None = None):
    """Turn 1 of 16 conversations, then turn 2 with a follow-up user question."""
    from mismatch.engines.episodes import continuation_ids

    params = SamplingParams(max_new_tokens=12, candidates=4)
    more = continuation_ids(tok, [{"role": "user", "content": "And 3 + 4?"}])
    engine = Engine(model, pad_id=tok.pad_token_id, eos_ids={tok.eos_token_id}, slots=16,
                    kv_reuse=reuse)
    first = engine.run([Request(prompt=p, params=params, seed=i, session=i,
                                forced=None if forced is None else forced[0][i])
                        for i, p in enumerate(prompts[:16])])
    second = engine.run([Request(prompt=p + c.tokens + more, params=params, seed=100 + i,
                                 session=i, forced=None if forced is None else forced[1][i])
                         for i, (p, c) in enumerate(zip(prompts[:16], first))])
    return first, second, engine


@pytest.mark.parametrize("gpu", ["a100", "h100"])
def test_kv_reuse_prefills_only_the_new_tokens_and_stays_within_the_decode_gap(model, tok,
                                                                              prompts, gpu):
    """Turn 2 with turn 1's KV (from its decode steps) vs re-prefilled: the same tokens under
    teacher forcing, and log-prob differences of the size of the prefill-vs-decode gap on the
    same tokens (the kernels probe's `decode` source). In FP32 both would agree to ~1e-6."""
    from mismatch.engines.generation import to_rollout
    from mismatch.engines.scorer import score

    with _numerics(model, prompts, gpu, "bf16"):
        first, second, reused = _two_turns(model, tok, prompts, reuse=True)
        forced = [[c.tokens for c in first], [c.tokens for c in second]]
        _, again, fresh = _two_turns(model, tok, prompts, reuse=False, forced=forced)
        ro = to_rollout(again, pad_id=tok.pad_token_id, label="x", mode="emulated")
        teacher = score(model, ro, with_routing=False)  # the same tokens, prefilled whole
    assert [c.tokens for c in again] == forced[1]  # teacher forcing: identical tokens
    for c, p, f in zip(second, prompts, first):
        assert c.cached_tokens == len(p) + len(f.tokens) - 1  # all but turn 1's last token
    assert all(c.cached_tokens == 0 for c in again)
    turn1 = sum(len(p) for p in prompts[:16])
    assert reused.stats.prefill_tokens - turn1 < (fresh.stats.prefill_tokens - turn1) / 5
    gap = (teacher.logprobs - ro.sampler_logprobs)[ro.completion_mask.bool()].abs()
    diff = torch.cat([(a.logprobs - b.logprobs).abs() for a, b in zip(second, again)])
    assert 0 < float(diff.mean()) <= 3 * float(gap.mean())
    assert float(diff.median()) <= 3 * float(gap.median()) + 1e-6


def test_sessions_beyond_the_slots_are_evicted_and_replayed_in_full(model, tok):
    from mismatch.zoo.tasks import generate_tasks

    tasks = generate_tasks("heldout", 6)
    params = SamplingParams(max_new_tokens=24, candidates=4)
    seeds = lambda i, t: 1000 * i + t  # noqa: E731
    runs = {}
    for slots in (6, 2):
        sessions = [Session(tok, [t], 3) for t in tasks]
        engine = Engine(model, pad_id=tok.pad_token_id, eos_ids={tok.eos_token_id}, slots=slots)
        drive_sessions(engine, sessions, params, seed_of=seeds)
        runs[slots] = ([s.trace.tito for s in sessions], engine.stats)
    assert runs[6][1].evictions == 0
    assert all(len(s) > 0 for s in runs[2][0])
    # a smaller engine holds fewer conversations at once, but each one is still played in full
    assert all(t.count(tok.eos_token_id) >= 1 for t in runs[2][0])


def test_a_prompt_beyond_the_context_is_a_clear_error(model, tok):
    engine = Engine(model, pad_id=tok.pad_token_id, eos_ids={tok.eos_token_id}, slots=2,
                    max_len=64)
    with pytest.raises(ValueError, match="leaves no room"):
        engine.run([Request(prompt=[5] * 64, params=SamplingParams(max_new_tokens=4))])
    with pytest.raises(ValueError, match="at least one slot"):
        Engine(model, pad_id=0, eos_ids={1}, slots=0)
    with pytest.raises(ValueError, match="non-empty prompt"):
        Request(prompt=[], params=SamplingParams())


def test_prefill_is_bounded_and_every_request_still_served(model, tok, prompts):
    """A prefill budget of two prompts a forward: the waiting requests join over the next steps
    and every completion is the one an unbounded engine gives (own streams, own slots)."""
    params = SamplingParams(max_new_tokens=8, candidates=2, temperature=0)
    reqs = [Request(prompt=p, params=params, seed=i) for i, p in enumerate(prompts[:6])]
    eos, pad = {tok.eos_token_id}, tok.pad_token_id
    small = Engine(model, pad_id=pad, eos_ids=eos, slots=6,
                   prefill_tokens=2 * max(len(p) for p in prompts[:6]))
    out = small.run(reqs)
    ref = Engine(model, pad_id=pad, eos_ids=eos, slots=6).run(reqs)
    assert [c.tokens for c in out] == [c.tokens for c in ref]
    assert small.stats.steps > max(len(c.tokens) for c in ref)  # staggered joins took steps


@pytest.mark.parametrize("gpu,dtype,kv", [(None, None, None), ("a100", "bf16", None),
                                          ("b200", "nvfp4", "fp8")])
def test_a_shared_prompt_is_prefilled_once_and_each_sample_is_as_if_alone(model, tok, prompts,
                                                                          gpu, dtype, kv):
    """Three prompts four times each, interleaved (a GRPO step's groups): with KV reuse each
    prompt is computed once and its copies take its KV (an FP8 cache's rounded values and the
    routing included); every completion is the one the engine gives when each request prefills
    alone (kv_reuse=False), bit for bit."""
    params = SamplingParams(max_new_tokens=16, candidates=8)
    eos, pad = {tok.eos_token_id}, tok.pad_token_id
    group = prompts[:3]
    reqs = [Request(prompt=group[i % 3], params=params, seed=10 + i) for i in range(12)]
    with _numerics(model, group, gpu, dtype, kv):
        shared = Engine(model, pad_id=pad, eos_ids=eos, slots=12)
        ours = shared.run(reqs)
        alone = Engine(model, pad_id=pad, eos_ids=eos, slots=12, kv_reuse=False)
        ref = alone.run(reqs)
    assert shared.stats.shared_tokens == 3 * sum(len(p) for p in group)
    assert alone.stats.shared_tokens == 0
    assert shared.stats.prefill_tokens == alone.stats.prefill_tokens
    assert len({tuple(c.tokens) for c in ours}) > 3  # the copies sampled their own streams
    for a, b in zip(ours, ref):
        assert a.tokens == b.tokens
        for f in ("logprobs", "logprobs_processed", "candidate_ids", "candidate_logprobs",
                  "candidate_in_support", "routed_experts"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None and y is None) or torch.equal(x, y), f


def test_only_new_sequences_with_the_same_tokens_and_lane_share_a_prefill():
    from mismatch.engines.prefix_sharing import shared_rows

    assert shared_rows([0, 0, 0], [[1, 2], [1, 3], [2, 2]], [0, 0, 0]) is None
    assert shared_rows([0, 0], [[1, 2], [1, 2]], [0, 1]) is None  # other numerics
    assert shared_rows([5, 5], [[1, 2], [1, 2]], [0, 0]) is None  # slots with their own past
    computed, source = shared_rows([0, 0, 3, 0, 0], [[1, 2], [4], [1, 2], [1, 2], [4]],
                                   [0, 0, 0, 0, 0])
    assert computed == [0, 1, 2]
    assert source == [0, 1, 2, 0, 1]
