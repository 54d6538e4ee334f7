"""The multi-turn tool-use episode: the environment side of the RL loop.

A policy is shown `episode.messages` (rendered with `add_generation_prompt=True`), generates one
assistant turn, and hands the text to `episode.step`. The environment then

- runs every `calc` call and answers with tool messages;
- ends the episode on a `submit` call, scoring it with `tasks.reward` (1 correct, 0 otherwise);
- answers a reply without a well-formed tool call with a user nudge (`NUDGE`) and ends the
  episode after `max_format_errors` such replies in a row — the collapse signature of
  the reference study (docs/study.md: "three replies in a row without a tool call");
- ends the episode after `max_turns` assistant turns.

A nudge is a user message, so under the default (Qwen3) rendering the reasoning of every earlier
assistant turn disappears from the re-rendered history: one way re-rendering diverges from
token-in-token-out (chat_template.py, `keep_reasoning`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .tasks import Task, reward
from .tool_calls import Reply, execute_call, parse_reply
from .tool_lang import DEFAULT_LIMITS, ToolLimits

__all__ = ["EpisodeConfig", "Episode", "StepResult", "EndReason", "NUDGE"]

EndReason = Literal["submit", "turn_limit", "format_errors"]
NUDGE = "Please call calc or submit inside <tool_call></tool_call>."


@dataclass(frozen=True, kw_only=True)
class EpisodeConfig:
    """Rules of one episode."""

    max_turns: int = 8
    """Most assistant turns before the episode ends unscored."""
    max_format_errors: int = 3
    """Replies in a row without a well-formed tool call that end the episode."""
    limits: ToolLimits = DEFAULT_LIMITS
    """Size limits of each calculator call."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"EpisodeConfig.max_turns must be >= 1, got {self.max_turns}")
        if self.max_format_errors < 1:
            raise ValueError("EpisodeConfig.max_format_errors must be >= 1, "
                             f"got {self.max_format_errors}")


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What one assistant turn led to."""

    reply: Reply
    """The parsed turn."""
    env_messages: tuple[dict[str, Any], ...]
    """Tool results or the nudge appended after the turn (empty when the episode ended)."""
    done: bool
    """Whether the episode is over."""
    end_reason: EndReason | None
    """Why it ended (None while running)."""
    reward: float
    """The episode's reward once done (0.0 before, and for endings other than a correct submit)."""


class Episode:
    """One task being solved; mutable state, one `step` per generated assistant turn."""

    def __init__(self, task: Task, config: EpisodeConfig = EpisodeConfig()) -> None:
        self.task = task
        self.config = config
        self.messages: list[dict[str, Any]] = task.prompt_messages()
        self.turns = 0
        self.format_error_streak = 0
        self.done = False
        self.end_reason: EndReason | None = None
        self.reward = 0.0

    def _end(self, reason: EndReason, value: float = 0.0) -> None:
        self.done, self.end_reason, self.reward = True, reason, value

    def step(self, reply_text: str) -> StepResult:
        """Feed one generated assistant turn; returns what the environment answered."""
        if self.done:
            raise RuntimeError(f"episode of task {self.task.seed} is over ({self.end_reason})")
        reply = parse_reply(reply_text)
        self.turns += 1
        self.messages.append(reply.to_message())
        env: list[dict[str, Any]] = []
        if not reply.tool_calls:
            self.format_error_streak += 1
            if self.format_error_streak >= self.config.max_format_errors:
                self._end("format_errors")
            else:
                env.append({"role": "user", "content": NUDGE})
        else:
            self.format_error_streak = 0
            for call in reply.tool_calls:
                if call.name == "submit":
                    self._end("submit", reward(self.task, call.arguments.get("answer")))
                    break
                env.append(execute_call(call, self.config.limits))
        if not self.done and self.turns >= self.config.max_turns:
            self._end("turn_limit")
        if self.done:
            env = []
        self.messages.extend(env)
        return StepResult(reply=reply, env_messages=tuple(env), done=self.done,
                          end_reason=self.end_reason, reward=self.reward)
