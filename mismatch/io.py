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
import os
import shutil
from pathlib import Path
from typing import Iterator

__all__ = ["atomic_directory", "atomic_path", "atomic_write_bytes", "atomic_write_text",
           "replace_directory", "save_figure"]


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


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Write `data` to `path` through a temporary sibling and a rename."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
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
