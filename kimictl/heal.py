"""Self-healing of a deployed P/D cluster (`kimictl heal`): find the slices that are broken, then per slice drain it
from the proxy, restart it (and its counterpart when that holds stale peer state), pair-smoke it and re-add it.

What counts as broken, per slice (one DP group, the unit that restarts together):
- dead: an engine process is not running under its supervisor (stopped, failed, in back-off), or it was restarted
  by the supervisor alone after a crash while the other ranks of its DP group kept running, or it does not answer
  /health + /v1/models (past its start-up grace);
- hung: no progress: requests run on it (its engine profile's `running` gauges > 0) while none of its `activity`
  counters (tokens, finished requests) moves for the hang deadline - a slow answer under load is not a hang. heal's
  own probes give every engine a request meanwhile: prefill engines a 1-token completion sent straight to them,
  decode engines only P/D hand-overs (a local prefill on a decode engine is what crashes vllm-ascend, #11882);
- failing: a prefill engine answers that completion with an HTTP error;
- pair: it answers on its own, but every P/D hand-over probed with it fails while its partners hand over with
  others; stale-peer: the partners of such an engine started before it did (it restarted under them): they hold
  its old KV-transfer state, so they restart too;
- missing: it is healthy but a router of the proxy does not list it (a drain left behind, a router that dropped
  it while it was down): re-added, not restarted.

Flap damping: at most `max_actions` actions per slice within `window_s` (the event log per cluster,
`kimictl.state.heal_events`: a "started" event is written before an action touches anything, so an action whose
heal was killed, or that a concurrent round on this control node runs now, counts); one more is refused and the
run escalates (exit 1 with the reason). The only instance of a role is never restarted automatically: the run
escalates, saying what it would have done.

A host that does not answer (SSH) is not a reason to stop watching, nor to restart anything else: its slices are
"unreachable", routed out of every router that still lists them (no wait: nothing in flight there can finish), and
left alone; the round reports it (result "unreachable", exit 1 for `--once`) and the watch goes on. The event log
gets one "host" event when a host stops answering and one ("back") when it answers again. A slice whose host came
back with its engines not running (the host rebooted) is "returned": it is brought back the way any dead slice is
healed (restart on the release the cluster runs, ready, pair smoke, re-add), also when it is its role's only
instance - nothing serves it, so starting it cannot make anything worse; it stays "returned" until a heal of it
succeeds, within the flap-damping window after the host's return.

The steps themselves are the slice wing's, shared with the rollout (`kimictl.slices.steps.SliceSteps`); a heal
restarts a slice on the release it runs, holding router copies as "heal:<pid>" (it never releases another
command's hold).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypedDict, Unpack

import yaml

from kimictl import health, state
from kimictl.deployed import current_deployment
from kimictl.errors import EXIT_DEGRADED, EXIT_FAILED, EXIT_OK, HostError, InvalidInput, KimictlError
from kimictl.facts import DATA_DIR
from kimictl.hostops import HostObservation, HostOps, Proc, desired_procs, exit_text
from kimictl.inventory import Inventory
from kimictl.lease import try_hold
from kimictl.render import Rendered
from kimictl.routers import AscendProxyAdmin, FrontControl, RouterAdmin, RouterError
from kimictl.slices.model import Endpoint, Slice
from kimictl.slices.probes import pair_probe
from kimictl.slices.steps import SliceSteps, StepOptions
from kimictl.topology import Heal as TopologyHeal

HEAL_SCHEMA_VERSION = 1
RESTART_KINDS = ("dead", "hung", "failing", "pair", "stale-peer", "returned")
KINDS = (*RESTART_KINDS, "missing", "starting", "unreachable")
ALIVE = ("starting", "running")  # supervisor states of a process that runs (backoff: it crashed, waits to restart)


@functools.cache
def heal_defaults() -> dict[str, float]:
    """kimictl/data/heal.yml."""
    return yaml.safe_load((DATA_DIR / "heal.yml").read_text())


class HealGiven(TypedDict, total=False):
    """What the command line gave for a heal round (left out or None: not given)."""

    dry_run: bool
    hang_deadline: float | None
    max_actions: int | None
    window: float | None
    drain_timeout: float | None
    drain_quiet: float | None
    ready_timeout: float | None
    accept_new_host_keys: bool


@dataclass
class HealOptions(StepOptions):
    dry_run: bool = False
    hang_deadline: float = 20.0
    max_actions: int = 3
    window: float = 3600.0
    startup_grace: float = 900.0
    ready_timeout: float | None = None
    accept_new_host_keys: bool = False

    @classmethod
    def resolve(cls, topology_heal: TopologyHeal | None = None, **given: Unpack[HealGiven]) -> HealOptions:
        """heal.yml, the topology's `heal:` section over it, then what the command line gave (None: not given)."""
        d = heal_defaults()
        t = topology_heal
        opts = cls(hang_deadline=float(d["hang_deadline_s"]), max_actions=int(d["max_actions"]),
                   window=float(d["window_s"]), startup_grace=float(d["startup_grace_s"]))
        for key, attr in (("hang_deadline", "hang_deadline_s"), ("max_actions", "max_actions"),
                          ("window", "window_s")):
            if t is not None and getattr(t, attr) is not None:
                setattr(opts, key, getattr(t, attr))
        for key, value in given.items():
            if value is not None:
                setattr(opts, key, value)
        return opts


