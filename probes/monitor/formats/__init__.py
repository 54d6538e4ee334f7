"""Framework adapters: each RL framework's own metric logs → the monitor's native records.

- `adapter.py`: `Adapter` (candidate fields, sums, one-segment globs, proxies squared),
  `parse_map` (`--map SIGNAL=FIELD`);
- `frameworks.py`: `ADAPTERS`, one per framework, each field citing the code that logs it;
- `console.py`: slime's and Miles' console metric lines (a Python dict repr per report);
- `reader.py`: `RecordReader` (lines → records on one step axis, with what was skipped and the
  notices the user should read), TRL's trainer_state.json;
- `tensorboard.py`: TensorBoard event files → metric dicts (`TensorBoardLog`; the tensorboard
  package's protobufs), `wandb_offline.py`: W&B run files → history rows (`WandbLog`; wandb's).

What each framework writes and how to point the monitor at it: README.md, "Live collapse alerts",
and docs/monitor.md.
"""

from __future__ import annotations

from typing import Sequence

from mismatch.probes.monitor.formats.adapter import Adapter, parse_map
from mismatch.probes.monitor.formats.frameworks import ADAPTERS
from mismatch.probes.monitor.formats.reader import RecordReader

__all__ = ["Adapter", "ADAPTERS", "RecordReader", "get_adapter", "parse_map"]


def get_adapter(name: str, mapping: Sequence[str] | None = None) -> Adapter:
    """The adapter `name` with `--map` overrides applied; unknown names are a ValueError."""
    key = name.strip().lower()
    if key not in ADAPTERS:
        raise ValueError(f"unknown format {name!r}; formats: {', '.join(ADAPTERS)}")
    overrides = parse_map(mapping)
    return ADAPTERS[key].with_map(overrides) if overrides else ADAPTERS[key]
