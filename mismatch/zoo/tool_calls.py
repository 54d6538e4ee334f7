"""Reading a generated assistant turn: its reasoning, its tool calls, and running those calls.

A reply is the text a policy generated after `<|im_start|>assistant\n`, in the chat template's
format (chat_template.py):

    <think>\n{reasoning}\n</think>\n\n{content}<tool_call>\n{"name": "calc", "arguments": {...}}\n
    </tool_call><|im_end|>

`parse_reply` never raises on model output: what it cannot read becomes an entry of
`Reply.errors` (a malformed call is a format error, as the RL loop counts them). Only JSON is
parsed (`json.loads`, bounded by `MAX_REPLY_CHARS`); `execute_call` runs the calculator of
tool_lang.py, nothing else.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .tasks import tool_message
from .tool_lang import DEFAULT_LIMITS, ToolError, ToolLimits, evaluate

__all__ = ["ToolCall", "Reply", "parse_reply", "execute_call", "TOOL_NAMES", "MAX_REPLY_CHARS",
           "MAX_CALLS_PER_REPLY"]

TOOL_NAMES = ("calc", "submit")
MAX_REPLY_CHARS = 16_384  # a reply longer than this is not parsed at all (bounds json.loads work)
MAX_CALLS_PER_REPLY = 4  # further calls in one reply are ignored and reported as an error
_END_MARKERS = ("<|im_end|>", "<|endoftext|>")
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    """One well-formed tool call."""

    name: str
    """The tool's name (not necessarily a known tool: `execute_call` reports unknown ones)."""
    arguments: dict[str, Any]
    """The decoded JSON arguments object."""


@dataclass(frozen=True, kw_only=True)
class Reply:
    """A parsed assistant turn."""

    reasoning: str | None
    """Text of the `<think>` block (stripped of surrounding newlines), None without one."""
    content: str
    """Visible text outside the think block and the tool calls, stripped."""
    tool_calls: tuple[ToolCall, ...]
    """The well-formed calls, in order."""
    errors: tuple[str, ...] = field(default=())
    """What could not be read (malformed JSON, unclosed tags, too many calls, ...)."""

    def to_message(self) -> dict[str, Any]:
        """The assistant message this reply re-renders as (for re-rendering a history)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls]
        return message


def _strip_end(text: str) -> str:
    text = text.rstrip()
    for marker in _END_MARKERS:
        if marker in text:
            text = text[: text.index(marker)]
    return text


def _split_reasoning(text: str) -> tuple[str | None, str, list[str]]:
    """(reasoning, rest, errors); accepts a reply whose `<think>` was in the prompt."""
    if "</think>" not in text:
        if "<think>" in text:
            return None, text.replace("<think>", ""), ["unclosed <think> block"]
        return None, text, []
    head, rest = text.split("</think>", 1)
    errors = ["more than one </think>"] if "</think>" in rest else []
    reasoning = head.split("<think>")[-1].strip("\n")
    return reasoning, rest.lstrip("\n"), errors


def _parse_call(body: str) -> ToolCall | str:
    """A ToolCall, or the reason the body of a <tool_call> block is not one."""
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as exc:
        return f"tool call is not JSON ({exc.msg if hasattr(exc, 'msg') else 'too deep'})"
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"}:
        return 'tool call must be {"name": ..., "arguments": {...}}'
    if not isinstance(obj["name"], str) or not isinstance(obj["arguments"], dict):
        return "tool call name must be a string and arguments an object"
    return ToolCall(name=obj["name"], arguments=obj["arguments"])


def parse_reply(text: str) -> Reply:
    """Parse one generated assistant turn (with or without its trailing `<|im_end|>`)."""
    if len(text) > MAX_REPLY_CHARS:
        return Reply(reasoning=None, content="", tool_calls=(),
                     errors=(f"reply too long ({len(text)} > {MAX_REPLY_CHARS} characters)",))
    reasoning, rest, errors = _split_reasoning(_strip_end(text))
    calls: list[ToolCall] = []
    for match in _CALL.finditer(rest):
        parsed = _parse_call(match.group(1).strip())
        if isinstance(parsed, str):
            errors.append(parsed)
        elif len(calls) == MAX_CALLS_PER_REPLY:
            errors.append(f"more than {MAX_CALLS_PER_REPLY} tool calls in one reply")
            break
        else:
            calls.append(parsed)
    content = _CALL.sub("", rest)
    if "<tool_call>" in content or "</tool_call>" in content:
        errors.append("unbalanced <tool_call> tags")
    return Reply(reasoning=reasoning, content=content.strip(), tool_calls=tuple(calls),
                 errors=tuple(errors))


def execute_call(call: ToolCall, limits: ToolLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Run a `calc` call and return the tool message (a result or an `error: ...` text).

    `submit` is not executed here: the episode (episode.py) scores it.
    """
    if call.name != "calc":
        known = ", ".join(TOOL_NAMES)
        return tool_message(f"error: unknown tool {call.name[:40]!r}; tools are {known}")
    if set(call.arguments) != {"expression"}:
        return tool_message('error: calc takes exactly one argument, "expression"')
    try:
        return tool_message(str(evaluate(call.arguments["expression"], limits)))
    except ToolError as exc:
        return tool_message(f"error: {exc}")

