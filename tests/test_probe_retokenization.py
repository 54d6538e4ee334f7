"""The retokenization probe on the embedded model: the TITO control measures exactly 0, template
re-rendering of episodes with reasoning is caught, a non-canonical segmentation is caught."""

from __future__ import annotations

import json

import pytest
import torch

from mismatch.engines.episodes import Session, continuation_ids
from mismatch.probes.config import ProbeConfig
from mismatch.probes.context import ProbeContext
from mismatch.probes.errors import ProbeError
from mismatch.probes.multi_turn import measure_episodes
from mismatch.probes.retokenization import RetokenizationConfig, run
from mismatch.probes.round_trip import measure_round_trips, round_trip
from mismatch.zoo.chat_template import continuation_text
from mismatch.zoo.episode import NUDGE
from mismatch.zoo.tasks import TOOLS, generate_tasks

SMALL = RetokenizationConfig(episodes=4, questions=2, max_turns=2, turn_tokens=64)


@pytest.fixture(scope="module")
def ctx() -> ProbeContext:
    return ProbeContext(ProbeConfig(gpu="b200", dtype="bf16", n_prompts=8, subset_prompts=4,
                                    max_new_tokens=16, batch_size=4,
                                    sources=("retokenization",), retokenization=SMALL))


def _turn(thought: str, name: str, arguments: dict) -> str:
    """A gold assistant turn as the template writes it (and as the model was trained on)."""
    call = json.dumps({"name": name, "arguments": arguments})
    return f"<think>\n{thought}\n</think>\n\n<tool_call>\n{call}\n</tool_call><|im_end|>"


def _gold_turns(task) -> list[str]:
    turns = [_turn(t, "calc", {"expression": e}) for e, t in zip(task.expressions, task.reasoning)]
    return turns + [_turn(task.reasoning[-1], "submit", {"answer": task.answer})]


