"""`ProbeError`: the one exception of `mismatch probe` for bad input (a prompt file, lengths, a
model, a probe's options). Its message says what to do; the CLI prints it as a one-line error."""

from __future__ import annotations

__all__ = ["ProbeError"]


class ProbeError(ValueError):
    """Bad probe input (prompt file, lengths, model, options); the message says what to do."""
