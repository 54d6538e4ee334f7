"""Multi-turn chat-template re-rendering (the retokenization probe's part (b); retokenization.py
explains the measurement): conversations driven token in, token out by the target sampler, then
re-rendered from their messages as a message-keeping trainer does, compared turn by turn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from mismatch.engines.episodes import PROBE_CHAT as _PROBE_CHAT
from mismatch.engines.episodes import EpisodeTrace, Session
from mismatch.engines.episodes import after_turn_text as _after_turn
from mismatch.engines.episodes import decode_ids as _decode
from mismatch.engines.episodes import encode_text as _encode
from mismatch.engines.episodes import render_chat as _render

from .aligned_pairs import AlignedPairs
from .context import ProbeContext
from .tally import Tally

if TYPE_CHECKING:
    from .config import RetokenizationConfig

__all__ = ["Render", "drive_episodes", "measure_episodes"]

Render = Literal["template", "tito"]
"""The trainer's context: the chat template re-rendered from messages, or the TITO ids (control)."""
_EPISODE_SEED = 1_000_003  # seed offset of episode sampling: apart from the shared batches' 0, 1, ..
_EXAMPLE_CHARS = 48  # characters of context shown on each side of an example's change
_CAUSES = ("reasoning_dropped", "segmentation", "reserialized")


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
    pairs, changed_pairs = AlignedPairs(ctx), AlignedPairs(ctx)
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

