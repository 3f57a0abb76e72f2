"""Print `kimictl preflight` wall time on 2, 8 and 16 sandbox A3 hosts running a3-pd (target: 16 <= 2x of 2)."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kimictl.inventory import load_inventory
from kimictl.plan import make_plan
from kimictl.preflight import run_preflight
from kimictl.sandbox.cluster import Sandbox
from kimictl.topology import load_topology


def measure(n: int, topology: str, runs: int) -> tuple[float, int, int]:
    with tempfile.TemporaryDirectory(prefix="kimictl-bench-", dir="/var/tmp") as tmp:
        sb = Sandbox(Path(tmp) / "sb")
        sb.up(n, "atlas-800-a3", checkpoint_bytes=8 * 2**20)
        try:
            inv = load_inventory(Path(tmp) / "sb" / "inventory.yml")
            plan = make_plan(inv, load_topology(topology))
            times, report = [], None
            for _ in range(runs):
                t0 = time.monotonic()
                report = run_preflight(inv, plan)
                times.append(time.monotonic() - t0)
            assert report is not None
            return statistics.median(times), len(report.results), len(report.failed_errors)
        finally:
            sb.down()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hosts", type=int, nargs="+", default=[2, 8, 16])
    ap.add_argument("--topology", default="a3-pd")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    print(f"{'hosts':>5}  {'preflight (s)':>13}  {'checks':>6}  {'errors':>6}   "
          f"(median of {args.runs}, {args.topology})")
    base = None
    for n in args.hosts:
        t, checks, errors = measure(n, args.topology, args.runs)
        base = base or t
        print(f"{n:>5}  {t:>13.2f}  {checks:>6}  {errors:>6}   ratio to {args.hosts[0]} hosts: {t / base:.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
