"""The `mismatch` command line. Thin: each command builds a config and calls the library.

Heavy imports (torch, transformers, modelopt) happen inside the commands so that
`mismatch --help` stays instant. User errors (ValueError and its subclasses raised for bad
input) become one line on stderr and exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
import typer

from mismatch.cli.common import EXIT_BAD_INPUT

app = typer.Typer(
    name="mismatch",
    help="Numerics mismatch profiler and simulator for large-model RL.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



@app.callback()
def _root() -> None:
    """Numerics mismatch profiler and simulator for large-model RL."""


def _register() -> None:
    """Every command, in the order `mismatch --help` lists them. Each module imports only typer
    at the top, so registering them all keeps `--help` instant."""
    from mismatch.cli.monitor import monitor_command
    from mismatch.cli.probe import probe_command
    from mismatch.cli.quantize import formats_command, profiles_command, quantize_command
    from mismatch.cli.qualify import qualify_command
    from mismatch.cli.study import study_command
    from mismatch.cli.train import report_command, train_command
    from mismatch.cli.zoo import zoo_app

    for name, command in (("formats", formats_command), ("quantize", quantize_command),
                          ("profiles", profiles_command), ("probe", probe_command),
                          ("qualify", qualify_command), ("monitor", monitor_command),
                          ("train", train_command), ("report", report_command),
                          ("study", study_command)):
        app.command(name)(command)
    app.add_typer(zoo_app, name="zoo")


_register()


def main() -> None:
    """Console-script entry point."""
    from mismatch.runtime import bound_kernel_caches, tune_allocator

    tune_allocator()
    bound_kernel_caches()  # before any command's first matrix product; children inherit it
    try:
        app()
    except ValueError as exc:  # bad input reported by the library, outside a command's own check
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        typer.echo(f"mismatch: error: {message}", err=True)
        sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    main()
