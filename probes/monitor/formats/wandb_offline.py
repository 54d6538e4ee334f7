"""W&B run files (`run-<id>.wandb`) → metric dicts, read as they grow.

`wandb.init(mode="offline")` (and online runs too) writes every record of the run to
`wandb/offline-run-<date>-<id>/run-<id>.wandb`: verl's "wandb" logger calls
`wandb.log(data=metrics, step=step)` (volcengine/verl@b178a3c:verl/utils/tracking.py Tracking.log),
slime `wandb.log(metrics)` with its step key (`rollout/step`, `train/step`) among the metrics
(THUDM/slime@624b824:slime/observability/logging_utils.py log).

The file format (wandb/wandb@c406aec:core/pkg/leveldb/record.go, golang/leveldb's record log): a
7-byte header `:W&B` + uint16 0xBEE1 + version 0, then 32 KiB blocks of chunks, each a 7-byte
header (uint32 checksum, uint16 length, uint8 type: 1 full, 2 first, 3 middle, 4 last) and its
payload; a block's tail shorter than a header is zeros. wandb writes the checksum with
`CRCAlgoIEEE`: CRC-32 (zlib's) of the type byte and the payload. A record (its chunks' payloads
joined) is a `wandb_internal_pb2.Record` protobuf, from the `wandb` package
(`pip install 'mismatch[logs]'`); a `history` record is one `wandb.log` row, its items each a key
(or nested_key path) and a JSON value.

`WandbLog(path).poll()` returns the rows new since the last poll as dicts (nested keys joined with
"."; `step` set from wandb's `_step` where the row has no `step` of its own). A record not yet
completely written is left for the next poll; a chunk that fails its checksum is skipped with the
rest of its block, as the LevelDB reader recovers, and counted as malformed.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

__all__ = ["WandbLog", "run_file", "is_run_file", "load_protos", "MAGIC"]

MAGIC = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_SEED = {t: zlib.crc32(bytes([t])) for t in (_FULL, _FIRST, _MIDDLE, _LAST)}
_CHUNK = 1 << 22
INSTALL_HINT = "pip install 'mismatch[logs]'"


def is_run_file(path: Path) -> bool:
    """Whether `path` starts as a W&B run file does."""
    try:
        with open(path, "rb") as handle:
            return handle.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def run_file(folder: Path) -> Path | None:
    """The `run-<id>.wandb` of a W&B run folder; None if it holds none. A ValueError if it holds
    several (then it is no single run's folder)."""
    found = sorted(folder.glob("run-*.wandb"))
    if len(found) > 1:
        raise ValueError(f"{folder}: {len(found)} W&B run files in it; pass one of them")
    return found[0] if found else None


def load_protos():
    """wandb's wandb_internal_pb2; a one-line ValueError without the wandb package."""
    try:
        from wandb.proto import wandb_internal_pb2
    except ImportError as exc:
        raise ValueError(f"reading a W&B run needs the wandb package ({exc.name or exc}): "
                         f"{INSTALL_HINT}") from None
    return wandb_internal_pb2


def _value(text: str) -> Any:
    try:
        return json.loads(text)  # NaN and Infinity as Python's json writes them
    except ValueError:
        return text


class WandbLog:
    """One W&B run file, read incrementally by `poll`."""

    def __init__(self, path: Path, *, events: Any = None) -> None:
        self.path = path
        self.events = events if events is not None else {}
        self._pb = load_protos()
        self.offset = 0

    def _count(self, what: str) -> None:
        self.events[what] = self.events.get(what, 0) + 1

    def _records(self, buf: bytes, base: int) -> tuple[list[bytes], int]:
        """The complete records in `buf` (which starts at file offset `base`, at a record's
        start), and how many bytes of it they took."""
        out: list[bytes] = []
        pos = 0
        if base == 0:
            if len(buf) < len(MAGIC):
                return out, 0
            if buf[:len(MAGIC)] != MAGIC:
                raise ValueError(f"{self.path}: not a W&B run file (no :W&B header)")
            pos = len(MAGIC)
        done = pos
        parts: list[bytes] = []
        while True:
            left = _BLOCK - (base + pos) % _BLOCK
            if left < _HEADER:
                if pos + left > len(buf):
                    break
                pos += left  # zero padding at a block's end
                continue
            if pos + _HEADER > len(buf):
                break
            crc, length, kind = struct.unpack("<IHB", buf[pos:pos + _HEADER])
            if crc == 0 and length == 0 and kind == 0:
                break  # zeros: not written yet
            end = pos + _HEADER + length
            if end > len(buf):
                break
            payload = buf[pos + _HEADER:end]
            if kind not in _SEED or zlib.crc32(payload, _SEED[kind]) != crc:
                self._count("malformed")  # recover as LevelDB does: drop the rest of the block
                parts = []
                pos = done = pos + left  # may lie past what is written: read from there later
                if pos >= len(buf):
                    break
                continue
            if kind in (_MIDDLE, _LAST) and not parts:  # the tail of a record dropped above
                pos = done = end
                continue
            if kind in (_FULL, _FIRST) and parts:  # a record left unfinished
                self._count("malformed")
                parts = []
            pos = end
            parts.append(payload)
            if kind in (_FULL, _LAST):
                out.append(b"".join(parts))
                parts = []
                done = pos
        return out, done

    def poll(self) -> list[dict]:
        """The history rows written since the last poll."""
        try:
            size = self.path.stat().st_size
        except OSError:
            return []
        if size < self.offset:  # rewritten from the start
            self.offset = 0
            self._count("truncations")
        rows: list[dict] = []
        while size > self.offset:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                buf = handle.read(max(_CHUNK, size - self.offset))
            records, used = self._records(buf, self.offset)
            self.offset += used
            for data in records:
                row = self._row(data)
                if row is not None:
                    rows.append(row)
            if not used:
                break
        return rows

    def _row(self, data: bytes) -> dict | None:
        record = self._pb.Record()
        try:
            record.ParseFromString(data)
        except Exception:  # noqa: BLE001  protobuf's DecodeError, whatever its module
            self._count("malformed")
            return None
        if record.WhichOneof("record_type") != "history":
            return None
        row: dict[str, Any] = {}
        for item in record.history.item:
            key = item.key or ".".join(item.nested_key)
            row[key] = _value(item.value_json)
        if "_step" not in row and record.history.HasField("step"):
            row["_step"] = record.history.step.num
        if "step" not in row and "_step" in row:
            row["step"] = row["_step"]
        return row
