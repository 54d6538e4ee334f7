"""The chat template of the embedded model: Qwen3's format, with reasoning stripping switchable.

Rendered text (ChatML with Qwen3's tool and thinking conventions):

    <|im_start|>system\n{system}\n\n# Tools\n<tools>\n{tool json}\n...\n</tools>\n{how to call}<|im_end|>\n
    <|im_start|>user\n{question}<|im_end|>\n
    <|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n<tool_call>\n{"name": .., "arguments": ..}\n</tool_call><|im_end|>\n
    <|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n
    <|im_start|>assistant\n ...

Rules taken from Qwen3's template:
- tool results (role "tool") are rendered inside a user turn; consecutive ones share that turn;
- the "last query" is the last user message that is not a tool response. Assistant turns before it
  lose their reasoning (only their content and tool calls are rendered); turns after it keep a
  `<think>` block (the final assistant turn gets an empty one if it has no reasoning);
- `add_generation_prompt` appends `<|im_start|>assistant\n`; with `enable_thinking=false` it also
  appends an empty `<think>\n\n</think>\n\n`.

The one addition: the template variable `keep_reasoning` (default false). When true, every
assistant turn keeps its reasoning, which makes the rendering of a multi-turn episode prefix-stable
(render(history) is a prefix of render(history + more)) — what token-in-token-out RL needs and
what Qwen3's stripping breaks as soon as a user message follows assistant turns.

Assistant bodies are wrapped in `{% generation %}` so `return_assistant_tokens_mask=True` marks
exactly the tokens a policy generates (from after `<|im_start|>assistant\n` to `<|im_end|>`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CHAT_TEMPLATE", "render", "continuation_text", "SPECIAL_TOKENS", "ADDED_TOKENS",
           "EOS_TOKEN", "PAD_TOKEN"]

PAD_TOKEN = "<|endoftext|>"  # padding and end of document (Qwen's convention)
EOS_TOKEN = "<|im_end|>"  # a turn ends here; generation stops here
SPECIAL_TOKENS = (PAD_TOKEN, "<|im_start|>", EOS_TOKEN)
"""Control tokens: atomic, skipped by `decode(..., skip_special_tokens=True)`."""
ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>",
                "<tool_response>", "</tool_response>")
"""Markup tokens: atomic but kept on decode (Qwen3 marks them special=False the same way)."""

CHAT_TEMPLATE = r"""
{%- set keep_reasoning = keep_reasoning | default(false) -%}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\nCall a tool with <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' and message.content is string and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- generation %}
        {%- if (keep_reasoning or loop.index0 > ns.last_query_index) and (loop.last or reasoning_content) %}
            {{- '<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif not (message.role == 'system' and loop.first) %}
        {{- raise_exception('unknown role ' + message.role + ': use system, user, assistant or tool') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
""".strip()


def render(messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
           add_generation_prompt: bool = False, keep_reasoning: bool = False) -> str:
    """Render `messages` with `CHAT_TEMPLATE` exactly as `tokenizer.apply_chat_template` would.

    Usable before a tokenizer exists (the tokenizer is trained on this text).
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages], tools=tools, chat_template=CHAT_TEMPLATE,
        add_generation_prompt=add_generation_prompt, keep_reasoning=keep_reasoning)
    return rendered[0]


def continuation_text(env_messages: list[dict[str, Any]]) -> str:
    """What follows a generated assistant turn (ending in `<|im_end|>`) when the environment
    answers with `env_messages` (tool results and/or user turns), up to the next generation prompt.

    Appending these tokens to the generated ones (token in, token out) reproduces
    `render(..., keep_reasoning=True)` of the whole episode.
    """
    if not env_messages:
        raise ValueError("continuation_text needs at least one tool or user message")
    if any(m.get("role") not in ("tool", "user") for m in env_messages):
        raise ValueError("continuation_text takes only tool and user messages, got roles "
                         f"{[m.get('role') for m in env_messages]}")
    return "\n" + render(env_messages, add_generation_prompt=True)
