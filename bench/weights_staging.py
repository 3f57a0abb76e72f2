"""Stage a generated checkpoint to N sandbox hosts and print the time against the physical limit and against
plain rsync through the same links, measured in the same run.

Every host link is shaped by tc (the sandbox's slow-link fault: both directions of the host's veth) and the
fake hub's egress by its server-wide token bucket, both at --rate. Ways:
  naive    every host pulls the whole checkpoint from the hub with the real client, all at once
  kimictl  `kimictl weights pull`: the hub sends each file once, the hosts pass them on (schedule.py)
  plain    after the pull, every host rsyncs the same bytes from its neighbour over SSH, all at once, through
           the same shaped links (no hub, no hashing, no Python): what this machine can do at best, since all
           simulated hosts share its cores
  limit    max(S / B_hub, S / B_link): the hub must send S once, and each host must receive S
Also: where the pull's time went (from its timeline, runs/<stamp>-weights/timeline.jsonl) and how busy this
machine's CPUs were meanwhile; verify throughput against cores x the single-core sha256 rate measured here,
and what stamps save.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

from kimictl.remote.weights_agent import FAST_CIPHERS
from kimictl.sandbox.cluster import Sandbox
from kimictl.sandbox.inject import Injector

NAIVE_DIR = "/var/lib/kimi/naive"
PLAIN_DIR = "/var/lib/kimi/plain"
MODEL_DIR = "/var/lib/kimi/models/Kimi-K2.5-W4A8"
TICK = os.sysconf("SC_CLK_TCK")


def kimictl(env: dict, *args: str) -> tuple[float, dict]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kimictl", *args, "-o", "json"], capture_output=True, text=True,
                          env=env, check=False)
    took = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"kimictl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return took, json.loads(proc.stdout)


def ssh(d: Path, host: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", "-F", str(d / "ssh_config"), host, command], capture_output=True, text=True,
                          check=False)


def naive(d: Path, hosts: list[str], inv: dict) -> float:
    """Every host downloads everything from the hub with modelscope's snapshot_download, concurrently."""
    v = inv["all"]["vars"]
    code = (f"from modelscope.hub.snapshot_download import snapshot_download; "
            f"snapshot_download({v['kimi_model_id']!r}, local_dir={NAIVE_DIR!r}, max_workers=4)")
    cmd = (f"rm -rf {NAIVE_DIR} && env MODELSCOPE_ENDPOINT={v['kimi_model_endpoint']} TQDM_DISABLE=1 "
           f"MODELSCOPE_DOWNLOAD_INTRA_CLOUD=false MODELSCOPE_CACHE=/var/lib/kimi/ms-cache "
           f"{v['kimi_python']} -c {shlex.quote(code)}")
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(hosts)) as pool:
        res = list(pool.map(lambda h: ssh(d, h, cmd), hosts))
    took = time.monotonic() - t0
    for h, r in zip(hosts, res, strict=True):
        if r.returncode != 0:
            sys.exit(f"naive pull on {h} failed:\n{r.stderr[-2000:]}")
        ssh(d, h, f"rm -rf {NAIVE_DIR} /var/lib/kimi/ms-cache")
    return took


def sha256_rate() -> float:
    buf = os.urandom(64 << 20)
    t0 = time.perf_counter()
    hashlib.sha256(buf).digest()
    return len(buf) / (time.perf_counter() - t0)


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, from /proc/stat."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)


def phases(state: Path, launched: float) -> dict[str, float]:
    """Seconds after launch: first hub progress, peer key in place, hub done, last host complete."""
    recs = [json.loads(x) for x in next(state.rglob("timeline.jsonl")).read_text().splitlines()]
    hub_paths = {(r["host"], p) for r in recs if r["ev"] == "hub" for p in r["paths"]}
    at = {"hub start": min(r["t"] for r in recs if r["ev"] in ("progress", "done")
                           and (r["host"], r["path"]) in hub_paths),
          "peers ready": min((r["t"] for r in recs if r["ev"] == "prepared"), default=float("nan")),
          "hub done": max(r["t"] for r in recs if r["ev"] == "done" and r["via"] == "hub"),
          "complete": max(r["t"] for r in recs if r["ev"] == "complete")}
    return {k: v - launched for k, v in at.items()}


