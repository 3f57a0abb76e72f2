"""The all-gather scheduler of `weights pull`: which file moves next, from where, to which host.

Pure: no I/O, no threads, no clock. The caller reports what happened (bytes moved, a file received, verified or
failed, a host failed, the peer key in place) and asks `next()` for the transfers to start; `Stager` (stage.py)
carries them out with the hub clients and rsync, and bench/weights_fleet.py drives the same code against a
flow-level model of a fleet.

The rules:
- Files no host holds are pulled from the hub once each, largest first, by at most `hub_streams` pulls across
  the cluster (one per host, plus one in its last TAIL). A few pulls at full speed, not one per host at a
  trickle: a file can be relayed only once it has landed whole, so the hub's files must land early and
  steadily, not all at the end. The hub owes a file again only when no host holds it and no copy is on its way.
- A hub pull goes to a host that lacks the file, the one with the fewest files nobody else holds: new files
  land all over the cluster, so every host's uplink starts passing files on early and none becomes the one
  source of many. While it pulls, a host takes at most `hub_peer_in` peer streams: the hub is the one source
  of new bytes, its stream keeps most of the link.
- Every verified file is at once a source for the others. A host with a free incoming stream takes the rarest
  file it lacks (fewest copies, held or on their way) that a holder with a free outgoing stream can send; the
  hosts with the fewest bytes choose first, one stream each in turn, the least busy holder sends, and a holder
  sends a given file to `fanout` hosts at a time. New files fan out like a tree.
- At most `streams` peer transfers go into and out of each host. A stream frees its slot when its bytes are in
  (the receiver verifies while the next one moves) or when all but its last `TAIL` of bytes have moved, so the
  next stream's start-up overlaps the end of the last one. Small files from one holder share one stream, up to
  `batch_bytes`.
- A failed transfer is tried again from another holder when there is one; a hub pull that broke off is resumed
  by the same host. A failed host's hub pulls go back to the queue, and files only it held go back to the hub.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

HUB = "@hub"
CONTROL = "@control"   # control mode: this machine holds every file and pushes it
DEFAULT_STREAMS = 4
DEFAULT_HUB_STREAMS = 4
HUB_PEER_IN = 1
HUB_LANES = 2            # download areas per host: the next hub pull may start while the last one ends
FANOUT = 1               # copies of one file one holder sends at a time
TAIL = 0.1               # a stream's last tenth of bytes no longer holds its slot
BATCH_BYTES = 32 << 20   # small files share one rsync stream; big ones (real shards are GBs) go alone
_HUB = -1


@dataclass(frozen=True)
class Transfer:
    """Move `paths` into host `dest` from `src` (HUB, CONTROL or a host); `lane` is the host's hub download area."""

    dest: str
    src: str
    paths: tuple[str, ...]
    lane: int = 0