@dataclass
class Finding:
    slice: str  # "" when no single slice can be blamed
    kind: str  # one of KINDS
    engine: str
    host: str
    detail: str


@dataclass
class Action:
    slice: str
    role: str
    hosts: list[str]
    engines: list[str]
    reasons: list[str]  # finding kinds
    steps: list[str]  # drain, restart, pair-smoke, readd; route-out (a slice whose host does not answer)
    result: str = "planned"  # planned | healed | routed-out | failed | escalated | skipped
    seconds: dict[str, float] = field(default_factory=dict)
    probes: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    note: str | None = None


@dataclass
class HealResult:
    cluster: str
    release: str
    result: str  # healthy | planned | healed | deferred | unreachable | failed | escalated
    dry_run: bool
    findings: list[Finding]
    actions: list[Action]
    escalations: list[str]
    event_log: str
    run_dir: str | None = None
    proxy_gate: dict[str, Any] | None = None
    error: str | None = None
    seconds: float = 0.0
    unreachable: dict[str, str] = field(default_factory=dict)  # host -> why it does not answer

    @property
    def exit_code(self) -> int:
        """0 healthy or healed; 3 actions pending (--dry-run, or deferred while another command held the cluster
        lease); 1 an action failed, a host does not answer or the run escalated."""
        return {"healthy": EXIT_OK, "healed": EXIT_OK, "planned": EXIT_DEGRADED,
                "deferred": EXIT_DEGRADED}.get(self.result, EXIT_FAILED)

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": HEAL_SCHEMA_VERSION, "cluster": self.cluster, "release": self.release,
                "result": self.result, "dry_run": self.dry_run, "findings": [vars(f) for f in self.findings],
                "actions": [vars(a) for a in self.actions], "escalations": self.escalations,
                "proxy_gate": self.proxy_gate, "event_log": self.event_log, "run_dir": self.run_dir,
                "error": self.error, "seconds": self.seconds, "unreachable": self.unreachable}


def _started(st: dict[str, Any] | None) -> float | None:
    """The supervisor's child_started_at as epoch seconds."""
    raw = (st or {}).get("child_started_at")
    if not raw:
        return None
    try:
        return datetime.fromisoformat(str(raw).replace("Z", "+00:00")).replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class HealInputs:
    """What a heal round starts from (`prepare_heal`): the inventory, the current release record, its render
    snapshot and its topology's `heal:` section (None: not set, or the topology file is not readable here)."""

    inventory: Inventory
    record: state.ReleaseRecord
    rendered: Rendered
    topology_heal: TopologyHeal | None = None


