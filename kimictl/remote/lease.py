"""The cluster lease on its lock host: an exclusive `flock` on <state>/lease.lock, held by this process for as long
as the control node that asked for it keeps the SSH channel open.

Run by kimictl/lease.py over SSH as `python3 -c BOOT MODE ARGS_JSON`, with this file's text as the first line of
stdin (a JSON string). Everything after that line on stdin is the control node's lifeline.

- `hold {"state_dir", "holder", "wait", "ttl"}`: take the lock without blocking (or polling for up to `wait`
  seconds), write the holder's record into the lock file and print one JSON line: {"ok": true, "holder": record},
  or {"ok": false, "holder": the other holder's record} when it stays held. While waiting, one line
  {"waiting": true, "holder": ...} names whom we wait for. Once held, the lock is kept until stdin reaches EOF (the
  control node closed the channel, or died and sshd closed it) or no line came for `ttl` seconds (the control node
  is cut off or stopped); then the process exits and the kernel drops the flock. Nothing has to clean up after a
  dead holder: the lock lives only as long as this process.
- `peek {"state_dir"}`: print {"state": "free"} or {"state": "held", "holder": record}. It takes a shared lock for
  an instant (a holder's lock excludes it); a `hold` that meets that instant retries for a second before it
  reports the lease held.

The record names the control node (hostname, user, pid), the command and since when (UTC), plus `lock_pid`: this
process on the lock host. The standard library only, Python 3.9 (the hosts' python3); never imports kimictl.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
import time

LOCK_FILE = "lease.lock"
GRACE = 1.0  # seconds a `hold` retries before it calls the lease held (a `peek` holds it for an instant)
POLL = 0.1


def lock_path(state_dir: str) -> str:
    return os.path.join(state_dir, LOCK_FILE)


def read_record(fd: int) -> dict:
    """The holder's record in the lock file ({} while none is written yet, or it cannot be read)."""
    for _ in range(3):   # a holder writes its record right after it takes the lock: give it a moment
        try:
            doc = json.loads(os.pread(fd, 4096, 0) or b"null")
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            return doc
        time.sleep(0.05)
    return {}


def open_lock(state_dir: str) -> int:
    """The lock file, created (0600) under the state dir, which is created (0755) when the host has none yet."""
    os.makedirs(state_dir, 0o755, exist_ok=True)
    # O_NOFOLLOW: a symlink planted as the lock file is refused (ELOOP), never followed.
    return os.open(lock_path(state_dir), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _try(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class Lifeline:
    """The control node's side of the channel: every line on stdin is a heartbeat; EOF means it is gone."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.last = time.monotonic()
        self.gone = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            while self.stream.readline():
                self.last = time.monotonic()
        except (OSError, ValueError):
            pass
        self.gone.set()

    def lost(self, ttl: float) -> bool:
        return self.gone.is_set() or time.monotonic() - self.last > ttl


def say(doc: dict) -> None:
    try:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()
    except (OSError, ValueError):   # the channel is gone: the lifeline ends the process
        pass


def hold(state_dir: str, holder: dict, wait: float, ttl: float, stdin) -> int:
    try:
        fd = open_lock(state_dir)
    except OSError as exc:   # a state dir that cannot be made, a planted symlink (ELOOP)
        say({"error": f"{exc.filename or lock_path(state_dir)}: {exc.strerror or exc}"})
        return 1
    life = Lifeline(stdin)
    start = time.monotonic()
    waiting = False
    while not _try(fd, fcntl.LOCK_EX):
        now = time.monotonic()
        if now - start >= max(wait, GRACE) or life.lost(ttl):
            say({"ok": False, "holder": read_record(fd)})
            return 0
        if wait > GRACE and not waiting and now - start >= GRACE:
            waiting = True
            say({"waiting": True, "holder": read_record(fd)})
        time.sleep(POLL)
    record = {**holder, "lock_pid": os.getpid()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    say({"ok": True, "holder": record})
    while not life.gone.wait(min(1.0, ttl)):
        if life.lost(ttl):
            break
    os.ftruncate(fd, 0)   # released: no record of a holder that is gone (the lock itself goes with the process)
    os.close(fd)
    return 0


def peek(state_dir: str) -> dict:
    try:
        fd = os.open(lock_path(state_dir), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return {"state": "free"}
    try:
        if _try(fd, fcntl.LOCK_SH):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return {"state": "free"}
        return {"state": "held", "holder": read_record(fd)}
    finally:
        os.close(fd)


def main(argv: list) -> int:
    if len(argv) != 2 or argv[0] not in ("hold", "peek"):
        sys.stderr.write("usage: lease.py hold|peek ARGS_JSON\n")
        return 2
    args = json.loads(argv[1])
    if argv[0] == "peek":
        say(peek(args["state_dir"]))
        return 0
    rc = hold(args["state_dir"], args["holder"], float(args.get("wait", 0)), float(args["ttl"]), sys.stdin.buffer)
    # The lifeline's thread is blocked reading stdin: a normal exit would wait on stdin's buffer lock at shutdown
    # (and abort); nothing is left to flush but stdout.
    sys.stdout.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
