"""Greedy episodes on held-out tasks: how often the model solves the task family on its own.

Each turn, every unfinished episode's history is rendered with the chat template
(`add_generation_prompt=True`), the batch is left-padded, the model decodes greedily until
`<|im_end|>` (at most `max_new_tokens`), and the text goes to `Episode.step`. This re-renders the
history each turn (it is an evaluation, not a token-in-token-out rollout); the histories hold only
tool results unless the model forgets a tool call, so nothing is stripped in the common case.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from .episode import Episode, EpisodeConfig
from .tasks import TOOLS, Task

__all__ = ["SolveFigures", "greedy_solve"]


@dataclass(frozen=True, kw_only=True)
class SolveFigures:
    """Outcome of greedy episodes."""

    episodes: int
    """How many episodes ran."""
    solve_rate: float
    """Share that ended with a correct `submit` (mean reward)."""
    by_kind: dict[str, float] = field(default_factory=dict)
    """Solve rate of each task kind present."""
    end_reasons: dict[str, int] = field(default_factory=dict)
    """How many episodes ended each way (submit, turn_limit, format_errors)."""
    mean_turns: float = 0.0
    """Mean assistant turns per episode."""

    def as_dict(self) -> dict:
        return asdict(self)


def _generate(model, tokenizer, histories: list[list[dict]], max_new_tokens: int) -> list[str]:
    """One greedy assistant turn for each history (a batch, left-padded)."""
    import torch

    prompts = [tokenizer.apply_chat_template(h, tools=TOOLS, add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
               for h in histories]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])  # (B, T)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                             max_new_tokens=max_new_tokens, do_sample=False, temperature=None,
                             top_p=None, top_k=None, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=pad)
    texts = []
    for row in out[:, width:].tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        texts.append(tokenizer.decode(row, skip_special_tokens=False))
    return texts


def greedy_solve(model, tokenizer, tasks: list[Task], *, max_new_tokens: int = 96,
                 config: EpisodeConfig = EpisodeConfig()) -> SolveFigures:
    """Run one greedy episode per task and report how many it solved."""
    if not tasks:
        raise ValueError("greedy_solve needs at least one task")
    episodes = [Episode(task, config) for task in tasks]
    while active := [e for e in episodes if not e.done]:
        for episode, text in zip(active, _generate(model, tokenizer, [e.messages for e in active],
                                                   max_new_tokens)):
            episode.step(text)
    kinds = sorted({e.task.kind for e in episodes})
    by_kind = {k: sum(e.reward for e in episodes if e.task.kind == k)
               / sum(1 for e in episodes if e.task.kind == k) for k in kinds}
    return SolveFigures(episodes=len(episodes),
                        solve_rate=sum(e.reward for e in episodes) / len(episodes),
                        by_kind=by_kind,
                        end_reasons=dict(Counter(str(e.end_reason) for e in episodes)),
                        mean_turns=sum(e.turns for e in episodes) / len(episodes))
