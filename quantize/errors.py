"""The one exception type of `quantize/` for bad input (the CLI turns it into a one-line error)."""


class QuantizeError(ValueError):
    """Bad input to a codec, a checkpoint writer or a loader; the message says what to do."""
