"""The embedded model and its task family: tool language, tasks, episodes, tokenizer, chat
template, the shipped weights (architecture, size, peakedness) and a reproducible build."""

from __future__ import annotations

import json
import re
import socket
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mismatch.zoo import ZooError, default_model_dir, load_model, load_tokenizer
from mismatch.zoo.chat_template import ADDED_TOKENS, SPECIAL_TOKENS, continuation_text, render
from mismatch.zoo.episode import NUDGE, Episode, EpisodeConfig
from mismatch.zoo.tasks import (HELDOUT_SEED_BASE, TASK_KINDS, TOOLS, generate_tasks, make_task,
                                parse_answer, reward, task_seeds)
from mismatch.zoo.tool_calls import execute_call, parse_reply, ToolCall
from mismatch.zoo.tool_lang import ToolError, ToolLimits, evaluate

MAX_WEIGHT_BYTES = 20 * 2**20  # the spec's ceiling for the shipped safetensors

# Bounds for the shipped BF16 model on 16 held-out transcripts. The build (model_card.md, 128
# transcripts) measured: assistant tokens mean top-1 p 0.982, perplexity 1.040; all tokens 0.953,
# 1.137; five disjoint 16-transcript samples ranged 0.976-0.982 / 1.035-1.056 (assistant) and
# 0.947-0.955 / 1.132-1.159 (all). A model that keeps the format but never learned to copy
# numbers (the same recipe stopped before its copying transition) scores 0.90-0.92 / 1.22-1.26 on
# assistant tokens, and a 10-step model 0.03 / 80: the bounds sit between, with room for
# sampling and a rebuild on another machine.
MIN_MEAN_TOP1_ASSISTANT = 0.95
MAX_PPL_ASSISTANT = 1.12
MIN_MEAN_TOP1_ALL = 0.90
MAX_PPL_ALL = 1.30
MIN_ARITH_SOLVE_RATE = 0.5  # the build solved 0.95 of held-out arith episodes greedily


# ---------------------------------------------------------------- tool language


@pytest.mark.parametrize("text, expected", [
    ("12*(7+3)", 120), ("1+2*3", 7), ("(1+2)*3", 9), ("7/2", 3), ("-7/2", -4), ("7%3", 1),
    ("-7%3", 2), ("--5", 5), ("2-3-4", -5), ("100/10/5", 2), (" 4 * ( 2 + 3 ) ", 20), ("0", 0),
])
def test_evaluate_matches_python_integer_arithmetic(text, expected):
    assert evaluate(text) == expected


@pytest.mark.parametrize("text, message", [
    ("1" * 13, "number too long"),
    ("1+" * 200 + "1", "too long"),
    ("(" * 40 + "1" + ")" * 40, "nested too deeply"),
    ("-" * 40 + "1", "nested too deeply"),
    ("999999999*999999999", "out of range"),
    ("2**1000", "unexpected '*'"),
    ("__import__('os').system('ls')", "unexpected character"),
    ("1; rm -rf /", "unexpected character"),
    ("١٢+1", "unexpected character"),  # Arabic-Indic digits: str.isdigit() would accept them
    ("1/0", "division by zero"), ("5%0", "division by zero"),
    ("", "empty"), ("(1+2", "missing ')'"), ("1 2", "after the expression"), ("1+", "end"),
])
def test_evaluate_refuses_oversized_and_malicious_input(text, message):
    with pytest.raises(ToolError, match=re.escape(message)):
        evaluate(text)


def test_evaluate_limits_are_configurable_and_type_checked():
    with pytest.raises(ToolError, match="too long"):
        evaluate("1+1", ToolLimits(max_chars=2))
    with pytest.raises(ToolError, match="must be a string"):
        evaluate(12)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_depth"):
        ToolLimits(max_depth=0)


# ---------------------------------------------------------------- tasks, reward, episodes


def test_tasks_are_seeded_and_split_by_seed():
    assert make_task(7) == make_task(7)
    assert {make_task(s).kind for s in range(200)} == set(TASK_KINDS)
    held = task_seeds("heldout", 5)
    assert min(held) >= HELDOUT_SEED_BASE and max(task_seeds("train", 5)) < HELDOUT_SEED_BASE
    with pytest.raises(ValueError, match="outside the train split"):
        task_seeds("train", 10, start=HELDOUT_SEED_BASE - 5)
    for task in generate_tasks("heldout", 50):
        assert evaluate(task.expressions[-1]) == task.answer
        assert len(task.gold_messages()) == 2 + 2 * len(task.expressions) + 1