class Healer:
    """One heal round over a deployed P/D cluster: `detect`, `plan`, then `act` (unless dry-run)."""

    def __init__(self, inputs: HealInputs, opts: HealOptions, say: Callable[[str], None],
                 on_event: Callable[[str, str, str], None] | None = None, *,
                 ops: HostOps | None = None, http: Any = health, router: Callable[..., RouterAdmin] = RouterAdmin,
                 instances: Callable[..., AscendProxyAdmin] = AscendProxyAdmin,
                 front: Callable[..., FrontControl] = FrontControl, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep,
                 hold: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None):
        inv, rendered = inputs.inventory, inputs.rendered
        if rendered.plan.mode != "pd" or rendered.proxy is None:
            raise InvalidInput(f"cluster {rendered.plan.cluster} runs topology {rendered.plan.topology} "
                               f"({rendered.plan.mode}): heal drains and re-adds slices through the P/D proxy",
                               hint="a colocated engine is restarted by its supervisor; see `kimictl status`")
        self.ops = ops or HostOps(inv, rendered.plan.served_model_name,
                                  state.new_run_dir(rendered.plan.cluster, "heal"), say=say, on_event=on_event,
                                  accept_new_host_keys=opts.accept_new_host_keys, ready_timeout=opts.ready_timeout,
                                  http=http)
        self.record, self.rendered, self.opts, self.say, self.http = inputs.record, rendered, opts, say, http
        self.clock, self.sleep = clock, sleep
        # the cluster lease, taken per action (kimictl.lease.try_hold: never waits, says who holds it)
        self.hold = hold or (lambda command: try_hold(inv, command, accept_new_keys=opts.accept_new_host_keys))
        self.cluster, self.served_model_name = rendered.plan.cluster, rendered.plan.served_model_name
        self.procs: dict[str, Proc] = {p.id: p for p in desired_procs(rendered, inv)}
        self.observed: dict[str, HostObservation] = {}
        self.routers_error: str | None = None
        self.unreachable: dict[str, str] = {}  # host -> why it does not answer (its SSH error)
        self.down: set[str] = set()  # slices with a host that does not answer
        self.listed: set[str] = set()  # those of them a router still lists
        self.back: dict[str, float | None] = {}  # host that came back -> when (None: in this round)
        self.events: list[dict[str, Any]] = []  # the heal event log as this round found it
        self.steps = SliceSteps(inv, rendered, rendered, self.ops, opts, say, procs=self._procs, http=http,
                                router=router, instances=instances, front=front, owner=f"heal:{os.getpid()}")
        self.steps.proxy_proc = self.procs.get("proxy")

    def _procs(self, s: Slice, release: str) -> list[Proc]:
        return [self.procs[e] for e in s.engines]

    def _state(self, engine: str) -> dict[str, Any] | None:
        p = self.procs[engine]
        return self.observed.get(p.host, HostObservation({}, None)).states.get(engine)

    # --- detection (no changes) ----------------------------------------------------------------------

    def detect(self) -> list[Finding]:
        """Everything broken now, per slice (read-only: supervisor state over SSH, probes over HTTP). The slices of
        a host that does not answer are only "unreachable": none of their engines is asked anything."""
        self.observed, self.unreachable = self.ops.observe_reachable()
        self.events = state.heal_events(self.cluster)
        self.back = self._returned_hosts()
        now = self.clock()
        found = self._unreachable_findings()
        for s in self.steps.slices.values():
            if s.name not in self.down:
                found += self._process_findings(s)
        sick = {f.engine for f in found}
        ready_checks = [ep for s in self.steps.slices.values() if s.name not in self.down for ep in s.endpoints
                        if ep.engine not in sick]
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(ready_checks)))) as pool:
            answers = list(pool.map(self._ready, ready_checks))
        live: list[Endpoint] = []
        for ep, why in zip(ready_checks, answers, strict=True):
            if why is None:
                live.append(ep)
                continue
            kind, detail, st = "dead", why, self._state(ep.engine)
            t0 = _started(st)
            if t0 is not None and now - t0 < self.opts.startup_grace and not int((st or {}).get("restarts", 0)):
                kind, detail = "starting", f"started {now - t0:.0f}s ago and still loading ({why})"
            found.append(Finding(self._slice_of(ep.engine).name, kind, ep.engine, ep.host, detail))
        found += self._probe(live)
        found += self._membership_findings(live, {f.engine for f in found})
        return found

    def _slice_of(self, engine: str) -> Slice:
        return next(s for s in self.steps.slices.values() if engine in s.engines)

    def _unreachable_findings(self) -> list[Finding]:
        """The engines on hosts that do not answer; their slices are down (`self.down`)."""
        self.down = {s.name for s in self.steps.slices.values() if set(s.hosts) & set(self.unreachable)}
        return [Finding(s.name, "unreachable", e, self.procs[e].host,
                        f"its host does not answer: {self.unreachable[self.procs[e].host]}")
                for s in self.steps.slices.values() for e in s.engines if self.procs[e].host in self.unreachable]

    def _returned_hosts(self) -> dict[str, float | None]:
        """Hosts that answer again after they did not: the last "host" event of each says it was unreachable (it
        comes back now: None), or it came back (its "back" event's time) within the flap-damping window."""
        last = {str(ev.get("host")): ev for ev in self.events if ev.get("event") == "host"}
        out: dict[str, float | None] = {}
        for host, ev in last.items():
            if host not in self.observed:
                continue
            if ev.get("result") == "unreachable":
                out[host] = None
            elif ev.get("result") == "back" and self.clock() - float(ev["ts"]) < self.opts.window:
                out[host] = float(ev["ts"])
        return out

    def _returned(self, slice_name: str, host: str) -> bool:
        """The slice's engine on `host` is down because its host went away: the host came back and no heal of the
        slice has succeeded since."""
        if host not in self.back:
            return False
        since = self.back[host]
        return since is None or not any(
            ev.get("event") == "action" and ev.get("slice") == slice_name and ev.get("result") == "healed"
            and float(ev["ts"]) >= since for ev in self.events)

    def _process_findings(self, s: Slice) -> list[Finding]:
        out = []
        states = {e: self._state(e) for e in s.engines}
        for e, st in states.items():
            host = self.procs[e].host
            kind, back = "dead", ""
            if self._returned(s.name, host):
                kind, back = "returned", f"{host} answers again after it did not; "
            if st is None:
                out.append(Finding(s.name, kind, e, host, f"{back}not supervised on its host (stopped or never "
                                   "started)"))
            elif st.get("state") not in ALIVE:
                out.append(Finding(s.name, kind, e, host, f"{back}supervisor state {st.get('state')}, restarts "
                                   f"{st.get('restarts', 0)}, last exit: {exit_text(st.get('last_exit'))}"))
            elif int(st.get("restarts", 0)) > 0 and len(s.engines) > 1:
                out.append(Finding(s.name, "dead", e, host, f"crashed and was restarted alone by its supervisor "
                                   f"(restarts {st.get('restarts')}, last exit: {exit_text(st.get('last_exit'))}); "
                                   "the other ranks of its DP group kept running"))
        return out

    def _ready(self, ep: Endpoint) -> str | None:
        """None when the engine answers /health + /v1/models, else why not."""
        ready = self.http.engine_ready(ep.ip, ep.port, self.served_model_name, api_key=self.steps.engine_key)
        return None if ready.ok else f"{ep.url}: {ready.detail}"

    def _probe(self, eps: list[Endpoint]) -> list[Finding]:
        """Progress and hand-overs of the engines that answer: their counters are read, every engine gets requests
        (a 1-token completion straight to each prefill engine; P/D hand-overs, prefill to decode, for every engine:
        a decode engine is never sent a completion of its own), the counters are read again when the hang deadline
        has passed, while those requests may still run. hung: requests run and no counter moved; failing: a prefill
        engine answers its completion with an HTTP error; pair: see `_pair_findings`. A probe that is only slow
        (no answer in time, the engine making progress) finds nothing."""
        if not eps:
            return []
        deadline = self.opts.hang_deadline
        pre = [ep for ep in eps if ep.role == "prefill"]
        dec = [ep for ep in eps if ep.role == "decode"]
        n = max(len(pre), len(dec))
        pairs = list(dict.fromkeys((pre[(i + k) % len(pre)], dec[i % len(dec)]) for i in range(n)
                                   for k in (0, 1))) if pre and dec else []
        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=min(16, len(eps))) as pool:
            before = dict(zip(eps, pool.map(self.progress, eps), strict=True))
        # the probes outlast the second reading: a request that has not finished then still runs on its engine
        timeout = deadline + 2.0
        with ThreadPoolExecutor(max_workers=max(1, min(64, len(pre) + len(pairs)))) as pool:
            direct = [pool.submit(self._completion, ep, timeout) for ep in pre]
            handovers = [pool.submit(pair_probe, p, d, self.served_model_name, timeout=timeout, http=self.http,
                                     api_key=self.steps.engine_key) for p, d in pairs]
            self.sleep(max(0.0, t0 + deadline - time.monotonic()))
            after = {ep: self.progress(ep) for ep in eps}
            answers = [f.result() for f in direct]
            probes = [f.result() for f in handovers]
        out: list[Finding] = []
        for ep in eps:
            b, a = before[ep], after[ep]
            if b is not None and a is not None and a[2] > 0 and a[1] == b[1]:
                out.append(Finding(self._slice_of(ep.engine).name, "hung", ep.engine, ep.host,
                                   f"{ep.url} answers /health, but {a[2]:g} request(s) run on it and no token "
                                   f"counter moved within {deadline:g}s (no progress)"))
        for ep, (code, body) in zip(pre, answers, strict=True):
            if code not in (0, 200) and ep.engine not in {f.engine for f in out}:
                out.append(Finding(self._slice_of(ep.engine).name, "failing", ep.engine, ep.host,
                                   f"{ep.url}: a 1-token completion got HTTP {code}: {health.body_text(body)}"))
        return out + self._pair_findings(eps, pairs, probes, {f.engine for f in out})

    def progress(self, ep: Endpoint) -> tuple[float, tuple[float, ...], float] | None:
        """(busy, activity counters, running requests) of an engine; None when its /metrics does not answer."""
        got = self.steps.drain_sample(ep)
        return None if got is None or len(got) < 3 else got  # type: ignore[return-value]

    def _completion(self, ep: Endpoint, timeout: float) -> tuple[int, Any]:
        """A 1-token completion straight to a prefill engine (never a decode one: vllm-ascend #11882)."""
        assert ep.role == "prefill", ep
        return self.http.http_post_json(f"{ep.url}/v1/completions", {
            "model": self.served_model_name, "prompt": "kimictl heal probe", "max_tokens": 1},
            timeout=timeout, api_key=self.steps.engine_key)

    def _pair_findings(self, eps: list[Endpoint], pairs: list[tuple[Endpoint, Endpoint]],
                       probes: list[dict[str, Any]], judged: set[str]) -> list[Finding]:
        """Hand-overs between engines that answer: each prefill endpoint with two decode endpoints and each decode
        endpoint with two prefill endpoints (a second partner tells a broken engine from a broken partner). Probes
        with an engine already found hung or failing, and probes that got no answer in time (slow is not broken),
        are left out."""
        ok: dict[str, int] = {}
        bad: dict[str, list[str]] = {}
        failed: list[dict[str, Any]] = []
        for (p, d), r in zip(pairs, probes, strict=True):
            if p.engine in judged or d.engine in judged or (not r["ok"] and r.get("unanswered")):
                continue
            if not r["ok"]:
                failed.append(r)
            for me, other in ((p, d), (d, p)):
                if r["ok"]:
                    ok[me.engine] = ok.get(me.engine, 0) + 1
                else:
                    bad.setdefault(me.engine, []).append(other.engine)
        if not bad:
            return []
        by_id = {ep.engine: ep for ep in eps}
        broken = [e for e in bad if not ok.get(e) and any(ok.get(o) for o in bad[e])]
        if not broken:
            return [Finding("", "pair", ", ".join(sorted(bad)), "", "P/D hand-overs fail but no single engine can be "
                            f"blamed (its partners fail with others too): {failed[0]['detail']}")]
        out = []
        for e in broken:
            ep = by_id[e]
            detail = next(r["detail"] for r in failed if e in (r["prefill"], r["decode"]))
            out.append(Finding(self._slice_of(e).name, "pair", e, ep.host,
                               f"every probed hand-over with it fails ({', '.join(bad[e])}): {detail}"))
            mine = _started(self._state(e))
            for o in dict.fromkeys(bad[e]):
                theirs = _started(self._state(o))
                if mine is not None and theirs is not None and theirs < mine:
                    out.append(Finding(self._slice_of(o).name, "stale-peer", o, by_id[o].host,
                                       f"started before {e} restarted: it holds {e}'s old KV-transfer state"))
        return out

    def _membership_findings(self, eps: list[Endpoint], sick: set[str]) -> list[Finding]:
        """Healthy endpoints a router of the proxy does not list; the down slices a router still lists
        (`self.listed`)."""
        try:
            self.steps.connect_routers()
        except KimictlError as exc:
            self.routers_error = exc.message
            self.say(f"cannot read the proxy's routers: {exc.message}")
            return []
        out = []
        for i, r in enumerate(self.steps.routers):
            try:
                members = r.members()
            except RouterError as exc:
                self.routers_error = exc.message
                continue
            self.listed |= {s.name for s in self.steps.slices.values() if s.name in self.down
                            and any(ep.url in members for ep in s.endpoints)}
            for ep in eps:
                if ep.engine not in sick and ep.url not in members:
                    out.append(Finding(self._slice_of(ep.engine).name, "missing", ep.engine, ep.host,
                                       f"router {i} ({r.url}) does not list {ep.url}"))
        return out

    # --- the plan ------------------------------------------------------------------------------------

    def plan(self, findings: list[Finding]) -> tuple[list[Action], list[str]]:
        """One action per broken slice in plan order, and the escalations (flap damping, a role's only instance,
        unplaceable faults). A slice whose host does not answer is routed out while a router lists it, nothing
        more; a role's only instance that is "returned" (its host came back without it) is brought back."""
        escalations = [f"{f.kind}: {f.detail}" for f in findings if not f.slice]
        recent = self.recent_actions()
        kinds: dict[str, list[str]] = {}
        for f in findings:
            if f.slice and f.kind != "starting":
                kinds.setdefault(f.slice, [])
                if f.kind not in kinds[f.slice]:
                    kinds[f.slice].append(f.kind)
        actions = []
        for name, s in self.steps.slices.items():
            if name in self.listed:
                actions.append(Action(name, s.role, list(s.hosts), list(s.engines), ["unreachable"], ["route-out"]))
            if name not in kinds or name in self.down:
                continue
            restart = any(k in RESTART_KINDS for k in kinds[name])
            steps = ["drain", "restart", "pair-smoke", "readd"] if restart else ["readd"]
            a = Action(name, s.role, list(s.hosts), list(s.engines), kinds[name], steps)
            n = recent.get(name, 0)
            # a slice whose host came back without it serves nothing: starting it cannot make anything worse
            returned = "returned" in kinds[name] and set(kinds[name]) <= {"returned", "dead"}
            if restart and not returned and sum(1 for x in self.steps.slices.values() if x.role == s.role) == 1:
                a.result = "escalated"
                a.error = (f"{name} is the only {s.role} instance: heal would have restarted it "
                           f"({', '.join(kinds[name])}), but never restarts a role's only instance by itself (every "
                           "request fails until it is back): a person decides when (see `kimictl logs --engine "
                           f"{s.engines[0]}`)")
                escalations.append(a.error)
            elif n >= self.opts.max_actions:
                a.result = "escalated"
                a.error = (f"{name}: {n} heal action(s) started within the last {self.opts.window:.0f}s (at most "
                           f"{self.opts.max_actions}): it keeps breaking ({', '.join(kinds[name])}); not acting again")
                escalations.append(a.error)
            actions.append(a)
        return actions, escalations

    def recent_actions(self) -> dict[str, int]:
        """Per slice, the actions started within the window: each "started" event, an action's end event
        counted with its start (same id), and a record without an id (logged before "started" events) alone."""
        now = self.clock()
        seen: dict[str, set[str]] = {}
        for n, ev in enumerate(state.heal_events(self.cluster)):
            if ev.get("event") == "action" and ev.get("slice") and now - float(ev["ts"]) < self.opts.window:
                seen.setdefault(str(ev["slice"]), set()).add(str(ev.get("id") or f"line {n}"))
        return {k: len(v) for k, v in seen.items()}

    # --- acting --------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def lease(self, a: Action) -> Iterator[str | None]:
        """The cluster lease for one action, held while the block runs: yields None when it is ours, else why not
        (another command holds it, or its lock host does not answer): the action is then skipped, saying so."""
        stack = contextlib.ExitStack()
        try:
            got = stack.enter_context(self.hold(f"heal {a.slice}: {', '.join(a.steps)}"))
            busy = None if got.ours else f"{got.holder.text()} holds the cluster lease"
        except KimictlError as exc:   # the lock host does not answer: no lease, no action
            busy = f"the cluster lease cannot be taken ({exc.message})"
        with stack:
            yield busy

    def act(self, actions: list[Action], findings: list[Finding]) -> dict[str, Any] | None:
        """Heal slice after slice; the first failure stops the run (the rest stay planned). Returns the proxy gate
        (requests through the proxy reached every healed endpoint) or None when nothing was re-added."""
        if self.routers_error and any(a.result == "planned" and ("drain" in a.steps or "readd" in a.steps)
                                      for a in actions):
            raise HostError(f"cannot drain or re-add through the proxy: {self.routers_error}", step="routers",
                            host=self.rendered.proxy.host_name if self.rendered.proxy else None,
                            hint="see `kimictl status`: the proxy must answer before heal can act")
        pending = {a.slice for a in actions if a.result == "planned"}
        done: list[Slice] = []
        for a in actions:
            if a.result != "planned":
                continue
            with self.lease(a) as busy:
                if busy:
                    a.result, a.note = "skipped", f"not acting now: {busy}"
                    self.say(f"{a.slice}: {a.note}")
                    continue
                if a.steps == ["route-out"]:
                    self._route_out(a)
                else:
                    self._act_one(a, pending, findings)
            pending.discard(a.slice)
            if "readd" in a.steps:
                done.append(self.steps.slices[a.slice])
        if not done:
            return None
        gate = self.steps.proxy_gate(done, skip=self.down)
        self.say(f"proxy gate: {gate['requests']} request(s) through the proxy reached every healed endpoint")
        return gate

    def _route_out(self, a: Action) -> None:
        """A slice whose host does not answer, out of every router that still lists it (no "started" event: nothing
        restarts, it does not count towards flap damping; the host's "unreachable" event names its slices)."""
        t0 = time.monotonic()
        self.steps.route_out([self.steps.slices[a.slice]])
        a.result, a.seconds["total"] = "routed-out", round(time.monotonic() - t0, 2)
        gone = ", ".join(h for h in a.hosts if h in self.unreachable)
        self.say(f"{a.slice}: routed out of {len(self.steps.routers)} router(s): {gone} does not answer; its "
                 "engines are brought back when it does")

    def _act_one(self, a: Action, pending: set[str], findings: list[Finding]) -> None:
        """One action between its "started" event (written before anything is touched) and its end event."""
        s = self.steps.slices[a.slice]
        why = [f"{f.kind} {f.engine}: {f.detail}" for f in findings if f.slice == a.slice]
        self.say(f"{a.slice}: {'; '.join(why)[:400]}")
        action_id = uuid.uuid4().hex[:16]
        self._event(a, action_id, "started", findings=why, pid=os.getpid())
        t0 = time.monotonic()
        try:
            self._heal_slice(a, s, pending)
        except KimictlError as exc:
            a.result, a.error = "failed", exc.message
            a.seconds["total"] = round(time.monotonic() - t0, 2)
            self._event(a, action_id, a.result, error=a.error, seconds=a.seconds)
            raise
        a.result = "healed"
        a.seconds["total"] = round(time.monotonic() - t0, 2)
        self._event(a, action_id, a.result, seconds=a.seconds)
        self.say(f"{a.slice}: healed in {a.seconds['total']:.1f}s (" + ", ".join(
            f"{k.replace('_', ' ')} {v:.1f}s" for k, v in a.seconds.items() if k != "total") + ")")

    def _heal_slice(self, a: Action, s: Slice, pending: set[str]) -> None:
        t = time.monotonic()
        if "drain" in a.steps:
            # up to the drain timeout, as a rollout drains; requests that make no progress cannot finish
            self.steps.drain([s], stuck=self.opts.hang_deadline)
            a.seconds["drain"] = round(time.monotonic() - t, 2)
        if "restart" in a.steps:
            t = time.monotonic()
            procs = self.steps.restart([s], "current")
            self.ops.wait_ready(procs)
            a.seconds["restart_ready"] = round(time.monotonic() - t, 2)
            t = time.monotonic()
            a.probes = self.steps.pair_gate([s], pending | self.down | {s.name})
            a.seconds["pair_smoke"] = round(time.monotonic() - t, 2)
        if "readd" in a.steps:
            t = time.monotonic()
            self.steps.readd([s])
            a.seconds["readd"] = round(time.monotonic() - t, 2)

    def _event(self, a: Action, action_id: str, result: str, **extra: Any) -> None:
        state.append_heal_event(self.cluster, {
            "event": "action", "id": action_id, "slice": a.slice, "result": result, "reasons": a.reasons,
            "steps": a.steps, "release": self.record.release, "run_dir": str(self.ops.run_dir), **extra})

    # --- one round -----------------------------------------------------------------------------------

    def run(self) -> HealResult:
        """One round. It ends with a result, never on a host: one that does not answer is reported (result
        "unreachable" unless the round failed or escalated) and its slices routed out; a host whose answer cannot be
        read fails this round only (the next one reads again)."""
        t0 = time.monotonic()
        res = HealResult(self.cluster, self.record.release, "healthy", self.opts.dry_run, [], [], [],
                         str(state.heal_events_path(self.cluster)))
        try:
            self._round(res)
        except HostError as exc:
            res.result, res.error = "failed", exc.render()
        finally:
            res.seconds = round(time.monotonic() - t0, 2)
            self.ops.close()
        res.unreachable = dict(self.unreachable)
        if res.unreachable and res.result in ("healthy", "healed", "planned", "deferred"):
            res.result = "unreachable"
        return res

    def _round(self, res: HealResult) -> None:
        res.findings = self.detect()
        res.actions, res.escalations = self.plan(res.findings)
        for f in res.findings:
            if f.kind == "starting":
                self.say(f"{f.engine} on {f.host}: {f.detail}")
        if self.opts.dry_run:
            res.result = "escalated" if res.escalations else "planned" if res.actions else "healthy"
            return
        self._host_events()
        for e in res.escalations:
            state.append_heal_event(self.cluster, {"event": "escalate", "reason": e,
                                                   "release": self.record.release})
        if not any(a.result == "planned" for a in res.actions):
            res.result = "escalated" if res.escalations else "healthy"
            return
        res.run_dir = str(self.ops.run_dir)
        try:
            res.proxy_gate = self.act(res.actions, res.findings)
        except KimictlError as exc:
            res.result, res.error = "failed", exc.render()
            return
        skipped = any(a.result == "skipped" for a in res.actions)   # the lease was another command's
        res.result = "escalated" if res.escalations else "deferred" if skipped else "healed"

    def _host_events(self) -> None:
        """One "host" event when a host stops answering (`result` "unreachable", with why and its slices) and one
        when it answers again ("back"); a host that stays away is reported by every round, logged once."""
        last = {str(ev.get("host")): ev.get("result") for ev in self.events if ev.get("event") == "host"}
        for host in sorted(set(self.unreachable) | set(self.back)):
            mine = [s.name for s in self.steps.slices.values() if host in s.hosts]
            if host in self.unreachable and last.get(host) != "unreachable":
                state.append_heal_event(self.cluster, {"event": "host", "host": host, "result": "unreachable",
                                                       "detail": self.unreachable[host], "slices": mine,
                                                       "release": self.record.release})
                self.say(f"{host} does not answer ({self.unreachable[host]}): its slice(s) {', '.join(mine) or '-'} "
                         "are routed out and left alone until it does")
            elif host in self.back and self.back[host] is None:
                state.append_heal_event(self.cluster, {"event": "host", "host": host, "result": "back",
                                                       "slices": mine, "release": self.record.release})
                self.say(f"{host} answers again: its slice(s) {', '.join(mine) or '-'} come back (what does not run "
                         f"there starts on release {self.record.release})")


def prepare_heal(inventory: Path) -> HealInputs:
    """The inventory, the current release record, its render snapshot and its topology's `heal:` section."""
    from kimictl.inventory import load_inventory
    from kimictl.topology import load_topology

    inv = load_inventory(inventory)
    deployed = current_deployment(inv.cluster.name)
    try:
        topo_heal = load_topology(deployed.topology()).heal
    except InvalidInput:
        topo_heal = None  # the topology file moved away: heal.yml's defaults (the render snapshot is enough)
    return HealInputs(inv, deployed.record, deployed.rendered, topo_heal)
