"""Synthetic tool-use tasks: arithmetic questions answered through a calculator tool.

An episode is a chat: a user asks a question; the assistant thinks briefly, calls `calc` with an
expression of the tool language (tool_lang.py), reads the tool's answer, and calls `submit` with
the final integer. The reward is 1 for a correct submission and 0 otherwise (`reward`).

Four kinds, of increasing difficulty for a ~2M-parameter model, so that a briefly trained policy
solves some and fails others (RL needs both):

    arith     the expression is in the question; the model copies it      ("What is 12*(7+3)?")
    word      a templated word problem; the model writes the expression   (boxes of items, shares)
    table     a price list; the model looks prices up and writes the sum  ("Price list: pear=5,..")
    two_step  two calls in a row, the second using the first one's result (multi-turn tool use)

Every task is a pure function of its seed (`make_task(seed)` uses only `random.Random(seed)`).
The split is by seed: training seeds are `[0, HELDOUT_SEED_BASE)`, held-out seeds are
`HELDOUT_SEED_BASE + i`, so `task_seeds("heldout", n)` never meets a training seed.

Messages use the OpenAI / transformers chat format that the chat template (chat_template.py)
renders: assistant turns carry `reasoning_content` and `tool_calls`, tool results are
`{"role": "tool", "content": "120"}`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Literal

from .tool_lang import evaluate

__all__ = ["Task", "TaskKind", "TASK_KINDS", "TOOLS", "SYSTEM_PROMPT", "HELDOUT_SEED_BASE",
           "make_task", "task_seeds", "generate_tasks", "parse_answer", "reward",
           "assistant_tool_message", "tool_message"]

Split = Literal["train", "heldout"]
HELDOUT_SEED_BASE = 10**9  # seeds at or above this are held out; training draws below it

SYSTEM_PROMPT = "You are a careful assistant. Use calc for arithmetic, then submit the answer."

# Compact tool signatures (name, description, parameter types): the whole system turn stays
# ~80 tokens, so training time goes to the conversation rather than to a constant preamble.
TOOLS: list[dict[str, Any]] = [
    {"name": "calc", "description": "Integer arithmetic: + - * / % ( ).",
     "parameters": {"expression": "string"}},
    {"name": "submit", "description": "Submit the final answer.",
     "parameters": {"answer": "integer"}},
]

_NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jo")
_ITEMS = ("apples", "books", "coins", "cards", "pens", "stamps", "shells", "marbles")
_FRUITS = ("apple", "pear", "plum", "fig", "kiwi", "lime", "peach", "mango", "grape", "lemon")


@dataclass(frozen=True, kw_only=True)
class Task:
    """One question with its gold solution."""

    seed: int
    """The seed that made it (`make_task(seed)` reproduces it)."""
    kind: str
    """A key of `TASK_KINDS`."""
    question: str
    """The user's message."""
    expressions: tuple[str, ...]
    """The gold `calc` calls, in order (one, or two for `two_step`)."""
    reasoning: tuple[str, ...]
    """The gold thinking of each assistant turn: one per calc call, then one before submit."""
    answer: int
    """The correct final answer."""

    def __post_init__(self) -> None:
        if len(self.reasoning) != len(self.expressions) + 1:
            raise ValueError(f"task {self.seed}: {len(self.reasoning)} reasoning strings for "
                             f"{len(self.expressions)} calc calls (need one more)")

    def prompt_messages(self) -> list[dict[str, Any]]:
        """The episode's opening: system prompt and the user's question (render with `TOOLS`)."""
        return [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": self.question}]

    def gold_messages(self) -> list[dict[str, Any]]:
        """The full gold transcript: prompt, each calc call and its result, then `submit`."""
        messages = self.prompt_messages()
        for expression, thought in zip(self.expressions, self.reasoning):
            messages.append(assistant_tool_message(thought, "calc", {"expression": expression}))
            messages.append(tool_message(str(evaluate(expression))))
        messages.append(assistant_tool_message(self.reasoning[-1], "submit",
                                               {"answer": self.answer}))
        return messages


def assistant_tool_message(reasoning: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn that thinks, then makes one tool call."""
    return {"role": "assistant", "content": "", "reasoning_content": reasoning,
            "tool_calls": [{"type": "function",
                            "function": {"name": name, "arguments": arguments}}]}


def tool_message(content: str) -> dict[str, Any]:
    """A tool result as the chat template expects it."""
    return {"role": "tool", "content": content}


def _finish(rng: random.Random, *, seed: int, kind: str, question: str,
            expressions: list[str], thoughts: list[str]) -> Task:
    answer = evaluate(expressions[-1])
    closing = rng.choice(("calc returned {x}, so the answer is {x}.",
                          "The result is {x}. I will submit {x}.", "So the answer is {x}."))
    return Task(seed=seed, kind=kind, question=question, expressions=tuple(expressions),
                reasoning=(*thoughts, closing.format(x=answer)), answer=answer)


def _arith(rng: random.Random, seed: int) -> Task:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 99)
    shape = rng.choice(("{a}+{b}", "{a}-{b}", "{a}*{b}", "{a}+{b}+{c}", "{a}*{b}+{c}",
                        "{a}*{b}-{c}", "{a}+{b}*{c}", "{a}*({b}+{c})", "({a}+{b})*{c}",
                        "({a}-{b})*{c}", "{p}/{b}", "{p}/{b}+{c}"))
    expr = shape.format(a=a, b=b, c=c, p=b * rng.randint(2, 30))
    question = rng.choice(("What is {e}?", "Compute {e}.", "Please evaluate {e}.",
                           "How much is {e}?", "Calculate {e}.")).format(e=expr)
    thought = rng.choice(("The user wants {e}. I will use calc.",
                          "I need to compute {e} with calc.",
                          "Let me evaluate {e} with calc.",
                          "This is {e}; calc can do it.")).format(e=expr)
    return _finish(rng, seed=seed, kind="arith", question=question, expressions=[expr],
                   thoughts=[thought])


# (question, expression, thought); {n} name, {i} item, {a} {b} {c} numbers, {p} = a multiple of b
_WORD_PROBLEMS = (
    ("{n} has {a} boxes with {b} {i} in each and gives away {c}. How many {i} are left?",
     "{a}*{b}-{c}", "{a} boxes of {b} is {a}*{b}, minus {c} given away: {a}*{b}-{c}."),
    ("{n} buys {a} packs of {b} {i} and {c} loose {i}. How many {i} does {n} have?",
     "{a}*{b}+{c}", "{a} packs of {b} plus {c} loose: {a}*{b}+{c}."),
    ("{p} {i} are shared equally among {b} friends. How many {i} does each friend get?",
     "{p}/{b}", "Sharing {p} among {b} friends: {p}/{b}."),
    ("{n} had {a} {i}, found {b} more and lost {c}. How many {i} does {n} have now?",
     "{a}+{b}-{c}", "{a} plus {b} found minus {c} lost: {a}+{b}-{c}."),
    ("A shelf has {a} rows of {b} {i}. {n} adds {c} more rows. How many {i} are on the shelf?",
     "({a}+{c})*{b}", "{a}+{c} rows of {b}: ({a}+{c})*{b}."),
)


def _word(rng: random.Random, seed: int) -> Task:
    question, expr, thought = rng.choice(_WORD_PROBLEMS)
    b = rng.randint(2, 12)
    fields = dict(n=rng.choice(_NAMES), i=rng.choice(_ITEMS), a=rng.randint(2, 30), b=b,
                  c=rng.randint(1, 9), p=b * rng.randint(2, 15))
    return _finish(rng, seed=seed, kind="word", question=question.format(**fields),
                   expressions=[expr.format(**fields)], thoughts=[thought.format(**fields)])


def _table(rng: random.Random, seed: int) -> Task:
    fruits = rng.sample(_FRUITS, 4)
    prices = {fruit: rng.randint(1, 20) for fruit in fruits}
    listing = ", ".join(f"{fruit}={price}" for fruit, price in prices.items())
    bought = rng.sample(fruits, rng.choice((1, 2)))
    counts = [rng.randint(2, 9) for _ in bought]
    basket = " and ".join(f"{n} {fruit}" for n, fruit in zip(counts, bought))
    expr = "+".join(f"{n}*{prices[fruit]}" for n, fruit in zip(counts, bought))
    looked_up = " and ".join(f"{fruit} is {prices[fruit]}" for fruit in bought)
    return _finish(rng, seed=seed, kind="table",
                   question=f"Price list: {listing}. What is the cost of {basket}?",
                   expressions=[expr],
                   thoughts=[f"{looked_up[0].upper()}{looked_up[1:]}, so {expr}."])


# (question, first expression, second operator, name of the intermediate result)
_TWO_STEP = (
    ("Add {a} and {b}, then multiply the sum by {c}.", "{a}+{b}", "*", "sum"),
    ("Multiply {a} by {b}, then subtract {c}.", "{a}*{b}", "-", "product"),
    ("Subtract {b} from {a}, then multiply the result by {c}.", "{a}-{b}", "*", "difference"),
    ("Multiply {a} by {b}, then add {c}.", "{a}*{b}", "+", "product"),
    ("Add {a} and {b}, then subtract {c}.", "{a}+{b}", "-", "sum"),
)


def _two_step(rng: random.Random, seed: int) -> Task:
    question, first, op, what = rng.choice(_TWO_STEP)
    fields = dict(a=rng.randint(10, 99), b=rng.randint(2, 40), c=rng.randint(2, 20))
    first = first.format(**fields)
    partial = evaluate(first)
    second = f"{partial}{op}{fields['c']}"
    return _finish(rng, seed=seed, kind="two_step", question=question.format(**fields),
                   expressions=[first, second],
                   thoughts=[f"First the {what}: {first}.",
                             f"The {what} is {partial}. Now {second}."])


@dataclass(frozen=True, kw_only=True)
class TaskKind:
    """One task family: how often it is drawn and how it is made."""

    weight: float
    """Relative frequency in `make_task` draws."""
    make: Callable[[random.Random, int], Task]
    """(rng, seed) -> Task; uses only `rng` for randomness."""


TASK_KINDS: dict[str, TaskKind] = {
    "arith": TaskKind(weight=0.3, make=_arith),
    "word": TaskKind(weight=0.25, make=_word),
    "table": TaskKind(weight=0.25, make=_table),
    "two_step": TaskKind(weight=0.2, make=_two_step),
}


def make_task(seed: int, kind: str | None = None) -> Task:
    """The task of `seed` (its kind drawn by weight unless `kind` names one)."""
    if kind is not None and kind not in TASK_KINDS:
        raise ValueError(f"unknown task kind {kind!r}; choose one of {sorted(TASK_KINDS)}")
    rng = random.Random(seed)
    drawn = rng.choices(list(TASK_KINDS), weights=[k.weight for k in TASK_KINDS.values()])[0]
    return TASK_KINDS[kind or drawn].make(rng, seed)


def task_seeds(split: Split, n: int, *, start: int = 0) -> list[int]:
    """Seeds `start .. start+n-1` of a split (held-out seeds are offset by HELDOUT_SEED_BASE)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if start < 0 or n < 0 or (split == "train" and start + n > HELDOUT_SEED_BASE):
        raise ValueError(f"seed range [{start}, {start + n}) is outside the {split} split")
    base = HELDOUT_SEED_BASE if split == "heldout" else 0
    return [base + start + i for i in range(n)]


def generate_tasks(split: Split, n: int, *, start: int = 0) -> list[Task]:
    """`n` tasks of a split, in seed order."""
    return [make_task(seed) for seed in task_seeds(split, n, start=start)]


def parse_answer(answer: Any) -> int | None:
    """The integer a `submit` call's `answer` argument denotes, or None (ints or digit strings)."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return answer
    if isinstance(answer, str):
        text = answer.strip()
        digits = text[1:] if text[:1] in "+-" else text
        if 0 < len(digits) <= 20 and digits.isascii() and digits.isdigit():
            return int(text)
    return None


def reward(task: Task, answer: Any) -> float:
    """1.0 if `answer` (a `submit` argument) equals the task's answer, else 0.0."""
    return 1.0 if parse_answer(answer) == task.answer else 0.0
