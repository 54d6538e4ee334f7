"""Prompts as token ids: the shipped held-out tasks through the chat template, or a user's JSONL
file; and the token ids that end a completion."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ZooError

__all__ = ["eos_ids", "load_prompts"]


def load_prompts(tokenizer, path: Path | None, n: int, *, start: int = 0) -> list[list[int]]:
    """Token-id prompts: the shipped held-out tasks rendered with the chat template (from task
    `start` on), or a JSONL file of {"messages": [...]} (rendered with the template) or
    {"prompt": "text"} lines."""
    if path is None:
        from mismatch.zoo.tasks import TOOLS, generate_tasks

        tasks = generate_tasks("heldout", n, start=start)
        return [list(tokenizer.apply_chat_template(t.prompt_messages(), tools=TOOLS,
                                                   add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)) for t in tasks]
    path = Path(path)
    if not path.is_file():
        raise ZooError(f"prompt file {path} does not exist")
    prompts: list[list[int]] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ZooError(f"{path}:{lineno}: not JSON ({exc.msg}); one object per line") from None
        if isinstance(row, dict) and isinstance(row.get("messages"), list):
            ids = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        else:
            raise ZooError(f"{path}:{lineno}: need {{\"messages\": [...]}} or "
                             f"{{\"prompt\": \"...\"}}")
        if len(ids) == 0:
            raise ZooError(f"{path}:{lineno}: the prompt is empty")
        prompts.append(list(ids))
        if len(prompts) == n:
            break
    if not prompts:
        raise ZooError(f"prompt file {path} holds no prompts")
    return prompts


def eos_ids(tokenizer, model) -> set[int]:
    """The end-of-sequence ids of the tokenizer and of the model's generation config."""
    ids = {tokenizer.eos_token_id}
    gen = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen if isinstance(gen, (list, tuple)) else [gen])
    return {i for i in ids if isinstance(i, int)}
