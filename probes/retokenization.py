"""Retokenization: the trainer scores a token sequence other than the one the sampler produced.

Both measurements run the trainer's numerics (`ctx.trainer`, reference kernels) on both sides, so
the only thing that differs is the token sequence. Every sequence is scored by itself, a batch of
one without padding (aligned_pairs.py), so padding or batch composition can never pass for
retokenization; a sequence that is the same on both sides is scored once and compares to itself
exactly. Part (a) is round_trip.py, part (b) multi_turn.py; this module is the probe.

(a) decode → re-encode. The target sampler's completions of the first `subset_prompts` prompts
    are decoded to text (special tokens kept), as a framework that stores text would, and encoded
    again. A BPE encoder writes any text in one canonical segmentation; a sampled sequence need
    not be canonical (" apples" drawn as " app" + "les"), and then its ids change. Figures: the
    share of sequences whose ids change, the share of sampled tokens that do not survive (a token
    survives when the re-encoding has a token with the same id over the same characters), where
    the first change falls, examples. The log-prob comparison scores prompt + sampled ids
    (other, μ: what the sampler conditioned on) and prompt + re-encoded ids (reference, π: what a
    text-keeping trainer scores) on the surviving tokens: before the first change the contexts
    are identical (exactly 0), after it the same token is conditioned on another segmentation.

(b) multi-turn template. Conversations of the zoo's calculator tasks (zoo/episode.py: tool
    results, format-error nudges, turn limits) are driven by the target sampler token in, token
    out (TITO): the context of turn k+1 is the context of turn k, the ids sampled in turn k
    (closed with the end-of-turn token if the length cap cut it), then the environment's answer
    rendered as the template's continuation and encoded on its own — the sequence the sampler
    saw. Each conversation asks `questions` tasks in turn, the next question following a finished
    episode as a user message; cut after its first question it is the RL environment's episode,
    also measured on its own (`single_question`). A trainer that keeps messages re-renders the
    conversation with `apply_chat_template(messages, tools=TOOLS)`: under Qwen3's rule (the
    template's default) every assistant turn before the last real user message (a nudge, or the
    next question) loses its `<think>` block, tool calls are re-serialized from parsed JSON (a
    malformed one disappears), a cut turn is closed where it stopped, and the text is encoded
    canonically. Each sampled assistant turn that occurs verbatim in both sequences, with its
    turn header, is compared token by token: reference π = trainer on the re-rendered context,
    other μ = trainer on the TITO context, with exact full-vocabulary KL. `render="tito"` makes
    the trainer's context the TITO sequence itself: the control, which must give no changed
    conversation and KL exactly 0.

A changed episode is attributed to one cause: `reasoning_dropped` (rendering with the template's
`keep_reasoning=True` gives the TITO ids back), `segmentation` (it gives the TITO text back in
other ids), `reserialized` (the turns' text itself changes).
"""

from __future__ import annotations

from .aligned_pairs import summary_if_interval
from .base import SourceResult
from .config import RetokenizationConfig  # the probe's options (config.py: no torch)
from .context import ProbeContext
from .multi_turn import Render, drive_episodes, measure_episodes
from .round_trip import measure_round_trips
from .tally import KLSummary, Tally

__all__ = ["RetokenizationConfig", "run"]


def _sampled(ctx: ProbeContext, on_batch) -> tuple[list[list[int]], list[list[int]]]:
    """The target sampler's completions of the first `subset_prompts` prompts (with EOS)."""
    prompts, completions = [], []
    left = min(ctx.cfg.subset_prompts, len(ctx.prompts))
    for b, batch in enumerate(ctx.batches):
        if left <= 0:
            break
        batch = batch[:left]
        ro = ctx.generate(ctx.sampler, batch, seed_offset=b)
        pw = ro.prompt_width
        for row, prompt in enumerate(batch):
            prompts.append(list(prompt))
            completions.append(ro.token_ids[row, pw:][ro.completion_mask[row, pw:] > 0].tolist())
        left -= len(batch)
        on_batch()
    return prompts, completions


def _kl(summary: KLSummary | None) -> float:
    return summary.kl_exact if summary else 0.0


