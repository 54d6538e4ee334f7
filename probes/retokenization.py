"""Retokenization: the trainer scores a token sequence other than the one the sampler produced.

Both measurements run the trainer's numerics (`ctx.trainer`, reference kernels) on both sides, so
the only thing that differs is the token sequence. Every sequence is scored by itself, a batch of
one without padding (on the trainer's CPU emulation left padding alone moves log-probs by up to
0.03 nats), so padding or batch composition can never pass for retokenization; a sequence that
is the same on both sides is scored once and compares to itself exactly.

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

from dataclasses import dataclass
from typing import Literal

import torch

from mismatch.records import Rollout

from mismatch.engines.episodes import PROBE_CHAT as _PROBE_CHAT
from mismatch.engines.episodes import EpisodeTrace, Session, continuation_ids
from mismatch.engines.episodes import after_turn_text as _after_turn
from mismatch.engines.episodes import decode_ids as _decode
from mismatch.engines.episodes import encode_text as _encode
from mismatch.engines.episodes import render_chat as _render

from .base import Evaluation, SourceResult
from .context import ProbeContext
from .tally import Tally

__all__ = [
    "EpisodeTrace",
    "RetokenizationConfig",
    "RoundTrip",
    "Session",
    "continuation_ids",
    "drive_episodes",
    "measure_episodes",
    "measure_round_trips",
    "round_trip",
    "run",
]

Render = Literal["template", "tito"]
_EPISODE_SEED = 1_000_003  # seed offset of episode sampling: apart from the shared batches' 0, 1, ..
_HIST_BINS = 10  # first-change positions, in tenths of the completion
_EXAMPLE_CHARS = 48  # characters of context shown on each side of an example's change
_FULL_BYTES = 1 << 30  # cap of one side's [rows, width, V] FP32 log-softmax held for exact KL
_CAUSES = ("reasoning_dropped", "segmentation", "reserialized")


@dataclass(frozen=True, kw_only=True)
class RetokenizationConfig:
    """How many episodes the multi-turn measurement drives, and how long."""

    episodes: int = 32
    """Conversations driven with the target sampler (held-out zoo tasks)."""
    questions: int = 2
    """Zoo tasks per conversation: the user asks the next one once an episode ends (one: the
    RL environment's single-question episodes, where nothing but a nudge is a user message)."""
    max_turns: int = 4
    """Assistant turns per question at most (a calc call then a submit solve most tasks)."""
    turn_tokens: int = 64
    """Token cap of one assistant turn (the longest gold turn of the zoo tasks is 55 tokens)."""
    examples: int = 2
    """Changed sequences, and changed episodes, shown as text."""

    def __post_init__(self) -> None:
        if min(self.episodes, self.questions, self.max_turns, self.turn_tokens) < 1 \
                or self.examples < 0:
            raise ValueError(f"RetokenizationConfig: episodes, questions, max_turns and "
                             f"turn_tokens must be >= 1 and examples >= 0, got {self.episodes}, "
                             f"{self.questions}, {self.max_turns}, {self.turn_tokens}, "
                             f"{self.examples}")


# --------------------------------------------------------------------------------- scoring


def _score_alone(model: torch.nn.Module, ids: list[int],
                 positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log-probs of `ids` (one sequence, no padding) at `positions` (each >= 1):
    token log-probs [N] and whole log-softmax [N, V], FP32."""
    from mismatch.engines.scorer import score

    n = len(ids)
    if not positions:
        return torch.zeros(0), torch.zeros(0, 0)
    first = min(positions)
    ro = Rollout(token_ids=torch.tensor([ids]), attention_mask=torch.ones(1, n, dtype=torch.long),
                 completion_mask=torch.zeros(1, n), sampler_logprobs=torch.zeros(1, n),
                 sampler_logprobs_processed=torch.zeros(1, n),
                 candidate_ids=torch.zeros(1, n, 1, dtype=torch.long),
                 candidate_logprobs=torch.zeros(1, n, 1), sampler="trainer", mode="emulated")
    s = score(model, ro, with_routing=False, full_from=first)
    at = torch.tensor(positions)
    return s.logprobs[0, at], s.full_logprobs[0, at - first]  # (N,), (N, V)


class _Pairs:
    """Token-aligned pairs of sequences, scored by the trainer into a Tally in chunks."""

    def __init__(self, ctx: ProbeContext) -> None:
        self.ctx = ctx
        self.rows: list[tuple[list[int], list[int], list[int], list[int]]] = []

    def add(self, reference: list[int], other: list[int], ref_pos: list[int],
            other_pos: list[int]) -> None:
        """Compare reference[ref_pos[i]] with other[other_pos[i]] (the same token)."""
        self.rows.append((reference, other, ref_pos, other_pos))

    @torch.no_grad()
    def tally(self, chunk: int) -> Tally:
        """Score every pair (rows of `chunk` at a time, fewer where the vocabulary is large)."""
        from mismatch.engines.numerics import apply_numerics

        ctx = self.ctx
        model = ctx.model(ctx.trainer.compute_dtype)
        tally = Tally()
        width = max([1] + [len(r[2]) for r in self.rows])  # one width: Tally concatenates chunks
        vocab = model.get_output_embeddings().weight.shape[0]
        chunk = max(1, min(chunk, _FULL_BYTES // (4 * width * vocab)))
        with apply_numerics(model, ctx.trainer, ctx.scales(ctx.trainer), kernels=False):
            for c0 in range(0, len(self.rows), chunk):
                rows = self.rows[c0:c0 + chunk]
                evals = []
                memo: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
                for side in (0, 1):
                    lp = torch.zeros(len(rows), width)
                    full = None
                    for i, row in enumerate(rows):
                        key = (tuple(row[side]), tuple(row[2 + side]))
                        if key not in memo:  # identical ids, identical positions: scored once
                            memo[key] = _score_alone(model, row[side], row[2 + side])
                        got_lp, got_full = memo[key]
                        if got_lp.numel() == 0:
                            continue
                        if full is None:
                            full = torch.zeros(len(rows), width, got_full.shape[-1])
                        lp[i, :got_lp.numel()] = got_lp
                        full[i, :got_lp.numel()] = got_full
                    evals.append(Evaluation(logprobs=lp, full=full if full is not None
                                            else torch.zeros(len(rows), width, 1)))
                mask = torch.zeros(len(rows), width)
                for i, row in enumerate(rows):
                    mask[i, :len(row[2])] = 1.0
                tally.add(evals[0], evals[1], mask)
        return tally


def _summary(tally: Tally, seed: int) -> dict | None:
    """Tally.summary, or None under two sequences with compared tokens (no interval exists)."""
    rows = sum(int((m.sum(-1) > 0).sum()) for m in tally.mask)
    return tally.summary(seed=seed) if rows >= 2 else None


# --------------------------------------------------------------------------------- (a) round trips


@dataclass
class RoundTrip:
    """One sampled completion decoded to text and encoded again."""

    original: list[int]
    reencoded: list[int]
    aligned: list[tuple[int, int]]
    """(index in original, index in reencoded) of the tokens that survive: same id, same span."""

    @property
    def changed(self) -> bool:
        return self.original != self.reencoded

    @property
    def first_change(self) -> int | None:
        """Index in `original` of the first id that differs (None when unchanged)."""
        for i, (a, b) in enumerate(zip(self.original, self.reencoded)):
            if a != b:
                return i
        return None if not self.changed else min(len(self.original), len(self.reencoded))

    @property
    def affected(self) -> int:
        """Tokens of `original` that do not survive the round trip."""
        return len(self.original) - len(self.aligned)


def _spans(tokenizer, ids: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, id) of each token in the decoded text (ends from decoding each prefix)."""
    ends = [len(_decode(tokenizer, ids[:k + 1])) for k in range(len(ids))]
    return [(s, e, i) for s, e, i in zip([0] + ends[:-1], ends, ids)]


def round_trip(tokenizer, ids: list[int]) -> RoundTrip:
    """Decode `ids` (special tokens kept) and encode the text again."""
    reencoded = _encode(tokenizer, _decode(tokenizer, ids))
    if reencoded == list(ids):
        return RoundTrip(list(ids), reencoded, [(i, i) for i in range(len(ids))])
    where = {span: j for j, span in enumerate(_spans(tokenizer, reencoded))}
    aligned = [(i, where[span]) for i, span in enumerate(_spans(tokenizer, ids)) if span in where]
    return RoundTrip(list(ids), reencoded, aligned)


def _pieces(tokenizer, ids: list[int]) -> list[str]:
    return [_decode(tokenizer, [i]) for i in ids]


def _round_trip_example(tokenizer, trip: RoundTrip) -> str:
    d = trip.first_change or 0
    return (f"{_decode(tokenizer, trip.original[max(0, d - 3):d + 4])!r}: sampled as "
            f"{_pieces(tokenizer, trip.original[d:d + 4])}, re-encoded as "
            f"{_pieces(tokenizer, trip.reencoded[d:d + 4])}")


def measure_round_trips(ctx: ProbeContext, prompts: list[list[int]],
                        completions: list[list[int]],
                        examples: int = 2) -> tuple[dict, Tally]:
    """Round-trip each completion; figures and the trainer's Tally on the surviving tokens
    (reference = prompt + re-encoded ids, other = prompt + sampled ids)."""
    tok = ctx.tokenizer
    pairs = _Pairs(ctx)
    trips = [round_trip(tok, ids) for ids in completions]
    for prompt, trip in zip(prompts, trips):
        p = len(prompt)
        pairs.add(prompt + trip.reencoded, prompt + trip.original,
                  [p + j for _, j in trip.aligned], [p + i for i, _ in trip.aligned])
    changed = [t for t in trips if t.changed]
    tokens = sum(len(t.original) for t in trips)
    first = [t.first_change for t in changed]
    relative = [f / max(1, len(t.original)) for f, t in zip(first, changed)]
    hist = [0] * _HIST_BINS
    for r in relative:
        hist[min(_HIST_BINS - 1, int(r * _HIST_BINS))] += 1
    figures = {
        "sequences": len(trips),
        "sampled_tokens": tokens,
        "changed_sequences": len(changed),
        "changed_sequence_fraction": len(changed) / max(1, len(trips)),
        "changed_token_fraction": sum(t.affected for t in trips) / max(1, tokens),
        "first_change_position_mean": sum(first) / len(first) if first else None,
        "first_change_relative_position_mean":
            sum(relative) / len(relative) if relative else None,
        "first_change_relative_position_hist": hist,
        "examples": [_round_trip_example(tok, t) for t in changed[:examples]],
    }
    return figures, pairs.tally(ctx.cfg.batch_size)


# --------------------------------------------------------------------------------- (b) episodes


def drive_episodes(ctx: ProbeContext, config: RetokenizationConfig,
                   on_turn=None) -> list[EpisodeTrace]:
    """Run `config.episodes` conversations of `config.questions` held-out zoo tasks each with the
    target sampler, token in, token out, through the rollout engine (each next turn joins the
    running batch as its previous one ends; KV reused across turns). `on_turn(t)`: the furthest
    turn any conversation has finished, as it grows."""
    from mismatch.engines.engine import Engine
    from mismatch.engines.episodes import drive_sessions
    from mismatch.engines.numerics import apply_numerics
    from mismatch.zoo.tasks import generate_tasks

    tok = ctx.tokenizer
    spec = ctx.sampler.spec
    model = ctx.model(spec.compute_dtype)
    limit = getattr(model.config, "max_position_embeddings", None)
    room = None if limit is None else limit - config.turn_tokens
    tasks = generate_tasks("heldout", config.episodes * config.questions)
    q = config.questions
    sessions = [Session(tok, tasks[i * q:(i + 1) * q], config.max_turns)
                for i in range(config.episodes)]
    params = ctx.sampling_params(max_new_tokens=config.turn_tokens)
    engine = Engine(model, pad_id=ctx.pad_id, eos_ids=ctx.eos_ids, slots=ctx.cfg.batch_size,
                    with_routing=False)
    furthest = 0

    def turned(i: int, turn: int, comp) -> None:
        nonlocal furthest
        if turn + 1 > furthest:
            furthest = turn + 1
            if on_turn is not None:
                on_turn(furthest)

    seed = ctx.cfg.seed + _EPISODE_SEED
    with apply_numerics(model, spec, ctx.scales(spec), kernels=ctx.sampler.attention):
        drive_sessions(engine, sessions, params, room=room, on_turn=turned,
                       seed_of=lambda i, turn: (seed + i) * 1000 + turn)
    return [s.trace for s in sessions]


def _find(haystack: list[int], needle: list[int], start: int) -> int | None:
    n = len(needle)
    for j in range(start, len(haystack) - n + 1):
        if haystack[j:j + n] == needle:
            return j
    return None


def _generation_header(tokenizer) -> int:
    """Tokens of the template's generation prompt (`<|im_start|>assistant\\n`: 3 here)."""
    with_prompt = _render(tokenizer, _PROBE_CHAT, generation=True)
    return len(with_prompt) - len(_render(tokenizer, _PROBE_CHAT))


def _trainer_ids(tokenizer, trace: EpisodeTrace, after_turn: list[int], **kwargs) -> list[int]:
    """The episode re-rendered as a trainer would, without the newline after its last turn."""
    ids = _render(tokenizer, trace.messages, **kwargs)
    if after_turn and ids[-len(after_turn) - 1:] == [tokenizer.eos_token_id] + after_turn:
        ids = ids[:-len(after_turn)]
    return ids


def _cause(tokenizer, trace: EpisodeTrace, after_turn: list[int]) -> str:
    kept = _trainer_ids(tokenizer, trace, after_turn, keep_reasoning=True)
    if kept == trace.tito:
        return "reasoning_dropped"
    if _decode(tokenizer, kept) == _decode(tokenizer, trace.tito):
        return "segmentation"
    return "reserialized"


def _episode_example(tokenizer, tito: list[int], other: list[int]) -> str:
    d = next((i for i, (a, b) in enumerate(zip(tito, other)) if a != b), min(len(tito),
                                                                            len(other)))
    lead = _decode(tokenizer, tito[:d])[-_EXAMPLE_CHARS // 2:]
    a = _decode(tokenizer, tito[d:])[:_EXAMPLE_CHARS]
    b = _decode(tokenizer, other[d:])[:_EXAMPLE_CHARS]
    return f"after {lead!r}: TITO {a!r} | re-rendered {b!r}"


def measure_episodes(ctx: ProbeContext, traces: list[EpisodeTrace], render: Render = "template",
                     examples: int = 2) -> tuple[dict, Tally, Tally]:
    """Re-render each trace as a trainer would (`render="template"`), or take its TITO ids as
    they are (`"tito"`, the control). Returns the figures, the Tally of every verbatim turn's
    sampled tokens and the Tally of the changed traces alone (reference = trainer on the
    trainer's context, other = trainer on the TITO context)."""
    if render not in ("template", "tito"):
        raise ValueError(f"render must be 'template' or 'tito', got {render!r}")
    tok = ctx.tokenizer
    after_turn = _encode(tok, _after_turn(tok))
    header = _generation_header(tok)
    pairs, changed_pairs = _Pairs(ctx), _Pairs(ctx)
    causes = dict.fromkeys(_CAUSES, 0)
    shown: list[str] = []
    n_changed = n_turns = n_aligned_turns = 0
    rendered_len = 0
    for trace in traces:
        trainer = list(trace.tito) if render == "tito" else _trainer_ids(tok, trace, after_turn)
        rendered_len += len(trainer)
        ref_pos, other_pos, cursor = [], [], 0
        for start, n in trace.turns:
            h = min(header, start)
            j = _find(trainer, trace.tito[start - h:start + n], cursor)
            n_turns += 1
            if j is None:
                continue
            n_aligned_turns += 1
            ref_pos += range(j + h, j + h + n)
            other_pos += range(start, start + n)
            cursor = j + h + n
        pairs.add(trainer, trace.tito, ref_pos, other_pos)
        if trainer != trace.tito:
            n_changed += 1
            causes[_cause(tok, trace, after_turn)] += 1
            changed_pairs.add(trainer, trace.tito, ref_pos, other_pos)
            if len(shown) < examples:
                shown.append(_episode_example(tok, trace.tito, trainer))
    n = max(1, len(traces))
    figures = {
        "episodes": len(traces),
        "changed_episodes": n_changed,
        "changed_episode_fraction": n_changed / n,
        "changed_episode_causes": causes,
        "nudged_episode_fraction": sum(t.nudged for t in traces) / n,
        "turns_mean": sum(len(t.turns) for t in traces) / n,
        "verbatim_turn_fraction": n_aligned_turns / max(1, n_turns),
        "tito_tokens_mean": sum(len(t.tito) for t in traces) / n,
        "trainer_tokens_mean": rendered_len / n,
        "episode_examples": shown,
    }
    chunk = ctx.cfg.batch_size
    return figures, pairs.tally(chunk), changed_pairs.tally(chunk)


# --------------------------------------------------------------------------------- the probe


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


def _kl(summary: dict | None) -> float:
    return summary["kl_exact"] if summary else 0.0


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
            f"template (NUMERICS.md §3).")
        notes.append(
            f"The embedded model was trained on single-question episodes only: a second question "
            f"in the same chat is outside its training distribution (nudges in "
            f"{b['nudged_episode_fraction']:.1%} of conversations against "
            f"{b['single_question_nudged_fraction']:.1%} of first questions), its turns there are "
            f"fragile and their log-probs move far when earlier reasoning disappears; this run does "
            f"not say how far a model trained on multi-question chats would move.")
    return notes


def run(ctx: ProbeContext, render: Render = "template",
        config: RetokenizationConfig = RetokenizationConfig()) -> SourceResult:
    """Measure decode→re-encode round trips (a) and multi-turn template re-rendering (b).

    render="tito": the control, the trainer's context is the TITO sequence itself."""
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
    parts = {"decode_reencode": _summary(tally_a, ctx.cfg.seed)}
    examples = list(figures_a["examples"])
    figures_b, tally_b = None, Tally()
    if has_template:
        traces = [t for t in drive_episodes(ctx, config, lambda t: step(n_batches + 1 + t - done))
                  if t.turns]  # a prompt too long for one turn under the model's context
        figures_b, tally_b, tally_changed = measure_episodes(ctx, traces, render,
                                                             config.examples)
        figures_b["questions"] = config.questions
        figures_b["response_tokens_compared"] = tally_b.tokens
        parts["multi_turn_template"] = _summary(tally_b, ctx.cfg.seed)
        if 0 < figures_b["changed_episodes"] < len(traces):
            parts["multi_turn_template_changed_episodes"] = _summary(tally_changed, ctx.cfg.seed)
        firsts = [t.first_question() for t in traces if t.questions]
        if config.questions > 1 and firsts:
            single, tally_single, _ = measure_episodes(ctx, firsts, render, 0)
            figures_b["single_question_changed_fraction"] = single["changed_episode_fraction"]
            figures_b["single_question_nudged_fraction"] = single["nudged_episode_fraction"]
            parts["single_question"] = _summary(tally_single, ctx.cfg.seed)
        step(total - done)
        examples += figures_b.pop("episode_examples")
        extra.update(figures_b)
    extra["render"] = render
    extra["examples"] = examples
    parts = {k: v for k, v in parts.items() if v is not None}
    return SourceResult(name="retokenization", headline=parts.get("multi_turn_template"),
                        parts=parts, extra=extra, notes=_notes(figures_a, figures_b, render, parts),
                        log_ratio=tally_b.log_ratio() if tally_b.tokens else None)
