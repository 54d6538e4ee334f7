"""Lines → native records: JSON or console lines through an adapter, one step axis, notices.

`RecordReader(adapter).feed(line)` is what `mismatch monitor` calls per line. It

- parses a JSON object, or, for slime and Miles, a console metric line (console.py);
- maps it through the adapter and counts what it skipped (`tally`: malformed, other_events,
  no_signals) and what the user should be told (`notes`, `notices()`);
- puts slime's and Miles' two step axes on one, the rollout axis. Their rollout lines carry the
  rollout id, their train lines train/step = rollout_id × n + i (n optimizer steps per rollout).
  A train line that names its rollout (a Miles event logged inside train()) is put on it; one
  that does not (slime's and Miles' console, wandb-style dicts) goes on the last rollout id seen
  from a rollout line (not a console perf line: the rollout manager may run ahead), or, once n is known (n = the first train step seen in rollout R ≥ 1,
  divided by R), on train_step // n. When the two axes differ the reader says so, in one line.

`read_trainer_state(path)`: the `log_history` of a TRL / transformers trainer_state.json.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any, Mapping

from mismatch.probes.monitor.formats.adapter import Adapter
from mismatch.probes.monitor.formats.console import CONSOLE_EXAMPLE, parse_console_line

__all__ = ["RecordReader", "read_trainer_state", "trainer_state_path", "expected_input"]

_CONSOLE_FORMATS = {"slime", "miles"}


def expected_input(adapter: Adapter) -> str:
    """What `--format NAME` reads, in a few words (for the error on an unreadable file)."""
    if adapter.name in _CONSOLE_FORMATS:
        return (f"{adapter.description}, e.g. `{CONSOLE_EXAMPLE}`")
    return adapter.description


def _int(x: Any) -> int | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return int(x)


class RecordReader:
    """One adapter's reader over a run's lines (stateful: the step axes)."""

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter
        self.console = adapter.name in _CONSOLE_FORMATS
        self.tally: Counter[str] = Counter()
        """lines, json_objects, console_lines; skipped: malformed, other_events, no_signals."""
        self.notes: Counter[str] = Counter()
        """kl_squared, zero_unset, train_steps_moved (see `notices`)."""
        self._rollout: int | None = None  # the last rollout id seen
        self._per_rollout: int | None = None  # n: train steps per rollout, once known
        self._first_train: dict[int, int] = {}  # rollout id → first train step seen in it
        self._example: tuple[int, int] | None = None  # (train step, rollout) of a moved one

    def parse(self, line: bytes | str) -> dict | None:
        """One JSON object or console metrics dict; None (counted) otherwise or when blank."""
        text = line.strip()
        if not text:
            return None
        self.tally["lines"] += 1
        try:
            obj = json.loads(text)
        except (UnicodeDecodeError, ValueError):
            obj = None
            if self.console:
                try:
                    obj = parse_console_line(text.decode() if isinstance(text, bytes) else text)
                except UnicodeDecodeError:
                    obj = None
                if obj is not None:
                    self.tally["console_lines"] += 1
                    return obj
        else:
            if isinstance(obj, dict):
                self.tally["json_objects"] += 1
                return obj
        self.tally["malformed"] += 1
        return None

    def feed(self, line: bytes | str) -> dict | None:
        """The native record of one line, or None (blank, malformed, other event, no signal)."""
        obj = self.parse(line)
        return None if obj is None else self.feed_object(obj)

    def feed_entry(self, entry: Mapping[str, Any]) -> dict | None:
        """`feed_object` for an object read whole (a trainer_state.json's log_history entry)."""
        self.tally["lines"] += 1
        self.tally["json_objects"] += 1
        return self.feed_object(entry)

    def feed_object(self, obj: Mapping[str, Any]) -> dict | None:
        """The native record of one parsed object (see `feed`)."""
        kind = obj.get("type")
        other = isinstance(kind, str) and kind.startswith("console_")  # eval, critic lines
        record = None if other else self.adapter.record(obj, self.notes)
        if record is None:
            self.tally["other_events"] += 1
            return None
        train = record.pop("train_step", None)
        if train is not None or self.adapter.train_step:
            self._one_axis(record, _int(train), obj.get("console_kind"))
        if len(record) == 1 and "episodes" not in record:  # only the step
            self.tally["no_signals"] += 1
            return None
        return record

    def _one_axis(self, record: dict, train: int | None, kind: str | None) -> None:
        rollout = _int(record.get("step"))
        if train is None:  # a rollout line
            # perf lines also come from the rollout manager, which may run a rollout ahead of
            # training (async): only the trainer's own rollout lines say which rollout it is on
            if rollout is not None and kind != "perf":
                self._rollout = rollout
            return
        if rollout is None:  # a train line without its rollout: place it
            if self._per_rollout:
                rollout = train // self._per_rollout
            elif self._rollout is not None:
                rollout = self._rollout
            else:
                rollout = 0
            record["step"] = rollout
        else:
            self._rollout = rollout
        if rollout >= 1 and rollout not in self._first_train:
            self._first_train[rollout] = train
            if self._per_rollout is None and train % rollout == 0 and train // rollout >= 1:
                self._per_rollout = train // rollout
        if train != rollout:
            self.notes["train_steps_moved"] += 1
            self._example = (train, rollout)

    def notices(self) -> list[str]:
        """One line per thing the user should know about how the log was read."""
        out = []
        name = self.adapter.name
        if self.notes["train_steps_moved"]:
            train, rollout = self._example
            per = f" (train/step = rollout × {self._per_rollout} + i)" if self._per_rollout else ""
            out.append(f"{name} logs two step axes{per}: {self.notes['train_steps_moved']} train "
                       f"records put on the rollout axis (e.g. train step {train} → step "
                       f"{rollout}); alert steps are rollout ids")
        if self.notes["kl_squared"]:
            out.append(f"kl: {self.notes['kl_squared']} values are a proxy (mean |Δ log p| or "
                       "|Δ p|) squared before being judged as KL; their scale is not a KL's")
        if self.notes["zero_unset"]:
            out.append(f"entropy: {self.notes['zero_unset']} values of 0.0 skipped (the framework "
                       "logs 0.0 when entropy is not computed): no entropy signal from them")
        return out


def trainer_state_path(path: Path) -> Path | None:
    """The trainer_state.json that `path` names: itself, inside a checkpoint dir, or the newest
    checkpoint-N's inside an output dir; None if none is there (yet)."""
    if path.is_file():
        return path
    if not path.is_dir():
        return None
    if (path / "trainer_state.json").is_file():
        return path / "trainer_state.json"
    numbered = []
    for child in path.glob("checkpoint-*/trainer_state.json"):
        suffix = child.parent.name.removeprefix("checkpoint-")
        if suffix.isdigit():
            numbered.append((int(suffix), child))
    return max(numbered)[1] if numbered else None


def read_trainer_state(path: Path) -> list[dict] | None:
    """The log_history entries of a trainer_state.json, or None if it is not one (or is being
    rewritten: a partial file does not parse)."""
    try:
        state = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(state, dict) or not isinstance(state.get("log_history"), list):
        return None
    return [e for e in state["log_history"] if isinstance(e, dict)]


def looks_like_state_file(path: Path) -> bool:
    """Whether `path` opens as an indented JSON document (`{` alone on its first line), as
    transformers' TrainerState.save_to_json writes it, rather than JSON lines."""
    try:
        with open(path, "rb") as handle:
            first = handle.readline(1 << 16)
    except OSError:
        return False
    return first.strip() == b"{"
