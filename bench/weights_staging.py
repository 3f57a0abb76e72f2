"""Stage a generated checkpoint to N sandbox hosts three ways and print each against the physical limit.

Every host link is shaped by tc (the sandbox's slow-link fault: both directions of the host's veth) and the
fake hub's egress by its server-wide token bucket, both at --rate. Ways:
  naive    every host pulls the whole checkpoint from the hub with the real client, all at once
  kimictl  `kimictl weights pull`: disjoint shares from the hub (the next file to whichever host's hub pull is
           free), and a peer-to-peer all-gather meanwhile
  limit    max(S / B_hub, S / B_link): the hub must send S once, and each host must receive S
Also: where the pull's time went (from its timeline, runs/<stamp>-weights/timeline.jsonl) and how busy this
machine's CPUs were meanwhile (all simulated hosts share them); verify throughput against cores x the
single-core sha256 rate measured here, and what stamps save.
"""

from __future__ import annotations

import argparse
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
from pathlib import Path

import yaml

from kimictl.sandbox.cluster import Sandbox

NAIVE_DIR = "/var/lib/kimi/naive"


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


def run(n: int, size_mib: int, files: int, rate_mbit: int, skip_naive: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="kimictl-bench-", dir="/var/tmp") as tmp:
        d = Path(tmp) / "sb"
        env = {**os.environ, "KIMICTL_STATE_DIR": str(Path(tmp) / "state")}
        sb = Sandbox(d)
        sb.up(n, "atlas-800-a3", checkpoint_bytes=size_mib << 20, checkpoint_shards=files - 7)
        try:
            hosts = [h.name for h in sb.load().hosts]
            inv = yaml.safe_load((d / "inventory.yml").read_text())
            hub = inv["all"]["vars"]["kimi_model_endpoint"]
            size = sum(f["size"] for f in json.loads((d / "checkpoint.json").read_text())["files"])
            nfiles = len(json.loads((d / "checkpoint.json").read_text())["files"])
            for h in hosts:
                sb.apply(sb.parse(f"slow-link:{h}:{rate_mbit}mbit"))
            req = urllib.request.Request(f"{hub}/_admin/rate", data=json.dumps({"rate": f"{rate_mbit}Mbit/s"})
                                         .encode(), method="POST")
            urllib.request.urlopen(req, timeout=10).read()
            b_hub = b_link = rate_mbit * 1e6 / 8
            limit = max(size / b_hub, size / b_link)
            t_naive = None if skip_naive else naive(d, hosts, inv)
            launched, cpu0 = time.time(), cpu_jiffies()
            t_kimi, doc = kimictl(env, "weights", "pull", "-i", str(d / "inventory.yml"))
            cpu1, load = cpu_jiffies(), os.getloadavg()[0]
            at = phases(Path(tmp) / "state", launched)
            assert doc["ok"], doc
            hub_share = sum(h["received"].get("hub", 0) for h in doc["hosts"])
            t_full, full = kimictl(env, "weights", "verify", "-i", str(d / "inventory.yml"), "--full")
            t_stamp, _ = kimictl(env, "weights", "verify", "-i", str(d / "inventory.yml"))
        finally:
            sb.down()
    per_host = max(h["seconds"] for h in full["hosts"])
    read = sum(h["bytes_read"] for h in full["hosts"])
    cores = os.cpu_count() or 1
    one = sha256_rate()
    print(f"\n== N={n} hosts, {nfiles} files, {size / 2**20:.0f} MiB, hub and every link at {rate_mbit} Mbit/s ==")
    print(f"physical limit max(S/B_hub, S/B_link): {limit:7.1f} s")
    if t_naive is not None:
        print(f"naive (every host pulls all):          {t_naive:7.1f} s  ratio {t_naive / limit:.2f}")
    print(f"kimictl weights pull (sharded):        {t_kimi:7.1f} s  ratio {t_kimi / limit:.2f}  (target <= 1.2)")
    print(f"  hub sent {hub_share / 2**20:.0f} MiB to hosts (1x the checkpoint); the rest went peer to peer")
    print(f"  timeline: hub under way {at['hub start']:.1f} s, peer key in place {at['peers ready']:.1f} s, hub done "
          f"{at['hub done']:.1f} s (hub busy {size / b_hub / (at['hub done'] - at['hub start']):.0%}), last host "
          f"complete {at['complete']:.1f} s")
    busy = (cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1])
    print(f"  this machine's {os.cpu_count()} cores were {busy:.0%} busy during the pull (1-min load {load:.1f})")
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
