"""docs/architecture.md names every module of kimictl/ (a module nobody can find in the map is a module nobody owns)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()
NAMED = set(re.findall(r"`(?:kimictl/)?([\w/]+\.py)`", DOC))


def test_every_module_is_named_in_the_architecture_doc() -> None:
    pkg = ROOT / "kimictl"
    modules = sorted(p.relative_to(pkg).as_posix() for p in pkg.rglob("*.py")
                     if p.name != "__init__.py" and "_resources" not in p.parts)
    missing = [m for m in modules if m not in NAMED]
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_the_doc_names_no_module_that_is_gone() -> None:
    pkg = ROOT / "kimictl"
    stale = sorted(n for n in NAMED if "/" in n and not n.startswith(("tests/", "bench/", "docs/", "scripts/"))
                   and (n.split("/")[0] in {p.name for p in pkg.iterdir() if p.is_dir()})
                   and not (pkg / n).exists())
    assert not stale, f"docs/architecture.md names modules that do not exist: {stale}"


def test_no_two_test_modules_share_a_basename() -> None:
    """pytest imports test modules by basename (no packages under tests/): a second test_x.py in another folder
    stops the whole run at collection, which a run of one folder never shows."""
    seen: dict[str, str] = {}
    for p in sorted((ROOT / "tests").rglob("test_*.py")):
        rel = p.relative_to(ROOT).as_posix()
        assert p.name not in seen, f"{rel} and {seen[p.name]} share a basename"
        seen[p.name] = rel
