"""Multi-turn episodes driven token in, token out (TITO) through the rollout engine.

A `Session` is one conversation of zoo tasks asked in turn (zoo/episode.py: tool results,
format-error nudges, turn limits); when one task's episode ends, the user asks the next task's
question in the same conversation. Its `trace.tito` is exactly the sequence the sampler saw: the
context of turn k+1 is the context of turn k, the ids sampled in turn k (closed with the
end-of-turn token if the length cap cut it), then the environment's answer rendered as the
template's continuation and encoded on its own. Nothing is decoded and re-encoded on the way.

`drive_sessions` plays many sessions through one `Engine` at once, continuously: as soon as one
conversation's turn ends, the environment answers and its next turn joins the running batch (no
waiting for the batch's longest reply), and with KV reuse that turn prefills only the new tokens.
train/ (RL episodes) and probes/ (the retokenization probe) both drive their conversations here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .engine import Engine
from .requests import Completion, Request
from .logits import SamplingParams

__all__ = ["EpisodeError", "EpisodeTrace", "Session", "continuation_ids", "render_chat",
           "drive_sessions", "decode_ids", "encode_text", "after_turn_text", "PROBE_CHAT"]


class EpisodeError(ValueError):
    """A chat template or tokenizer that cannot drive token-in-token-out conversations."""


def decode_ids(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def encode_text(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class EpisodeTrace:
    """What the sampler saw in one conversation, and what the environment recorded."""

    tito: list[int]
    """Prompt ids, then each turn's sampled ids (closed if cut), then each continuation."""
    turns: list[tuple[int, int]] = field(default_factory=list)
    """(start in `tito`, sampled tokens) of each assistant turn."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The chat the trainer re-renders: system, questions, turns and environment answers."""
    questions: list[tuple[int, int, int]] = field(default_factory=list)
    """(len(tito), len(messages), len(turns)) when each finished question's episode ended."""

    @property
    def nudged(self) -> bool:
        """Whether a format-error nudge (a user message) followed some turn."""
        from mismatch.zoo.episode import NUDGE

        return any(m["role"] == "user" and m["content"] == NUDGE for m in self.messages)

    def first_question(self) -> EpisodeTrace:
        """The conversation cut where its first question's episode ended."""
        if not self.questions:
            raise ValueError("the first question's episode has not ended")
        n_tito, n_messages, n_turns = self.questions[0]
        return EpisodeTrace(tito=self.tito[:n_tito], turns=self.turns[:n_turns],
                            messages=self.messages[:n_messages], questions=self.questions[:1])


def render_chat(tokenizer, messages: list[dict], *, generation: bool = False,
            tokenize: bool = True, **kwargs):
    from mismatch.zoo.tasks import TOOLS

    out = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=generation,
                                        tokenize=tokenize, return_dict=False, **kwargs)
    return list(out) if tokenize else out


PROBE_CHAT = [{"role": "user", "content": "?"}]


def after_turn_text(tokenizer) -> str:
    """Text the template writes after an assistant turn's end-of-turn token ("\\n" in ChatML)."""
    closed = render_chat(tokenizer, PROBE_CHAT + [{"role": "assistant", "content": "ok"}],
                     tokenize=False)
    eos = tokenizer.eos_token
    return closed[closed.rindex(eos) + len(eos):]


def continuation_ids(tokenizer, env_messages: list[dict]) -> list[int]:
    """Ids a TITO framework appends after a finished assistant turn when the environment
    answers with `env_messages`: the rest of the turn's line, the answer, the generation prompt
    (for the embedded template: chat_template.continuation_text)."""
    head = render_chat(tokenizer, PROBE_CHAT, tokenize=False)
    full = render_chat(tokenizer, PROBE_CHAT + list(env_messages), generation=True, tokenize=False)
    if not full.startswith(head):
        raise EpisodeError("the chat template renders a history differently once tool or user "
                         "messages follow; cannot build token-in-token-out continuations")
    return encode_text(tokenizer, after_turn_text(tokenizer) + full[len(head):])


