"""Reading a run's metrics log as it grows: `tail -F` for lines, re-reads for a state file,
polls for TensorBoard and W&B logs.

What is read (`resolve_log`): JSON lines, slime's and Miles' console metric lines, TRL's
trainer_state.json (given the file, a checkpoint dir or an output dir with checkpoint-N/ in it:
the newest one's), re-read whenever it changes (`follow_state`), a TensorBoard run folder or
event file (formats/tensorboard.py), a W&B run folder or run-<id>.wandb file
(formats/wandb_offline.py), both polled for what was appended (`follow_objects`), or a
`mismatch train` run folder (its metrics.jsonl). formats/reader.py turns them into records;
`read_records` is both in one, for the reader's adapter.

Following is `tail -F` (`follow_lines`): new lines are read as they are appended; a file that
shrinks (truncated in place) is read again from its start; a file replaced under the same name
(renamed away and re-created, as log rotation does) is drained, then the new one is opened. It
stops when `stop` is set (`stop_on_signals`: on SIGINT / SIGTERM), or after `max_idle` seconds
without new data. A truncation that is refilled past the old size between two polls cannot be
seen (as with tail). A TensorBoard folder is watched for new event files too (a restarted run,
another process's writer).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from mismatch.probes.monitor.formats import Adapter, RecordReader
from mismatch.probes.monitor.formats.reader import (looks_like_state_file, read_trainer_state,
                                                    trainer_state_path)
from mismatch.probes.monitor.formats.tensorboard import (TensorBoardLog, event_files,
                                                         is_event_file, step_field_for)
from mismatch.probes.monitor.formats.tensorboard import load_protos as load_tensorboard
from mismatch.probes.monitor.formats.wandb_offline import MAGIC as WANDB_MAGIC
from mismatch.probes.monitor.formats.wandb_offline import WandbLog, is_run_file, run_file
from mismatch.probes.monitor.formats.wandb_offline import load_protos as load_wandb

__all__ = ["follow_lines", "follow_state", "follow_objects", "read_records", "reads_state",
           "resolve_log", "check_log", "stop_on_signals"]

_CHUNK = 1 << 16  # bytes per read
_MAX_LINE = 1 << 26  # a "line" longer than 64 MiB is no metrics record: handed on (and counted
# malformed) rather than held in memory until a newline that may never come


def follow_lines(path: Path, *, follow: bool, poll_interval: float = 0.5,
                 max_idle: float | None = None, stop: threading.Event | None = None,
                 events: Counter | None = None) -> Iterator[bytes]:
    """Complete lines (without the newline) of `path`; with `follow`, also those appended later.

    A last line without a newline is yielded when the file is done (not following), when a
    rotation replaces it, or when following stops. `events` counts truncations and rotations.
    """
    stop = stop or threading.Event()
    events = events if events is not None else Counter()
    f = open(path, "rb")
    buf = b""
    last_growth = time.monotonic()
    try:
        while not (follow and stop.is_set()):
            chunk = f.read(_CHUNK)
            if chunk:
                last_growth = time.monotonic()
                *lines, buf = (buf + chunk).split(b"\n")
                yield from lines
                if len(buf) > _MAX_LINE:
                    yield buf
                    buf = b""
                continue
            if not follow:
                break
            current = os.fstat(f.fileno())
            try:
                named = os.stat(path)
            except FileNotFoundError:  # renamed away, its successor not created yet
                named = None
            if named is not None and (named.st_ino, named.st_dev) != (current.st_ino,
                                                                      current.st_dev):
                for rest in iter(lambda: f.read(_CHUNK), b""):  # written before the rename
                    buf += rest
                *lines, buf = buf.split(b"\n")
                yield from lines
                if buf:
                    yield buf
                f.close()
                f = open(path, "rb")
                buf = b""
                events["rotations"] += 1
                last_growth = time.monotonic()
                continue
            if current.st_size < f.tell():
                f.seek(0)
                buf = b""
                events["truncations"] += 1
                last_growth = time.monotonic()
                continue
            if max_idle is not None and time.monotonic() - last_growth >= max_idle:
                break
            stop.wait(poll_interval)
        if buf:
            yield buf
    finally:
        f.close()


def follow_state(path: Path, *, follow: bool, poll_interval: float = 0.5,
                 max_idle: float | None = None, stop: threading.Event | None = None,
                 events: Counter | None = None) -> Iterator[dict]:
    """The log_history entries of the trainer_state.json that `path` names (formats.reader.
    trainer_state_path), each once; with `follow`, re-read whenever it changes (or a newer
    checkpoint appears). A file that does not parse is waited for when following (it may be
    being rewritten), a ValueError otherwise. `events` counts the reads (`state_reads`)."""
    stop = stop or threading.Event()
    events = events if events is not None else Counter()
    seen: set[str] = set()
    last: tuple | None = None
    last_growth = time.monotonic()
    while not (follow and stop.is_set()):
        target = trainer_state_path(path)
        try:
            st = os.stat(target) if target is not None else None
        except OSError:
            st = None
        mark = None if st is None else (str(target), st.st_ino, st.st_mtime_ns, st.st_size)
        if mark is not None and mark != last:
            entries = read_trainer_state(target)
            if entries is not None:
                last, last_growth = mark, time.monotonic()
                events["state_reads"] += 1
                for entry in entries:
                    key = json.dumps(entry, sort_keys=True, default=str)
                    if key not in seen:
                        seen.add(key)
                        yield entry
            elif not follow:
                raise ValueError(f"{target}: not a trainer_state.json (no log_history list); "
                                 "--format trl reads the one TRL writes at each checkpoint")
        if not follow:
            if target is None:
                raise ValueError(f"{path}: no trainer_state.json in it nor in a checkpoint-N/ "
                                 "under it; TRL writes one at each checkpoint (save_steps)")
            return
        if max_idle is not None and time.monotonic() - last_growth >= max_idle:
            return
        stop.wait(poll_interval)


def reads_state(path: Path, adapter: Adapter) -> bool:
    """Whether `path` is read as a trainer_state.json (TRL), not as lines."""
    return adapter.name == "trl" and (path.is_dir() or (path.is_file()
                                                        and looks_like_state_file(path)))


def resolve_log(path: Path, adapter: Adapter) -> tuple[str, Path]:
    """What `path` is and the file (or folder) to read: ("state", trainer_state.json or its
    folder: TRL), ("tensorboard", an event file or a folder of them), ("wandb", a run file:
    given, or the run-<id>.wandb of a run folder) or ("lines", a file, or the metrics.jsonl of a
    `mismatch train` run folder). A one-line ValueError for anything else."""
    if not path.exists():
        raise ValueError(f"{path}: no such file")
    if reads_state(path, adapter):
        return "state", path
    if path.is_file():
        if is_event_file(path):
            return "tensorboard", path
        if path.suffix == ".wandb" or is_run_file(path):
            return "wandb", path
        return "lines", path
    if not path.is_dir():
        raise ValueError(f"{path}: not a regular file")
    if (path / "metrics.jsonl").is_file():
        return "lines", path / "metrics.jsonl"
    if event_files(path):
        return "tensorboard", path
    if (found := run_file(path)) is not None:
        return "wandb", found
    runs = sorted({p.parent.relative_to(path).as_posix() for pattern in
                   ("*/**/events.out.tfevents.*", "*/**/run-*.wandb") for p in path.glob(pattern)})
    inside = f"; runs under it: {', '.join(runs[:3])}{', ...' if len(runs) > 3 else ''}" \
        if runs else ""
    raise ValueError(f"{path}: not a regular file, and no metrics.jsonl, events.out.tfevents.* "
                     f"or run-*.wandb in it{inside}")


def check_log(path: Path, adapter: Adapter, *, follow: bool) -> None:
    """A one-line ValueError (or OSError) if `path` cannot be read as `adapter`'s log: missing,
    of no kind `resolve_log` knows, or needing a package that is not installed."""
    kind, target = resolve_log(path, adapter)
    if kind == "tensorboard":
        load_tensorboard()
    elif kind == "wandb":
        load_wandb()
        with open(target, "rb") as handle:
            head = handle.read(len(WANDB_MAGIC))
        if len(head) == len(WANDB_MAGIC) and head != WANDB_MAGIC:
            raise ValueError(f"{target}: not a W&B run file (no :W&B header)")
    elif kind == "lines":
        with open(target, "rb"):
            pass
    elif not follow and trainer_state_path(path) is None:
        raise ValueError(f"{path}: no trainer_state.json in it nor in a checkpoint-N/ under "
                         "it; TRL writes one at each checkpoint (save_steps), or log live "
                         "with mismatch.integrations.trl.MonitorLogCallback")


def follow_objects(source, *, follow: bool, poll_interval: float = 0.5,
                   max_idle: float | None = None, stop: threading.Event | None = None,
                   events: Counter | None = None) -> Iterator[dict]:
    """The metric dicts of a TensorBoard or W&B log (`source.poll()`, `source.flush()` where it
    holds a step back); with `follow`, polled until `stop` or `max_idle` seconds without new
    data. `events` is counted in by the source itself."""
    stop = stop or threading.Event()
    last_growth = time.monotonic()
    flush = getattr(source, "flush", lambda: [])
    while not (follow and stop.is_set()):
        batch = source.poll()
        if batch:
            last_growth = time.monotonic()
            yield from batch
            continue
        if not follow or (max_idle is not None and time.monotonic() - last_growth >= max_idle):
            break
        stop.wait(poll_interval)
    yield from flush()


def read_records(path: Path, reader: RecordReader, *, follow: bool, poll_interval: float = 0.5,
                 max_idle: float | None = None, stop: threading.Event | None = None
                 ) -> Iterator[dict]:
    """The native records of the log at `path` through `reader` (lines, a trainer_state.json's
    entries, TensorBoard scalars or W&B history rows: `resolve_log`), followed as `follow_lines`
    / `follow_state` / `follow_objects` do; truncations, rotations and state reads are counted in
    `reader.tally`."""
    options = dict(follow=follow, poll_interval=poll_interval, max_idle=max_idle, stop=stop,
                   events=reader.tally)
    kind, target = resolve_log(path, reader.adapter)
    if kind == "state":
        records = (reader.feed_entry(e) for e in follow_state(path, **options))
    elif kind == "tensorboard":
        log = TensorBoardLog(target, step_field_for(reader.adapter), hold_last=follow,
                             events=reader.tally)
        records = (reader.feed_entry(e) for e in follow_objects(log, **options))
    elif kind == "wandb":
        records = (reader.feed_entry(e) for e in
                   follow_objects(WandbLog(target, events=reader.tally), **options))
    else:
        records = (reader.feed(line) for line in follow_lines(target, **options))
    return (record for record in records if record is not None)


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Inside: SIGINT and SIGTERM set `stop` instead of ending the process (main thread only;
    elsewhere nothing changes). The previous handlers come back on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in previous:
        signal.signal(s, lambda *_: stop.set())
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
