"""`MonitorLogCallback`: TRL / transformers logs as JSON lines, for `mismatch monitor --follow`.

TRL writes no metrics file while it trains: transformers' `Trainer.log` appends each log to
`state.log_history` in memory (huggingface/trl@f2cd577:trl/trainer/grpo_trainer.py
GRPOTrainer.log → transformers Trainer.log), and that history reaches disk only at checkpoints,
as `checkpoint-N/trainer_state.json`. This callback appends every log as it happens:

    from mismatch.integrations.trl import MonitorLogCallback
    trainer = GRPOTrainer(..., callbacks=[MonitorLogCallback("runs/grpo/metrics.jsonl")])

    $ mismatch monitor runs/grpo/metrics.jsonl --follow --format trl

One line per `on_log`, `{**logs, "step": state.global_step}` (the entry Trainer.log puts in
log_history), flushed at once, written by process zero only (`state.is_world_process_zero`).
transformers is imported when the class is first looked up, not when this module is imported.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["MonitorLogCallback"]

_CLASS = None


def _jsonable(value: Any) -> Any:
    """A log value as JSON can carry it: numbers (NaN kept, the monitor counts it), else str."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:
        number = float(value)  # numpy / torch scalars
    except (TypeError, ValueError):
        return str(value)
    return number if math.isfinite(number) or math.isnan(number) else str(value)


def _build():
    from transformers import TrainerCallback

    class MonitorLogCallback(TrainerCallback):
        """Append each Trainer log to `path` as one flushed JSON line (process zero only)."""

        def __init__(self, path: str | Path) -> None:
            self.path = Path(path)
            self._file = None

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs:
                return
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")
            entry = {str(k): _jsonable(v) for k, v in logs.items()}
            entry["step"] = state.global_step
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()

        def on_train_end(self, args, state, control, **kwargs):
            if self._file is not None:
                self._file.close()
                self._file = None

    return MonitorLogCallback


def __getattr__(name: str):
    global _CLASS
    if name == "MonitorLogCallback":
        if _CLASS is None:
            _CLASS = _build()
        return _CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