def _notes(a: dict, b: dict | None, render: Render, parts: dict) -> list[str]:
    notes = [(
        f"Decode→re-encode: {a['sequences']} completions of the target sampler were decoded to "
        f"text (special tokens kept) and encoded again; "
        f"{a['changed_sequence_fraction']:.1%} of them came back as other ids, "
        f"{a['changed_token_fraction']:.2%} of sampled tokens did not survive; the trainer's "
        f"log-probs of the surviving tokens differ by exact KL "
        f"{_kl(parts.get('decode_reencode')):.3g} nats/token.")]
    if a["changed_sequences"] == 0:
        notes.append("The round trip was lossless on these samples: the model drew only the "
                     "tokenizer's canonical segmentation (a peaked model trained on canonically "
                     "encoded text rarely does otherwise; a non-canonical case is in the tests).")
    if b is None:
        notes.append("The tokenizer has no chat template: the multi-turn comparison does not "
                     "apply.")
        return notes
    if render == "tito":
        notes.append("Control run: the trainer's context is the token-in-token-out sequence "
                     "itself, so nothing may change and the KL must be exactly 0.")
    c = b["changed_episode_causes"]
    notes.append(
        f"Multi-turn: {b['episodes']} conversations of {b['questions']} held-out zoo tasks, "
        f"driven token in, token out by the target sampler ({b['turns_mean']:.2f} assistant "
        f"turns each), were re-rendered from their messages with the chat template as a "
        f"message-keeping trainer does; {b['changed_episode_fraction']:.1%} of the trainer's "
        f"contexts differ from what the sampler saw (reasoning dropped: {c['reasoning_dropped']}, "
        f"same text in other tokens: {c['segmentation']}, turns re-serialized: "
        f"{c['reserialized']}). The {b['response_tokens_compared']} sampled tokens of turns "
        f"present verbatim in both contexts differ by exact KL "
        f"{_kl(parts.get('multi_turn_template')):.3g} nats/token"
        + (f" ({_kl(parts['multi_turn_template_changed_episodes']):.3g} over the changed "
           f"conversations alone)." if "multi_turn_template_changed_episodes" in parts else "."))
    if "single_question_changed_fraction" in b:
        notes.append(
            f"Cut after its first question (the RL environment's single-question episode), "
            f"{b['single_question_changed_fraction']:.1%} of conversations differ (KL "
            f"{_kl(parts.get('single_question')):.3g}): the template (Qwen3's rule) strips the "
            f"reasoning only of turns before the last real user message and tool results are "
            f"not user messages, so within one question only a format-error nudge "
            f"({b['single_question_nudged_fraction']:.1%} of first questions had one), a turn cut "
            f"at the length cap or a tool call not in the template's JSON spelling changes the "
            f"context. The next question is a user message and drops the reasoning of every turn "
            f"before it: that is how every multi-turn rollout diverges under the stock Qwen3 "
            f"template.")
        notes.append(
            f"The embedded model was trained on single-question episodes only: a second question "
            f"in the same chat is outside its training distribution (nudges in "
            f"{b['nudged_episode_fraction']:.1%} of conversations against "
            f"{b['single_question_nudged_fraction']:.1%} of first questions), its turns there are "
            f"fragile and their log-probs move far when earlier reasoning disappears; this run does "
            f"not say how far a model trained on multi-question chats would move.")
    return notes


def run(ctx: ProbeContext, render: Render = "template") -> SourceResult:
    """Measure decode→re-encode round trips (a) and multi-turn template re-rendering (b), as
    `ctx.cfg.retokenization` sizes them.

    render="tito": the control, the trainer's context is the TITO sequence itself."""
    config = ctx.cfg.retokenization
    if render not in ("template", "tito"):
        raise ValueError(f"render must be 'template' or 'tito', got {render!r}")
    n_batches = -(-min(ctx.cfg.subset_prompts, len(ctx.prompts)) // ctx.cfg.batch_size)
    has_template = bool(getattr(ctx.tokenizer, "chat_template", None))
    turns = config.max_turns * config.questions
    total = n_batches + 1 + (turns + 1 if has_template else 0)
    done = 0

    def step(k: int = 1) -> None:
        nonlocal done
        done += k
        ctx.progress("retokenization", done, total)

    prompts, completions = _sampled(ctx, step)
    figures_a, tally_a = measure_round_trips(ctx, prompts, completions, config.examples)
    step()
    extra = {k: v for k, v in figures_a.items() if k != "examples"}
    parts = {"decode_reencode": summary_if_interval(tally_a, ctx.cfg.seed)}
    examples = list(figures_a["examples"])
    figures_b, tally_b = None, Tally()
    if has_template:
        traces = [t for t in drive_episodes(ctx, config, lambda t: step(n_batches + 1 + t - done))
                  if t.turns]  # a prompt too long for one turn under the model's context
        figures_b, tally_b, tally_changed = measure_episodes(ctx, traces, render,
                                                             config.examples)
        figures_b["questions"] = config.questions
        figures_b["response_tokens_compared"] = tally_b.tokens
        parts["multi_turn_template"] = summary_if_interval(tally_b, ctx.cfg.seed)
        if 0 < figures_b["changed_episodes"] < len(traces):
            parts["multi_turn_template_changed_episodes"] = summary_if_interval(tally_changed, ctx.cfg.seed)
        firsts = [t.first_question() for t in traces if t.questions]
        if config.questions > 1 and firsts:
            single, tally_single, _ = measure_episodes(ctx, firsts, render, 0)
            figures_b["single_question_changed_fraction"] = single["changed_episode_fraction"]
            figures_b["single_question_nudged_fraction"] = single["nudged_episode_fraction"]
            parts["single_question"] = summary_if_interval(tally_single, ctx.cfg.seed)
        step(total - done)
        examples += figures_b.pop("episode_examples")
        extra.update(figures_b)
    extra["render"] = render
    extra["examples"] = examples
    parts = {k: v for k, v in parts.items() if v is not None}
    return SourceResult(name="retokenization", headline=parts.get("multi_turn_template"),
                        parts=parts, extra=extra, notes=_notes(figures_a, figures_b, render, parts),
                        log_ratio=tally_b.log_ratio() if tally_b.tokens else None)