@dataclass
class Shaped:
    """A sandbox whose hub and host links are shaped to one rate, with a generated checkpoint on its hub."""

    dir: Path
    sb: Sandbox
    hosts: list[str]
    inv: dict
    env: dict
    files: list[dict]   # the checkpoint's manifest: path, size, sha256
    rate_bps: float     # bytes/s, hub and every link

    @property
    def size(self) -> int:
        return sum(f["size"] for f in self.files)

    def ssh(self, host: str, command: str) -> subprocess.CompletedProcess:
        return ssh(self.dir, host, command)

    def peer_ssh(self, host: str) -> str:
        """The ssh command one host uses to reach another, own connection (never the control node's master)."""
        return (f"ssh -F {self.dir}/ssh_config -o ControlMaster=auto -o ControlPath=/tmp/kbench-{host}-%C "
                f"-o ControlPersist=30 {' '.join(FAST_CIPHERS)}")


@contextlib.contextmanager
def shaped(n: int, size_mib: int, files: int, rate_mbit: int):
    with tempfile.TemporaryDirectory(prefix="kimictl-bench-", dir="/var/tmp") as tmp:
        d = Path(tmp) / "sb"
        env = {**os.environ, "KIMICTL_STATE_DIR": str(Path(tmp) / "state")}
        sb = Sandbox(d)
        sb.up(n, "atlas-800-a3", checkpoint_bytes=size_mib << 20, checkpoint_shards=files - 7)
        try:
            hosts = [h.name for h in sb.load().hosts]
            inv = yaml.safe_load((d / "inventory.yml").read_text())
            hub = inv["all"]["vars"]["kimi_model_endpoint"]
            injector = Injector(sb)
            for h in hosts:
                injector.apply(injector.parse(f"slow-link:{h}:{rate_mbit}mbit"))
            req = urllib.request.Request(f"{hub}/_admin/rate", data=json.dumps({"rate": f"{rate_mbit}Mbit/s"})
                                         .encode(), method="POST")
            urllib.request.urlopen(req, timeout=10).read()
            yield Shaped(d, sb, hosts, inv, env, json.loads((d / "checkpoint.json").read_text())["files"],
                         rate_mbit * 1e6 / 8)
        finally:
            sb.down()


CGROUP = Path(f"/sys/fs/cgroup/cpuacct/kimictl-bench-{os.getpid()}")


