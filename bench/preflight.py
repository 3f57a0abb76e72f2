"""Print `kimictl preflight` wall time on 2, 8, 16 and 32 sandbox A3 hosts running a3-pd (target: 16 <= 2x of 2).

32 is the sandbox's largest size (kimictl/sandbox/layout.py MAX_HOSTS). Every run must judge the cluster
correctly: the healthy sandbox fails no error-level check, or the bench stops and names the checks.

Besides wall time it prints where the CPU went, per host and run: on this control node (paramiko, the judge)
and on the fake hosts (their sshd and everything it started: the probe script, the tool doubles, ping),
summed from /proc over each host's sshd. The sandbox shares this machine's cores, so on a small machine the
hosts' CPU is what grows with the host count; on a real cluster each host spends its share on its own CPUs.
"""

from __future__ import annotations

import argparse
import os
import resource
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

TICK = os.sysconf("SC_CLK_TCK")


def _sshd_pids(state) -> list[int]:
    """Each host's sshd: the child of its launcher (unshare or the loopback subreaper)."""
    pids = []
    for h in state.hosts:
        try:
            kids = Path(f"/proc/{h.launcher_pid}/task/{h.launcher_pid}/children").read_text().split()
        except OSError:
            continue
        pids += [int(k) for k in kids[:1]]
    return pids


def _tree_cpu(pids: list[int]) -> float:
    """CPU seconds of these processes and of their reaped descendants (utime, stime, cutime, cstime)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15])
    return total / TICK


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cache_manifest(inv) -> None:
    """What any `kimictl weights` command does: cache the hub manifest, so RES-001 judges the real size."""
    try:
        from kimictl.weights.stage import load_manifest
    except ImportError:
        return
    try:
        load_manifest(inv, None)
    except Exception as exc:   # the bench still times preflight (RES-001 then fails)
        print(f"(no hub manifest: {exc})", file=sys.stderr)


def measure(n: int, topology: str, runs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="kimictl-bench-", dir="/var/tmp") as tmp:
        sb = Sandbox(Path(tmp) / "sb")
        up = sb.up(n, "atlas-800-a3", cluster="bench-preflight", checkpoint_bytes=8 * 2**20)
        try:
            inv = load_inventory(Path(tmp) / "sb" / "inventory.yml")
            plan = make_plan(inv, load_topology(topology))
            _cache_manifest(inv)
            sshds = _sshd_pids(up.state)
            run_preflight(inv, plan)   # warm-up: imports, template compilation, page cache
            times, ctl, hosts, report = [], [], [], None
            for _ in range(runs):
                c0, h0, t0 = _self_cpu(), _tree_cpu(sshds), time.monotonic()
                report = run_preflight(inv, plan)
                times.append(time.monotonic() - t0)
                ctl.append(_self_cpu() - c0)
                time.sleep(0.2)   # let each sshd reap its session before reading its children's CPU
                hosts.append(_tree_cpu(sshds) - h0)
            assert report is not None
            if report.failed_errors:
                sys.exit(f"preflight on {n} healthy hosts failed: "
                         + "; ".join(f"{r.id} {r.host}: {r.message}" for r in report.failed_errors[:5]))
            return {"wall": statistics.median(times), "checks": len(report.results),
                    "errors": len(report.failed_errors), "ctl_ms": statistics.median(ctl) / n * 1000,
                    "host_ms": statistics.median(hosts) / n * 1000 if sshds else float("nan")}
        finally:
            sb.down()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, nargs="+", default=[2, 8, 16, 32])
    ap.add_argument("--topology", default="a3-pd")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    print(f"{'hosts':>5}  {'preflight (s)':>13}  {'checks':>6}  {'errors':>6}  {'ctl ms/host':>11}  "
          f"{'host ms/host':>12}   (median of {args.runs}, {args.topology}, {os.cpu_count()} CPUs)")
    base = None
    for n in args.hosts:
        m = measure(n, args.topology, args.runs)
        base = base or m["wall"]
        print(f"{n:>5}  {m['wall']:>13.2f}  {m['checks']:>6}  {m['errors']:>6}  {m['ctl_ms']:>11.0f}  "
              f"{m['host_ms']:>12.0f}   ratio to {args.hosts[0]} hosts: {m['wall'] / base:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
