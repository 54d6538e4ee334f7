"""Rollouts token in, token out on the embedded model: the trajectory is exactly prompt + turns +
tool outputs, and re-scoring it teacher-forced reproduces the sampler's log-probs."""

from __future__ import annotations

import pytest
import torch

from mismatch.engines.numerics import apply_numerics, calibrate
from mismatch.engines.scorer import score
from mismatch.profiles import resolve, trainer_spec
from mismatch.records import Rollout
from mismatch.zoo import load_model
from mismatch.zoo.episode import Episode, EpisodeConfig
from mismatch.zoo.tasks import generate_tasks
from mismatch.engines.episodes import continuation_ids
from mismatch.engines.episodes import decode_ids as _decode
from mismatch.engines.episodes import render_chat as _render
from mismatch.train.fleet import SamplerGroup
from mismatch.train.rollout import Trajectory, run_episodes

BF16 = SamplerGroup(name="b200-bf16", spec=resolve("b200", "bf16", "bf16"), share=1.0)
NVFP4 = SamplerGroup(name="b200-nvfp4", spec=resolve("b200", "nvfp4", "fp8"), share=1.0)
ENDS = {"submit", "turn_limit", "format_errors"}


@pytest.fixture(scope="module")
def tasks():
    return generate_tasks("heldout", 4)


@pytest.fixture(scope="module")
def bf16_runs(model, tok, tasks):
    return run_episodes(model, tok, tasks, BF16, version=7, max_new_tokens=32, temperature=1.0,
                        seed=3)


def _rescore(model, traj: Trajectory) -> torch.Tensor:
    n = len(traj.token_ids)
    ro = Rollout(token_ids=torch.tensor([traj.token_ids]),
                 attention_mask=torch.ones(1, n, dtype=torch.long),
                 completion_mask=torch.zeros(1, n), sampler_logprobs=torch.zeros(1, n),
                 sampler_logprobs_processed=torch.zeros(1, n),
                 candidate_ids=torch.zeros(1, n, 1, dtype=torch.long),
                 candidate_logprobs=torch.zeros(1, n, 1), sampler="trainer", mode="emulated")
    return score(model, ro, with_routing=False).logprobs[0]


def _replay(tok, task, traj: Trajectory) -> list[int]:
    """The expected ids: the prompt, each turn's sampled ids (closed with EOS when cut), the
    environment's continuation — rebuilt from a fresh episode fed the sampled turns."""
    ep = Episode(task, EpisodeConfig(max_turns=4))
    ids = _render(tok, task.prompt_messages(), generation=True)
    for start, n in traj.turn_spans:
        turn = traj.token_ids[start:start + n]
        ids += turn
        if turn[-1] != tok.eos_token_id:
            ids.append(tok.eos_token_id)
        result = ep.step(_decode(tok, turn))
        if not result.done:
            ids += continuation_ids(tok, list(result.env_messages))
    assert ep.done and ep.end_reason == traj.end_reason and ep.reward == traj.reward
    return ids


def test_shapes_and_env_fields(bf16_runs, tasks, tok, model):
    vocab = model.get_output_embeddings().weight.shape[0]
    assert len(bf16_runs) == len(tasks)
    for traj in bf16_runs:
        n = len(traj.token_ids)
        assert len(traj.sampled_mask) == len(traj.sampler_logprobs) == n
        assert len(traj.policy_version) == n
        sampled = sum(traj.sampled_mask)
        assert sampled == sum(length for _, length in traj.turn_spans) > 0
        assert len(traj.candidate_ids) == len(traj.candidate_logprobs) == sampled
        assert all(len(c) == min(128, vocab) for c in traj.candidate_ids)
        assert set(traj.policy_version) == {7, -1}
        assert all(v == 7 for v, m in zip(traj.policy_version, traj.sampled_mask) if m)
        assert all(lp == 0.0 for lp, m in zip(traj.sampler_logprobs, traj.sampled_mask)
                   if not m)
        assert all(lp <= 0.0 for lp in traj.sampler_logprobs)
        assert traj.end_reason in ENDS and traj.reward in (0.0, 1.0)
        assert traj.group == "b200-bf16" and traj.turns == len(traj.turn_spans) >= 1
        # the sampled token is the argmax candidate or scores no higher than the top one
        for pos, (c_ids, c_lp) in zip(traj.sampled_positions,
                                      zip(traj.candidate_ids.tolist(),
                                          traj.candidate_logprobs.tolist())):
            assert traj.sampler_logprobs[pos] <= c_lp[0] + 1e-6
            assert c_lp == sorted(c_lp, reverse=True)