def _encode(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _bytewise(tok, text: str) -> list[int]:
    """`text` spelled one byte-level symbol per token: valid ids, not the canonical encoding."""
    (token,) = tok.convert_ids_to_tokens(_encode(tok, text))
    return [tok.convert_tokens_to_ids(ch) for ch in token]


# ------------------------------------------------------------------------------ decode → re-encode


def test_round_trip_detects_non_canonical_segmentation(ctx):
    tok = ctx.tokenizer
    head, tail = _encode(tok, "<think>\nLet me"), _encode(tok, " 12*7 with calc.\n</think>")
    odd = _bytewise(tok, " evaluate")
    assert len(odd) == 9  # " evaluate" is one token canonically
    ids = head + odd + tail
    trip = round_trip(tok, ids)
    assert trip.changed and trip.reencoded == head + _encode(tok, " evaluate") + tail
    assert trip.first_change == len(head)
    assert trip.affected == len(odd)
    assert [i for i, _ in trip.aligned] == list(range(len(head))) + \
        list(range(len(head) + len(odd), len(ids)))
    assert all(trip.original[i] == trip.reencoded[j] for i, j in trip.aligned)
    canonical = round_trip(tok, head + tail)
    assert not canonical.changed and canonical.first_change is None and canonical.affected == 0


def test_measure_round_trips_scores_the_lossy_case(ctx):
    tok = ctx.tokenizer
    task = generate_tasks("heldout", 1)[0]
    prompt = ctx.prompts[0]
    gold = _encode(tok, _gold_turns(task)[0])
    lead = _encode(tok, "<think>\nLet me")
    odd = lead + _bytewise(tok, " evaluate") + _encode(tok, " 12*7 with calc.\n</think>")
    figures, tally = measure_round_trips(ctx, [prompt, prompt], [gold, odd], examples=1)
    assert figures["sequences"] == 2 and figures["changed_sequences"] == 1
    assert figures["changed_sequence_fraction"] == 0.5
    assert figures["changed_token_fraction"] == pytest.approx(9 / (len(gold) + len(odd)))
    assert figures["first_change_position_mean"] == len(lead)
    assert sum(figures["first_change_relative_position_hist"]) == 1
    assert "evaluate" in figures["examples"][0]
    s = tally.summary()
    assert s.tokens == len(gold) + len(odd) - 9  # every token but the respelled ones
    assert s.kl_exact > 0  # tokens after the change see another segmentation
    lr = tally.log_ratio()
    # the gold row and the odd row's unchanged prefix compare to themselves: exactly 0
    assert torch.count_nonzero(lr[:len(gold) + len(lead)]) == 0


# ------------------------------------------------------------------------------ multi-turn


def test_continuation_matches_the_embedded_template(ctx):
    for env in ([{"role": "tool", "content": "54"}], [{"role": "user", "content": NUDGE}]):
        assert continuation_ids(ctx.tokenizer, env) == _encode(ctx.tokenizer,
                                                               continuation_text(env))


def _session(ctx, tasks, replies: list[str | list[int]]):
    """A conversation of `tasks` fed the given replies (text, or ids as sampled)."""
    session = Session(ctx.tokenizer, tasks, max_turns=4)
    for i, reply in enumerate(replies):
        ids = _encode(ctx.tokenizer, reply) if isinstance(reply, str) else reply
        assert session.step(ids) == (i < len(replies) - 1)
    return session.trace


def test_gold_conversation_is_prefix_stable_and_tito_exact(ctx):
    tasks = generate_tasks("heldout", 4)
    traces = [_session(ctx, tasks[i:i + 2], _gold_turns(tasks[i]) + _gold_turns(tasks[i + 1]))
              for i in (0, 2)]
    for trace in traces:
        assert len(trace.questions) == 2 and not trace.nudged
        # with every turn's reasoning kept, the template renders the TITO ids back (plus "\n")
        kept = ctx.tokenizer.apply_chat_template(trace.messages, tools=TOOLS, tokenize=True,
                                                 return_dict=False, keep_reasoning=True)
        assert list(kept) == trace.tito + _encode(ctx.tokenizer, "\n")
    figures, tally, changed = measure_episodes(ctx, traces, "tito")
    assert figures["changed_episode_fraction"] == 0 and changed.tokens == 0
    assert figures["verbatim_turn_fraction"] == 1.0
    assert tally.summary().kl_exact == 0.0 and torch.all(tally.log_ratio() == 0)
    first, first_tally, _ = measure_episodes(ctx, [t.first_question() for t in traces],
                                             "template")
    assert first["changed_episode_fraction"] == 0  # one question: only tool results follow
    assert first_tally.summary().kl_exact == 0.0


def _reasoning_dropped(ctx, case: str, tasks) -> tuple:
    """A conversation whose re-rendering drops reasoning: a second question, or a nudge."""
    if case == "next_question":
        return tasks, _gold_turns(tasks[0]) + _gold_turns(tasks[1])
    # a reply without a tool call: the environment nudges with a user message
    return tasks[:1], ["<think>\nI should think first.\n</think>\n\nLet me see.<|im_end|>"] + \
        _gold_turns(tasks[0])


@pytest.mark.parametrize("case", ["next_question", "nudge"])
def test_template_drops_earlier_reasoning(ctx, case):
    all_tasks = generate_tasks("heldout", 4)
    traces = [_session(ctx, *_reasoning_dropped(ctx, case, all_tasks[i:i + 2])) for i in (0, 2)]
    assert all(t.nudged == (case == "nudge") for t in traces)
    figures, tally, changed = measure_episodes(ctx, traces, "template", examples=1)
    assert figures["changed_episode_fraction"] == 1.0
    assert figures["changed_episode_causes"]["reasoning_dropped"] == 2
    assert len(figures["episode_examples"]) == 1 and "<think>" in figures["episode_examples"][0]
    assert figures["trainer_tokens_mean"] < figures["tito_tokens_mean"]
    # the turns after the last user message are verbatim in both; the earlier ones are not
    assert 0 < figures["verbatim_turn_fraction"] < 1
    s = tally.summary()
    assert s.tokens == changed.tokens > 0 and s.kl_exact > 0
    control, control_tally, _ = measure_episodes(ctx, traces, "tito")
    assert control["changed_episode_fraction"] == 0
    assert control_tally.summary().kl_exact == 0.0
    assert control_tally.tokens == sum(n for t in traces for _, n in t.turns)


def test_turn_cut_at_the_cap_is_closed_by_the_framework(ctx):
    tok = ctx.tokenizer
    task = generate_tasks("heldout", 1)[0]
    cut = _encode(tok, _gold_turns(task)[0])[:10]  # no <|im_end|>: the length cap stopped it
    trace = _session(ctx, [task], [cut] + _gold_turns(task))
    start, n = trace.turns[0]
    assert n == 10 and trace.tito[start:start + 11] == cut + [tok.eos_token_id]
    figures, _, _ = measure_episodes(ctx, [trace], "template")
    assert figures["changed_episode_fraction"] == 1.0


# ------------------------------------------------------------------------------ the probe


def test_run_tito_control_is_exactly_zero(ctx):
    seen = []
    ctx._progress = lambda label, done, total: seen.append((label, done, total))
    try:
        result = run(ctx, render="tito")
    finally:
        ctx._progress = None
    assert seen and seen[-1][1] == seen[-1][2] and {s[0] for s in seen} == {"retokenization"}
    assert [d for _, d, _ in seen] == sorted(d for _, d, _ in seen)
    e = result.extra
    assert e["render"] == "tito" and e["episodes"] == SMALL.episodes
    assert e["changed_episode_fraction"] == 0.0 and e["changed_sequence_fraction"] == 0.0
    assert result.headline.tokens > 0 and result.headline.kl_exact == 0.0
    assert result.headline.kl_k3 == 0.0
    assert torch.all(result.log_ratio == 0)
    for part in result.parts.values():
        assert part.kl_exact == 0.0


def test_run_template_is_json_ready(ctx):
    result = run(ctx)
    out = json.loads(json.dumps(result.to_json()))
    assert out["applies"] and result.name == "retokenization"
    assert out["render"] == "template" and out["sequences"] == ctx.cfg.subset_prompts
    assert out["sampled_tokens"] > 0 and out["episodes"] == SMALL.episodes
    for part in ("decode_reencode", "multi_turn_template"):
        assert out["parts"][part]["tokens"] > 0 and out["parts"][part]["kl_exact"] >= 0, part
    assert out["parts"]["multi_turn_template"] == result.headline.to_json()
    assert 0 <= out["changed_token_fraction"] <= out["changed_sequence_fraction"] <= 1
    # a second question is a user message: the reasoning before it is dropped on re-rendering
    assert out["changed_episode_fraction"] > 0
    assert sum(out["changed_episode_causes"].values()) == out["changed_episodes"]
    assert out["kl_exact"] > 0 and result.log_ratio.numel() == out["tokens"]
    assert len(out["examples"]) <= 2 * SMALL.examples
    assert all(isinstance(n, str) and n for n in out["notes"])


def test_config_errors_say_what_to_do():
    with pytest.raises(ProbeError, match=r"got 0, 2, 4, 64, 2; leave them at their defaults"):
        RetokenizationConfig(episodes=0)
