"""The `mismatch` command line. Thin: each command builds a config and calls the library.

Heavy imports (torch, transformers, modelopt) happen inside the commands so that
`mismatch --help` stays instant. User errors (ValueError and its subclasses raised for bad
input, and click's usage errors: a value that does not parse, an unknown option) become one line
on stderr and exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from typing import NoReturn

import typer

from mismatch.cli.common import EXIT_BAD_INPUT

app = typer.Typer(
    name="mismatch",
    help="Numerics mismatch profiler and simulator for large-model RL.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # every subcommand inherits it
)


def _flags_show_no_type() -> None:
    """typer 0.29's help draws a flag's type, `--json <bool>`, as if it took a value (it takes
    none: `--json true` is refused). Draw a flag with no type column, as click does."""
    try:
        from typer.core import TyperOption
    except ImportError:
        return
    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "_mismatch_flags", False):
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag and self.metavar is None else shown(self, ctx)

    display_type_rich._mismatch_flags = True
    TyperOption.display_type_rich = display_type_rich


_flags_show_no_type()


@app.callback()
def _root() -> None:
    """Numerics mismatch profiler and simulator for large-model RL."""


def _register() -> None:
    """Every command, in the order `mismatch --help` lists them. Each module imports only typer
    at the top, so registering them all keeps `--help` instant."""
    from mismatch.cli.monitor import monitor_command
    from mismatch.cli.plan import plan_command
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
                          ("study", study_command), ("plan", plan_command)):
        app.command(name)(command)
    app.add_typer(zoo_app, name="zoo")


_register()


def _parser_exceptions():
    """The click exception classes typer raises: recent typer vendors click as `typer._click`,
    older releases use click itself."""
    try:
        from typer._click import exceptions
    except ImportError:
        from click import exceptions
    return exceptions


def _exit_with_error(message: str, code: int) -> NoReturn:
    typer.echo(f"mismatch: error: {message}", err=True)
    sys.exit(code)


def _click_error_message(exc) -> str:
    """One line for click's errors; a usage error (bad option value, unknown option or command,
    missing argument) also names the help to read, in place of typer's boxed panel."""
    message = " ".join(exc.format_message().split())
    ctx = getattr(exc, "ctx", None)
    return f"{message} (see `{ctx.command_path} --help`)" if ctx is not None else message


def main() -> None:
    """Console-script entry point."""
    from mismatch.runtime import bound_kernel_caches, passive_thread_waits, tune_allocator

    tune_allocator()
    bound_kernel_caches()  # before any command's first matrix product; children inherit it
    passive_thread_waits()  # before torch loads OpenMP (the CLI imports it in its commands)
    click = _parser_exceptions()
    bare_group = getattr(click, "NoArgsIsHelpError", ())  # click < 8.2 prints the help and exits 0
    try:
        code = app(standalone_mode=False)
    except bare_group as exc:  # `mismatch` or `mismatch zoo` alone
        # Building the exception rendered the help already where typer draws it with rich; plain
        # click carries it as the message.
        typer.echo(exc.format_message(), nl=False)
        sys.exit(EXIT_BAD_INPUT)
    except click.ClickException as exc:  # usage errors, and e.g. a file that cannot be opened
        _exit_with_error(_click_error_message(exc), exc.exit_code)
    except (typer.Abort, getattr(click, "Abort", typer.Abort)):  # Ctrl-D at a prompt
        typer.echo("mismatch: aborted", err=True)
        sys.exit(1)
    except ValueError as exc:  # bad input reported by the library, outside a command's own check
        _exit_with_error(str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                         EXIT_BAD_INPUT)
    # Outside standalone mode a command's typer.Exit(code) comes back as the return value.
    if isinstance(code, int) and code:
        sys.exit(code)


if __name__ == "__main__":
    main()
