"""The calculator tool language: integer arithmetic, parsed and evaluated without `eval`.

Grammar (whitespace between tokens is ignored):

    expr   := term   (('+' | '-') term)*
    term   := factor (('*' | '/' | '%') factor)*
    factor := ('+' | '-') factor | NUMBER | '(' expr ')'

Numbers are non-negative decimal integers; `/` is floor division and `%` the matching modulo
(Python's `//` and `%`), so every value is an exact integer and two evaluations of the same text
always agree. There are no names, no calls, no exponentiation: the language cannot reach anything
but the arithmetic below.

Untrusted input (the text comes from a model's tool call) is bounded by `ToolLimits` before and
during evaluation, so cost is bounded by the input size, not by what the input asks for:
- `max_chars` and `max_tokens` bound the work of the lexer and parser (each token is visited once);
- `max_depth` bounds the parser's recursion (parentheses and unary signs);
- `max_digits` bounds each literal and `max_abs` every intermediate result, so no operation ever
  touches a big integer (Python's int would otherwise let `9**9**9`-style growth through `*`).
Every refusal is a `ToolError` whose message is what the tool returns to the model.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ToolError", "ToolLimits", "DEFAULT_LIMITS", "evaluate", "tokenize"]

_DIGITS = frozenset("0123456789")
_OPERATORS = frozenset("+-*/%()")
_WHITESPACE = frozenset(" \t")


class ToolError(Exception):
    """The tool refused or failed on its input; `str(error)` is the message shown to the model."""


@dataclass(frozen=True, kw_only=True)
class ToolLimits:
    """Size limits of one calculator call; together they bound its time and memory."""

    max_chars: int = 256
    """Longest expression text accepted, in characters."""
    max_tokens: int = 128
    """Most numbers + operators + parentheses in one expression."""
    max_depth: int = 32
    """Deepest nesting of parentheses and unary signs (bounds the parser's recursion)."""
    max_digits: int = 12
    """Longest integer literal, in digits."""
    max_abs: int = 10**15
    """Largest magnitude of any intermediate or final value."""

    def __post_init__(self) -> None:
        for name in ("max_chars", "max_tokens", "max_depth", "max_digits", "max_abs"):
            if getattr(self, name) < 1:
                raise ValueError(f"ToolLimits.{name} must be >= 1, got {getattr(self, name)}")


DEFAULT_LIMITS = ToolLimits()


def tokenize(text: str, limits: ToolLimits = DEFAULT_LIMITS) -> list[str]:
    """Split `text` into number and operator tokens; refuse anything outside the language."""
    if not isinstance(text, str):
        raise ToolError(f"expression must be a string, got {type(text).__name__}")
    if len(text) > limits.max_chars:
        raise ToolError(f"expression too long ({len(text)} > {limits.max_chars} characters)")
    tokens: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch in _WHITESPACE:
            i += 1
            continue
        if ch in _DIGITS:
            j = i
            while j < len(text) and text[j] in _DIGITS:
                j += 1
            if j - i > limits.max_digits:
                raise ToolError(f"number too long ({j - i} > {limits.max_digits} digits)")
            tokens.append(text[i:j])
            i = j
        elif ch in _OPERATORS:
            tokens.append(ch)
            i += 1
        else:
            raise ToolError(f"unexpected character {ch!r} at position {i}")
        if len(tokens) > limits.max_tokens:
            raise ToolError(f"expression too long (more than {limits.max_tokens} tokens)")
    if not tokens:
        raise ToolError("empty expression")
    return tokens


class _Parser:
    """Recursive-descent evaluator over a token list; one pass, bounded depth."""

    def __init__(self, tokens: list[str], limits: ToolLimits) -> None:
        self.tokens = tokens
        self.pos = 0
        self.depth = 0
        self.limits = limits

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _check(self, value: int) -> int:
        if abs(value) > self.limits.max_abs:
            raise ToolError(f"value out of range (|x| > {self.limits.max_abs})")
        return value

    def _enter(self) -> None:
        self.depth += 1
        if self.depth > self.limits.max_depth:
            raise ToolError(f"expression nested too deeply (> {self.limits.max_depth})")

    def expr(self) -> int:
        value = self.term()
        while self._peek() in ("+", "-"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self.term()
            value = self._check(value + rhs if op == "+" else value - rhs)
        return value

    def term(self) -> int:
        value = self.factor()
        while self._peek() in ("*", "/", "%"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self.factor()
            if op == "*":
                value = self._check(value * rhs)  # both operands ≤ max_abs: product ≤ max_abs²
            elif rhs == 0:
                raise ToolError("division by zero")
            else:
                value = self._check(value // rhs if op == "/" else value % rhs)
        return value

    def factor(self) -> int:
        tok = self._peek()
        if tok is None:
            raise ToolError("unexpected end of expression")
        if tok in ("+", "-"):
            self.pos += 1
            self._enter()
            value = self.factor()
            self.depth -= 1
            return -value if tok == "-" else value
        if tok == "(":
            self.pos += 1
            self._enter()
            value = self.expr()
            self.depth -= 1
            if self._peek() != ")":
                raise ToolError("missing ')'")
            self.pos += 1
            return value
        if tok[0] in _DIGITS:
            self.pos += 1
            return self._check(int(tok))
        raise ToolError(f"unexpected {tok!r}")


def evaluate(text: str, limits: ToolLimits = DEFAULT_LIMITS) -> int:
    """Evaluate one calculator expression exactly; raise `ToolError` on anything else.

    >>> evaluate("12*(7+3)")
    120
    """
    parser = _Parser(tokenize(text, limits), limits)
    value = parser.expr()
    if parser.pos != len(parser.tokens):
        raise ToolError(f"unexpected {parser.tokens[parser.pos]!r} after the expression")
    return value