def test_token_ids_are_prompt_turns_and_tool_outputs(bf16_runs, tasks, tok):
    for task, traj in zip(tasks, bf16_runs):
        assert traj.token_ids == _replay(tok, task, traj)


def test_rescoring_reproduces_sampler_logprobs(bf16_runs, model):
    trainer = trainer_spec("bf16")
    for traj in bf16_runs:
        pos = torch.tensor(traj.sampled_positions)
        sampler = torch.tensor(traj.sampler_logprobs)[pos]
        with apply_numerics(model, BF16.spec, {}):
            same = _rescore(model, traj)[pos]
        assert (same - sampler).abs().mean() < 0.01
        with apply_numerics(model, trainer, {}, kernels=False):
            trained = _rescore(model, traj)[pos]
        assert (trained - sampler).abs().mean() < 0.05


def test_nvfp4_group_runs(model, tok, tasks):
    prompts = [_render(tok, t.prompt_messages(), generation=True) for t in tasks[:2]]
    scales = calibrate(model, NVFP4.spec, [(torch.tensor([p]), torch.ones(1, len(p),
                                                                          dtype=torch.long))
                                           for p in prompts])
    assert scales
    runs = run_episodes(model, tok, tasks[:2], NVFP4, version=1, scales=scales,
                        max_new_tokens=32, top_k_candidates=16, seed=5)
    assert len(runs) == 2
    for task, traj in zip(tasks, runs):
        assert traj.group == "b200-nvfp4" and traj.end_reason in ENDS
        assert traj.reward in (0.0, 1.0)
        assert all(len(c) == 16 for c in traj.candidate_ids)
        assert sum(traj.sampled_mask) == len(traj.candidate_ids) > 0
        assert traj.token_ids == _replay(tok, task, traj)
        pos = torch.tensor(traj.sampled_positions)
        with apply_numerics(model, NVFP4.spec, scales):
            same = _rescore(model, traj)[pos]
        assert (same - torch.tensor(traj.sampler_logprobs)[pos]).abs().mean() < 0.02
    # without scales, run_episodes calibrates them itself
    again = run_episodes(model, tok, tasks[:1], NVFP4, version=1, max_new_tokens=8, seed=5)
    assert again[0].end_reason in ENDS and sum(again[0].sampled_mask) > 0


def test_rejects_wrong_dtype(tok, tasks):
    fp32 = load_model(dtype="float32")
    with pytest.raises(ValueError, match="computes in bf16"):
        run_episodes(fp32, tok, tasks[:1], BF16, version=0)


def test_full_distribution_support_covers_every_candidate(bf16_runs):
    for traj in bf16_runs:
        assert len(traj.candidate_support) == len(traj.candidate_ids)
        assert all(all(flags) for flags in traj.candidate_support)


def test_top_p_support_is_the_nucleus_and_holds_the_sampled_token(model, tok, tasks):
    runs = run_episodes(model, tok, tasks[:2], BF16, version=0, max_new_tokens=24,
                        top_p=0.97, top_k=64, top_k_candidates=128, seed=11)
    for traj in runs:
        for pos, ids, lps, flags in zip(traj.sampled_positions, traj.candidate_ids.tolist(),
                                        traj.candidate_logprobs.tolist(),
                                        traj.candidate_support.tolist()):
            n = sum(flags)
            assert 1 <= n <= 64
            assert flags == [True] * n + [False] * (len(flags) - n)  # a prefix of the ranking
            assert traj.token_ids[pos] in ids[:n]  # the sampled token lies in its nucleus
            # top-k first, then top-p over the renormalized top 64 (float64 check): the mass
            # before the last kept token is < p and the kept mass reaches p
            probs = torch.tensor(lps[:64], dtype=torch.float64).exp()
            probs = probs / probs.sum()
            assert probs[:n - 1].sum() < 0.97 + 1e-5
            assert probs[:n].sum() >= 0.97 - 1e-5


def test_routed_experts_cover_every_sampled_position(bf16_runs, model):
    layers = model.config.num_hidden_layers
    k = model.config.num_experts_per_tok
    for traj in bf16_runs:
        e = traj.routed_experts
        assert e is not None and tuple(e.shape) == (len(traj.token_ids), layers, k)
        # the last sampled token is never fed back, so it has no routing; every other is routed
        last = traj.sampled_positions[-1]
        assert (e[:last] >= 0).all() and (e[:last] < model.config.num_experts).all()
        assert (e[last + 1:] == -1).all() or last + 1 == len(traj.token_ids)
