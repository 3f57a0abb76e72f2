"""Print what hostile clients cost kimictl's proxy front on loopback (in front of the tests' stand-in router):
its RSS while four clients leave 100 MiB bodies unfinished, and its log size and answers while 300 clients leave
request heads unfinished against a front allowed 256 open files (the soft limit under systemd is 1024).

    python bench/proxy_front_abuse.py [--front PATH]    # e.g. the front of main: git show main:kimictl/proxy_front.py
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKE_ROUTER = ROOT / "tests" / "unit" / "data" / "fake_router.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(front: Path, tmp: Path, nofile: int | None) -> tuple[subprocess.Popen, int, Path]:
    port, state, log = free_port(), tmp / "state.json", tmp / "front.log"
    argv = [sys.executable, str(front), "run", "--listen", f"127.0.0.1:{port}", "--state", str(state),
            "--router", f"{free_port()}:{free_port()}", "--", sys.executable, str(FAKE_ROUTER)]
    if nofile:
        argv = ["prlimit", f"--nofile={nofile}:{nofile}", "--", *argv]
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if all(r["state"] == "ready" for r in json.loads(state.read_text())["routers"]):
                return proc, port, log
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the front did not come up: {log.read_text()[-2000:]}")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def unfinished_bodies(front: Path, tmp: Path) -> None:
    proc, port, _ = start(front, tmp, None)
    try:
        before = rss_mib(proc.pid)
        socks = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(4)]
        for s in socks:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 104857600\r\n\r\n")
        chunk = b"x" * (1 << 20)
        for _ in range(99):
            for s in socks:
                s.sendall(chunk)
        print(f"4 unfinished 100 MiB bodies (99 MiB of each sent): front RSS {before:.0f} MiB -> "
              f"{rss_mib(proc.pid):.0f} MiB")
        for s in socks:
            s.close()
    finally:
        stop(proc)


def half_sent_heads(front: Path, tmp: Path, wait: float) -> None:
    proc, port, log = start(front, tmp, 256)
    try:
        socks = []
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            socks.append(s)
        answers: Counter[str] = Counter()
        pending = {s.fileno(): s for s in socks}
        deadline = time.monotonic() + wait
        while pending and time.monotonic() < deadline:
            ready, _, _ = select.select(list(pending), [], [], max(0.0, deadline - time.monotonic()))
            for fd in ready:
                s = pending.pop(fd)
                try:
                    got = s.recv(64)
                except OSError as exc:
                    got = f"{type(exc).__name__}".encode()
                answers[got[:12].decode(errors="replace") or "closed"] += 1
        answers["no answer"] += len(pending)
        for s in socks:
            s.close()
        t0 = time.monotonic()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
                c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                after = c.recv(64)[:12].decode(errors="replace")
        except OSError as exc:
            after = repr(exc)
        print(f"300 half-sent request heads, {wait:.0f} s, 256 open files: answers {dict(answers)}; front log "
              f"{log.stat().st_size} bytes; then a good request: {after!r} in {time.monotonic() - t0:.2f} s")
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--front", type=Path, default=ROOT / "kimictl" / "proxy_front.py")
    ap.add_argument("--wait", type=float, default=15.0, help="seconds to wait for the half-sent clients' answers")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        unfinished_bodies(args.front, Path(d))
    with tempfile.TemporaryDirectory() as d:
        half_sent_heads(args.front, Path(d), args.wait)


if __name__ == "__main__":
    main()
