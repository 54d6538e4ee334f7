"""The reference study as an experiment on top of the library: its grid of `mismatch train` runs
(grid.py), their logs exported and adopted (logs.py), each run summarized (runs.py), the report
and its plots (aggregate.py, plots.py), and the top-p runs' held-out evaluation from the full
vocabulary after the fact (full_vocab.py). `mismatch study` is its command line."""
