"""Why an episode ended, read from the metrics a framework logs about it.

The collapse's ending is the policy stopping its tool calls: in the study's environment three
replies in a row without a tool call end an episode, and at the collapsed checkpoint 62% of
episodes ended that way. A record may carry a step's raw `episodes` (an explicit `end_reason`,
or the replies themselves); `episode_summary` replays them under the environment's rules
(mismatch/zoo/episode.py) and gives the step's format-error share and mean reward, which the
monitor judges as the `format_error_rate` and `reward` signals.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from mismatch.probes.monitor.signals import as_number

__all__ = ["FORMAT_ERROR_REASONS", "episode_end_reason", "episode_summary"]

FORMAT_ERROR_REASONS = frozenset({"format_errors", "format_error", "repeated_format_errors",
                                  "no_tool_call"})
"""End reasons that count as "ended on repeated format errors" (`format_errors` is the zoo's,
mismatch/zoo/episode.py; the others are spellings seen in other environments)."""


def _reply_calls(reply: Any) -> tuple[bool, bool] | None:
    """(made a well-formed tool call, submitted) for one reply, or None if it says neither.

    A reply is a bool or 0/1 (1: it called a tool), a dict with `tool_call` (bool), `tool_calls`
    (list of calls, each a dict with a `name`), `submit` (bool), or `content`/`text` (the raw
    reply), or the raw reply text itself, parsed as the zoo's RL loop parses it.
    """
    if isinstance(reply, bool):
        return reply, False
    if isinstance(reply, str):
        from mismatch.zoo.tool_calls import parse_reply

        calls = parse_reply(reply).tool_calls
        return bool(calls), any(c.name == "submit" for c in calls)
    if not isinstance(reply, Mapping):
        return None
    submitted = reply.get("submit") is True or reply.get("tool") == "submit"
    if "tool_calls" in reply and isinstance(reply["tool_calls"], list):
        calls = reply["tool_calls"]
        submitted = submitted or any(isinstance(c, Mapping) and c.get("name") == "submit"
                                     for c in calls)
        return bool(calls) or submitted, submitted
    if "tool_call" in reply:
        return bool(reply["tool_call"]) or submitted, submitted
    text = reply.get("content", reply.get("text"))
    if isinstance(text, str):
        return _reply_calls(text)
    return (True, True) if submitted else None


def _flags(replies: list) -> bytes | None:
    """Replies given as bools (or 0/1) as one byte each, or None for any other form."""
    if not replies or type(replies[0]) not in (bool, int):
        return None
    try:
        flags = bytes(replies)
    except (TypeError, ValueError):
        return None
    return None if flags.translate(None, b"\x00\x01") else flags


def episode_end_reason(episode: Any, *, max_format_errors: int = 3,
                       max_turns: int | None = None) -> str | None:
    """Why an episode ended: "format_errors", "submit", "turn_limit", another stated reason,
    "other" (replies without a terminating event), or None when the record says nothing usable.

    An explicit `end_reason` wins (format-error spellings in FORMAT_ERROR_REASONS map to
    "format_errors"); otherwise the `replies` (or `turns`) are replayed under the environment's
    rules (mismatch/zoo/episode.py): `max_format_errors` replies in a row without a tool call end
    it, a submit ends it, `max_turns` replies end it.
    """
    if type(episode) is not dict and not isinstance(episode, Mapping):
        return None
    reason = episode.get("end_reason")
    if isinstance(reason, str) and reason:
        return "format_errors" if reason in FORMAT_ERROR_REASONS else reason
    replies = episode.get("replies", episode.get("turns"))
    if not isinstance(replies, list):
        return None
    flags = _flags(replies)
    if flags is not None:  # the compact form, scanned in C
        at = flags.find(b"\x00" * max_format_errors)
        ended = at + max_format_errors if at >= 0 else None  # 1-based reply that ends it
        if max_turns is not None and len(flags) >= max_turns and (ended is None
                                                                  or ended > max_turns):
            return "turn_limit"
        return "format_errors" if ended is not None else "other"
    streak = 0
    for i, reply in enumerate(replies, 1):
        if reply is True or reply is False:
            called, submitted = reply, False
        elif type(reply) is dict and len(reply) == 1 and "tool_call" in reply:  # compact form
            called, submitted = bool(reply["tool_call"]), False
        else:
            calls = _reply_calls(reply)
            if calls is None:
                return None
            called, submitted = calls
        if not called:
            streak += 1
            if streak >= max_format_errors:
                return "format_errors"
        else:
            streak = 0
            if submitted:
                return "submit"
        if max_turns is not None and i >= max_turns:
            return "turn_limit"
    return "other"


def episode_summary(episodes: Any, *, max_format_errors: int = 3,
                    max_turns: int | None = None) -> dict[str, Any]:
    """End reasons of a step's episodes: {episodes, bad, end_reasons, format_error_rate, reward}.

    `reward` is the mean of the episodes' numeric `reward` fields (None if none has one);
    `bad` counts entries that say nothing usable (they are left out of the shares).
    """
    reasons: dict[str, int] = {}
    reward_sum, rewarded, bad = 0.0, 0, 0
    for episode in episodes if isinstance(episodes, list) else ():
        reason = episode_end_reason(episode, max_format_errors=max_format_errors,
                                    max_turns=max_turns)
        if reason is None:
            bad += 1
            continue
        reasons[reason] = reasons.get(reason, 0) + 1
        r = as_number(episode.get("reward"))
        if r is not None and math.isfinite(r):
            reward_sum += r
            rewarded += 1
    if not isinstance(episodes, list):
        bad += 1
    n = sum(reasons.values())
    return {"episodes": n, "bad": bad, "end_reasons": reasons,
            "format_error_rate": reasons.get("format_errors", 0) / n if n else None,
            "reward": reward_sum / rewarded if rewarded else None}
