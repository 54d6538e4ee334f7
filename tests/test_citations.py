"""The project cites primary sources (papers, public code at a commit, vendor docs), never notes
kept outside the repository: no shipped file, script, test, document or report names them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("mismatch", "probes", "train", "quantize", "scripts", "tests", "docs", "examples",
           "reports")
OUTSIDE_NOTES = re.compile(r"NUMERICS(\.md| §)|\.\./shared/")


def _files():
    yield ROOT / "README.md"
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".md", ".toml", ".txt", ".json", ".sh") and path.is_file() \
                    and path != Path(__file__).resolve():
                yield path


def test_nothing_cites_notes_outside_the_repository():
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
             for p in _files() for n, line in enumerate(p.read_text(errors="replace")
                                                       .splitlines(), 1)
             if OUTSIDE_NOTES.search(line)]
    assert not found, "cite the primary source instead:\n" + "\n".join(found)


def test_the_pattern_catches_a_citation():
    assert OUTSIDE_NOTES.search("the IcePop range; NUMERICS.md §5")
    assert OUTSIDE_NOTES.search("Facts: ../shared/NUMERICS.md")
    assert not OUTSIDE_NOTES.search("--weights-dir /shared/weights")
