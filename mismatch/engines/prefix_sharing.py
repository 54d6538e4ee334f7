"""Requests with the same prompt, prefilled once (the engine's shared prefill).

A GRPO group asks for `samples_per_prompt` completions of one prompt; a serving engine computes
that prompt's KV once and lets the group's sequences share it (vLLM's parallel sampling, n > 1,
over its prefix cache: docs.vllm.ai "Automatic Prefix Caching"; SGLang's radix cache). Here the
rows of one prefill forward that start from an empty slot with the same tokens and the same lane
(the same numerics) are computed once; the engine copies the KV the first of them wrote into the
others' slots (`SlotCache.copy_prefix`) and hands each the same last-token logits.

Every row of a forward computes its own tokens alone (its own positions, its own slot's keys, its
own per-row activation scales), so the shared row's KV and logits are those each copy would have
computed in the same batch — the same bits where the kernels do not block their reduction by the
batch's row count (the engine's batch-composition caveat).
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

__all__ = ["shared_rows", "copy_shared"]


def shared_rows(starts: Sequence[int], inputs: Sequence[Sequence[int]],
                lanes: Sequence[Hashable]) -> tuple[list[int], list[int]] | None:
    """(computed, source) for a prefill batch: `computed` the rows to run (the first of each
    set of rows that start at position 0 with the same tokens and lane, and every other row), and
    source[i] the index into `computed` whose KV and logits row i takes. None when no two rows
    share a prompt (run the batch as it is)."""
    computed: list[int] = []
    source: list[int] = []
    first: dict[tuple, int] = {}
    for i, (start, x, lane) in enumerate(zip(starts, inputs, lanes)):
        key = (tuple(x), lane) if start == 0 else None
        j = first.get(key) if key is not None else None
        if j is None:
            j = len(computed)
            computed.append(i)
            if key is not None:
                first[key] = j
        source.append(j)
    return None if len(computed) == len(source) else (computed, source)


def copy_shared(cache, routing: torch.Tensor | None, state: list, rows: Sequence[int],
                inputs: Sequence[Sequence[int]], computed: list[int], source: list[int]) -> int:
    """After the computed rows' forward: give each shared row's slot the KV (`cache`, a
    SlotCache), the routing record ([slots, capacity, L, k] or None) and the token list (`state`,
    the engine's per-slot states: its prompt) of the row it shares with; returns the prompt
    tokens copied."""
    copies = [(rows[computed[j]], rows[i], len(inputs[i])) for i, j in enumerate(source)
              if computed[j] != i]
    src = torch.tensor([c[0] for c in copies], dtype=torch.long)
    dst = torch.tensor([c[1] for c in copies], dtype=torch.long)
    n = max(c[2] for c in copies)
    device = cache.keys[0].device
    cache.copy_prefix(src.to(device), dst.to(device), n)
    if routing is not None:
        routing[dst, :n] = routing[src, :n]
    for i, j in enumerate(source):
        if computed[j] != i:
            state[rows[i]].tokens = list(inputs[i])
    return sum(c[2] for c in copies)
