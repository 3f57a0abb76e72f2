"""Reading a secret kept in a file on the control node: readable by its owner only, read when needed, never copied
into rendered files, run directories or logs. Which files hold a cluster's keys: kimictl/cluster_secrets.py."""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from kimictl.errors import InvalidInput

# A key that goes on an env file line (VLLM_API_KEY=KEY) as it is: bash's `. FILE` and docker's --env-file read these
# characters back literally, and neither format has a quoting both understand (docker keeps quotes as part of the
# value). No blanks, quotes, $ or backslashes; no leading ~ (bash expands it in an assignment).
ENV_KEY = re.compile(r"[A-Za-z0-9._+/=-][A-Za-z0-9._~+/=-]{0,4095}")
ENV_KEY_RULE = ("the key must be one token of letters, digits and ._~+/=- (no spaces, quotes, $, backslashes or a "
                "leading ~): engines read it from an env file")


MAX_SECRET = 64 << 10   # a key or a token is a few hundred bytes at most


@contextlib.contextmanager
def regular_file(path: Path, what: str) -> Iterator[tuple[int, os.stat_result]]:
    """(fd, stat) of a file the user names (`what`: the flag or key naming it), opened without blocking (a FIFO put
    there must not hang the command); exit 2 naming it when it cannot be opened or is not a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise InvalidInput(f"{what} {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInput(f"{what} {path} is not a regular file")
        yield fd, st
    finally:
        os.close(fd)


def read_text(fd: int, path: Path, what: str, size: int) -> str:
    """The UTF-8 text of regular_file's `fd` (`size` bytes at most); exit 2 naming it when it cannot be read."""
    try:
        return os.read(fd, size + 1).decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"{what} {path}: cannot read it: {exc}") from None


def read_secret_file(path: Path, what: str) -> str:
    """The file's content without surrounding whitespace; exit 2 when missing, not a regular file, readable by
    others, empty or too large for a key."""
    with regular_file(path, what) as (fd, st):
        if st.st_mode & 0o077:
            raise InvalidInput(f"{what} {path} is readable by others (mode {st.st_mode & 0o777:o}); chmod 600 it")
        if st.st_size > MAX_SECRET:
            raise InvalidInput(f"{what} {path} is {st.st_size} bytes: not a key or token (at most {MAX_SECRET})")
        text = read_text(fd, path, what, MAX_SECRET).strip()
    if not text:
        raise InvalidInput(f"{what} {path} is empty")
    return text


def key_problem(key: str) -> str | None:
    """Why `key` (already stripped) is not a key an env file line carries exactly (ENV_KEY), or None when it is one;
    the reason never quotes the key."""
    if not key:
        return "it is empty"
    if len(key) > MAX_SECRET:
        return f"it is {len(key)} characters: not a key or token (at most {MAX_SECRET})"
    return None if ENV_KEY.fullmatch(key) else ENV_KEY_RULE


def check_env_key(path: Path, what: str) -> str:
    """read_secret_file's key, refused (exit 2) unless an env file line carries it exactly (ENV_KEY)."""
    key = read_secret_file(path, what)
    why = key_problem(key)
    if why:
        raise InvalidInput(f"{what} {path}: {why}")
    return key
