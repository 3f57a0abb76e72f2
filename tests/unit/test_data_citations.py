"""Data files cite what anyone can read: repository paths or public upstream sources, never notes outside the
repository or a path of one machine."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[2] / "kimictl" / "data"
REPO = DATA.parents[1]
FILES = sorted(p for p in DATA.rglob("*") if p.is_file())


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(DATA)))
def test_cites_no_private_notes(path: Path) -> None:
    text = path.read_text()
    assert not re.search(r"shared/reference|\.\./shared|/work/|/root/\.cache/kimictl", text), path
    # a markdown file named as a source is either this repository's docs/ or an upstream path (docs/source/...)
    for m in re.finditer(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)\b", text):
        name = m.group(1)
        if name.startswith("docs/") and not name.startswith(("docs/source/", "docs/design/")):
            assert (REPO / name).is_file(), f"{path.name} cites {name}, which the repository lacks"
        else:
            assert "/" in name, f"{path.name} cites a bare note {name!r}: name a repository path or an upstream one"
