"""Code that runs on the hosts: each file here is copied (or piped) to a host and run by its own `python3`.

Rules for every file in this package: the standard library only, Python 3.9 or newer, never an import of
kimictl (tests/unit/test_remote.py compiles and imports each one in a bare 3.9 interpreter). The control node
ships them by path (`source`) or pipes their text into `python3 -` (`script`).
"""

from __future__ import annotations

from pathlib import Path

_DIR = Path(__file__).resolve().parent


def source(name: str) -> Path:
    """The path of one host-side file (Ansible copies it; the weights agent is streamed from it)."""
    path = _DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"kimictl host-side file {name} is missing from {_DIR}")
    return path


def script(name: str) -> str:
    """The text of one host-side script, for `python3 - ARGS` over SSH."""
    return source(name).read_text(encoding="utf-8")
