"""Print the host's current release as JSON: {release, manifest, files} (engines/ and proxy/ files), or null.

Run on a host by `kimictl start` (one SSH round trip per host): `python3 - STATE_DIR` with this file on stdin.
The files are what the process tags hash, so start rebuilds exactly the processes deploy started.
"""

from __future__ import annotations

import json
import os
import sys


def read_current(state_dir: str) -> dict | None:
    cur = os.path.join(state_dir, "current")
    if not os.path.islink(cur):
        return None
    rel = os.path.realpath(cur)
    files = {}
    for sub in ("engines", "proxy"):
        d = os.path.join(rel, sub)
        for n in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            with open(os.path.join(d, n), encoding="utf-8") as f:
                files[sub + "/" + n] = f.read()
    with open(os.path.join(rel, "manifest.json"), encoding="utf-8") as f:
        man = json.load(f)
    return {"release": os.path.basename(rel), "manifest": man, "files": files}


def main(argv: list) -> int:
    print(json.dumps(read_current(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
