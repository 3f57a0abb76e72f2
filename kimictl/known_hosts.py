"""known_hosts the way OpenSSH reads it, for kimictl's own (paramiko) connections, and a safe writer.

Read: plain, hashed (`|1|salt|hash`), wildcard (`*`, `?`), negated (`!`) and `[host]:port` patterns; the markers
`@revoked` (that key is refused for the hosts its pattern matches) and `@cert-authority`; the user's files, then
the global ones (/etc/ssh/ssh_known_hosts); a line that cannot be parsed is skipped, as OpenSSH does.
Write: a new key is appended to the first user file under an exclusive lock (fcntl), after re-reading the file; the
file is never rewritten, so parallel connections (threads, processes, OpenSSH under Ansible appending too) lose no
key and no comment.

CA-signed host keys: paramiko cannot check host certificates, so for kimictl's probes a host covered only by a
`@cert-authority` line is unknown (the message says so); OpenSSH, i.e. the Ansible stage, honours the line.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import hashlib
import hmac
import os
import re
from dataclasses import dataclass
from pathlib import Path

GLOBAL_FILES = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")
MARKERS = ("@revoked", "@cert-authority")


class HostKeyError(Exception):
    """A host's key is revoked, changed or unknown; the message names the host and the files."""


@dataclass(frozen=True)
class Entry:
    marker: str   # "" | "@revoked" | "@cert-authority"
    patterns: str
    key_type: str
    blob: bytes
    where: str    # path:line

    def matches(self, name: str) -> bool:
        """OpenSSH's host matching: `name` is `host` on port 22, else `[host]:port`."""
        name = name.lower()
        if self.patterns.startswith("|1|"):
            try:
                _, _, salt, digest = self.patterns.split("|")
                mac = hmac.new(base64.b64decode(salt), name.encode(), hashlib.sha1).digest()
                return hmac.compare_digest(mac, base64.b64decode(digest))
            except (ValueError, binascii.Error):
                return False
        hit = False
        for pat in self.patterns.lower().split(","):
            negate = pat.startswith("!")
            if re.fullmatch("".join(".*" if c == "*" else "." if c == "?" else re.escape(c)
                                    for c in pat.removeprefix("!")), name):
                if negate:
                    return False
                hit = True
        return hit


def host_name(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


def fingerprint(blob: bytes) -> str:
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def parse(text: str, path: str) -> list[Entry]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        marker = ""
        if fields[0].startswith("@"):
            marker, fields = fields[0], fields[1:]
            if marker not in MARKERS:
                continue
        if len(fields) < 3:
            continue
        try:
            blob = base64.b64decode(fields[2], validate=True)
        except (binascii.Error, ValueError):
            continue
        if blob[4:4 + int.from_bytes(blob[:4], "big")] != fields[1].encode():   # not a key of the named type
            continue
        out.append(Entry(marker, fields[0], fields[1], blob, f"{path}:{n}"))
    return out


def load(paths: list[str] | tuple[str, ...]) -> list[Entry]:
    out = []
    for p in paths:
        with contextlib.suppress(OSError):
            out += parse(Path(p).read_text(errors="replace"), p)
    return out


def append(path: Path, name: str, key_type: str, b64: str) -> bool:
    """Append `name key_type b64` unless the file already trusts that key for `name`; True when a line was added.
    Existing bytes are never touched."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    blob = base64.b64decode(b64)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        chunks, off = [], 0
        while chunk := os.pread(fd, 1 << 16, off):
            chunks.append(chunk)
            off += len(chunk)
        data = b"".join(chunks)
        if any(not e.marker and e.blob == blob and e.matches(name)
               for e in parse(data.decode(errors="replace"), str(path))):
            return False
        line = f"{name} {key_type} {b64}\n".encode()
        os.write(fd, line if not data or data.endswith(b"\n") else b"\n" + line)
        return True
    finally:
        os.close(fd)   # drops the lock


def check(host: str, name: str, key_type: str, b64: str, files: tuple[str, ...], global_files: tuple[str, ...],
          *, accept_new: bool) -> str:
    """Decide on the key `name` offered: "known", or "added" (accept_new, appended to files[0]); HostKeyError when
    it is revoked, differs from the known key, or is unknown and accept_new is off."""
    blob = base64.b64decode(b64)
    mine = [e for e in load(files + global_files) if e.matches(name)]
    what = f"{key_type} {fingerprint(blob)}"
    revoked = next((e for e in mine if e.marker == "@revoked" and e.blob == blob), None)
    if revoked:
        raise HostKeyError(f"{host} ({name}) offers host key {what}, which is marked @revoked in {revoked.where}; "
                           "refusing to connect")
    plain = [e for e in mine if not e.marker]
    if any(e.blob == blob for e in plain):
        return "known"
    if plain:
        raise HostKeyError(f"the host key of {host} ({name}) has CHANGED: it offers {what}, but "
                           + ", ".join(e.where for e in plain) + " holds another key; someone may be intercepting "
                           "the connection. If the host was reinstalled, remove the old line and connect again")
    if accept_new and files:
        append(Path(files[0]), name, key_type, b64)
        return "added"
    ca = next((e for e in mine if e.marker == "@cert-authority"), None)
    hint = (f"; {ca.where} (@cert-authority) covers it, but kimictl's probes cannot check host certificates: add "
            "its plain key") if ca else ""
    raise HostKeyError(f"unknown host key for {host} ({name}, {what}): not in " + " ".join(files + global_files)
                       + f"{hint}; check the fingerprint and add it to known_hosts, or pass --accept-new-host-keys")
