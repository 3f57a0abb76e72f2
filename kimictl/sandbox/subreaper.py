#!/usr/bin/python3
"""Loopback-mode host launcher: runs sshd as a child subreaper so `down` also kills daemons started over ssh."""

import contextlib
import ctypes
import os
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


class Stop(Exception):
    """SIGTERM/SIGINT: tear the fake host down."""


def kids(me):
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == str(me):
                        out.append(int(p))
            except (OSError, IndexError):
                pass
    return out


def main():
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    def stop(*_):
        raise Stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execv(sys.argv[1], sys.argv[1:])
    try:
        while True:
            try:
                os.wait()
            except ChildProcessError:
                time.sleep(0.5)
    except Stop:
        pass
    me = os.getpid()
    # orphans of ssh sessions (setsid/nohup daemons) were reparented to us: kill them all
    for sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGKILL, signal.SIGKILL):
        for k in kids(me):
            with contextlib.suppress(ProcessLookupError):
                os.kill(k, sig)
        t = time.time()
        while time.time() - t < 1.0:
            try:
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass
            except ChildProcessError:
                pass
            if not kids(me):
                return
            time.sleep(0.02)


if __name__ == "__main__":
    main()
