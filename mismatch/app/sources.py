"""`mismatch probe --sources`: the source probes' pipeline (mismatch.probes.runner) with what the
probes layer cannot build itself wired in: the staleness probe's generated checkpoint ladder,
policy-gradient steps taken by the train layer (mismatch.train.staleness_ladder)."""

from __future__ import annotations

from collections.abc import Callable

from mismatch.probes.config import ProbeConfig
from mismatch.probes.runner import SourcesRun, run_sources
from mismatch.train.staleness_ladder import PolicyGradientLadder

__all__ = ["probe_sources"]


def probe_sources(cfg: ProbeConfig,
                  progress: Callable[[str, int, int], None] | None = None) -> SourcesRun:
    """Run `cfg`'s source probes (and the ladder); `progress(label, done, total)`."""
    return run_sources(cfg, progress,
                       standalone_inputs={"staleness": {"ladder": PolicyGradientLadder}})
