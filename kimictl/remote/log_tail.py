"""Print the last lines of every engine's and the proxy's log on this host, as JSON.

Run on a host by `kimictl logs` (one SSH round trip per host): `python3 - ARGS_JSON` with this file on stdin;
ARGS_JSON is {"sd": state dir, "lines": N}. Output: {manifest (of `current`, or null), states (supervised ids),
logs: {id: [lines] or null when the log file is missing}}.
"""

from __future__ import annotations

import glob
import json
import os
import sys


def tail(path: str, n: int) -> list | None:
    """The last n lines of a file, reading backwards in 64 KiB steps; None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            pos = f.tell()
            buf = b""
            while pos > 0 and buf.count(b"\n") <= n:
                step = min(65536, pos)
                pos -= step
                f.seek(pos)
                buf = f.read(step) + buf
    except OSError:
        return None
    lines = buf.decode("utf-8", "replace").splitlines()
    return lines[-n:] if n > 0 else []


def collect(sd: str, lines: int) -> dict:
    try:
        with open(os.path.join(sd, "current", "manifest.json")) as f:
            man = json.load(f)
    except (OSError, ValueError):
        man = None
    ids = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(sd, "run", "*.json")))
    want = ([e["id"] for e in man.get("engines", [])] + (["proxy"] if man.get("proxy") else [])) if man else ids
    logs = {i: tail(os.path.join(sd, "logs", i + ".log"), lines) for i in want}
    return {"manifest": man, "states": ids, "logs": logs}


def main(argv: list) -> int:
    a = json.loads(argv[0])
    print(json.dumps(collect(a["sd"], a["lines"])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
