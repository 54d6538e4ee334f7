"""The applications: the pipelines the CLI calls (probe, qualify, reports), above `train`."""
