"""Print this host's copy of the cluster's release record as JSON (playbooks/record.yml writes it; the control node
reads it back with kimictl/cluster_record.py, one SSH round trip per record host).

Run as `python3 - STATE_DIR [HAVE]`: HAVE is a comma-separated list of releases whose render snapshots the control
node already keeps (they are not sent again). The answer:

  {"releases": <text of record/releases.jsonl> | null, "current": <text of record/current.json> | null,
   "snapshots": {<release>: {"rendered.json": <text>, "topology.yml": <text> | null}}, "skipped": [<why>, ...]}

A file over its cap is not sent (named in "skipped"); snapshots are sent newest first until BUDGET is spent (the
rest come with the next read). The control node checks all of it again: nothing here is trusted there.
"""

from __future__ import annotations

import json
import os
import re
import sys

HISTORY_MAX = 16 * 2**20
CURRENT_MAX = 2**20
SNAPSHOT_MAX = 64 * 2**20
TOPOLOGY_MAX = 2**20
BUDGET = 256 * 2**20
RELEASE = re.compile(r"[0-9a-f]{1,64}")


def _read(path: str, cap: int, skipped: list) -> str | None:
    """The file's text; None when it is missing, or over its cap (then named in `skipped`)."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return None
    if size > cap:
        skipped.append(f"{path}: {size} bytes, over the {cap}-byte cap")
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read(cap + 1)


def read_record(state_dir: str, have: set) -> dict:
    rd = os.path.join(state_dir, "record")
    skipped: list = []
    out = {"releases": _read(os.path.join(rd, "releases.jsonl"), HISTORY_MAX, skipped),
           "current": _read(os.path.join(rd, "current.json"), CURRENT_MAX, skipped), "snapshots": {},
           "skipped": skipped}
    snaps = os.path.join(rd, "snapshots")
    names = [n for n in (os.listdir(snaps) if os.path.isdir(snaps) else [])
             if RELEASE.fullmatch(n) and n not in have and os.path.isfile(os.path.join(snaps, n, "rendered.json"))]
    names.sort(key=lambda n: os.path.getmtime(os.path.join(snaps, n, "rendered.json")), reverse=True)
    spent = 0
    for n in names:
        rendered = _read(os.path.join(snaps, n, "rendered.json"), SNAPSHOT_MAX, skipped)
        if rendered is None:
            continue
        if spent + len(rendered) > BUDGET:
            skipped.append(f"{n}: left for the next read (this answer is full)")
            continue
        spent += len(rendered)
        out["snapshots"][n] = {"rendered.json": rendered,
                               "topology.yml": _read(os.path.join(snaps, n, "topology.yml"), TOPOLOGY_MAX, skipped)}
    return out


def main(argv: list) -> int:
    have = set(argv[1].split(",")) if len(argv) > 1 and argv[1] else set()
    sys.stdout.write(json.dumps(read_record(argv[0], have)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
