"""`weights pull` at fleet scale: the real scheduler (kimictl/weights/schedule.py) against a flow-level network model.

A real fleet (16-256 hosts, 25-200 Gbit/s links, a site mirror, 126 shards of ~4 GB) cannot run here, so this
drives the scheduling code `weights pull` uses against a model of the network, the way network schedulers are
proved:
- every transfer is a flow through resources: the hub's uplink or the sending host's uplink, the receiving
  host's downlink (capped by its disk write rate), optionally CPU; each resource's capacity is shared max-min
  fairly among the flows through it (progressive filling; a flow may also have a rate cap of its own);
- a transfer first waits its start-up time (connection, handshake, forced command), then moves its bytes;
  the receiver hashes each file (one core per file) before it counts as landed and may be relayed: a big file
  that comes alone from a peer while it arrives (what the agent does), anything else once it is in;
- peer transfers wait until the run's peer key is in place (an Ansible run);
- event-driven: the clock jumps to the next flow completion or timer, and only the flows whose max-min share
  can change are recomputed (then checked against the bottleneck condition, widened until it holds).

Printed per case and N: kimictl's time, the physical limit, and the same for two baselines: naive (every host
pulls everything from the hub at once) and chain (the hub sends to one host, each host passes each file on to
the next). The physical limit is max(S / B_hub, S / B_link, S / disk): every host must take in S through its own
link and disk, and the hub must send S at least once.

`--calibrate` (root, a sandbox) measures this machine's parameters and a real 4-host `weights pull` in the same
run and prints the model's prediction against it.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kimictl.remote.weights_agent import FOLLOW_MIN
from kimictl.weights.schedule import HUB, TAIL, Schedule

EPS = 1e-9
SLACK = 1e-7   # a flow within this of its bottleneck share counts as at it
GBIT = 1e9 / 8


# --- the flow model --------------------------------------------------------------------------------------

@dataclass(eq=False)
class Flow:
    res: list[tuple[int, float]]     # (resource, units of it per unit of rate)
    left: float                      # units still to move
    cap: float | None                # a rate limit of its own (one core, one stream)
    done: Callable[[], None]
    mark: float = -1.0               # call at_mark when `left` falls to this
    at_mark: Callable[[], None] | None = None
    rate: float = 0.0
    since: float = 0.0               # when `left` was last brought up to date
    version: int = 0
    alive: bool = True
    id: int = 0                      # creation order: ties are broken the same way in every run


class Net:
    """Resources shared max-min fairly by the flows through them; a clock that jumps from event to event.

    Shares are recomputed when the clock is about to move and flows came or went since: progressive filling of
    the flows around the change, every other rate held, then the bottleneck condition (each flow is at its own
    cap, or on a saturated resource where no flow gets more) is checked around it; where it fails, the refill
    widens. The result is the max-min fair allocation, as a full progressive filling would give."""

    def __init__(self) -> None:
        self.cap: list[float] = []
        self.users: list[set[Flow]] = []
        self.load: list[float] = []
        self.now = 0.0
        self.events: list[tuple[float, int, object]] = []
        self.seq = itertools.count()
        self.flows: set[Flow] = set()
        self.dirty: set[Flow] = set()
        self.solves = 0

    def resource(self, cap: float) -> int:
        self.cap.append(cap)
        self.users.append(set())
        self.load.append(0.0)
        return len(self.cap) - 1

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn))

    def after(self, dt: float, fn: Callable[[], None]) -> None:
        self.at(self.now + dt, fn)

    def add(self, res: list[tuple[int, float]], units: float, done: Callable[[], None], cap: float | None = None,
            mark: float = -1.0, at_mark: Callable[[], None] | None = None) -> Flow:
        f = Flow([(r, c) for r, c in res if c > 0], max(units, 0.0), cap, done, mark, at_mark, since=self.now,
                 id=next(self.seq))
        if f.left <= 0:
            f.alive = False
            self.after(0.0, done)
            return f
        if not f.res:   # nothing shared: it runs at its own cap, whatever else happens
            self._set_rate(f, cap if cap is not None else math.inf)
            return f
        for r, _ in f.res:
            self.users[r].add(f)
        self.flows.add(f)
        self.dirty.add(f)
        for r, _ in f.res:
            self.dirty |= self.users[r]
        return f

    def remove(self, f: Flow) -> None:
        if not f.alive:
            return
        self._set_rate(f, 0.0)
        f.alive = False
        if not f.res:
            return
        self.flows.discard(f)
        self.dirty.discard(f)
        for r, _ in f.res:
            self.users[r].discard(f)
            self.dirty |= self.users[r]

    def run(self, until: Callable[[], bool], limit: float = 1e7) -> float:
        while not until():
            if self.dirty and (not self.events or self.events[0][0] > self.now):
                self._reshare(self.dirty)
                self.dirty = set()
            if not self.events:
                break
            t, _, what = heapq.heappop(self.events)
            if t > limit:
                raise RuntimeError("the simulation does not converge")
            self.now = max(self.now, t)
            if isinstance(what, tuple):
                f, version, kind = what
                if not f.alive or f.version != version:
                    continue
                self._advance(f)
                if kind == "mark":
                    f.mark, cb = -1.0, f.at_mark
                    cb()
                else:
                    self.remove(f)
                    f.done()
            else:
                what()
        return self.now

    # --- max-min shares ---
    def _advance(self, f: Flow) -> None:
        f.left = max(0.0, f.left - f.rate * (self.now - f.since))
        f.since = self.now

    def _set_rate(self, f: Flow, rate: float) -> bool:
        if abs(rate - f.rate) <= EPS * max(rate, f.rate, 1.0):
            return False
        self._advance(f)
        for r, c in f.res:
            self.load[r] += c * (rate - f.rate)
        f.rate = rate
        f.version += 1
        if rate > 0:
            heapq.heappush(self.events, (self.now + f.left / rate, next(self.seq), (f, f.version, "done")))
            if f.mark >= 0:
                heapq.heappush(self.events, (self.now + max(f.left - f.mark, 0.0) / rate, next(self.seq),
                                             (f, f.version, "mark")))
        return True

    def _fill(self, flows: set[Flow]) -> list[Flow]:
        """Progressive filling of phi's rates, every other flow's rate held; returns the flows that changed."""
        phi = sorted(flows, key=lambda f: f.id)
        count: dict[int, float] = {}
        spare: dict[int, float] = {}
        users: dict[int, list[Flow]] = {}
        load, cap = self.load, self.cap
        heap: list = []
        capped: list[Flow] = []
        for f in phi:
            for r, c in f.res:
                if r in spare:
                    spare[r] += c * f.rate
                    count[r] += c
                    users[r].append(f)
                else:
                    spare[r] = cap[r] - load[r] + c * f.rate
                    count[r] = c
                    users[r] = [f]
            if f.cap is not None:
                heap.append((f.cap, -1 - len(capped)))
                capped.append(f)
        heap += [(max(spare[r], 0.0) / a, r) for r, a in count.items()]
        heapq.heapify(heap)
        rates: dict[Flow, float] = {}
        pop, push = heapq.heappop, heapq.heappush
        while heap and len(rates) < len(phi):
            level, r = pop(heap)
            if r < 0:
                todo = [capped[-1 - r]]
            else:
                a = count[r]
                if a <= EPS or abs(max(spare[r], 0.0) / a - level) > EPS * max(level, 1.0):
                    continue
                todo = users[r]
            touched = []
            for f in todo:
                if f in rates:
                    continue
                rates[f] = level
                for r2, c in f.res:
                    spare[r2] -= c * level
                    count[r2] -= c
                    touched.append(r2)
            for r2 in set(touched):
                if count[r2] > EPS:
                    push(heap, (max(spare[r2], 0.0) / count[r2], r2))
        return [f for f in phi if self._set_rate(f, rates.get(f, 0.0))]

    def _reshare(self, phi: set[Flow]) -> None:
        """Max-min shares after a change among phi: refill phi, check the bottleneck condition (each flow at its own
        cap, or on a saturated resource where no flow gets more) for phi and for every flow sharing a resource with
        a flow whose rate changed; where it fails, refill again with all flows around the failures."""
        load, cap, users = self.load, self.cap, self.users
        while True:
            self.solves += 1
            if len(phi) * 2 > len(self.flows):
                phi = set(self.flows)
            changed = self._fill(phi)
            if len(phi) >= len(self.flows):
                return
            check = set(phi)
            for f in changed:
                for r, _ in f.res:
                    check |= users[r]
            top: dict[int, float] = {}
            bad = []
            for g in check:
                if g.cap is not None and g.rate >= g.cap * (1 - SLACK):
                    continue
                for r, _ in g.res:
                    if load[r] >= cap[r] * (1 - SLACK):
                        t = top.get(r)
                        if t is None:
                            t = top[r] = max(h.rate for h in users[r])
                        if g.rate >= t * (1 - SLACK):
                            break
                else:
                    bad.append(g)
            if not bad:
                return
            for g in bad:
                for r, _ in g.res:
                    phi |= users[r]


# --- the fleet -------------------------------------------------------------------------------------------

@dataclass
class Params:
    hub_bps: float                       # bytes/s
    link_bps: float                      # each host, each direction
    disk_bps: float = 4e9                # write
    slow: dict[str, float] = field(default_factory=dict)   # host -> factor on its link and disk
    startup_s: float = 0.3               # a peer transfer: connect, handshake, forced command, rsync file list
    hub_startup_s: float = 0.5           # a hub pull: the client's request and listing
    hash_bps: float = 1.5e9              # sha256 of a landed file, one core
    key_ready_s: float = 10.0            # the peer key's Ansible run (bench default: KEY_S)
    stream_bps: float | None = None      # one stream's own limit (one core of ssh/rsync), None = none
    # CPU, when it is a shared resource (the sandbox: every simulated host on the same cores)
    cores: float | None = None
    cpu_peer: float = 0.0                # CPU-s per byte moved peer to peer (ssh, sshd, rsync both ends, kernel)
    cpu_hub: float = 0.0                 # CPU-s per byte from the hub (hub server, client, kernel)
    cpu_start: float = 0.0               # CPU-s per peer transfer start (ssh handshake, forced command, rsync)
    cpu_hub_start: float = 0.0           # CPU-s per hub pull start
    fail: tuple[str, float] | None = None   # a host that dies at a time
    control_cpu: float = 0.0             # CPU-s the control node spends (Ansible, agents' channels), from t=0
    hash_inline: bool = True             # a peer file that comes alone is hashed while it arrives (the agent)


def limit(p: Params, total: int, hosts: list[str]) -> float:
    """max(S / B_hub, S / B_link, S / disk) over the hosts that must end with the checkpoint."""
    alive = [h for h in hosts if not p.fail or h != p.fail[0]]
    worst = min(min(p.link_bps, p.disk_bps) * p.slow.get(h, 1.0) for h in alive)
    return max(total / p.hub_bps, total / worst)


class Fleet:
    """The network and hosts of one run; transfers go through it as start-up, bytes, hash."""

    def __init__(self, p: Params, hosts: list[str], sizes: dict[str, int]):
        self.p, self.hosts, self.sizes = p, hosts, sizes
        self.net = Net()
        self.hub = self.net.resource(p.hub_bps)
        self.up = {h: self.net.resource(p.link_bps * p.slow.get(h, 1.0)) for h in hosts}
        self.down = {h: self.net.resource(min(p.link_bps, p.disk_bps) * p.slow.get(h, 1.0)) for h in hosts}
        self.cpu = self.net.resource(p.cores) if p.cores else None
        self.dead: set[str] = set()
        self.active: dict[str, set[Flow]] = {h: set() for h in hosts}   # flows into or out of each host
        self.finished: dict[str, float] = {}
        self.hub_bytes = 0

    def _cpu(self, per_unit: float) -> list[tuple[int, float]]:
        return [(self.cpu, per_unit)] if self.cpu is not None and per_unit > 0 else []

    def transfer(self, src: str, dest: str, paths: tuple[str, ...], landed: Callable[[str, str], None],
                 failed: Callable[[str, str], None], received: Callable[[str, str], None] | None = None,
                 progress: Callable[[str, str, int], None] | None = None) -> None:
        t = _Transfer(self, src, dest, paths, landed, failed, received, progress)
        self.net.after(self.p.hub_startup_s if t.hub else self.p.startup_s, t.waited)

    def kill(self, host: str) -> None:
        self.dead.add(host)
        for f in sorted(self.active[host], key=lambda f: f.id):
            if f.alive:
                self.net.remove(f)
                self.net.after(0.0, f.done)   # its transfer sees the host gone and reports the failure


class _Transfer:
    """One transfer through the fleet, phase by phase: start-up (and its CPU), the bytes, the hash. Each phase
    first checks its ends are alive; when one is dead, the transfer stops and its receiver reports it failed."""

    def __init__(self, fleet: Fleet, src: str, dest: str, paths: tuple[str, ...],
                 landed: Callable[[str, str], None], failed: Callable[[str, str], None],
                 received: Callable[[str, str], None] | None, progress: Callable[[str, str, int], None] | None):
        p = fleet.p
        self.fleet, self.p, self.net, self.dest, self.paths = fleet, p, fleet.net, dest, paths
        self.landed, self.failed, self.received, self.progress = landed, failed, received, progress
        self.hub = hub = src == HUB
        self.nbytes = nbytes = sum(fleet.sizes[x] for x in paths)
        self.ends = {dest} if hub else {dest, src}
        self.flows: list[Flow] = []
        self.inline = p.hash_inline and not hub and len(paths) == 1 and nbytes >= FOLLOW_MIN
        self.res = [(fleet.hub if hub else fleet.up[src], 1.0), (fleet.down[dest], 1.0),
                    *fleet._cpu((p.cpu_hub if hub else p.cpu_peer) + (1 / p.hash_bps if self.inline else 0.0))]
        self.head = int(nbytes * (1 - TAIL)) if progress and len(paths) == 1 else 0
        self.t_bytes = 0.0

    def gone(self) -> bool:
        if self.ends & self.fleet.dead:
            for f in self.flows:
                self.net.remove(f)
            if self.dest not in self.fleet.dead:
                for x in self.paths:
                    self.failed(self.dest, x)
            return True
        return False

    def track(self, f: Flow) -> None:
        self.flows.append(f)
        for h in self.ends:
            self.fleet.active[h].add(f)

    def waited(self) -> None:
        """Start-up is over: its CPU (when CPU is a shared resource), then the bytes."""
        if self.gone():
            return
        cpu = self.p.cpu_hub_start if self.hub else self.p.cpu_start
        if self.fleet.cpu is not None and cpu > 0:
            self.track(self.net.add(self.fleet._cpu(1.0), cpu, self.started, cap=1.0))
        else:
            self.started()

    def started(self) -> None:
        self.t_bytes = self.net.now
        if not self.gone():
            self.track(self.net.add(self.res, self.nbytes, self.moved, cap=self.p.stream_bps,
                                    mark=self.nbytes - self.head if self.head else -1.0, at_mark=self.tail))

    def tail(self) -> None:   # the agent's progress events say how far a stream is
        if not self.gone():
            self.progress(self.dest, self.paths[0], self.head)

    def moved(self) -> None:
        """The bytes are in: the hash of what it could not hash on the way."""
        if self.gone():
            return
        if self.hub:
            self.fleet.hub_bytes += self.nbytes
        if self.received:
            for x in self.paths:
                self.received(self.dest, x)
        left = self.nbytes
        if self.inline:   # hashed while it arrived: only what the hash could not keep up with is left
            left = max(0.0, self.nbytes - self.p.hash_bps * (self.net.now - self.t_bytes))
        self.track(self.net.add(self.fleet._cpu(1 / self.p.hash_bps), left, self.hashed, cap=self.p.hash_bps))

    def hashed(self) -> None:
        if not self.gone():
            for x in self.paths:
                self.landed(self.dest, x)


def run_kimictl(p: Params, hosts: list[str], sizes: dict[str, int], streams: int = 4,
                **kw) -> tuple[float, Fleet, Schedule]:
    fleet = Fleet(p, hosts, sizes)
    sched = Schedule(sizes, {h: () for h in hosts}, streams=streams, **kw)

    def pump() -> None:
        for t in sched.next():
            fleet.transfer(t.src, t.dest, t.paths, landed, failed, received, progress)
        for h in sched.finishing():
            fleet.finished[h] = fleet.net.now

    def received(h: str, path: str) -> None:
        sched.received(h, path)
        pump()

    def progress(h: str, path: str, nbytes: int) -> None:
        if sched.progress(h, path, nbytes):
            pump()

    def landed(h: str, path: str) -> None:
        sched.landed(h, path)
        pump()

    def failed(h: str, path: str) -> None:
        sched.failed(h, path)
        pump()

    def ready() -> None:
        sched.peers_ready()
        pump()

    fleet.net.after(p.key_ready_s, ready)
    if fleet.cpu is not None and p.control_cpu > 0:   # the control node shares the cores too
        fleet.net.add([(fleet.cpu, 1.0)], p.control_cpu, lambda: None, cap=1.0)
    if p.fail:
        host, t = p.fail

        def die() -> None:
            fleet.kill(host)
            sched.host_failed(host)
            pump()
        fleet.net.at(t, die)
    pump()
    fleet.net.run(lambda: sched.done)
    if not sched.done:
        raise RuntimeError("kimictl schedule stalled")
    return max(fleet.finished.values()), fleet, sched


def run_naive(p: Params, hosts: list[str], sizes: dict[str, int]) -> float:
    """Every host pulls the whole checkpoint from the hub at once (one client each; its per-file start-ups
    overlap with its other downloads, and each file is hashed while the next one downloads: only the last
    file's hash is added)."""
    fleet = Fleet(replace(p, hash_bps=p.hash_bps), hosts, sizes)
    total = sum(sizes.values())
    left = set(hosts) - ({p.fail[0]} if p.fail else set())
    last = max(sizes.values())

    for h in hosts:
        def moved(h=h) -> None:
            fleet.net.after(last / p.hash_bps, lambda: fleet.finished.setdefault(h, fleet.net.now))
        res = [(fleet.hub, 1.0), (fleet.down[h], 1.0), *fleet._cpu(p.cpu_hub)]
        f = fleet.net.add(res, total, moved, cap=p.stream_bps and p.stream_bps * 4)
        fleet.active[h].add(f)
    if p.fail:
        fleet.net.at(p.fail[1], lambda: fleet.kill(p.fail[0]))
    fleet.net.run(lambda: left <= set(fleet.finished))
    return max(fleet.finished[h] for h in left) + p.hub_startup_s


def run_chain(p: Params, hosts: list[str], sizes: dict[str, int]) -> float:
    """The hub sends every file once, to the first host; each host passes each file on to the next one, one file
    at a time, in manifest order, as soon as it has verified it (it verifies one file while the next arrives).
    A dead host is stepped over."""
    fleet = Fleet(p, hosts, sizes)
    order = list(sizes)
    have: dict[str, list[str]] = {h: [] for h in hosts}   # verified, in order
    got: dict[str, set[str]] = {h: set() for h in hosts}  # verified or being verified
    into: dict[str, str | None] = dict.fromkeys(hosts)     # the sender of the file on its way into each host
    hub_next = [0]

    def succ(h: str) -> str | None:
        i = hosts.index(h) + 1
        while i < len(hosts) and hosts[i] in fleet.dead:
            i += 1
        return hosts[i] if i < len(hosts) else None

    def pred(h: str) -> str | None:
        i = hosts.index(h) - 1
        while i >= 0 and hosts[i] in fleet.dead:
            i -= 1
        return hosts[i] if i >= 0 else None

    def pump(*near: str) -> None:
        """Start what the hosts around an event can start now (every host, when none is named)."""
        first = next((h for h in hosts if h not in fleet.dead), None)
        if first and into[first] is None and hub_next[0] < len(order):
            into[first] = HUB
            path = order[hub_next[0]]
            hub_next[0] += 1
            fleet.transfer(HUB, first, (path,), landed, failed, received)
        for h in {x for n in near for x in (n, pred(n)) if x} if near else hosts:
            nxt = succ(h)
            if h in fleet.dead or nxt is None or into[nxt] is not None:
                continue
            todo = next((x for x in have[h] if x not in got[nxt]), None)
            if todo:
                into[nxt] = h
                fleet.transfer(h, nxt, (todo,), landed, failed, received)

    def received(h: str, path: str) -> None:
        got[h].add(path)
        into[h] = None
        pump(h)

    def landed(h: str, path: str) -> None:
        have[h].append(path)
        if len(have[h]) == len(order):
            fleet.finished[h] = fleet.net.now
        pump(h)

    def failed(h: str, path: str) -> None:
        if into[h] == HUB or (into[h] is None and all(x in fleet.dead for x in hosts[:hosts.index(h)])):
            hub_next[0] = min(hub_next[0], order.index(path))   # the hub sends it again to the first host
        got[h].discard(path)
        into[h] = None
        pump(h)

    live = [h for h in hosts if not p.fail or h != p.fail[0]]
    if p.fail:
        def die() -> None:
            dead = p.fail[0]
            fleet.kill(dead)
            into[dead] = None
            pump()
        fleet.net.at(p.fail[1], die)
    pump()
    fleet.net.run(lambda: set(live) <= set(fleet.finished))
    return max(fleet.finished[h] for h in live)


# --- the checkpoint --------------------------------------------------------------------------------------

def checkpoint_files() -> dict[str, int]:
    """The real checkpoint's file list: the model's bytes (model facts) in msModelSlim's shards, plus the index
    and quant description."""
    from kimictl.facts import model_facts
    from kimictl.sandbox.checkpoint import DESCRIPTION_NAME, INDEX_NAME, shard_name

    facts = model_facts()
    n, total = facts.checkpoint_shards, facts.total_bytes
    sizes = {"config.json": 8 << 10, INDEX_NAME: 4 << 20, DESCRIPTION_NAME: 4 << 20}
    for k in range(1, n + 1):
        sizes[shard_name(k, n)] = total * k // n - total * (k - 1) // n
    return sizes


# --- the cases -------------------------------------------------------------------------------------------

CASES = {
    "hub-bound": dict(hub_bps=10 * GBIT, link_bps=25 * GBIT),
    "link-bound": dict(hub_bps=100 * GBIT, link_bps=25 * GBIT),
}
KEY_S = (3.0, 0.025)   # the peer key's Ansible run: start-up, plus control-node work per host (assumed)


def cases(which: list[str], sizes: list[int], base: Params) -> list[tuple[str, int, Params]]:
    """Each bandwidth case at each size as is, with one host at half the link rate, and with one host failing
    halfway through the physical limit."""
    out = []
    total = sum(checkpoint_files().values())
    for name in which:
        p0 = replace(base, **CASES[name])
        for n in sizes:
            p = replace(p0, key_ready_s=p0.key_ready_s if p0.key_ready_s >= 0 else KEY_S[0] + KEY_S[1] * n)
            out.append((name, n, p))
            out.append((f"{name}-slow-host", n, replace(p, slow={f"h{n // 2:03d}": 0.5})))
            t_fail = 0.5 * max(total / p.hub_bps, total / p.link_bps)
            out.append((f"{name}-host-fails", n, replace(p, fail=(f"h{n // 3:03d}", t_fail))))
    return out


# --- calibration against a real pull on the sandbox (root) -----------------------------------------------

HUB_PROBE = """
import json, os, shutil, sys, tempfile, time
from modelscope.hub.snapshot_download import snapshot_download
model, pats = sys.argv[1], sys.argv[2:]
d = tempfile.mkdtemp(dir="/var/lib/kimi")
snapshot_download(model, local_dir=d, allow_patterns=["config.json"], max_workers=1)
t0 = time.time()
for p in pats:
    snapshot_download(model, local_dir=d, allow_patterns=[p], max_workers=1)
print(json.dumps({"s": time.time() - t0}))
shutil.rmtree(d)
"""


def calibrate(rate_mbit: int, size_mib: int, files: int) -> int:
    """Measure this machine's parameters on a 4-host sandbox, run a real `weights pull` there, and compare its
    time with the model's prediction for the same files and parameters."""
    import os
    import shlex
    import statistics

    import weights_staging as ws

    def timed(host: str, command: str, c) -> tuple[float, float, str]:
        cpu0, t0 = ws.busy_cpu_s(), time.monotonic()
        r = c.ssh(host, command)
        took, cpu = time.monotonic() - t0, ws.busy_cpu_s() - cpu0
        if r.returncode != 0:
            sys.exit(f"calibration step on {host} failed: {command}\n{r.stderr[-2000:]}")
        return took, cpu, r.stdout

    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    print(f"calibration on this machine: {cores} cores, 1-min load {load:.1f} before"
          + ("  (busy: the figures below are distorted; run it on a quiet machine)" if load > 1.5 else ""))
    with ws.own_cpu_account(), ws.shaped(4, size_mib, files, rate_mbit) as c:
        a, b, h = c.hosts[0], c.hosts[1], c.hosts[2]
        cal, big = "/var/lib/kimi/cal", 64 << 20
        timed(a, f"mkdir -p {cal} && head -c 1 /dev/urandom > {cal}/tiny && head -c {big} /dev/urandom > {cal}/big",
              c)
        rs = f"rsync -e {shlex.quote(c.peer_ssh(b))}"
        timed(b, f"{rs} {a}:{cal}/tiny /tmp/kcal-tiny", c)   # the connection to a is up, as in a pull
        k = 10
        base = timed(b, "true", c)
        many = timed(b, f"for i in $(seq {k}); do {rs} {a}:{cal}/tiny /tmp/kcal-tiny; done", c)
        fc = timed(b, f"for i in $(seq {k}); do {c.inv['all']['vars']['kimi_python']} -I -S -c pass; done", c)
        start_s = (many[0] - base[0]) / k
        start_cpu = (many[1] - base[1] + fc[1] - base[1]) / k   # + the forced command's interpreter
        moved = timed(b, f"{rs} {a}:{cal}/big /tmp/kcal-big && rm -f /tmp/kcal-big /tmp/kcal-tiny", c)
        link_bps = big / (moved[0] - base[0] - start_s)
        cpu_peer = max(0.0, moved[1] - base[1] - start_cpu) / big
        timed(a, f"rm -rf {cal}", c)

        v = c.inv["all"]["vars"]
        env = (f"env MODELSCOPE_ENDPOINT={v['kimi_model_endpoint']} TQDM_DISABLE=1 "
               f"MODELSCOPE_DOWNLOAD_INTRA_CLOUD=false MODELSCOPE_CACHE=/var/lib/kimi/cal-ms {v['kimi_python']} "
               f"-c {shlex.quote(HUB_PROBE)} {shlex.quote(v['kimi_model_id'])}")
        shards = sorted((f for f in c.files if f["path"].endswith(".safetensors")), key=lambda f: -f["size"])[:4]
        tiny = ["generation_config.json", "tokenizer_config.json", "chat_template.jinja"]
        warm = timed(h, env, c)
        few = timed(h, f"{env} {' '.join(tiny)}", c)
        bulk = timed(h, f"{env} {' '.join(f['path'] for f in shards)}", c)
        timed(h, "rm -rf /var/lib/kimi/cal-ms", c)
        hub_start_s = json.loads(few[2])["s"] / len(tiny)
        hub_start_cpu = max(0.0, few[1] - warm[1]) / len(tiny)
        nbytes = sum(f["size"] for f in shards)
        hub_bps = nbytes / max(1e-3, json.loads(bulk[2])["s"] - len(shards) * hub_start_s)
        cpu_hub = max(0.0, bulk[1] - warm[1] - len(shards) * hub_start_cpu) / nbytes
        sha = statistics.median(ws.sha256_rate() for _ in range(3))

        children0 = _children_cpu()
        t_wall, _, _, cpu_pull = ws.pull(c)
        ctl_cpu = _children_cpu() - children0
        recs = [json.loads(x) for x in next(Path(c.env["KIMICTL_STATE_DIR"]).rglob("timeline.jsonl"))
                .read_text().splitlines()]
        t_hello = next(r["t"] for r in recs if r["ev"] == "hello")
        t_real = max(r["t"] for r in recs if r["ev"] == "complete") - t_hello
        key_s = next(r["t"] for r in recs if r["ev"] == "prepared") - t_hello
        sizes = {f["path"]: f["size"] for f in c.files}
        hosts = list(c.hosts)

    p = Params(hub_bps=hub_bps, link_bps=link_bps, disk_bps=1e12, startup_s=max(0.0, start_s - start_cpu),
               hub_startup_s=max(0.0, hub_start_s - hub_start_cpu), hash_bps=sha, key_ready_s=key_s, cores=cores,
               cpu_peer=cpu_peer, cpu_hub=cpu_hub, cpu_start=start_cpu, cpu_hub_start=hub_start_cpu,
               control_cpu=ctl_cpu)
    t_model = run_kimictl(p, hosts, sizes)[0]
    t_free = run_kimictl(replace(p, cores=None), hosts, sizes)[0]
    size = sum(sizes.values())
    ms = 1000
    print(f"measured in this run: links {link_bps * 8 / 1e6:.0f} Mbit/s, hub {hub_bps * 8 / 1e6:.0f} Mbit/s "
          f"(both shaped to {rate_mbit}); a peer transfer starts in {start_s * ms:.0f} ms ({start_cpu * ms:.0f} ms "
          f"CPU with the forced command's interpreter), a hub pull in {hub_start_s * ms:.0f} ms "
          f"({hub_start_cpu * ms:.0f} ms CPU); CPU per MiB moved: {cpu_peer * 2**20 * ms:.0f} ms peer to peer, "
          f"{cpu_hub * 2**20 * ms:.0f} ms from the hub (CPU of the sandbox's processes); sha256 "
          f"{sha / 2**20:.0f} MiB/s on one core; peer key in "
          f"place after {key_s:.1f} s; control node {ctl_cpu:.1f} CPU-s")
    print(f"real `weights pull`, 4 hosts, {len(sizes)} files, {size / 2**20:.0f} MiB: {t_real:.1f} s from the agents' "
          f"hello to the last host complete ({t_wall:.1f} s wall; this machine {cpu_pull:.0f} CPU-s busy)")
    print(f"model with these parameters: {t_model:.1f} s ({t_free:.1f} s if the {cores} cores every simulated host "
          f"shares were free)")
    print(f"calibration error {100 * (t_model - t_real) / t_real:+.0f}%")
    return 0


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, nargs="+", default=[4, 16, 64, 256])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--streams", type=int, default=4, help="weights pull --streams")
    ap.add_argument("--startup-s", type=float, default=Params.startup_s, help="a peer transfer's start-up")
    ap.add_argument("--hub-startup-s", type=float, default=Params.hub_startup_s, help="a hub pull's start-up")
    ap.add_argument("--hash-gbyte", type=float, default=Params.hash_bps / 1e9, help="sha256 GB/s on one core")
    ap.add_argument("--disk-gbyte", type=float, default=Params.disk_bps / 1e9, help="disk write GB/s")
    ap.add_argument("--key-s", type=float, default=-1.0,
                    help=f"peer key in place after this many seconds (default {KEY_S[0]:g} + {KEY_S[1]:g} x hosts)")
    ap.add_argument("--hash-after", action="store_true",
                    help="what if the agent hashed peer files only once they are in (it hashes them as they arrive)")
    ap.add_argument("--calibrate", action="store_true",
                    help="measure this machine and a real 4-host pull on the sandbox (root), compare with the model")
    ap.add_argument("--rate-mbit", type=int, default=200, help="--calibrate: hub and link rate")
    ap.add_argument("--size-mib", type=int, default=512, help="--calibrate: checkpoint size")
    ap.add_argument("--files", type=int, default=32, help="--calibrate: files in the checkpoint")
    args = ap.parse_args()
    if args.calibrate:
        return calibrate(args.rate_mbit, args.size_mib, args.files)
    base = Params(hub_bps=0, link_bps=0, startup_s=args.startup_s, hub_startup_s=args.hub_startup_s,
                  hash_bps=args.hash_gbyte * 1e9, disk_bps=args.disk_gbyte * 1e9, key_ready_s=args.key_s,
                  hash_inline=not args.hash_after)
    sizes = checkpoint_files()
    total = sum(sizes.values())
    print(f"checkpoint: {len(sizes)} files, {total / 1e9:.0f} GB (largest {max(sizes.values()) / 1e9:.2f} GB); "
          f"--streams {args.streams}; start-up {base.startup_s:g} s (peer) / {base.hub_startup_s:g} s (hub); "
          f"sha256 {base.hash_bps / 1e9:g} GB/s per file{' as peer files arrive' if base.hash_inline else ' after'}; "
          f"disk {base.disk_bps / 1e9:g} GB/s; peer key after "
          + (f"{args.key_s:g} s" if args.key_s >= 0 else f"{KEY_S[0]:g} s + {KEY_S[1] * 1000:g} ms/host"))
    for name, n, p in cases(args.cases, args.hosts, base):
        hosts = [f"h{i:03d}" for i in range(n)]
        lim = limit(p, total, hosts)
        t0 = time.process_time()
        t_k, fleet, _ = run_kimictl(p, hosts, sizes, streams=args.streams)
        cpu = time.process_time() - t0
        t_n = run_naive(p, hosts, sizes)
        t_c = run_chain(p, hosts, sizes)
        extra = ""
        if p.slow:
            fast = [t for h, t in fleet.finished.items() if h not in p.slow]
            extra = f", the other hosts {max(fast):.1f} s ({max(fast) / limit(replace(p, slow={}), total, hosts):.3f})"
        print(f"  {name} N={n}: limit {lim:.1f} s; kimictl {t_k:.1f} s (hub sent {fleet.hub_bytes / total:.2f} S"
              f"{extra}), naive {t_n:.1f} s, chain {t_c:.1f} s  [model: {cpu:.1f} CPU-s]")
        print(f"{name} hosts={n} kimictl ratio={t_k / lim:.2f} naive ratio={t_n / lim:.2f} chain ratio={t_c / lim:.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
