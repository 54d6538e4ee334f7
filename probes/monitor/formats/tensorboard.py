"""TensorBoard event files → metric dicts, read as they grow.

What frameworks write: verl's "tensorboard" logger and slime's `--use-tensorboard` both open one
`torch.utils.tensorboard.SummaryWriter` on `$TENSORBOARD_DIR`, else
`tensorboard_log/<project>/<experiment>`, and call `add_scalar(key, value, step)` once per metric
(volcengine/verl@b178a3c:verl/utils/tracking.py _TensorboardAdapter; THUDM/slime@624b824:
slime/observability/tensorboard_utils.py _TensorboardAdapter). slime drops its step key from the
dict and uses its value as the event's step: `train/step` for the train metrics, `rollout/step`
(the rollout id) for rollout and perf metrics, `eval/step` for eval
(slime/observability/logging_utils.py log). Every process that logs opens its own writer, so a
run's folder may hold several `events.out.tfevents.*` files growing at once.

The file format is TFRecord: per record a little-endian uint64 length, its masked CRC-32C, the
bytes of one `Event` protobuf, their masked CRC-32C (tensorboard's
tensorboard/compat/tensorflow_stub/pywrap_tensorflow.py PyRecordReader_New reads the same). The
`Event` protobuf and the CRC come from the `tensorboard` package (`pip install 'mismatch[logs]'`).
A record not yet completely written is left for the next poll, as TensorBoard's own loader does.

`TensorBoardLog(path, step_field).poll()` returns the dicts new since the last poll: the scalars
of one writer's consecutive events with the same step and step axis, as one dict
`{<step field>: step, tag: value, ...}`; events of all files are merged by wall time.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, Callable

from mismatch.probes.monitor.formats.adapter import Adapter

__all__ = ["TensorBoardLog", "event_files", "is_event_file", "step_field_for", "load_protos",
           "INSTALL_HINT"]

INSTALL_HINT = "pip install 'mismatch[logs]'"
_PATTERN = "events.out.tfevents.*"
_HEADER = 12  # uint64 length + uint32 masked crc of it
_CHUNK = 1 << 22


def is_event_file(path: Path) -> bool:
    """Whether `path` is named as TensorFlow / PyTorch event files are."""
    return "tfevents" in path.name


def event_files(folder: Path) -> list[Path]:
    """The event files directly in `folder`, oldest name first (the name carries the time)."""
    return sorted(p for p in folder.glob(_PATTERN) if p.is_file())


def load_protos():
    """(event_pb2, masked_crc32c) from the tensorboard package; a one-line ValueError without."""
    try:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
    except ImportError as exc:
        raise ValueError(f"reading TensorBoard event files needs the tensorboard package "
                         f"({exc.name or exc}): {INSTALL_HINT}") from None
    return event_pb2, masked_crc32c


def step_field_for(adapter: Adapter) -> Callable[[str], str]:
    """Under which field a tag's event step goes: for slime and Miles (two step axes) train/ tags
    go on the train-step field, eval/ tags on eval/step, the rest on the rollout field; for the
    others every tag's step is the step field (`--map step=...` renames it)."""
    step = adapter.step[0]
    if not adapter.train_step:
        return lambda tag: step
    train = adapter.train_step[0]

    def field(tag: str) -> str:
        head = tag.split("/", 1)[0]
        return train if head == "train" else "eval/step" if head == "eval" else step

    return field


def _scalar(value: Any, types: dict[int, str]) -> float | int | None:
    """The number a Summary.Value holds, or None (histograms, images, text, tensors of rank > 0)."""
    kind = value.WhichOneof("value")
    if kind == "simple_value":
        return value.simple_value
    if kind != "tensor":
        return None
    t = value.tensor
    if t.tensor_shape.dim and any(d.size != 1 for d in t.tensor_shape.dim):
        return None
    for name in ("float_val", "double_val", "int_val", "int64_val"):
        values = getattr(t, name)
        if len(values) == 1:
            return values[0]
    code = types.get(t.dtype)
    if code and len(t.tensor_content) == struct.calcsize(code):
        return struct.unpack(code, t.tensor_content)[0]
    return None


