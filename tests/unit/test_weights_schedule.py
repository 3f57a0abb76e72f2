"""The all-gather scheduler (kimictl/weights/schedule.py) without hosts: rules, limits, failures, and random runs."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kimictl.weights.schedule import CONTROL, HUB, TAIL, Schedule, Transfer


def sizes_of(n: int, size: int = 1 << 30) -> dict[str, int]:
    return {f"f{i}": size for i in range(n)}


def by_dest(ts: list[Transfer]) -> dict[str, list[Transfer]]:
    out: dict[str, list[Transfer]] = {}
    for t in ts:
        out.setdefault(t.dest, []).append(t)
    return out


def land(s: Schedule, t: Transfer) -> None:
    for p in t.paths:
        s.received(t.dest, p)
        s.landed(t.dest, p)


def test_rarest_file_first_from_its_holder():
    s = Schedule({"a": 1 << 30, "b": 1 << 30}, {"h0": ["a", "b"], "h1": ["a"], "h2": []}, streams=1)
    s.peers_ready()
    # h2 lacks both; b has one holder, a two: b first. h1's b must wait: h0 sends one stream at a time.
    assert s.next() == [Transfer("h2", "h0", ("b",))]
    assert s.next() == []


def test_stream_limits_hold_on_both_ends():
    s = Schedule(sizes_of(8), {"src": [f"f{i}" for i in range(8)], **{f"r{i}": [] for i in range(6)}}, streams=2)
    s.peers_ready()
    first = s.next()
    assert len(first) == 2 and all(t.src == "src" for t in first)   # the one holder sends two streams
    assert len({t.dest for t in first}) == 2                        # to two receivers, one each
    land(s, first[0])   # a receiver that holds a file becomes a source, and src has a free stream again
    more = s.next()
    assert more and all(len(v) <= 2 for v in by_dest([*first[1:], *more]).values())
    assert sum(t.src == "src" for t in [*first[1:], *more]) <= 2


def test_hub_files_largest_first_a_few_at_a_time_on_hosts_without_a_pull():
    size = {"s1": 1, "big": 100, "mid": 50, "s2": 1, "big2": 100}
    s = Schedule(size, {h: [] for h in ("a", "b", "c")}, hub_streams=2)
    first = s.next()
    assert [(t.src, t.paths) for t in first] == [(HUB, ("big",)), (HUB, ("big2",))]
    assert len({t.dest for t in first}) == 2
    land(s, first[0])
    nxt = s.next()
    assert [(t.src, t.paths) for t in nxt] == [(HUB, ("mid",))]
    assert nxt[0].dest == "c"   # the host that holds no file of its own yet
    assert s.hub_files == ["big", "big2", "mid", "s1", "s2"]


def test_a_hub_pull_in_its_tail_lets_the_next_one_start_on_another_lane():
    s = Schedule({"x": 1000, "y": 1000}, {"a": []}, hub_streams=1)
    (t,) = s.next()
    assert s.next() == []
    assert not s.progress("a", "x", 500)
    assert s.progress("a", "x", int(1000 * (1 - TAIL)))
    (u,) = s.next()
    assert u.paths == ("y",) and u.lane != t.lane   # never the download area x still uses


def test_a_hub_pulling_host_takes_few_peer_streams():
    s = Schedule(sizes_of(6), {"a": [f"f{i}" for i in range(5)], "b": []}, streams=4, hub_peer_in=1)
    s.peers_ready()
    ts = s.next()
    assert [t.src for t in ts if t.dest == "b"].count(HUB) == 1
    assert sum(t.src == "a" for t in ts) == 1   # the link stays mostly the hub's


def test_received_frees_the_stream_and_landed_makes_a_source():
    s = Schedule(sizes_of(3), {"a": ["f0", "f1", "f2"], "b": [], "c": []}, streams=1)
    s.peers_ready()
    (t,) = s.next()
    assert t.src == "a"
    s.received(t.dest, t.paths[0])
    (u,) = s.next()   # a's stream is free while t.dest verifies; t.dest is not a source yet
    assert u.src == "a"
    s.landed(t.dest, t.paths[0])
    assert s.holders_of(t.paths[0]) == sorted(["a", t.dest])


def test_a_failed_transfer_comes_from_another_holder():
    s = Schedule({"x": 1 << 30}, {"a": ["x"], "b": ["x"], "c": []}, streams=1)
    s.peers_ready()
    (t,) = s.next()
    assert s.failed("c", "x") == 1
    (u,) = s.next()
    assert u.src != t.src
    assert s.failed("c", "x") == 2
    (v,) = s.next()   # every holder failed once: they are all tried again
    assert v.dest == "c" and v.src in ("a", "b")


def test_a_broken_hub_pull_resumes_on_the_same_host_and_lane_a_corrupt_one_goes_anywhere():
    s = Schedule({"x": 10, "y": 10}, {"a": [], "b": []}, hub_streams=1)
    (t,) = s.next()
    assert s.failed(t.dest, "x") == 1
    assert s.next() == [t]
    s.received(t.dest, "x")   # the bytes came; the hash did not match
    assert s.failed(t.dest, "x") == 2
    nxt = s.next()
    assert [u.paths for u in nxt if u.src == HUB] == [("x",)]


def test_a_failed_hosts_hub_pull_and_the_files_only_it_held_go_back_to_the_hub():
    s = Schedule({"x": 10, "y": 10, "z": 10}, {"a": [], "b": [], "c": []}, hub_streams=2)
    first = s.next()
    held, pulling = first
    land(s, held)
    s.host_failed(held.dest)
    s.host_failed(pulling.dest)
    survivor = ({"a", "b", "c"} - {held.dest, pulling.dest}).pop()
    got = []
    for _ in range(10):
        ts = s.next()
        if not ts:
            break
        assert all(t.dest == survivor and t.src == HUB for t in ts)
        got += [p for t in ts for p in t.paths]
        for t in ts:
            land(s, t)
    assert sorted(got) == ["x", "y", "z"]
    assert s.finishing() == [survivor] and s.done


def test_a_file_whose_last_holder_failed_comes_from_the_hub_only_if_no_copy_is_on_its_way():
    s = Schedule({"x": 1 << 30}, {"a": ["x"], "b": [], "c": []}, streams=1)
    s.peers_ready()
    (t,) = s.next()
    s.received(t.dest, "x")   # its bytes are in; the receiver verifies them
    s.host_failed("a")
    assert s.next() == []     # the copy on its way may well be good
    assert s.failed(t.dest, "x") == 1   # it was not
    (u,) = s.next()
    assert u.src == HUB and u.paths == ("x",)


def test_control_mode_pushes_until_hosts_can_pass_files_on():
    s = Schedule(sizes_of(4), {"a": [], "b": []}, streams=2, control=True)
    ts = s.next()
    assert ts and all(t.src == CONTROL for t in ts) and len(ts) == 2   # this machine's two streams
    for t in ts:
        land(s, t)
    s.peers_ready()
    ts = s.next()
    assert any(t.src in ("a", "b") for t in ts)   # a host before this machine when both hold a file


def test_a_file_whose_other_holder_failed_comes_again_from_the_holder_that_failed_once():
    """h0's copy of f from the control node broke, so h0 avoids the control node while h1 also holds f; then h1
    fails: the control node is the only holder left and must be tried again (a stall before; found by the random
    runs below with seed 2080437422)."""
    s = Schedule({"f": 5, "g": 5}, {"h0": ["g"], "h1": ["f", "g"]}, control=True, batch_bytes=1)
    (t,) = s.next()
    assert (t.dest, t.src, t.paths) == ("h0", CONTROL, ("f",))
    s.failed("h0", "f")
    s.host_failed("h1")
    (t,) = s.next()
    assert (t.dest, t.src, t.paths) == ("h0", CONTROL, ("f",))
    land(s, t)
    assert s.finishing() == ["h0"] and s.done


def test_small_files_from_one_holder_share_a_stream():
    s = Schedule({"big": 1000, "s1": 1, "s2": 2, "s3": 3}, {"a": ["big", "s1", "s2", "s3"], "b": []},
                 streams=1, batch_bytes=100)
    s.peers_ready()
    assert s.finishing() == ["a"]
    (t,) = s.next()
    assert t.paths == ("big",)
    land(s, t)
    (u,) = s.next()
    assert sorted(u.paths) == ["s1", "s2", "s3"]
    s.received("b", "s1")
    assert s.next() == []   # the stream is free only when its last file is in
    s.received("b", "s2")
    s.received("b", "s3")
    for p in u.paths:
        s.landed("b", p)
    assert s.finishing() == ["b"]


def test_hosts_already_complete_are_sources_and_finish_at_once():
    s = Schedule(sizes_of(2), {"a": ["f0", "f1"], "b": []})
    assert s.finishing() == ["a"] and not s.done
    assert s.hub_files == []


# --- random runs -----------------------------------------------------------------------------------------

class Run:
    """Drive a Schedule with random events and check every decision against the state it was made in."""

    def __init__(self, rnd: random.Random, n: int, m: int, streams: int, hub_streams: int, control: bool,
                 fail_p: float, host_fail_p: float):
        self.rnd = rnd
        self.hosts = [f"h{i}" for i in range(n)]
        self.sizes = {f"f{i}": rnd.choice([1, 5, 40, 100]) for i in range(m)}
        self.have = {h: {p for p in self.sizes if rnd.random() < 0.2} for h in self.hosts}
        self.nowhere = set(self.sizes) - set().union(*self.have.values())
        self.streams, self.hub_streams = streams, hub_streams
        self.s = Schedule(self.sizes, {h: sorted(v) for h, v in self.have.items()}, streams=streams,
                          hub_streams=hub_streams, control=control, batch_bytes=50)
        self.control, self.fail_p, self.host_fail_p = control, fail_p, host_fail_p
        self.moving: list[Transfer] = []              # bytes still coming; holds its slots
        self.tail: list[Transfer] = []                # past TAIL: its slots are free, its bytes still come
        self.verifying: list[tuple[str, str, str]] = []   # (dest, path, src)
        self.dead: set[str] = set()
        self.hub_sent: list[str] = []
        self.hub_lost: set[str] = set()               # files the hub may have to send again
        self.log: list[tuple] = []
        self.finished: set[str] = set()

    def start(self) -> None:
        for t in self.s.next():
            self.log.append(("start", t))
            assert t.dest not in self.dead
            for p in t.paths:
                assert p not in self.have[t.dest], (t, "receiver holds it already")
                assert not any(p in x.paths and x.dest == t.dest for x in self.moving + self.tail), t
                assert not any(d == t.dest and q == p for d, q, _ in self.verifying), t
                if t.src == HUB:
                    self.hub_sent.append(p)
                elif t.src == CONTROL:
                    assert self.control
                else:
                    assert t.src not in self.dead and p in self.have[t.src], (t, "source does not hold it")
            if t.src == HUB:
                assert len(t.paths) == 1
            self.moving.append(t)
        self.check_limits()
        for h in self.s.finishing():
            assert self.have[h] == set(self.sizes)
            self.finished.add(h)

    def check_limits(self) -> None:
        peer = [t for t in self.moving if t.src != HUB]
        for h in self.hosts:
            assert sum(t.dest == h for t in peer) <= self.streams, h
            assert sum(t.src == h for t in peer) <= self.streams, h
            assert sum(t.dest == h and t.src == HUB for t in self.moving) <= 1, h
        assert sum(t.src == CONTROL for t in peer) <= self.streams
        assert sum(t.src == HUB for t in self.moving) <= self.hub_streams

    def step(self) -> bool:
        rnd, s = self.rnd, self.s
        choices = []
        if self.moving:
            choices += ["move"] * 3
        if self.tail:
            choices += ["tail"] * 2
        if self.verifying:
            choices += ["verify"] * 3
        if not s.ready:
            choices.append("ready")
        if len(self.dead) < len(self.hosts) - 1 and rnd.random() < self.host_fail_p:
            choices.append("die")
        if not choices:
            return False
        what = rnd.choice(choices)
        self.log.append((what,))
        if what == "ready":
            s.peers_ready()
        elif what == "die":
            h = rnd.choice([x for x in self.hosts if x not in self.dead])
            self.dead.add(h)
            s.host_failed(h)
            self.hub_lost |= self.have[h] | {p for t in self.moving + self.tail if t.dest == h for p in t.paths}
            self.hub_lost |= {p for d, p, _ in self.verifying if d == h}
            self.moving = [t for t in self.moving if t.dest != h]
            self.tail = [t for t in self.tail if t.dest != h]
            self.verifying = [v for v in self.verifying if v[0] != h]
            for t in [t for t in self.moving + self.tail if t.src == h]:   # its receivers see the stream break
                (self.moving if t in self.moving else self.tail).remove(t)
                for p in t.paths:
                    s.failed(t.dest, p)
        elif what in ("move", "tail"):
            pool = self.moving if what == "move" else self.tail
            t = pool.pop(rnd.randrange(len(pool)))
            if what == "move" and len(t.paths) == 1 and rnd.random() < 0.3:   # progress past the tail
                s.progress(t.dest, t.paths[0], self.sizes[t.paths[0]])
                self.tail.append(t)
            elif rnd.random() < self.fail_p:
                for p in t.paths:
                    s.failed(t.dest, p)
                    if t.src == HUB:   # resumed by the same host: counted again below
                        self.hub_lost.add(p)
            else:
                for p in t.paths:
                    s.received(t.dest, p)
                    self.verifying.append((t.dest, p, t.src))
        else:
            d, p, src = self.verifying.pop(rnd.randrange(len(self.verifying)))
            if rnd.random() < self.fail_p:
                s.failed(d, p)
                if src == HUB:
                    self.hub_lost.add(p)
            else:
                s.landed(d, p)
                self.have[d].add(p)
        return True

    def run(self, max_steps: int = 5000) -> None:
        self.start()
        for _ in range(max_steps):
            if self.s.done:
                break
            if not self.step():
                break
            self.start()
        alive = [h for h in self.hosts if h not in self.dead]
        assert self.s.done, f"stalled: {len(self.moving)} moving, {len(self.verifying)} verifying"
        for h in alive:
            assert self.have[h] == set(self.sizes), h
        assert self.finished >= set(alive)
        # each file leaves the hub once, unless its copy was lost (corrupt, or on a host that failed)
        for p in set(self.hub_sent):
            assert self.hub_sent.count(p) == 1 or p in self.hub_lost, p
        if self.control:
            assert not self.hub_sent
        else:
            assert set(self.hub_sent) >= self.nowhere


cluster = st.fixed_dictionaries({
    "seed": st.integers(0, 2**32 - 1),
    "n": st.integers(1, 9),
    "m": st.integers(1, 14),
    "streams": st.integers(1, 4),
    "hub_streams": st.integers(1, 4),
    "control": st.booleans(),
    "fail_p": st.sampled_from([0.0, 0.0, 0.1, 0.3]),
    "host_fail_p": st.sampled_from([0.0, 0.0, 0.02]),
})


@settings(max_examples=150, deadline=None)
@given(cluster)
def test_random_runs_end_with_every_host_holding_every_file_within_the_limits(c):
    Run(random.Random(c["seed"]), c["n"], c["m"], c["streams"], c["hub_streams"], c["control"], c["fail_p"],
        c["host_fail_p"]).run()


@settings(max_examples=25, deadline=None)
@given(cluster)
def test_the_same_events_give_the_same_decisions(c):
    logs = []
    for _ in range(2):
        r = Run(random.Random(c["seed"]), c["n"], c["m"], c["streams"], c["hub_streams"], c["control"],
                c["fail_p"], c["host_fail_p"])
        r.run()
        logs.append(r.log)
    assert logs[0] == logs[1]


@pytest.mark.parametrize("n", [2, 5, 17])
def test_a_cluster_from_scratch_takes_each_file_from_the_hub_once(n):
    r = Run(random.Random(n), n, 12, 3, 2, False, 0.0, 0.0)
    r.have = {h: set() for h in r.hosts}
    r.nowhere = set(r.sizes)
    r.s = Schedule(r.sizes, {h: [] for h in r.hosts}, streams=3, hub_streams=2, batch_bytes=50)
    r.run()
    assert sorted(r.hub_sent) == sorted(r.sizes)
