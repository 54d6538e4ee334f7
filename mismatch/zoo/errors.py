"""The one exception type of `mismatch.zoo` for bad input (the CLI makes it a one-line error)."""


class ZooError(ValueError):
    """A model directory that is missing or incomplete, or a bad build request; the message says
    what to do."""