class _File:
    """One event file's reading position."""

    def __init__(self, path: Path, order: int) -> None:
        self.path, self.order = path, order
        self.offset = 0
        self.seq = 0


class TensorBoardLog:
    """The event files of one run (a folder, or one file), read incrementally by `poll`."""

    def __init__(self, path: Path, step_field: Callable[[str], str], *, hold_last: bool = False,
                 events: Any = None) -> None:
        self.path = path
        self.step_field = step_field
        self.hold_last = hold_last
        """Keep the last group of a poll until the next poll (`flush` releases it): a writer
        flushes part of a step's scalars, the rest comes later."""
        self.events = events if events is not None else {}
        self._pb, self._crc = load_protos()
        self._types = {1: "<f", 2: "<d", 3: "<i", 9: "<q"}  # DT_FLOAT, DOUBLE, INT32, INT64
        self._files: dict[Path, _File] = {}
        self._held: list[tuple] = []

    def _discover(self) -> list[_File]:
        paths = [self.path] if not self.path.is_dir() else event_files(self.path)
        for p in paths:
            if p not in self._files:
                self._files[p] = _File(p, len(self._files))
        return list(self._files.values())

    def _read(self, f: _File) -> list[tuple]:
        """New (wall_time, file order, seq, step, tag, value) of one file."""
        try:
            size = f.path.stat().st_size
        except OSError:
            return []
        if size < f.offset:  # rewritten from the start
            f.offset = 0
            self.events["truncations"] = self.events.get("truncations", 0) + 1
        if size == f.offset:
            return []
        out: list[tuple] = []
        with open(f.path, "rb") as handle:
            handle.seek(f.offset)
            buf = handle.read(max(_CHUNK, size - f.offset))
        pos = 0
        while pos + _HEADER <= len(buf):
            header = buf[pos:pos + 8]
            (length,), (crc,) = struct.unpack("<Q", header), struct.unpack(
                "<I", buf[pos + 8:pos + 12])
            if crc != self._crc(header):
                raise ValueError(f"{f.path}: not a TensorBoard event file, or corrupt at byte "
                                 f"{f.offset + pos} (record length fails its CRC)")
            end = pos + _HEADER + length + 4
            if end > len(buf):
                break  # being written: read it next time
            data = buf[pos + _HEADER:end - 4]
            if struct.unpack("<I", buf[end - 4:end])[0] != self._crc(data):
                raise ValueError(f"{f.path}: corrupt event record at byte {f.offset + pos} "
                                 "(data fails its CRC)")
            pos = end
            event = self._pb.Event()
            event.ParseFromString(data)
            if event.WhichOneof("what") != "summary":
                continue
            for value in event.summary.value:
                number = _scalar(value, self._types)
                if number is not None:
                    f.seq += 1
                    out.append((event.wall_time, f.order, f.seq, event.step, value.tag, number))
        f.offset += pos
        return out

    def poll(self) -> list[dict]:
        """The metric dicts written since the last poll (see the module docstring)."""
        scalars = sorted(s for f in self._discover() for s in self._read(f))
        if not scalars:
            return self.flush()
        scalars = self._held + scalars
        groups: list[list[tuple]] = []
        for s in scalars:
            key = (s[1], s[3], self.step_field(s[4]))
            if groups and (groups[-1][0][1], groups[-1][0][3],
                           self.step_field(groups[-1][0][4])) == key:
                groups[-1].append(s)
            else:
                groups.append([s])
        self._held = groups.pop() if self.hold_last else []
        return [self._dict(g) for g in groups]

    def flush(self) -> list[dict]:
        """The group held back by the last poll, if any."""
        held, self._held = self._held, []
        return [self._dict(held)] if held else []

    def _dict(self, group: list[tuple]) -> dict:
        _, _, _, step, tag, _ = group[0]
        out: dict[str, Any] = {self.step_field(tag): step}
        for s in group:
            out.setdefault(s[4], s[5])  # a tag named as the step field keeps the event step
        return out
