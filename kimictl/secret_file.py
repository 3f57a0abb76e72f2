"""Reading a secret kept in a file on the control node: readable by its owner only, read when needed, never copied
into rendered files, run directories or logs. Which files hold a cluster's keys: kimictl/cluster_secrets.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kimictl.errors import InvalidInput


def read_secret_file(path: Path, what: str) -> str:
    """The file's content without surrounding whitespace; exit 2 when missing, not a regular file, readable by
    others or empty."""
    try:
        # O_NONBLOCK: a FIFO put where the key should be must not hang the command
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise InvalidInput(f"{what} {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInput(f"{what} {path} is not a regular file")
        if st.st_mode & 0o077:
            raise InvalidInput(f"{what} {path} is readable by others (mode {st.st_mode & 0o777:o}); chmod 600 it")
        try:
            text = os.read(fd, 1 << 20).decode().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidInput(f"{what} {path}: cannot read it: {exc}") from None
    finally:
        os.close(fd)
    if not text:
        raise InvalidInput(f"{what} {path} is empty")
    return text
