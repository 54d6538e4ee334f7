"""What every command shares: one-line errors with exit code 2, quiet optional libraries, and
progress bars on stderr."""

from __future__ import annotations

from typing import NoReturn

import typer

__all__ = ["ARM_ALIASES", "EXIT_BAD_INPUT", "LineProgress", "STUDY_ARM_ALIASES", "choice_list",
           "fail", "one_of", "preset_help", "quiet_libraries", "run_with_bars",
           "run_with_state_bar"]

EXIT_BAD_INPUT = 2
"""Exit code of bad input (a one-line error on stderr)."""

ARM_ALIASES = {"grpo+topp": "topp"}
"""`train --correction` takes the study's name of the top-p arm (GRPO + top-p mask replay) too."""
STUDY_ARM_ALIASES = {"topp": "grpo+topp"}
"""`study --arms` takes the trainer's name of that arm too: one set of names for both commands."""


def one_of(value, former, name: str = "--n-prompts", former_name: str = "--prompts"):
    """The value of an option given under its name or its former (hidden) one, not both."""
    if value is not None and former is not None:
        raise ValueError(f"{former_name} is the former name of {name}; pass {name} alone")
    return value if former is None else former



def choice_list(names, notes: dict[str, str] | None = None, *, sep: str = ", ",
                last: str = " or ") -> str:
    """A help text's choices, from a registry's names in its order: "a, b or c" (`sep` between
    names, `last` before the last one), each followed by "(its note)" where `notes` has one. A
    note for a name the registry does not hold is an error, so a renamed entry cannot keep a
    stale note."""
    names = list(names)
    notes = notes or {}
    stale = [n for n in notes if n not in names]
    if stale:
        raise ValueError(f"choice notes for {', '.join(stale)}: not among {', '.join(names)}")
    items = [f"{n} ({notes[n]})" if n in notes else n for n in names]
    return items[0] if len(items) == 1 else sep.join(items[:-1]) + last + items[-1]


def preset_help(registry: dict) -> str:
    """`--preset` help from a registry of preset functions: each name with its docstring's first
    sentence, so the help lists what the registry holds and nothing else."""
    parts = []
    for name, fn in registry.items():
        doc = " ".join((fn.__doc__ or "").split())
        first = doc.split(". ")[0].rstrip(".")
        if first[1:2].islower():  # "The first grid" → "the first grid", "L0 and …" kept
            first = first[0].lower() + first[1:]
        parts.append(f"{name} ({first})" if first else name)
    return " | ".join(parts) + "."


def quiet_libraries() -> None:
    """Silence import-time chatter of optional libraries (torchao's missing CUDA extensions,
    deepspeed's accelerator notice, transformers' progress bars) and stay offline: every model
    this tool loads is a local directory."""
    import os

    from mismatch.runtime import quiet_library_logs

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    quiet_library_logs()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Print one line to stderr and exit."""
    typer.echo(f"mismatch: error: {message}", err=True)
    raise typer.Exit(code)


class LineProgress:
    """Progress as plain lines on stderr where it is not a terminal (a CI log, a file): a label's
    first call, then at most one line every `every` seconds, then its end. A bar there would
    print nothing for minutes (rich draws no live display off a terminal) and a blank line."""

    def __init__(self, every: float = 30.0, clock=None, write=None):
        import sys
        import time

        self.every = every
        self.clock = clock or time.monotonic
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self.seen: dict[str, list[float]] = {}  # label → [started, last printed]

    def __call__(self, label: str, done: int, total: int | None, detail: str = "") -> None:
        now = self.clock()
        times = self.seen.get(label)
        finished = total is not None and done >= total
        if times is None:
            times = self.seen[label] = [now, now]
        elif times[1] == float("inf") or not (finished or now - times[1] >= self.every):
            return  # finished already, or printed less than `every` seconds ago
        line = f"mismatch: {label}: {done}/{total if total is not None else '?'}"
        line += " done" if finished else ""
        if now > times[0]:
            line += f" ({now - times[0]:.0f} s)"
        self.write(line + (f" {detail}" if detail else ""))
        times[1] = float("inf") if finished else now


def _terminal() -> bool:
    import sys

    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def run_with_bars(fn, *, quiet: bool):
    """fn(progress) with one progress bar per label on stderr (none when quiet); plain lines
    where stderr is not a terminal."""
    if quiet:
        return fn(None)
    if not _terminal():
        return fn(LineProgress())
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total)
            bar.update(tasks[label], completed=done, total=total)

        return fn(progress)


def run_with_state_bar(fn, *, quiet: bool, label: str, total, completed, describe):
    """fn(progress) with a bar on stderr, opened at the first progress call (so that an error
    before it — a bad checkpoint, say — stays one line); plain lines where stderr is not a
    terminal. total, completed, describe: of the state passed to progress."""
    if quiet:
        return fn(None)
    if not _terminal():
        lines = LineProgress()
        return fn(lambda state: lines(label, completed(state), total(state), describe(state)))
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    bar = Progress("[progress.description]{task.description}", BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True))
    task = None

    def progress(state: dict) -> None:
        nonlocal task
        if task is None:
            bar.start()
            task = bar.add_task(label, total=total(state))
        bar.update(task, completed=completed(state), description=describe(state))

    try:
        return fn(progress)
    finally:
        bar.stop()
