"""Rollouts of the asynchronous trainer: zoo episodes driven token in, token out (TITO).

`run_episodes` plays a batch of zoo tasks (single-question RL episodes: zoo/episode.py ends each
on a submit, the turn limit, or three replies in a row without a tool call) with one sampler
group's numerics active on the model. The conversation machinery is the retokenization probe's
(`mismatch.engines.episodes.Session`): the context of turn k+1 is the context of turn k, the ids
sampled in turn k (closed with the end-of-turn token if the length cap cut it), then the
environment's answer rendered as the template's continuation and encoded on its own. Nothing is
ever decoded and re-encoded, so the trainer scores exactly the sequence the sampler saw.

Each `Trajectory` carries, per sampled token, the sampler's raw log-prob (temperature 1, full
vocabulary: what log π is compared with), its top-k candidates (k = 128 by default) with the
flags of those inside the distribution actually sampled from (the top-p support when the sampler
draws from a nucleus: p = 0.97 capped at 64 tokens in the study, docs/study.md), the weight
version that generated it, and the experts each MoE layer routed every position to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from mismatch.probes.base import TORCH_DTYPES
from mismatch.profiles import NumericsSpec

from .fleet import SamplerGroup

__all__ = ["Trajectory", "run_episodes", "calibration_scales", "needs_scales"]

_TURN_SEED = 1000  # seed stride between turns (one generate call per turn)


@dataclass
class Trajectory:
    """One episode as the policy saw it, token in, token out."""

    token_ids: list[int]
    """Prompt ids, then each turn's sampled ids (closed if cut), then each tool output's ids."""
    sampled_mask: list[int]
    """1 on tokens the policy sampled, 0 on prompt, tool-output and framework-closing tokens."""
    sampler_logprobs: list[float]
    """Raw sampler log-prob of each sampled token (0.0 elsewhere); same length as token_ids."""
    candidate_ids: torch.Tensor
    """[sampled tokens, k] int64 top-k candidate ids of the raw distribution, one row per sampled
    token (in order)."""
    candidate_logprobs: torch.Tensor
    """[sampled tokens, k] float32 their log-probs."""
    policy_version: list[int]
    """Weight version that generated each sampled token (-1 on tokens not sampled)."""
    group: str
    """Name of the sampler group that served the episode."""
    reward: float
    """1.0 for a correct submit, else 0.0."""
    end_reason: str
    """The environment's: "submit", "turn_limit" or "format_errors"; "context_limit" when the
    model's context had no room for another turn."""
    turns: int
    """Assistant turns sampled."""
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    """(start in token_ids, sampled tokens) of each assistant turn."""
    candidate_support: torch.Tensor | None = None
    """[sampled tokens, k] bool: which candidates lie in the sampled distribution's support (all
    True when sampling from the full vocabulary and the candidates do not cover it)."""
    routed_experts: torch.Tensor | None = None
    """[len(token_ids), layers, k] int64 experts each MoE layer routed each position to (the
    sampler's last computation of that position; −1 where none was recorded)."""

    @property
    def sampled_positions(self) -> list[int]:
        return [i for i, m in enumerate(self.sampled_mask) if m]


def needs_scales(spec: NumericsSpec) -> bool:
    """Whether `spec` quantizes activations with static scales that must be calibrated."""
    return spec.activation_codec is not None


def calibration_scales(model: torch.nn.Module, tokenizer, spec: NumericsSpec,
                       tasks: list) -> dict:
    """Static activation scales of `spec` on `model`, calibrated on the first prompts of `tasks`
    (at most 8), rendered as the episodes render them ({} when the spec needs none)."""
    from mismatch.engines.episodes import render_chat

    if not needs_scales(spec):
        return {}
    return _scales_for(model, spec, [render_chat(tokenizer, t.prompt_messages(), generation=True)
                                     for t in tasks[:8]])


def _scales_for(model: torch.nn.Module, spec: NumericsSpec, prompts: list[list[int]]) -> dict:
    from mismatch.engines.numerics import calibrate

    device = next(model.parameters()).device
    batches = [(torch.tensor([p], device=device),
                torch.ones(1, len(p), dtype=torch.long, device=device)) for p in prompts[:8]]
    return calibrate(model, spec, batches)


def _eos_ids(tokenizer, model) -> set[int]:
    ids = {tokenizer.eos_token_id}
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen if isinstance(gen, (list, tuple)) else [gen])
    return {i for i in ids if isinstance(i, int)}


