"""A batch probe made of named (reference, other) variant pairs, each tallied on every batch of
the run's shared tokens: the form of the kernels, precision, accelerator and routing probes and of
the quick probe's split."""

from __future__ import annotations

from .base import Batch, Variant
from .context import ProbeContext
from .tally import KLSummary, Tally

__all__ = ["PairedProbe"]


class PairedProbe:
    """A batch probe made of named (reference, other) variant pairs, each tallied on every
    batch; subclasses set `self.pairs` and `headline_name`, and write `finish()`."""

    name = "paired"
    headline_name = ""

    def __init__(self, ctx: ProbeContext, pairs: dict[str, tuple[Variant, Variant]]) -> None:
        self.ctx = ctx
        self.pairs = pairs
        self.tallies = {name: Tally() for name in pairs}
        self.batches_needed: int | None = None  # every batch, extensions included

    def on_batch(self, batch: Batch) -> None:
        for name, (a, b) in self.pairs.items():
            self.ctx.compare(self.tallies[name], a, b, batch)

    @property
    def headline(self) -> Tally:
        """The comparison whose interval --ci-target watches."""
        return self.tallies[self.headline_name]

    def summaries(self) -> dict[str, KLSummary]:
        return {name: t.summary(self.ctx.cfg.seed) for name, t in self.tallies.items()}