@contextlib.contextmanager
def own_cpu_account():
    """Count the CPU of this process and everything it starts (the sandbox's hosts, hub, kimictl, Ansible) in
    a cpuacct cgroup of its own, so other work on the machine does not count; busy_cpu_s() reads it. Without
    cgroup v1 cpuacct it reads the whole machine's busy time instead."""
    root = CGROUP.parent
    try:
        CGROUP.mkdir()
        (CGROUP / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        yield
        return
    try:
        yield
    finally:
        (root / "cgroup.procs").write_text(str(os.getpid()))
        for _ in range(50):   # the sandbox's processes are gone once it is down; a straggler may take a moment
            try:
                CGROUP.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def busy_cpu_s() -> float:
    """CPU seconds spent so far: by this process and what it started (own_cpu_account), or by the machine."""
    try:
        return int((CGROUP / "cpuacct.usage").read_text()) / 1e9
    except OSError:
        return cpu_jiffies()[0] / TICK


def plain_rsync(c: Shaped) -> tuple[float, float]:
    """Every host rsyncs the checkpoint from its neighbour at once (after a pull, each holds it): (seconds, CPU-s)."""
    def one(i: int) -> subprocess.CompletedProcess:
        h, src = c.hosts[i], c.hosts[i - 1]
        return c.ssh(h, f"rm -rf {PLAIN_DIR} && rsync -a --exclude='.kimi*' -e {shlex.quote(c.peer_ssh(h))} "
                        f"{src}:{MODEL_DIR}/ {PLAIN_DIR}/")

    cpu0, t0 = busy_cpu_s(), time.monotonic()
    with ThreadPoolExecutor(len(c.hosts)) as pool:
        res = list(pool.map(one, range(len(c.hosts))))
    took, cpu = time.monotonic() - t0, busy_cpu_s() - cpu0
    for h, r in zip(c.hosts, res, strict=True):
        if r.returncode != 0:
            sys.exit(f"plain rsync into {h} failed:\n{r.stdout[-1000:]}{r.stderr[-2000:]}")
        c.ssh(h, f"rm -rf {PLAIN_DIR}")
    return took, cpu


def pull(c: Shaped) -> tuple[float, dict, dict[str, float], float]:
    """`kimictl weights pull`: (seconds, its JSON, phases from its timeline, machine CPU-s meanwhile)."""
    launched, cpu0 = time.time(), busy_cpu_s()
    took, doc = kimictl(c.env, "weights", "pull", "-i", str(c.dir / "inventory.yml"))
    cpu = busy_cpu_s() - cpu0
    assert doc["ok"], doc
    return took, doc, phases(Path(c.env["KIMICTL_STATE_DIR"]), launched), cpu


def run(n: int, size_mib: int, files: int, rate_mbit: int, skip_naive: bool) -> None:
    with own_cpu_account(), shaped(n, size_mib, files, rate_mbit) as c:
        size, nfiles = c.size, len(c.files)
        limit = max(size / c.rate_bps, size / c.rate_bps)
        t_naive = None if skip_naive else naive(c.dir, c.hosts, c.inv)
        load0 = os.getloadavg()[0]
        t_kimi, doc, at, cpu = pull(c)
        load = os.getloadavg()[0]
        hub_share = sum(h["received"].get("hub", 0) for h in doc["hosts"])
        t_plain, cpu_plain = plain_rsync(c)
        t_full, full = kimictl(c.env, "weights", "verify", "-i", str(c.dir / "inventory.yml"), "--full")
        t_stamp, _ = kimictl(c.env, "weights", "verify", "-i", str(c.dir / "inventory.yml"))
    per_host = max(h["seconds"] for h in full["hosts"])
    read = sum(h["bytes_read"] for h in full["hosts"])
    cores = os.cpu_count() or 1
    one = sha256_rate()
    print(f"\n== N={n} hosts, {nfiles} files, {size / 2**20:.0f} MiB, hub and every link at {rate_mbit} Mbit/s ==")
    print(f"physical limit max(S/B_hub, S/B_link): {limit:7.1f} s")
    if t_naive is not None:
        print(f"naive (every host pulls all):          {t_naive:7.1f} s  ratio {t_naive / limit:.2f}")
    print(f"kimictl weights pull (sharded):        {t_kimi:7.1f} s  ratio {t_kimi / limit:.2f}")
    print(f"plain rsync, each host from a neighbour: {t_plain:5.1f} s  ratio {t_plain / limit:.2f}  "
          f"({cpu_plain:.0f} CPU-s; the pull took {cpu:.0f} CPU-s)")
    print(f"kimictl / plain rsync: {t_kimi / t_plain:.2f}  (target <= 1.3)")
    print(f"  hub sent {hub_share / 2**20:.0f} MiB to hosts (1x the checkpoint); the rest went peer to peer")
    print(f"  timeline: hub under way {at['hub start']:.1f} s, peer key in place {at['peers ready']:.1f} s, hub done "
          f"{at['hub done']:.1f} s (hub busy {size / c.rate_bps / (at['hub done'] - at['hub start']):.0%}), last "
          f"host complete {at['complete']:.1f} s")
    print(f"  the pull kept this machine's {cores} cores {cpu / cores / t_kimi:.0%} busy (1-min load "
          f"{load0:.1f} before, {load:.1f} after)")
    print(f"verify --full: {read / 2**20:.0f} MiB on {n} hosts at once, {t_full:.1f} s wall; hashing took "
          f"{per_host:.2f} s on the slowest host = {read / per_host / 2**20:.0f} MiB/s in aggregate, against this "
          f"machine's {cores} cores x {one / 2**20:.0f} MiB/s single-core sha256 = {cores * one / 2**20:.0f} MiB/s")
    print(f"re-verify with stamps: {t_stamp:.1f} s vs {t_full:.1f} s (--full): {t_full / t_stamp:.1f}x faster")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--files", type=int, default=32, help="files in the checkpoint (shards + 7 small files)")
    ap.add_argument("--rate-mbit", type=int, default=200)
    ap.add_argument("--skip-naive", action="store_true")
    args = ap.parse_args()
    for n in args.hosts:
        run(n, args.size_mib, args.files, args.rate_mbit, args.skip_naive)
    return 0


if __name__ == "__main__":
    sys.exit(main())
