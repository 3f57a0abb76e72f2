"""Secrets kept in files on the control node: readable by their owner only, read when needed, never copied into
rendered files, run directories or logs."""

from __future__ import annotations

from pathlib import Path

from kimictl.errors import InvalidInput
from kimictl.inventory import Inventory


def read_secret_file(path: Path, what: str) -> str:
    """The file's content without surrounding whitespace; exit 2 when missing, empty or readable by others."""
    try:
        st = path.stat()
        text = path.read_text().strip()
    except OSError as exc:
        raise InvalidInput(f"{what} {path}: {exc.strerror}") from None
    if st.st_mode & 0o077:
        raise InvalidInput(f"{what} {path} is readable by others (mode {st.st_mode & 0o777:o}); chmod 600 it")
    if not text:
        raise InvalidInput(f"{what} {path} is empty")
    return text


def proxy_api_key(inv: Inventory) -> str | None:
    """The key clients send to the proxy (all.vars.kimi_api_key_file), or None when the inventory sets none."""
    f = inv.cluster.kimi_api_key_file
    return read_secret_file(Path(f), "all.vars.kimi_api_key_file") if f else None
