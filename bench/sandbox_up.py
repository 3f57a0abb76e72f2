"""Print `kimictl sandbox up`/`down` wall times for 2, 8 and 16 hosts (a figure printer, not a test)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kimictl.sandbox.cluster import Sandbox


def measure(n: int, hardware: str, mode: str | None) -> tuple[float, float, float]:
    """Seconds for up, for the first ssh round trip to the last host, and for down."""
    with tempfile.TemporaryDirectory(prefix="kimictl-bench-", dir="/var/tmp") as tmp:
        d = Path(tmp) / "sb"
        sb = Sandbox(d)
        t0 = time.monotonic()
        sb.up(n, hardware, mode=mode)
        t_up = time.monotonic() - t0
        try:
            t1 = time.monotonic()
            subprocess.run(["ssh", "-F", str(d / "ssh_config"), f"atlas-{n:02d}", "npu-smi info >/dev/null"],
                           check=True, timeout=60)
            t_ssh = time.monotonic() - t1
        finally:
            t2 = time.monotonic()
            sb.down()
            t_down = time.monotonic() - t2
    return t_up, t_ssh, t_down


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hosts", type=int, nargs="+", default=[2, 8, 16])
    ap.add_argument("--hardware", default="atlas-800-a3", choices=["atlas-800-a3", "atlas-800-a2"])
    ap.add_argument("--mode", choices=["netns", "loopback"], default=None)
    args = ap.parse_args()
    print(f"{'hosts':>5}  {'up (s)':>7}  {'1st ssh (s)':>11}  {'down (s)':>8}   ({args.hardware})")
    for n in args.hosts:
        t_up, t_ssh, t_down = measure(n, args.hardware, args.mode)
        print(f"{n:>5}  {t_up:>7.2f}  {t_ssh:>11.2f}  {t_down:>8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