def test_reward_on_hand_made_answers():
    task = make_task(1)  # "How much is 99-10?" -> 89
    assert task.answer == 89
    for good in (89, "89", " 89 ", "+89"):
        assert reward(task, good) == 1.0
    for bad in (88, "88", "89.0", 89.0, None, "eighty-nine", [89], {"answer": 89}, "8" * 30):
        assert reward(task, bad) == 0.0
    assert parse_answer(True) is None and parse_answer("-3") == -3


def _gold_reply(message: dict) -> str:
    """The exact text a policy generates for a gold assistant message."""
    call = message["tool_calls"][0]["function"]
    return (f"<think>\n{message['reasoning_content']}\n</think>\n\n<tool_call>\n"
            f'{{"name": "{call["name"]}", "arguments": {json.dumps(call["arguments"])}}}'
            "\n</tool_call><|im_end|>")


def test_episode_gold_replies_solve_the_task():
    task = make_task(0, kind="two_step")
    episode = Episode(task)
    gold = [m for m in task.gold_messages() if m["role"] == "assistant"]
    for message in gold[:-1]:
        result = episode.step(_gold_reply(message))
        assert not result.done and result.env_messages[0]["role"] == "tool"
    result = episode.step(_gold_reply(gold[-1]))
    assert (result.done, result.end_reason, result.reward) == (True, "submit", 1.0)
    assert episode.messages == task.gold_messages()
    with pytest.raises(RuntimeError, match="over"):
        episode.step("anything")


def test_episode_ends_on_three_replies_without_a_tool_call_and_on_turn_limit():
    episode = Episode(make_task(3))
    for text in ("", "<think>\nhmm\n</think>\n\nThe answer is 5.", '<tool_call>\n{"name": calc}\n</tool_call>'):
        result = episode.step(text)
    assert (result.done, result.end_reason, result.reward) == (True, "format_errors", 0.0)
    assert [m["content"] for m in episode.messages if m["role"] == "user"][1:] == [NUDGE, NUDGE]
    episode = Episode(make_task(3), EpisodeConfig(max_turns=2))
    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "1+1"}}\n</tool_call>'
    assert episode.step(call).env_messages == ({"role": "tool", "content": "2"},)
    assert episode.step(call).end_reason == "turn_limit"


def test_episode_wrong_submission_scores_zero():
    episode = Episode(make_task(1))
    result = episode.step('<tool_call>\n{"name": "submit", "arguments": {"answer": 90}}\n</tool_call>')
    assert (result.done, result.end_reason, result.reward) == (True, "submit", 0.0)


def test_parse_reply_reads_calls_and_reports_errors():
    reply = parse_reply("<think>\nplan\n</think>\n\nok <tool_call>\n{\"name\": \"calc\", "
                        "\"arguments\": {\"expression\": \"2*3\"}}\n</tool_call><|im_end|>")
    assert (reply.reasoning, reply.content, reply.errors) == ("plan", "ok", ())
    assert reply.tool_calls == (ToolCall(name="calc", arguments={"expression": "2*3"}),)
    assert execute_call(reply.tool_calls[0]) == {"role": "tool", "content": "6"}
    assert parse_reply("<tool_call>\n{\"name\": 1}\n</tool_call>").errors
    assert parse_reply("<tool_call>\n{\"name\": \"calc\"").errors == ("unbalanced <tool_call> tags",)
    assert parse_reply("x" * 20_000).errors[0].startswith("reply too long")
    assert "unknown tool" in execute_call(ToolCall(name="shell", arguments={}))["content"]
    bad = execute_call(ToolCall(name="calc", arguments={"expression": "9" * 99}))["content"]
    assert bad.startswith("error: expression") or bad.startswith("error: number")


# ---------------------------------------------------------------- tokenizer and chat template


def _no_network(*args, **kwargs):
    raise OSError("network access attempted while loading the embedded model")