class Session:
    """One conversation of zoo tasks asked in turn, recorded token in, token out.

    Each task is an `Episode` (zoo/episode.py: tool results, nudges, its own turn limit); when
    one ends, the user asks the next task's question in the same conversation."""

    def __init__(self, tokenizer, tasks: list, max_turns: int = 4) -> None:
        from mismatch.zoo.episode import Episode, EpisodeConfig

        if not tasks:
            raise ValueError("a session needs at least one task")
        self.tokenizer, self.tasks, self.index = tokenizer, list(tasks), 0
        self._episode = lambda task: Episode(task, EpisodeConfig(max_turns=max_turns))
        self.episode = self._episode(self.tasks[0])
        messages = self.tasks[0].prompt_messages()
        self.trace = EpisodeTrace(tito=render_chat(tokenizer, messages, generation=True),
                                  messages=messages)

    def step(self, ids: list[int], room: int | None = None) -> bool:
        """Record one sampled assistant turn `ids` and what follows it; returns whether the
        conversation goes on. `room`: the longest context that leaves space for another turn."""
        tok, tr = self.tokenizer, self.trace
        eos = tok.eos_token_id
        tr.turns.append((len(tr.tito), len(ids)))
        tr.tito.extend(ids)
        if not ids or ids[-1] != eos:
            tr.tito.append(eos)  # a turn cut at the length cap: the framework closes it
        result = self.episode.step(decode_ids(tok, ids))
        tr.messages.append(result.reply.to_message())
        env = list(result.env_messages)
        if result.done:
            tr.questions.append((len(tr.tito), len(tr.messages), len(tr.turns)))
            self.index += 1
            if self.index == len(self.tasks):
                return False
            self.episode = self._episode(self.tasks[self.index])
            env = [{"role": "user", "content": self.tasks[self.index].question}]
        more = continuation_ids(tok, env)
        if room is not None and len(tr.tito) + len(more) > room:
            return False
        tr.tito.extend(more)
        tr.messages.extend(env)
        return True




def drive_sessions(engine: Engine, sessions: list[Session], params: SamplingParams, *,
                   seed_of: Callable[[int, int], int], room: int | None = None,
                   on_turn: Callable[[int, int, Completion], None] | None = None,
                   progress: Callable[[int], None] | None = None,
                   lane_of: Callable[[int], int] | None = None) -> list[set[str]]:
    """Play `sessions` to their end through `engine`, every turn one request of session i with
    stream seed `seed_of(i, turn)`. `room`: the longest context that leaves space for another
    turn (a session that outgrows it stops). `on_turn(i, turn, completion)` sees each turn's
    completion before the session steps. `lane_of(i)`: the lane whose numerics compute session
    i (mismatch.engines.lanes; default 0). Returns, per session, {"context_limit"} when it was cut
    for room (never started, or stopped mid-conversation), else an empty set."""
    cut: list[set[str]] = [set() for _ in sessions]
    turns = [0] * len(sessions)

    def request(i: int) -> Request:
        return Request(prompt=list(sessions[i].trace.tito), params=params,
                       seed=seed_of(i, turns[i]), session=("session", i), tag=i,
                       lane=lane_of(i) if lane_of is not None else 0)

    def finished(comp: Completion) -> Request | None:
        i = comp.request.tag
        if on_turn is not None:
            on_turn(i, turns[i], comp)
        turns[i] += 1
        s = sessions[i]
        if s.step(list(comp.tokens), room):
            return request(i)
        if not s.episode.done:
            cut[i].add("context_limit")
        return None

    first = []
    for i, s in enumerate(sessions):
        if room is not None and len(s.trace.tito) > room:
            cut[i].add("context_limit")
        else:
            first.append(request(i))
    engine.run(first, on_finish=finished, progress=progress)
    return cut
