"""Print `kimictl deploy` wall time on a 2-host A3 sandbox against the engines' own start-up time.

The simulated engines load at a throughput set so that loading takes --load-seconds (real Kimi K2.5 W4A8
loads take ~10 min); orchestration overhead = (deploy wall time - engine start-up) / deploy wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kimictl.sandbox.cluster import Sandbox

CHECKPOINT_BYTES = 64 * 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--load-seconds", type=float, default=120.0)
    ap.add_argument("--topology", default="a3-pd")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kimictl-bench-", dir="/var/tmp") as tmp:
        d = Path(tmp) / "sb"
        env = {**os.environ, "KIMICTL_STATE_DIR": str(Path(tmp) / "state")}
        sb = Sandbox(d)
        sb.up(2, "atlas-800-a3", checkpoint_bytes=CHECKPOINT_BYTES)
        try:
            for host_json in d.glob("hosts/*/sim/host.json"):
                doc = json.loads(host_json.read_text())
                doc["load_gib_per_s"] = CHECKPOINT_BYTES / 2**30 / args.load_seconds
                host_json.write_text(json.dumps(doc))
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "kimictl", "deploy", "-i", str(d / "inventory.yml"),
                                   "--topology", args.topology, "--yes", "--output", "json"],
                                  capture_output=True, text=True, env=env, check=False)
            total = time.monotonic() - t0
            if proc.returncode != 0:
                print(proc.stderr[-2000:], file=sys.stderr)
                return 1
            res = json.loads(proc.stdout)
        finally:
            sb.down()
    secs = res["seconds"]
    engine = args.load_seconds
    print(f"deploy wall time:            {total:7.1f} s  ({args.topology}, 2 x atlas-800-a3 sandbox)")
    for k, v in secs.items():
        print(f"  {k:<26} {v:7.1f} s")
    print(f"engine start-up (load):      {engine:7.1f} s")
    print(f"orchestration overhead:      {total - engine:7.1f} s = {(total - engine) / total:.0%} of the deploy "
          "(target <= 25%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
