"""Run a module of another checkout of this project (an older commit, for side-by-side
benchmarks) in a subprocess, importing nothing from the installed one.

The `mismatch` package is assembled from four folders (pyproject.toml's package-dir:
mismatch/, probes/, quantize/, train/), which an editable install maps with an import hook
of its own. Putting the other tree on PYTHONPATH is not enough: `mismatch` would come from it,
but `mismatch.train` (no such folder under its mismatch/) from the installed tree. The
subprocess gets a `sitecustomize` that maps all four folders to the other tree before anything
is imported — in it and in every process it spawns (sampler processes import by name too).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

__all__ = ["tree_command"]

_SITECUSTOMIZE = '''
import importlib.util, os, sys

_tree = os.environ["MISMATCH_BENCH_TREE"]
_folders = {"mismatch": "mismatch", "mismatch.probes": "probes",
            "mismatch.quantize": "quantize", "mismatch.train": "train"}


class _TreeFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in _folders:
            return None
        where = os.path.join(_tree, _folders[name])
        return importlib.util.spec_from_file_location(
            name, os.path.join(where, "__init__.py"), submodule_search_locations=[where])


sys.meta_path.insert(0, _TreeFinder)
'''


def tree_command(tree: Path, module: str, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of `python -m module args` on the code of `tree`."""
    tree = Path(tree).resolve()
    boot = Path(tempfile.gettempdir()) / ("mismatch-tree-" +
                                          hashlib.sha1(str(tree).encode()).hexdigest()[:12])
    boot.mkdir(exist_ok=True)
    (boot / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    env = dict(os.environ, MISMATCH_BENCH_TREE=str(tree), PYTHONPATH=str(boot))
    return [sys.executable, "-m", module, *args], env
