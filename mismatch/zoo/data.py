"""Transcripts as token tensors: encoding with the chat template, padding, the training stream.

Glossary: B transcripts per batch, T tokens (the longest transcript in the batch).

A batch holds, all [B, T]:
    input_ids       int64  token ids, right-padded with the pad token
    attention_mask  int64  1 on real tokens, 0 on padding
    labels          int64  input_ids with padding set to -100 (HF causal-LM loss shifts them)
    assistant_mask  bool   True on tokens the assistant generates (template `{% generation %}`)

The training stream draws task seeds from `random.Random(seed)` within the training split, so a
build seed fixes the exact sequence of batches.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from .tasks import HELDOUT_SEED_BASE, TOOLS, Task, make_task

if TYPE_CHECKING:
    import torch

__all__ = ["Batch", "encode_messages", "collate", "encode_tasks", "train_batches"]

IGNORE_INDEX = -100  # labels with this value do not enter the loss (HF convention)


@dataclass(frozen=True, kw_only=True)
class Batch:
    """Padded token tensors of B transcripts (shapes in the module docstring)."""

    input_ids: "torch.Tensor"
    """[B, T] int64 token ids, right-padded."""
    attention_mask: "torch.Tensor"
    """[B, T] int64, 1 on real tokens."""
    labels: "torch.Tensor"
    """[B, T] int64, input_ids with padding set to IGNORE_INDEX."""
    assistant_mask: "torch.Tensor"
    """[B, T] bool, True on assistant-generated tokens."""


def encode_messages(tokenizer, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """(token ids, assistant mask) of one transcript rendered with `TOOLS` by the chat template."""
    out = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def collate(encoded: list[tuple[list[int], list[int]]], pad_token_id: int) -> Batch:
    """Right-pad encoded transcripts into a `Batch`."""
    import torch

    if not encoded:
        raise ValueError("collate needs at least one transcript")
    width = max(len(ids) for ids, _ in encoded)
    rows = len(encoded)
    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((rows, width), dtype=torch.int64)
    assistant_mask = torch.zeros((rows, width), dtype=torch.bool)
    for row, (ids, mask) in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        attention_mask[row, : len(ids)] = 1
        assistant_mask[row, : len(mask)] = torch.tensor(mask, dtype=torch.bool)
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    return Batch(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                 assistant_mask=assistant_mask)


def encode_tasks(tokenizer, tasks: list[Task], max_tokens: int) -> Batch:
    """The gold transcripts of `tasks` as one batch; refuses transcripts over `max_tokens`."""
    encoded = [encode_messages(tokenizer, task.gold_messages()) for task in tasks]
    longest = max(len(ids) for ids, _ in encoded)
    if longest > max_tokens:
        raise ValueError(f"a transcript has {longest} tokens, more than max_tokens={max_tokens}")
    return collate(encoded, tokenizer.pad_token_id)


def train_batches(tokenizer, *, seed: int, batch_size: int, steps: int,
                  max_tokens: int) -> Iterator[Batch]:
    """`steps` batches of gold training transcripts, task seeds drawn from `Random(seed)`."""
    rng = random.Random(seed)
    for _ in range(steps):
        tasks = [make_task(rng.randrange(HELDOUT_SEED_BASE)) for _ in range(batch_size)]
        yield encode_tasks(tokenizer, tasks, max_tokens)
