"""`python -m mismatch.cli` runs the command line (the study's runs are launched this way)."""

from mismatch.cli.main import main

main()
