"""The command line: `mismatch <command>`; the top of the layers (see README, Architecture).

Each command module builds its part's config and calls the library; heavy imports happen inside
the commands so that `mismatch --help` stays fast.
"""

from mismatch.cli.main import app, main

__all__ = ["app", "main"]
