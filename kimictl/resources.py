"""Locate templates/ and playbooks/: top level in a checkout, kimictl/_resources/ in a wheel."""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).parent


def _find(name: str) -> Path:
    for candidate in (_PKG / "_resources" / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"kimictl resource directory '{name}' not found next to {_PKG}")


def templates_dir() -> Path:
    return _find("templates")


def playbooks_dir() -> Path:
    return _find("playbooks")
