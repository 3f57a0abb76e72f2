"""Keep the release's fixed ports out of the kernel's ephemeral range: add them to net.ipv4.ip_local_reserved_ports.

Why: kv ports (>= 36000 on A3, to stay clear of AscendDirectTransport's own range) and the other fixed ports sit in
Linux's ephemeral range (32768-60999 by default). An outgoing connection (a weights pull, a metrics scrape, a proxy's
connection to an engine) may get one of them as its source port; while that socket is open, and for 60 s in
TIME_WAIT after it closes, an engine binding the port fails with "Address already in use" (libzmq's SO_REUSEADDR
does not help: the client socket did not set it). A reserved port is never handed out as a source port.

Run by playbooks/tasks/reserve_ports.yml: `python3 reserve_ports.py PORTS [--persist FILE]`, PORTS as the kernel
spells them (7100,36000-36015). Adds to whatever is reserved already (never removes), writes the union to FILE
(a sysctl.d file, so a reboot keeps it) and prints JSON {"changed": bool, "reserved": "..."}. A host that does
not let us write the setting (not root, read-only /proc/sys) is reported as {"changed": false, "skipped": why}.
Standard library only; runs on Python 3.9.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import tempfile

PROC = "/proc/sys/net/ipv4/ip_local_reserved_ports"
KEY = "net.ipv4.ip_local_reserved_ports"


def parse(text: str) -> list:
    """'7100,36000-36015' -> [(7100, 7100), (36000, 36015)]; raises ValueError naming the bad item."""
    out = []
    for item in "".join(text.split()).split(","):
        if not item:
            continue
        lo, dash, hi = item.partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise ValueError(f"not a port or port range: {item!r}") from None
        if not 1 <= first <= last <= 65535:
            raise ValueError(f"not a port or port range within 1-65535: {item!r}")
        out.append((first, last))
    return out


def merge(ranges: list) -> list:
    """Sorted, with overlapping and adjacent ranges joined."""
    out: list = []
    for first, last in sorted(ranges):
        if out and first <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return out


def spell(ranges: list) -> str:
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def _write_atomic(path: str, text: str) -> None:
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".kimictl-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def reserve(wanted: list, proc: str = PROC, persist: str | None = None) -> dict:
    with open(proc, encoding="utf-8") as f:
        now = merge(parse(f.read()))
    union = merge(now + wanted)
    changed = union != now
    if changed:
        try:
            with open(proc, "w", encoding="utf-8") as f:
                f.write(spell(union) + "\n")
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                return {"changed": False, "skipped": f"cannot write {proc}: {exc.strerror}"}
            raise
    if persist:
        text = (f"# Written by kimictl: its engines' and proxy's fixed ports, kept out of the ephemeral range\n"
                f"# (plus what was reserved when it wrote this). Removing it frees them at the next boot.\n"
                f"{KEY} = {spell(union)}\n")
        try:
            with open(persist, encoding="utf-8") as f:
                same = f.read() == text
        except FileNotFoundError:
            same = False
        if not same:
            _write_atomic(persist, text)
            changed = True
    return {"changed": changed, "reserved": spell(union)}


def main(argv: list) -> int:
    ap = argparse.ArgumentParser(prog="reserve_ports.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("ports", help="ports and ranges to reserve, e.g. 7100,36000-36015")
    ap.add_argument("--persist", help="a sysctl.d file to write the reserved set to")
    ap.add_argument("--proc", default=PROC, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        doc = reserve(merge(parse(args.ports)), args.proc, args.persist)
    except (OSError, ValueError) as exc:
        print(f"reserve_ports: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
