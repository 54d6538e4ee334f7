"""`mismatch zoo ...`: build the embedded model, show where it is and what it measures.

Thin: each command builds a config and calls the library; torch and transformers are imported
inside the commands so that `mismatch --help` stays instant. Register with
`app.add_typer(zoo_app, name="zoo")`; run standalone with `python -m mismatch.cli.zoo`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

zoo_app = typer.Typer(
    name="zoo",
    help="The embedded tiny Qwen3-MoE model: build it, locate it, show its figures.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_DEFAULT_STEPS = 1000  # = TrainConfig.steps (not imported: that would import the library eagerly)


@zoo_app.command("build")
def build_command(
    out: Optional[Path] = typer.Option(
        None, "--out", help="Output directory (default: the package data of the embedded model)."),
    steps: int = typer.Option(_DEFAULT_STEPS, "--steps", min=1, help="Optimizer steps."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of initialization and data order."),
) -> None:
    """Train the tiny model and its tokenizer from scratch (one CPU thread, reproducible)."""
    from dataclasses import replace

    from mismatch.zoo.build import BuildConfig, build
    from mismatch.zoo.card import summary_lines

    base = BuildConfig(seed=seed)
    config = replace(base, train=replace(base.train, steps=steps))
    info = build(config, out, log=lambda line: typer.echo(line, err=True))
    for line in summary_lines(info):
        typer.echo(line)


@zoo_app.command("path")
def path_command() -> None:
    """Print the directory of the embedded model."""
    from mismatch.zoo.loading import default_model_dir

    typer.echo(str(default_model_dir()))


@zoo_app.command("info")
def info_command(
    model: Optional[Path] = typer.Option(
        None, "--model", help="A zoo model directory (default: the embedded model)."),
) -> None:
    """Print the figures of the model card (size, held-out perplexity, peakedness)."""
    from mismatch.zoo.card import read_build_info, summary_lines
    from mismatch.zoo.loading import check_model_dir

    for line in summary_lines(read_build_info(check_model_dir(model))):
        typer.echo(line)


def main() -> None:
    """Standalone entry point (`python -m mismatch.cli.zoo`); bad input exits 2 with one line."""
    try:
        zoo_app()
    except ValueError as exc:
        typer.echo(f"mismatch: error: {str(exc).splitlines()[0] if str(exc) else exc!r}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
