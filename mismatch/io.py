"""Writing files so that a reader never sees a half-written one.

Every output of the project (a checkpoint, a metrics summary, a report, a plot, a run directory)
is written to a temporary sibling and renamed over its destination: `os.replace` is atomic on
one filesystem, so a reader sees the previous file or the new one, never a prefix. A failure
removes the temporary and leaves the destination as it was.

This module and `mismatch.runtime` are the foundation under every layer, quantize included: they
import nothing of the project.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

__all__ = ["OUTPUT_MARKER", "user_cache_dir", "atomic_directory", "atomic_path", "atomic_write_text",
           "check_output_dir", "check_writable_dir", "mark_output", "replace_directory",
           "save_figure"]

OUTPUT_MARKER = ".mismatch-output"
"""A file in every directory a command writes whole (probe, qualify): the command's name. A rerun
may replace a directory that holds it; any other non-empty directory is refused."""


def user_cache_dir(name: str) -> Path:
    """$XDG_CACHE_HOME/mismatch/<name> (~/.cache by default): what the project keeps between
    runs (probe figures of `mismatch plan`, the native kernels' builds)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mismatch" / name


def _tmp_sibling(path: Path) -> Path:
    return path.parent / f".{path.name}.tmp-{os.getpid()}"


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of the file `path` for the caller to write (by any writer:
    torch.save, savefig, safetensors); on success it replaces `path`, on failure it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> Path:
    """Write `text` to `path` through a temporary sibling and a rename."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


@contextlib.contextmanager
def atomic_directory(out: Path, *, force: bool = True) -> Iterator[Path]:
    """Yield a fresh temporary sibling of the directory `out` to fill; when the block succeeds it
    replaces `out` (which must not exist unless `force`), when it fails it is removed. An
    existing `out` is moved aside first and deleted only once the new one is in place, so a
    failed rename puts it back."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if (out.exists() or out.is_symlink()) and not force:
            raise FileExistsError(f"{out} exists")
        replace_directory(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_directory(new: Path, out: Path) -> None:
    """Move the finished directory `new` to `out`; an existing `out` is removed only after the
    rename succeeds (it is put back if the rename fails)."""
    new, out = Path(new), Path(out)
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    had_old = out.exists() or out.is_symlink()
    if had_old:
        os.replace(out, old)
    try:
        os.replace(new, out)
    except BaseException:
        if had_old:
            os.replace(old, out)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    elif old.exists() or old.is_symlink():
        old.unlink()


def mark_output(directory: Path, command: str) -> None:
    """Mark `directory` (being written) as the output of `command` (see OUTPUT_MARKER)."""
    (Path(directory) / OUTPUT_MARKER).write_text(command + "\n")


def _earlier_output(out: Path, command: str) -> bool:
    """`out` was written whole by `command`: its marker names it, or (written before the marker
    existed) its results.json records a `mismatch <command>` command line and it holds nothing but
    the JSON, Markdown and PNG files such a command writes."""
    marker = out / OUTPUT_MARKER
    if marker.is_file():
        return marker.read_text().strip() == command
    try:
        recorded = json.loads((out / "results.json").read_text()).get("command", "")
    except (OSError, ValueError, AttributeError):
        return False
    return (isinstance(recorded, str) and recorded.split()[:2] == ["mismatch", command]
            and all(p.is_file() and p.suffix in (".json", ".md", ".png") for p in out.iterdir()))


def check_writable_dir(out: Path, option: str = "--out") -> Path:
    """Fail now, before any work, if the directory `out` (existing or to be created) cannot be
    written: a path under a regular file, the working directory or one of its parents, no
    permission. Creates `out`'s missing parents. Raises ValueError with one line."""
    out = Path(out)
    where = out.resolve()
    cwd = Path.cwd().resolve()
    if where == cwd or where in cwd.parents:
        raise ValueError(f"{option} {out} is the working directory or holds it; name a new "
                         f"folder for the outputs (e.g. {option} runs/name)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{option} {out} is a file, not a directory; choose another {option}")
    for parent in where.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"cannot create {option} {out}: {parent} is a file, not a "
                                 f"directory; choose another {option}")
            break
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        probe = _tmp_sibling(where.parent / f"{where.name}.check")
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        raise ValueError(f"cannot write {option} {out}: {exc.strerror or exc}; choose another "
                         f"{option}") from None
    return out


def check_output_dir(out: Path, command: str, *, force: bool = False,
                     option: str = "--out") -> Path:
    """Before any work: `out` can be written (check_writable_dir) and replacing it loses nothing
    — it does not exist, is empty, or is an earlier output of the same `command` — unless
    `force`. Raises ValueError with one line that says what to do."""
    out = check_writable_dir(out, option)
    if force or not out.is_dir() or _earlier_output(out, command):
        return out
    held = sorted(p.name for p in out.iterdir())
    if held:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise ValueError(f"{option} {out} holds files that are not an earlier `mismatch "
                         f"{command}` output ({shown}); choose a new or empty folder, or pass "
                         f"--force to replace it")
    return out


def save_figure(fig, path: Path) -> str:
    """Lay out, write (110 dpi, atomically) and close one matplotlib figure; returns the file's
    name."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return path.name
