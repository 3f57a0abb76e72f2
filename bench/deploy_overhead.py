"""Print `kimictl deploy` wall time on a 2-host A3 sandbox against the engines' own start-up time.

The simulated engines load at a throughput set so that loading takes about --load-seconds (real Kimi K2.5 W4A8
loads take ~10 min). Engine start-up is what deploy itself measured (`engine_start`, from its `--output json`
timings); orchestration overhead = (deploy wall time - engine start-up) / deploy wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kimictl.sandbox.cluster import Sandbox

CHECKPOINT_BYTES = 64 * 2**20
ENGINES_PLAYBOOK = re.compile(r"(\d+)-engines")   # a HostOps.playbook run of engines.yml, numbered in run order


def engine_start(seconds: dict[str, float]) -> tuple[float, str]:
    """Engine start-up as deploy measured it, from its `--output json` "seconds", and the playbook run it follows.

    Deploy's "engines_ready" spans the engines.yml run that starts the engines (HostOps times each playbook run
    as "NN-engines") and the wait until every one answers; they start detached at the end of that run, so the
    wait after it is their start-up (less the run's last moments: overhead errs high). The first engines.yml run
    is theirs; a later one starts the proxy once they answer."""
    runs = sorted((int(m[1]), key) for key in seconds if (m := ENGINES_PLAYBOOK.fullmatch(key)))
    if "engines_ready" not in seconds or not runs:
        raise ValueError("deploy started no engines (no engines_ready and NN-engines timings in its --output json "
                         f"seconds: {', '.join(seconds) or 'none'})")
    key = runs[0][1]
    return round(seconds["engines_ready"] - seconds[key], 2), key


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
    engine, after = engine_start(secs)
    print(f"deploy wall time:            {total:7.1f} s  ({args.topology}, 2 x atlas-800-a3 sandbox)")
    for k, v in secs.items():
        print(f"  {k:<26} {v:7.1f} s")
    print(f"engine start-up (measured):  {engine:7.1f} s  (engines_ready - {after}; "
          f"loads set to {args.load_seconds:.0f} s)")
    print(f"orchestration overhead:      {total - engine:7.1f} s = {(total - engine) / total:.0%} of the deploy "
          "(target <= 25%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
