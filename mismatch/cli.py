"""The `mismatch` command line. Thin: each command builds a config and calls the library.

Heavy imports (torch, transformers, modelopt) happen inside the commands so that
`mismatch --help` stays instant. User errors (ValueError and its subclasses raised for bad
input) become one line on stderr and exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from typing import NoReturn

import typer

app = typer.Typer(
    name="mismatch",
    help="Numerics mismatch profiler and simulator for large-model RL.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

EXIT_BAD_INPUT = 2


@app.callback()
def _root() -> None:
    """Numerics mismatch profiler and simulator for large-model RL."""


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Print one line to stderr and exit."""
    typer.echo(f"mismatch: error: {message}", err=True)
    raise typer.Exit(code)


@app.command("formats")
def formats_command() -> None:
    """List the number formats (codecs) this build can encode, decode and emulate."""
    from quantize.codecs import CODECS

    width = max(len(name) for name in CODECS)
    for name, spec in CODECS.items():
        typer.echo(f"{name:<{width}}  {spec.description}")


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except ValueError as exc:  # bad input reported by the library
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


if __name__ == "__main__":
    main()
    sys.exit(0)