@pytest.fixture(scope="module")
def tokenizer():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", _no_network)
        return load_tokenizer()


@pytest.mark.parametrize("text", [
    "What is 12*(7+3)?", "  leading spaces\n\n\ttabs", "héllo wörld — ünïcode 😀 中文",
    "<|im_start|>user\nhi<|im_end|>\n<think>\nx\n</think>", "\x00\x01 bytes \xff",
])
def test_tokenizer_round_trips_text(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_tokenizer_special_and_markup_tokens_are_atomic(tokenizer):
    for i, token in enumerate((*SPECIAL_TOKENS, *ADDED_TOKENS)):
        assert tokenizer(token)["input_ids"] == [i]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    ids = tokenizer("<|im_start|>a<think>b</think><|im_end|>")["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a<think>b</think>"


def test_chat_template_renders_tool_calls_and_tool_results(tokenizer):
    task = make_task(4)  # "What is 15*(94+52)?"
    text = tokenizer.apply_chat_template(task.gold_messages(), tools=TOOLS, tokenize=False)
    assert text == render(task.gold_messages(), tools=TOOLS)
    assert ('<|im_start|>assistant\n<think>\nThe user wants 15*(94+52). I will use calc.\n</think>\n\n'
            '<tool_call>\n{"name": "calc", "arguments": {"expression": "15*(94+52)"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n2190\n</tool_response>'
            '<|im_end|>\n') in text
    assert '{"name": "submit", "arguments": {"answer": 2190}}' in text
    assert text.count(json.dumps(TOOLS[0])) == 1
    out = tokenizer.apply_chat_template(task.gold_messages(), tools=TOOLS, tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True)
    assert out["input_ids"] == tokenizer(text)["input_ids"]
    generated = tokenizer.decode([i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m])
    assert generated.count("<|im_end|>") == 2 and "<tool_response>" not in generated


def test_chat_template_strips_earlier_reasoning_unless_kept(tokenizer):
    history = make_task(4).gold_messages() + [{"role": "user", "content": "And doubled?"}]
    stripped = tokenizer.apply_chat_template(history, tools=TOOLS, tokenize=False,
                                             add_generation_prompt=True)
    kept = tokenizer.apply_chat_template(history, tools=TOOLS, tokenize=False,
                                         add_generation_prompt=True, keep_reasoning=True)
    assert "<think>" not in stripped and kept.count("<think>") == 2
    assert stripped.endswith("And doubled?<|im_end|>\n<|im_start|>assistant\n")
    # Within the current query (no user turn after them) reasoning is kept in both modes.
    current = make_task(4).gold_messages()
    assert render(current, tools=TOOLS).count("<think>") == 2
    no_think = render(current[:2], tools=TOOLS, add_generation_prompt=True)
    assert no_think.endswith("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True,
                                        enable_thinking=False, tokenize=True, return_dict=True)
    assert tokenizer.decode(ids["input_ids"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_keep_reasoning_makes_episodes_token_in_token_out():
    """Prompt + generated turns + environment continuations == one render with keep_reasoning."""
    task = make_task(0, kind="two_step")
    episode = Episode(task)
    text = render(episode.messages, tools=TOOLS, add_generation_prompt=True)
    replies = [_gold_reply(m) for m in task.gold_messages() if m["role"] == "assistant"]
    replies[0] = "<think>\nno call\n</think>\n\nhmm<|im_end|>"  # forces a nudge (a user turn)
    for reply in [replies[0], *replies]:
        result = episode.step(reply)
        text += reply + (continuation_text(list(result.env_messages)) if not result.done else "\n")
    assert text == render(episode.messages, tools=TOOLS, keep_reasoning=True)
    assert text != render(episode.messages, tools=TOOLS)  # Qwen3 stripping drops the first turn's


# ---------------------------------------------------------------- the embedded model


@pytest.fixture(scope="module")
def model():
    with pytest.MonkeyPatch.context() as patch:  # loading must be offline: any connect fails
        patch.setattr(socket.socket, "connect", _no_network)
        return load_model()


def test_embedded_model_meets_the_architecture_spec(model):
    cfg = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and cfg.model_type == "qwen3_moe"
    assert cfg.num_experts >= 8 and cfg.num_experts_per_tok == 2 and cfg.head_dim >= 32
    assert cfg.num_hidden_layers >= 4 and cfg.max_position_embeddings >= 1024
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    saved = json.loads((default_model_dir() / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3MoeForCausalLM"] and saved["dtype"] == "bfloat16"
    weights = default_model_dir() / "model.safetensors"
    assert weights.stat().st_size <= MAX_WEIGHT_BYTES
    info = json.loads((default_model_dir() / "build_info.json").read_text())
    assert info["weights"]["bytes"] == weights.stat().st_size
    assert "perplexity" in (default_model_dir() / "model_card.md").read_text()


def test_embedded_model_is_peaked_on_heldout_transcripts(model, tokenizer):
    from mismatch.zoo.data import encode_tasks
    from mismatch.zoo.metrics import heldout_figures

    batch = encode_tasks(tokenizer, generate_tasks("heldout", 16, start=500), max_tokens=1024)
    figures = heldout_figures(model, batch)
    assert figures["assistant"].mean_top1_prob > MIN_MEAN_TOP1_ASSISTANT, figures
    assert figures["assistant"].perplexity < MAX_PPL_ASSISTANT, figures
    assert figures["all"].mean_top1_prob > MIN_MEAN_TOP1_ALL, figures
    assert figures["all"].perplexity < MAX_PPL_ALL, figures


def test_embedded_model_solves_arithmetic_episodes_greedily(model, tokenizer):
    """The build's greedy solve rate on `arith` tasks is ~1.0 (model_card.md); a model that has
    not learned to copy the expression into its calc call solves ~0 of them."""
    from mismatch.zoo.solve import greedy_solve

    tasks = [make_task(seed, kind="arith") for seed in task_seeds("heldout", 6, start=900)]
    figures = greedy_solve(model, tokenizer, tasks, max_new_tokens=64)
    assert figures.solve_rate >= MIN_ARITH_SOLVE_RATE, figures
    assert figures.end_reasons == {"submit": 6}, figures


def test_bad_model_paths_are_one_line_value_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ZooError, match="lacks config.json, model.safetensors") as caught:
        load_model(tmp_path)
    assert "\n" not in str(caught.value)
    with pytest.raises(ZooError, match="lacks tokenizer.json"):
        load_tokenizer(tmp_path.parent)
    with pytest.raises(ZooError, match="not a torch floating-point dtype"):
        load_model(default_model_dir(), dtype="int8")


# ---------------------------------------------------------------- build and CLI


def _tiny_build_config():
    from mismatch.zoo.build import BuildConfig
    from mismatch.zoo.supervised import TrainConfig

    return BuildConfig(seed=3, tokenizer_corpus=300, heldout_transcripts=4, greedy_episodes=2,
                       max_new_tokens=8, train=TrainConfig(steps=3, batch_size=4))


def test_three_step_build_is_bitwise_reproducible(tmp_path):
    from mismatch.zoo.build import build

    config = _tiny_build_config()
    first, second = tmp_path / "a", tmp_path / "b"
    info = build(config, first)
    build(config, second)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temporary dirs left
    assert info["training"]["steps"] == 3 and (first / "model_card.md").is_file()
    other = build(replace(config, seed=4), tmp_path / "a")  # rebuilding over a build is allowed
    assert other["weights"]["sha256"] != info["weights"]["sha256"]
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(ZooError, match="not empty"):
        build(config, tmp_path / "junk")


def test_cli_path_and_info():
    from typer.testing import CliRunner

    from mismatch.cli.zoo import _DEFAULT_STEPS, zoo_app
    from mismatch.zoo.supervised import TrainConfig

    assert _DEFAULT_STEPS == TrainConfig().steps  # the CLI default must be the library's

    runner = CliRunner()
    result = runner.invoke(zoo_app, ["path"])
    assert result.exit_code == 0 and Path(result.output.strip()) == default_model_dir()
    result = runner.invoke(zoo_app, ["info"])
    assert result.exit_code == 0 and "held-out assistant" in result.output, result.output
    result = runner.invoke(zoo_app, ["info", "--model", "/nonexistent/model"])
    assert isinstance(result.exception, ZooError)