def run_episodes(model: torch.nn.Module, tokenizer, tasks: list,
                 group: SamplerGroup | Sequence[SamplerGroup], *, version: int,
                 scales: dict | Mapping[str, dict] | None = None, max_turns: int = 4,
                 max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, top_k_candidates: int = 128, seed: int = 0,
                 kv_reuse: bool = True, slots: int | None = None,
                 episode_seeds: list[int] | None = None) -> list[Trajectory]:
    """Drive one single-question episode per task under `group`'s numerics through the rollout
    engine (mismatch.engines.engine): all episodes at once, each next turn joining the running
    batch as soon as its previous turn ends, prefilling only its new tokens (`kv_reuse`; False
    re-prefills the whole context every turn). `model` must be loaded in the group's compute
    dtype.

    `group` may also be a list of groups, one per task: a mixed fleet's episodes in one batch,
    each computed with its own group's numerics (lanes: mismatch.engines.lanes; groups that
    compute alike share a lane). The model must allow it (`lanes_possible`).

    `scales`: static activation scales of the group's spec — with a list of groups, a mapping
    {group name: scales} — calibrated on the group's first 8 task prompts when the spec
    quantizes activations and none are given. `top_p`, `top_k`: the sampled nucleus (1.0 and
    0: the full distribution). Episode i's turn t draws from its own random stream (seed, i, t),
    whatever else runs beside it — or, with `episode_seeds`, the stream (episode_seeds[i], t),
    so that an episode's draws do not depend on which batch it is sampled in. `slots`:
    sequences the engine holds at once (default: one per episode)."""
    from mismatch.engines.engine import Engine
    from mismatch.engines.episodes import Session, drive_sessions
    from mismatch.engines.lane_numerics import apply_lane_numerics
    from mismatch.engines.routing import routers
    from mismatch.engines.logits import SamplingParams

    if not tasks:
        raise ValueError("run_episodes needs at least one task")
    if max_turns < 1 or max_new_tokens < 1 or top_k_candidates < 1:
        raise ValueError(f"max_turns, max_new_tokens and top_k_candidates must be >= 1, got "
                         f"{max_turns}, {max_new_tokens}, {top_k_candidates}")
    if episode_seeds is not None and len(episode_seeds) != len(tasks):
        raise ValueError(f"{len(episode_seeds)} episode seeds for {len(tasks)} tasks")
    if isinstance(group, SamplerGroup):
        groups = [group] * len(tasks)
        scales = {group.name: scales} if scales else {}
    else:
        groups = list(group)
        if len(groups) != len(tasks):
            raise ValueError(f"{len(groups)} sampler groups for {len(tasks)} tasks")
        scales = dict(scales or {})
    dtype = next(model.parameters()).dtype
    for g in dict.fromkeys(groups):
        if dtype != TORCH_DTYPES[g.spec.compute_dtype]:
            raise ValueError(f"group {g.name} computes in {g.spec.compute_dtype}; the model is "
                             f"loaded in {dtype}")
    lane_of_key: dict[tuple, int] = {}
    lanes = [lane_of_key.setdefault(g.spec.numerics_key(), len(lane_of_key)) for g in groups]
    vocab = model.get_output_embeddings().weight.shape[0]
    limit = getattr(model.config, "max_position_embeddings", None)
    room = None if limit is None else limit - max_new_tokens
    sessions = [Session(tokenizer, [task], max_turns) for task in tasks]
    lane_numerics: list[tuple[NumericsSpec, dict]] = []
    for lane in range(len(lane_of_key)):
        members = [i for i, x in enumerate(lanes) if x == lane]
        spec = groups[members[0]].spec
        got = next((scales[groups[i].name] for i in members if scales.get(groups[i].name)), None)
        if needs_scales(spec) and not got:
            got = _scales_for(model, spec, [sessions[i].trace.tito for i in members])
        lane_numerics.append((spec, got or {}))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                            top_p=top_p, top_k=top_k, candidates=min(top_k_candidates, vocab))
    logprobs: list[dict[int, float]] = [{} for _ in sessions]
    cands: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [[] for _ in sessions]
    routed: list[torch.Tensor | None] = [None for _ in sessions]

    def on_turn(i: int, turn: int, comp) -> None:
        start = len(sessions[i].trace.tito)
        for j, lp in enumerate(comp.logprobs.tolist()):
            logprobs[i][start + j] = lp
        cands[i].append((comp.candidate_ids, comp.candidate_logprobs,
                         comp.candidate_in_support))
        if comp.routed_experts is not None:
            routed[i] = comp.routed_experts  # positions 0 … the turn's last sampled id

    engine = Engine(model, pad_id=pad_id, eos_ids=_eos_ids(tokenizer, model),
                    slots=slots or len(sessions), kv_reuse=kv_reuse,
                    with_routing=bool(routers(model)))
    with apply_lane_numerics(model, lane_numerics):
        cut = drive_sessions(engine, sessions, params, room=room, on_turn=on_turn,
                             lane_of=lanes.__getitem__,
                             seed_of=lambda i, turn: _stream_seed(seed, i, turn)
                             if episode_seeds is None else episode_seeds[i] * _TURN_SEED + turn)
    out = []
    for i, s in enumerate(sessions):
        tr, ep = s.trace, s.episode
        n = len(tr.tito)
        experts = None
        if routed[i] is not None:
            span = routed[i][:n]
            experts = torch.full((n, *span.shape[1:]), -1, dtype=torch.long)
            experts[:span.shape[0]] = span
        mask = [0] * n
        for start, length in tr.turns:
            mask[start:start + length] = [1] * length
        lps = [logprobs[i].get(p, 0.0) for p in range(n)]
        out.append(Trajectory(
            token_ids=list(tr.tito), sampled_mask=mask, sampler_logprobs=lps,
            candidate_ids=torch.cat([c[0] for c in cands[i]]),
            candidate_logprobs=torch.cat([c[1] for c in cands[i]]),
            candidate_support=torch.cat([c[2] for c in cands[i]]), routed_experts=experts,
            policy_version=[version if m else -1 for m in mask], group=groups[i].name,
            reward=float(ep.reward),
            end_reason="context_limit" if cut[i] else str(ep.end_reason),
            turns=len(tr.turns), turn_spans=list(tr.turns)))
    return out


def _stream_seed(seed: int, episode: int, turn: int) -> int:
    """The random stream of one turn of one episode: a function of (seed, episode, turn) only."""
    return (seed * 1_000_003 + episode) * _TURN_SEED + turn