@dataclass(eq=False)
class _Stream:
    dest: int
    src: int                  # a source index (a host, or the control node), or _HUB
    left: set[int] = field(default_factory=set)   # files whose bytes are not all in yet
    slot: bool = True         # still holds its slots
    files: tuple[int, ...] = ()
    lane: int = 0


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class Schedule:
    """The state of one all-gather: who holds what, what is on its way, what the hub still owes."""

    def __init__(self, sizes: Mapping[str, int], have: Mapping[str, Iterable[str]], *,
                 streams: int | Mapping[str, int] = DEFAULT_STREAMS, hub_streams: int = DEFAULT_HUB_STREAMS,
                 hub_peer_in: int = HUB_PEER_IN, fanout: int = FANOUT, control: bool = False,
                 batch_bytes: int = BATCH_BYTES):
        """sizes: every file (manifest order) -> bytes; have: every host -> the files it holds verified.
        streams: peer streams into and out of each host (one number, or per host); control: this machine holds
        every file and pushes it (no hub)."""
        if hub_streams < 1 or hub_peer_in < 0:
            raise ValueError("hub_streams must be >= 1 and hub_peer_in >= 0")
        self.paths = list(sizes)
        self.size = [int(sizes[p]) for p in self.paths]
        self.pidx = {p: i for i, p in enumerate(self.paths)}
        self.hosts = list(have)
        self.hidx = {h: i for i, h in enumerate(self.hosts)}
        n, m = len(self.hosts), len(self.paths)
        default = streams if isinstance(streams, int) else DEFAULT_STREAMS
        per = {} if isinstance(streams, int) else dict(streams)
        self.limit = [int(per.get(h, default)) for h in self.hosts] + [default]   # the last one: CONTROL
        if min(self.limit) < 1:
            raise ValueError("every host needs at least one stream")
        self.control, self.ctl = control, n
        self.hub_streams, self.hub_peer_in, self.batch_bytes = hub_streams, hub_peer_in, batch_bytes
        self.fanout = fanout
        self.sending: dict[tuple[int, int], int] = {}   # (source, file) -> copies it sends now (slots held)
        self.busy_with = [0] * m                        # sources that send each file fanout times already
        self.full = (1 << m) - 1
        self.hostmask = (1 << n) - 1
        self.have = [0] * n
        for h, paths in have.items():
            for p in paths:
                self.have[self.hidx[h]] |= 1 << self.pidx[p]
        self.holders = [0] * m
        for i, mask in enumerate(self.have):
            for p in _bits(mask):
                self.holders[p] |= 1 << i
        if control:
            for p in range(m):
                self.holders[p] |= 1 << self.ctl
        self.nholders = [mask.bit_count() for mask in self.holders]
        self.coming = [0] * m                    # copies of each file on their way
        self.bytes = [sum(self.size[p] for p in _bits(mask)) for mask in self.have]   # held or on the way
        self.inflight = [0] * n                  # files on their way into each host
        self.n_in = [0] * n                      # peer streams into each host that hold a slot
        self.n_out = [0] * (n + 1)               # streams out of each source that hold a slot
        self.lanes: list[list[_Stream | None]] = [[None] * HUB_LANES for _ in range(n)]   # hub download areas
        self.hub_busy = 0                        # hub streams that hold a slot
        self.hubq: deque[int] = deque(sorted((p for p in range(m) if not self.holders[p]),
                                             key=lambda p: -self.size[p]))
        self.hub_files = [self.paths[p] for p in self.hubq]
        self.retry: list[tuple[int, int]] = []   # hub pulls to resume on the same host
        self.streams: dict[tuple[int, int], _Stream] = {}   # (host, file) -> its stream, until its bytes are in
        self.source: dict[tuple[int, int], int] = {}         # (host, file) -> source, until verified or failed
        self.tries: dict[tuple[int, int], int] = {}
        self.avoid: dict[tuple[int, int], int] = {}
        self.alive = [True] * n
        self.finished = [False] * n
        self.touched = set(range(n))   # hosts that may have just become complete
        self.ready = False
        self.used = [0] * (n + 1)   # when each source last sent: ties go to the one idle longest
        self.clock = 0

    # --- events ---------------------------------------------------------------------------------------
    def peers_ready(self) -> None:
        """The peer key is in place on every host: hosts may now send to each other."""
        self.ready = True

    def progress(self, host: str, path: str, nbytes: int) -> bool:
        """nbytes of path have reached host; True when that freed a slot (ask `next()` again)."""
        s = self.streams.get((self.hidx[host], self.pidx[path]))
        if s is None or not s.slot or len(s.left) != 1:
            return False
        p = next(iter(s.left))
        if nbytes < self.size[p] * (1 - TAIL):
            return False
        self._release(s)
        return True

    def received(self, host: str, path: str) -> None:
        """path's bytes are all on host, which now verifies them; the stream ends with its last file."""
        h, p = self.hidx[host], self.pidx[path]
        if self.alive[h]:
            self._end(h, p)

    def landed(self, host: str, path: str) -> None:
        """path is verified in place on host (from whichever source)."""
        h, p = self.hidx[host], self.pidx[path]
        if not self.alive[h]:
            return
        self._end(h, p)
        self._drop(h, p)
        self.touched.add(h)
        if not self.have[h] >> p & 1:
            self.have[h] |= 1 << p
            self.holders[p] |= 1 << h
            self.nholders[p] += 1
            if self.inflight[h] >> p & 1:
                self.inflight[h] &= ~(1 << p)
            else:   # a transfer given up on (its source failed) finished after all
                self.bytes[h] += self.size[p]

    def failed(self, host: str, path: str) -> int:
        """A transfer of path into host failed (moving or verifying); returns how often that happened so far
        (0: it was not on its way, e.g. its host had already failed)."""
        h, p = self.hidx[host], self.pidx[path]
        src = self.source.get((h, p))
        if src is None or not self.alive[h]:
            return 0
        n = self.tries[(h, p)] = self.tries.get((h, p), 0) + 1
        s = self.streams.get((h, p))
        if src == _HUB and s is not None:   # the same host again: its client resumes the download
            self.retry.append((h, p))
            return n
        self._end(h, p)
        self._drop(h, p)
        self.inflight[h] &= ~(1 << p)
        self.bytes[h] -= self.size[p]
        if not self.holders[p]:   # no copy is left anywhere (its bytes were wrong, or its source failed)
            self._owe([p])
            return n
        avoid = self.avoid.get((h, p), 0) | 1 << src
        self.avoid[(h, p)] = 0 if self.holders[p] & ~avoid == 0 else avoid   # every holder failed once: again
        return n

    def host_failed(self, host: str) -> None:
        """host is gone: nothing more goes to or comes from it, what only it held goes back to the hub.

        Transfers out of it stay on their way until their receivers report them (landed or failed)."""
        h = self.hidx[host]
        if not self.alive[h]:
            return
        self.alive[h] = False
        for d, p in [k for k in self.streams if k[0] == h]:
            self._end(d, p, force=True)
        for d, p in [k for k in self.source if k[0] == h]:
            self._drop(d, p)
        self.retry = [(d, p) for d, p in self.retry if d != h]
        for p in _bits(self.have[h]):
            self.holders[p] &= ~(1 << h)
            self.nholders[p] -= 1
        self.inflight[h] = 0
        for k, avoid in self.avoid.items():   # the holders left may all be ones to avoid now: each may be tried again
            if avoid and self.holders[k[1]] & ~avoid == 0:
                self.avoid[k] = 0
        self._owe([p for p in range(len(self.paths)) if not self.holders[p]])

    # --- decisions ------------------------------------------------------------------------------------
    def next(self) -> list[Transfer]:
        """The transfers to start now (recorded as on their way)."""
        out = []
        for h, p in list(self.retry):   # resumed on the same host and lane; one past its tail needs a slot again
            s = self.streams[(h, p)]
            if not s.slot:
                if self.hub_busy >= self.hub_streams or any(x is not None and x.slot for x in self.lanes[h]):
                    continue
                s.slot = True
                self.hub_busy += 1
            self.retry.remove((h, p))
            out.append(Transfer(self.hosts[h], HUB, (self.paths[p],), s.lane))
        while self.hubq and self.hub_busy < self.hub_streams:
            p = self.hubq[0]
            h = self._hub_host(p)
            if h is None:
                break
            self.hubq.popleft()
            lane = self.lanes[h].index(None)
            self.lanes[h][lane] = self._start(h, _HUB, [p], lane)
            self.hub_busy += 1
            out.append(Transfer(self.hosts[h], HUB, (self.paths[p],), lane))
        if self.ready or self.control:
            out += self._peers()
        return out

    def finishing(self) -> list[str]:
        """Hosts that now hold every file with nothing on its way (each returned once): time to finish them."""
        out = []
        for h in sorted(self.touched):
            if self.alive[h] and not self.finished[h] and self.have[h] == self.full and not self.inflight[h]:
                self.finished[h] = True
                out.append(self.hosts[h])
        self.touched.clear()
        return out

    @property
    def done(self) -> bool:
        """Every host that has not failed holds every file."""
        return all(f or not a for f, a in zip(self.finished, self.alive, strict=True))

    def holders_of(self, path: str) -> list[str]:
        return [self.hosts[i] if i < len(self.hosts) else CONTROL for i in _bits(self.holders[self.pidx[path]])]

    # --- internals ------------------------------------------------------------------------------------
    def _start(self, h: int, src: int, ps: list[int], lane: int = 0) -> _Stream:
        s = _Stream(h, src, set(ps), files=tuple(ps), lane=lane)
        for p in ps:
            self.streams[(h, p)] = s
            self.source[(h, p)] = src
            self.coming[p] += 1
            self.inflight[h] |= 1 << p
            self.bytes[h] += self.size[p]
        return s

    def _owe(self, lost: list[int]) -> None:
        """The hub sends these again when no host holds them and no copy is on its way (largest first)."""
        queued = set(self.hubq)
        lost = [p for p in lost if not self.control and not self.holders[p] and not self.coming[p]
                and p not in queued]
        self.hubq.extendleft(sorted(lost, key=lambda p: self.size[p]))

    def _drop(self, h: int, p: int) -> None:
        if self.source.pop((h, p), None) is not None:
            self.coming[p] -= 1

    def _release(self, s: _Stream) -> None:
        if not s.slot:
            return
        s.slot = False
        if s.src == _HUB:
            self.hub_busy -= 1
            return
        self.n_out[s.src] -= 1
        self.n_in[s.dest] -= 1
        for p in s.files:
            k = self.sending[(s.src, p)] = self.sending[(s.src, p)] - 1
            if k < self.fanout:
                self.busy_with[p] &= ~(1 << s.src)

    def _end(self, h: int, p: int, force: bool = False) -> None:
        """p's bytes left host h's stream (in, or given up); the stream ends with its last file, or at once."""
        s = self.streams.pop((h, p), None)
        if s is None:
            return
        s.left.discard(p)
        if force:
            for q in s.left:
                self.streams.pop((h, q), None)
            s.left.clear()
        if s.left:
            return
        self._release(s)
        if s.src == _HUB:
            self.lanes[h][s.lane] = None
            if force and not self.have[h] >> p & 1:
                self.hubq.appendleft(p)

    def _hub_host(self, p: int) -> int | None:
        """Who pulls p: a host with a free download area that lacks it, holding the fewest files nobody else has."""
        sole = [0] * len(self.hosts)
        for q, n in enumerate(self.nholders):
            if n == 1 and self.holders[q] & self.hostmask:
                sole[self.holders[q].bit_length() - 1] += 1
        for (h, _), src in self.source.items():
            if src == _HUB:
                sole[h] += 1
        best, key = None, None
        for h in range(len(self.hosts)):
            if self.alive[h] and not self.finished[h] and self._hub_free(h) \
                    and not (self.have[h] | self.inflight[h]) >> p & 1:
                k = (sole[h], self.n_in[h], self.bytes[h], h)
                if key is None or k < key:
                    best, key = h, k
        return best

    def _hub_free(self, h: int) -> bool:
        """A free download area, and no hub pull of its own before its tail."""
        lanes = self.lanes[h]
        return None in lanes and not any(s is not None and s.slot for s in lanes)

    def _slots(self, h: int) -> int:
        if not self.alive[h] or self.finished[h]:
            return 0
        free = self.limit[h] - self.n_in[h]
        if any(s is not None and s.slot for s in self.lanes[h]):
            free = min(free, self.hub_peer_in - self.n_in[h])
        return free

    def _peers(self) -> list[Transfer]:
        free = self._free_sources()
        if not free:
            return []
        avail = 0
        for p, mask in enumerate(self.holders):
            if mask & free & ~self.busy_with[p]:
                avail |= 1 << p
        n = len(self.hosts)
        want = {h: self.full & ~self.have[h] & ~self.inflight[h] for h in range(n) if self._slots(h) > 0}
        receivers = sorted((h for h, w in want.items() if w & avail), key=lambda h: (self.bytes[h], h))
        if not receivers:
            return []
        rarity = sorted(_bits(avail), key=lambda p: (self.nholders[p] + self.coming[p], p))
        out: list[Transfer] = []
        while receivers and free:   # one stream per host and pass: the sources spread over many receivers
            more = []
            for h in receivers:
                cand = want[h] & avail
                pick, srcs = self._rarest(h, cand, rarity, free)
                if not srcs:
                    continue
                src = self._source(srcs)
                group = self._batch(src, pick, cand, rarity)
                self._send(h, src, group)
                for q in group:
                    want[h] &= ~(1 << q)
                if self.n_out[src] >= self.limit[src]:
                    free &= ~(1 << src)
                for q in _bits(avail & (self.full if src == self.ctl else self.have[src])):
                    if not self.holders[q] & free & ~self.busy_with[q]:
                        avail &= ~(1 << q)
                out.append(Transfer(self.hosts[h], CONTROL if src == self.ctl else self.hosts[src],
                                    tuple(self.paths[q] for q in group)))
                if not free:
                    break
                if self._slots(h) > 0:
                    more.append(h)
            receivers = sorted(more, key=lambda h: (self.bytes[h], h))
        return out

    def _free_sources(self) -> int:
        """The sources (hosts once the peer key is in place, this machine in control mode) with a free outgoing
        stream."""
        free = 0
        if self.ready:
            for s in range(len(self.hosts)):
                if self.alive[s] and self.n_out[s] < self.limit[s]:
                    free |= 1 << s
        if self.control and self.n_out[self.ctl] < self.limit[self.ctl]:
            free |= 1 << self.ctl
        return free

    def _rarest(self, h: int, cand: int, rarity: list[int], free: int) -> tuple[int, int]:
        """The rarest of the files `cand` host h may take that a free holder (not one to avoid) can send, and
        those holders (0: none)."""
        for p in rarity:
            if cand >> p & 1:
                srcs = self.holders[p] & free & ~self.busy_with[p] & ~self.avoid.get((h, p), 0)
                if srcs:
                    return p, srcs
        return 0, 0

    def _batch(self, src: int, pick: int, cand: int, rarity: list[int]) -> list[int]:
        """pick, and when it is small more of the files `cand` from the same holder, up to batch_bytes in all."""
        group = [pick]
        if src != self.ctl and self.size[pick] < self.batch_bytes:   # more from the same holder
            total = self.size[pick]
            for q in rarity:
                if q != pick and cand >> q & 1 and self.holders[q] >> src & 1:
                    if total + self.size[q] > self.batch_bytes:
                        break
                    group.append(q)
                    total += self.size[q]
        return group

    def _send(self, h: int, src: int, group: list[int]) -> None:
        """Record a peer stream of `group` from src into h: its slots, and src's copies of each file."""
        self._start(h, src, group)
        self.n_in[h] += 1
        self.n_out[src] += 1
        self.clock += 1
        self.used[src] = self.clock
        for q in group:
            k = self.sending[(src, q)] = self.sending.get((src, q), 0) + 1
            if k >= self.fanout:
                self.busy_with[q] |= 1 << src

    def _source(self, srcs: int) -> int:
        """The least busy holder, a host before this machine; ties go to the one that has waited longest."""
        best, key = -1, None
        for s in _bits(srcs):
            k = (s == self.ctl, self.n_out[s], self.used[s], s)
            if key is None or k < key:
                best, key = s, k
        return best
