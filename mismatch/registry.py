"""Name → object tables the project registers its presets in (codecs, formats, precisions,
accumulations, checkpoint formats, GPU profiles, fleets, attention kernels, loss arms, run and
study presets): one rule for all of them — a name is registered once, a second registration is
a programming error named in one line."""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

__all__ = ["add_once", "table_of"]

T = TypeVar("T")


def add_once(table: dict[str, T], name: str, item: T, what: str) -> T:
    """`table[name] = item`; returns `item`. ValueError if `name` is already there (`what` names
    the kind of thing in the message, e.g. "codec")."""
    if name in table:
        raise ValueError(f"{what} {name!r} registered twice")
    table[name] = item
    return item


def table_of(items: Iterable[T], name: Callable[[T], str], what: str) -> dict[str, T]:
    """A new table of `items`, each under `name(item)`, through `add_once`."""
    out: dict[str, T] = {}
    for item in items:
        add_once(out, name(item), item, what)
    return out
