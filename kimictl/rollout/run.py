"""The rollout run: check the cluster runs its recorded release, then per batch drain the slices from every router,
restart them on the new release, gate them (readiness, pair smoke, traffic through the proxy), switch `current`
and re-add them; on a failed gate roll the touched slices back in reverse order and leave `current` alone.

`Rollout` composes the host operations (`kimictl.hostops.HostOps`), HTTP (`kimictl.health`) and the router
clients (`RouterAdmin`); each is injectable, so the batch and rollback state machine is unit-tested with fakes."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kimictl import health, state
from kimictl.errors import HostError, InvalidInput, KimictlError
from kimictl.facts import engine_profile
from kimictl.hostops import LIVE_STATES, ROLLBACK_READY_TIMEOUT_S, HostObservation, HostOps, Proc, desired_procs
from kimictl.inventory import Inventory
from kimictl.render import Rendered
from kimictl.rollout.overrides import Setting, apply_sets, effective_topology_yaml, parse_sets
from kimictl.rollout.router import (
    AscendProxyAdmin,
    FrontControl,
    RouterAdmin,
    RouterError,
    drain_sampler,
    pair_probe,
    wait_drained,
)
from kimictl.rollout.slices import Analysis, Batch, Endpoint, Slice, analyze, choose_order, plan_batches, slices_of
from kimictl.router_kinds import router_kind
from kimictl.secret_file import engine_api_key, proxy_admin_key
from kimictl.topology import Topology

ROLLOUT_SCHEMA_VERSION = 1


@dataclass
class RolloutOptions:
    canary: int = 1
    serial: int = 1
    check: bool = False
    drain_timeout: float = 300.0
    drain_quiet: float = 5.0
    ready_timeout: float | None = None
    allow_proxy_restart: bool = False
    routers: list[str] = field(default_factory=list)
    accept_new_host_keys: bool = False


@dataclass
class SliceReport:
    name: str
    role: str
    hosts: list[str]
    engines: list[str]
    batch: int
    canary: bool
    result: str = "pending"  # pending | rolled-out | rolled-back | failed
    seconds: dict[str, float] = field(default_factory=dict)
    probes: list[dict[str, Any]] = field(default_factory=list)
    drain_timed_out: list[str] = field(default_factory=list)


@dataclass
class RolloutResult:
    cluster: str
    result: str  # check | no-changes | rolled-out | rolled-back
    release: str
    previous_release: str
    sets: list[str]
    first_role: str | None
    batches: list[list[str]]
    membership: dict[str, str]
    slices: list[SliceReport]
    notes: list[str]
    run_dir: str | None
    proxy_restarts: list[dict[str, Any]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": ROLLOUT_SCHEMA_VERSION, "cluster": self.cluster, "result": self.result,
                "release": self.release, "previous_release": self.previous_release, "sets": self.sets,
                "first_role": self.first_role, "batches": self.batches, "membership": self.membership,
                "slices": [vars(s) for s in self.slices], "proxy_restarts": self.proxy_restarts,
                "notes": self.notes, "run_dir": self.run_dir, "seconds": self.seconds, "error": self.error}


def deployed_release(cluster: str) -> tuple[state.ReleaseRecord, Rendered]:
    """The current release record and its render snapshot (what the cluster runs, per the control node)."""
    rec = state.current(cluster)
    if rec is None:
        raise InvalidInput(f"no current release of cluster {cluster} is recorded "
                           f"({state.control_dir(cluster) / state.CURRENT}); nothing to roll out from",
                           hint="deploy first: kimictl deploy -i INV --topology T")
    return rec, state.run_snapshot(rec, f"the current release of {cluster},")


def recorded_topology(rec: state.ReleaseRecord, old: Rendered) -> str:
    """The topology the current release was made from: the effective file a rollout wrote, else the source."""
    eff = state.run_topology(rec)
    if eff is not None:
        return str(eff)
    src = old.plan.topology_source
    if src and Path(src).exists():
        return src
    raise InvalidInput(f"the topology of the current release ({src or old.plan.topology}) is not readable here",
                       hint="pass --topology")


class Rollout:
    """One rollout run over a deployed P/D cluster."""

    def __init__(self, inv: Inventory, record: state.ReleaseRecord, old: Rendered, new: Rendered, topo: Topology,
                 sets: list[Setting], opts: RolloutOptions, say: Callable[[str], None],
                 on_event: Callable[[str, str, str], None] | None = None, *, ops: HostOps | None = None,
                 http: Any = health, router: Callable[..., RouterAdmin] = RouterAdmin,
                 instances: Callable[..., AscendProxyAdmin] = AscendProxyAdmin,
                 front: Callable[..., FrontControl] = FrontControl):
        self.release = state.release_id(new.releases)
        self.inv, self.cluster, self.say = inv, new.plan.cluster, say
        self.served_model_name = new.plan.served_model_name
        self.ops = ops or HostOps(inv, self.served_model_name,
                                  state.new_run_dir(self.cluster, f"rollout-{self.release[:8]}"), say=say,
                                  on_event=on_event, accept_new_host_keys=opts.accept_new_host_keys,
                                  ready_timeout=opts.ready_timeout, http=http)
        self.run_dir, self.api_key, self.timings = self.ops.run_dir, self.ops.api_key, self.ops.timings
        self.http, self.make_router, self.make_instances, self.make_front = http, router, instances, front
        self.engine_key = engine_api_key(inv, pd=True)  # what the engines require (None: no key)
        self.front_ctl: FrontControl | None = None  # the front's hold/release, for a router that re-adds only idle
        metrics = engine_profile(inv.cluster.kimi_engine_profile).metrics
        self.drain_sample = drain_sampler(metrics.busy, metrics.activity, http)
        self.record, self.old, self.new, self.topo, self.sets, self.ro = record, old, new, topo, sets, opts
        self.previous = record.release
        self.slices = slices_of(new)
        self.reports: dict[str, SliceReport] = {}
        self.proxy_restarts: list[dict[str, Any]] = []
        self.routers: list[RouterAdmin] = []
        self.own_routers = 0  # the first ones in self.routers: the copies behind kimictl's proxy front
        self.runtime = True
        self.proxy_proc: Proc | None = None
        self.observed: dict[str, HostObservation] = {}
        self.switched: set[str] = set()
        self.touched_done: list[Slice] = []  # slices this run drained (the rollback set), in order
        self.stage: dict[str, str] = {}  # slice -> drained | restarted

    # --- planning (no changes) -------------------------------------------------------------------------

    def _prepare(self) -> tuple[Analysis, str | None, list[Batch], list[str]]:
        if self.new.plan.mode != "pd" or self.new.proxy is None:
            raise InvalidInput(f"topology {self.new.plan.topology} is {self.new.plan.mode}: there is no proxy to "
                               "drain slices through", hint="use `kimictl deploy` to change a colocated cluster")
        a = analyze(self.old, self.new)
        if a.problems:
            raise InvalidInput("this change cannot be rolled out slice by slice", details=a.problems,
                               hint="apply it with `kimictl deploy` (every engine restarts; the proxy fails "
                                    "requests meanwhile)")
        notes: list[str] = []
        first, batches = None, []
        if a.touched:
            first, reasons = choose_order(self.old, self.new, a.touched)
            if first is None:
                raise InvalidInput("the change makes P/D pairs of the old and the new release incompatible; one "
                                   "router would pair them during a rolling change (pair-wise rolling needs an "
                                   "atomic switch of the router's membership, which vllm-router cannot do)",
                                   details=reasons,
                                   hint="apply it with `kimictl deploy` (all engines restart together)")
            batches, notes = plan_batches(a.touched, self.slices, first, self.ro.canary, self.ro.serial)
        if a.proxy_changed and not self.ro.allow_proxy_restart:
            raise InvalidInput("the change alters the proxy's own command (policy or membership), so the router "
                               "must restart: clients get refused connections meanwhile",
                               hint="add --allow-proxy-restart to accept that, or leave the proxy settings alone")
        return a, first, batches, notes

    def _observe_and_check(self) -> None:
        """The cluster must run exactly the recorded release, every endpoint must answer, the routers must too."""
        self.observed = self.ops.observe()
        drift = []
        for proc in desired_procs(self.old, self.inv):
            st = self.observed.get(proc.host, HostObservation({}, None)).states.get(proc.id)
            if st is None or st.get("state") not in LIVE_STATES:
                drift.append(f"{proc.host}:{proc.id} (not running)")
            elif st.get("tag") != proc.tag:
                drift.append(f"{proc.host}:{proc.id} (runs another release)")
            elif proc.id == "proxy":
                self.proxy_proc = Proc(proc.host, "proxy", "proxy", str(st["tag"]), list(st["cmd"]), proc.ip,
                                       proc.port, True, "proxy", proc.router)
        if drift:
            raise HostError(f"the cluster does not run its recorded release {self.previous}: "
                            + ", ".join(drift[:6]), step="check",
                            hint="see `kimictl status`; converge with `kimictl deploy` or `kimictl start` first")
        sick = [ep for s in self.slices.values() for ep in s.endpoints
                if not self.http.engine_ready(ep.ip, ep.port, self.served_model_name, api_key=self.engine_key).ok]
        if sick:
            ep = sick[0]
            raise HostError("the cluster is not healthy before the rollout: " + ", ".join(x.engine for x in sick)
                            + " do not answer", host=ep.host, step="check",
                            log_tail=self.ops.log_tail(ep.host, ep.engine),
                            hint="fix it first (kimictl status)")
        assert self.new.proxy is not None and self.old.proxy is not None
        self.routers = self._own_routers(self.old)
        self.own_routers = len(self.routers)
        own = [r.url for r in self.routers]
        self.routers += [self.make_router(u, http=self.http) for u in dict.fromkeys(self.ro.routers) if u not in own]
        for i, r in enumerate(self.routers):
            try:
                runtime = r.supports_runtime_add()
            except RouterError as exc:
                raise HostError(exc.message, host=self.new.proxy.host_name if i == 0 else None, step="check") from None
            if not runtime and i >= self.own_routers:
                raise InvalidInput(f"router {r.url} cannot add workers at runtime (static P/D mode); kimictl can only "
                                   "restart the proxy it deployed",
                                   hint="run extra routers with --enable-igw, or leave them out of --router")
            self.runtime = self.runtime and runtime

    def _own_routers(self, rendered: Rendered) -> list[RouterAdmin]:
        """The proxy kimictl deployed: behind its front each router copy has its own membership, reached through
        the front with the admin key (a release made before the admin key: with the client key)."""
        assert rendered.proxy is not None and rendered.plan.proxy is not None
        base = f"http://{rendered.proxy.host}:{rendered.proxy.port}"
        own = [f"{base}/kimictl/router/{i}" for i in range(len(rendered.proxy.routers))] or [base]
        key = proxy_admin_key(self.cluster) if rendered.plan.proxy.admin_key else self.api_key
        if router_kind(rendered.plan.proxy.router).membership == "instances":
            self.front_ctl = self.make_front(base, api_key=key, http=self.http)
            return [self.make_instances(u, api_key=key, http=self.http) for u in own]
        return [self.make_router(u, api_key=key, http=self.http) for u in own]

    def _membership(self) -> dict[str, str]:
        return {r.url: "instances" if r.membership == "instances" else "runtime" if r.supports_runtime_add()
                else "reload" if i < self.own_routers and self.front else "restart"
                for i, r in enumerate(self.routers)}

    # --- the run ---------------------------------------------------------------------------------------

    def run(self) -> RolloutResult:
        t_all = time.monotonic()
        a, first, batches, notes = self._prepare()
        self._observe_and_check()
        if a.touched and not self.runtime and self.front:
            notes.append("the proxy's routers (vllm-router, static P/D mode) drop workers at runtime but cannot add "
                         "them back: each batch ends with a restart of the router copies one at a time behind the "
                         "proxy port (clients are not refused)")
        elif a.touched and not self.runtime:
            notes.append(f"the proxy {self.routers[0].url} runs vllm-router in static P/D mode: it drops workers at "
                         "runtime but cannot add them back, so each batch ends with a graceful restart of the proxy "
                         "(in-flight requests finish; new connections are refused for a moment)")
            if not self.ro.allow_proxy_restart and not self.ro.check:
                raise InvalidInput("the deployed proxy cannot re-add a slice without restarting; a restart refuses "
                                   "client connections for a moment", details=notes[-1:],
                                   hint="add --allow-proxy-restart to accept that, or run the proxy with runtime "
                                        "membership (see docs/operate.md, kimictl rollout)")
        for i, b in enumerate(batches):
            for s in b.slices:
                self.reports[s.name] = SliceReport(s.name, s.role, list(s.hosts), list(s.engines), i, b.canary)
        result = RolloutResult(self.cluster, "check", self.release, self.previous, [s.raw for s in self.sets], first,
                               [b.names for b in batches], self._membership(), list(self.reports.values()), notes,
                               None)
        for n in notes:
            self.say(f"note: {n}")
        if self.ro.check:
            return result
        if not a.touched and not a.changed_hosts:
            self.say(f"no changes: every slice already runs release {self.previous}")
            result.result = "no-changes"
            return result
        result.run_dir = str(self.run_dir)
        state.save_run(self.run_dir, self.new, self.new, effective_topology_yaml(self.topo))
        try:
            self._install(sorted(a.changed_hosts))
            for i, b in enumerate(batches):
                self.say(f"batch {i + 1}/{len(batches)}{' (canary)' if b.canary else ''}: {', '.join(b.names)}")
                self._roll_batch(b)
            if a.proxy_changed:
                self._restart_proxy(next(p for p in desired_procs(self.new, self.inv) if p.id == "proxy"),
                                    "proxy change")
                own = self._own_routers(self.new)
                self.routers[:self.own_routers], self.own_routers = own, len(own)
            rest = sorted(set(a.changed_hosts) - self.switched)
            if rest:
                self.ops.switch({h: self.new.releases[h] for h in rest})
            self._check_membership()
            smoke = self._final_smoke()
            self.say(f"final smoke through the proxy: prefill prompt tokens +{smoke['prefill_prompt_tokens']:.0f}, "
                     f"decode external prefix cache +{smoke['decode_external_prefix_cache_queries']:.0f}")
        except (KimictlError, KeyboardInterrupt) as exc:
            failure = exc if isinstance(exc, KimictlError) else HostError("interrupted", step="rollout")
            result.error = failure.message
            self._rollback_all(failure)
            result.result = "rolled-back"
            result.seconds = {**self.timings, "total": round(time.monotonic() - t_all, 2)}
            result.proxy_restarts = self.proxy_restarts
            self._record("rolled-back" if self.touched_done else "failed", result)
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise self._failure(failure) from None
        finally:
            self.ops.close()
        result.result = "rolled-out"
        result.proxy_restarts = self.proxy_restarts
        result.seconds = {**self.timings, "total": round(time.monotonic() - t_all, 2)}
        self._record("deployed", result)
        return result

    def _install(self, hosts: list[str]) -> None:
        """Unpack the new release next to the running one on every host whose files change (nothing restarts)."""
        if not hosts:
            return
        self.say(f"installing release files on {', '.join(hosts)}")
        self.ops.install_release(self.new, hosts)

    # --- one batch -------------------------------------------------------------------------------------

    def _old_proc(self, host: str, pid: str, ep: Endpoint | None, role: str) -> Proc:
        st = self.observed[host].states[pid]
        return Proc(host, pid, "engine", str(st.get("tag") or ""), list(st["cmd"]), ep.ip if ep else "",
                    ep.port if ep else 0, ep is not None, role)

    def _procs(self, s: Slice, release: str) -> list[Proc]:
        if release == "new":
            return [p for p in desired_procs(self.new, self.inv) if p.id in s.engines]
        eps = {ep.engine: ep for ep in s.endpoints}
        hosts = {e.id: e.host for e in self.new.engines}
        return [self._old_proc(hosts[e], e, eps.get(e), s.role) for e in s.engines]

    def _drain(self, slices: list[Slice]) -> dict[str, Any]:
        self.touched_done += [s for s in slices if s not in self.touched_done]
        eps = [ep for s in slices for ep in s.endpoints]
        for attempt in range(3):
            for r in self.routers:
                members = r.members()
                for ep in eps:
                    if ep.url in members:
                        r.remove(ep.url, ep.role)
            for s in slices:
                self.stage[s.name] = "drained"
            self.say(f"drained {', '.join(s.name for s in slices)} from {len(self.routers)} router(s); waiting for "
                     "in-flight requests")
            got = wait_drained(eps, timeout=self.ro.drain_timeout, quiet=self.ro.drain_quiet, sample=self.drain_sample)
            # A router restarted meanwhile (by its supervisor) comes back with every worker: drain again.
            back = [ep.engine for r in self.routers for ep in eps if ep.url in r.members()]
            if not back:
                if got["timed_out"]:
                    self.say(f"drain timeout ({self.ro.drain_timeout:.0f}s): {', '.join(got['timed_out'])} still "
                             "busy; their in-flight requests are cut")
                return got
            self.say(f"a router lists {', '.join(back)} again (did it restart?); draining again ({attempt + 1}/3)")
        raise HostError(f"cannot keep {', '.join(s.name for s in slices)} out of the routers", step="drain",
                        host=slices[0].hosts[0])

    def _restart(self, slices: list[Slice], release: str) -> list[Proc]:
        stops: dict[str, list[str]] = {}
        starts: dict[str, list[dict[str, Any]]] = {}
        procs: list[Proc] = []
        for s in slices:
            for p in self._procs(s, release):
                stops.setdefault(p.host, []).append(p.id)
                starts.setdefault(p.host, []).append(p.start_action())
                procs.append(p)
        self.ops.apply_actions(stops, starts, f"restart on the {release} release")
        return procs

    def _live_partners(self, role: str, exclude: set[str]) -> list[Endpoint]:
        other = "decode" if role == "prefill" else "prefill"
        return [ep for s in self.slices.values() if s.role == other and s.name not in exclude for ep in s.endpoints]

    def _pair_gate(self, slices: list[Slice], exclude: set[str]) -> list[dict[str, Any]]:
        results = []
        for s in slices:
            partners = self._live_partners(s.role, exclude)
            if not partners:
                raise HostError(f"no live {('decode' if s.role == 'prefill' else 'prefill')} endpoint to pair "
                                f"{s.name} with", host=s.hosts[0], step="smoke")
            for i, ep in enumerate(s.endpoints):
                # A second partner tells a broken slice from a partner that just failed.
                tries = []
                for k in range(min(2, len(partners))):
                    other = partners[(i + k) % len(partners)]
                    p, d = (ep, other) if s.role == "prefill" else (other, ep)
                    tries.append(pair_probe(p, d, self.served_model_name, http=self.http, api_key=self.engine_key))
                    if tries[-1]["ok"]:
                        break
                results.append(tries[-1])
                if not tries[-1]["ok"]:
                    raise HostError(f"pair smoke of {ep.engine} failed: "
                                    + "; ".join(f"{t['prefill']} -> {t['decode']}: {t['detail']}" for t in tries),
                                    host=ep.host, step=f"smoke {ep.engine}",
                                    log_tail=self.ops.log_tail(ep.host, ep.engine))
        return results

    def _readd(self, slices: list[Slice]) -> None:
        """Back into every router: at runtime where the router can add workers, else by restarting the proxy
        kimictl deployed (its rendered membership lists every endpoint)."""
        eps = [ep for s in slices for ep in s.endpoints]
        for i, r in enumerate(self.routers):
            if r.membership == "instances":
                self._readd_held(i, r, eps)
            elif r.supports_runtime_add():
                for ep in eps:
                    r.add(ep.url, ep.role)
        if self.runtime:
            return
        assert self.proxy_proc is not None
        why = "re-add " + ", ".join(s.name for s in slices)
        if self.front:
            self._reload_proxy(why)
        else:
            self._restart_proxy(self.proxy_proc, why)
        for r in self.routers[:self.own_routers]:
            missing = [ep.url for ep in eps if ep.url not in r.members()]
            if missing:
                raise HostError(f"router {r.url} came back without {', '.join(missing)}", host=self.proxy_proc.host,
                                step="proxy", log_tail=self.ops.log_tail(self.proxy_proc.host, "proxy"))

    def _readd_held(self, index: int, r: AscendProxyAdmin, eps: list[Endpoint]) -> None:
        """vllm-ascend's proxy re-adds an engine it drained only once it is idle: the front holds copy `index` (its
        clients' next requests go to the other copies), the copy finishes what it serves, takes the engines back,
        and is released - no restart, no refused connection."""
        assert self.front_ctl is not None and self.old.plan.proxy is not None
        kind = router_kind(self.old.plan.proxy.router)
        t0 = time.monotonic()
        self.front_ctl.hold(index, seconds=self.ro.drain_timeout + 120)
        try:
            r.readd([(ep.url, ep.role) for ep in eps], timeout=self.ro.drain_timeout,
                    check_interval=kind.check_interval)
        finally:
            self.front_ctl.release(index)
        self.proxy_restarts.append({"why": f"re-add {', '.join(ep.engine for ep in eps)} to router {index}",
                                    "seconds": round(time.monotonic() - t0, 2), "kind": "held"})

    @property
    def front(self) -> bool:
        """The deployed proxy is kimictl's front with router copies behind it (older releases ran one router)."""
        return bool(self.old.proxy and self.old.proxy.routers)

    def _reload_proxy(self, why: str) -> None:
        assert self.proxy_proc is not None
        t0 = time.monotonic()
        self.say(f"restarting the proxy's routers one at a time ({why})")
        self.ops.reload_proxy(self.proxy_proc.host)
        self.proxy_restarts.append({"why": why, "seconds": round(time.monotonic() - t0, 2), "kind": "routers"})

    def _restart_proxy(self, proc: Proc, why: str) -> None:
        t0 = time.monotonic()
        self.ops.apply_actions({proc.host: ["proxy"]}, {proc.host: [proc.start_action()]}, f"proxy restart ({why})")
        self.ops.wait_ready([proc])
        self.proxy_proc = proc
        self.proxy_restarts.append({"why": why, "seconds": round(time.monotonic() - t0, 2), "kind": "proxy"})

    def _proxy_gate(self, slices: list[Slice], attempts_per_endpoint: int = 8, timeout: float = 120.0,
                    ) -> dict[str, Any]:
        """Requests through the deployed proxy until every endpoint of the batch served its side of a P/D hand-over
        (counters moved) and the other side's counters moved too; every request must succeed. They go in waves of
        as many at once as the role has endpoints, per router copy (the front spreads connections over the copies):
        a round-robin router spreads any sequence, but one that picks the least loaded engine, first by order of
        joining (vllm-ascend's proxy), sends one request at a time to the same idle engine, and a re-added engine
        joined last."""
        from concurrent.futures import ThreadPoolExecutor

        assert self.new.proxy is not None
        url = f"http://{self.new.proxy.host}:{self.new.proxy.port}/v1/completions"
        eps = [ep for s in slices for ep in s.endpoints]
        counter = {"prefill": health.PREFILL_COUNTER, "decode": health.DECODE_COUNTER}
        others = [ep for s in self.slices.values() for ep in s.endpoints if ep.role != eps[0].role]

        def total(ep: Endpoint) -> float:
            return self.http.metric_totals(ep.ip, ep.port).get(counter[ep.role], 0.0)

        def probe(_: int) -> tuple[int, Any]:
            # A fresh prefix per request, so cache- or prefix-aware policies spread them like round robin does;
            # a few tokens, so the requests of a wave overlap.
            prompt = f"rollout probe {uuid.uuid4().hex}: {health.smoke_prompt(64)}"
            return self.http.http_post_json(url, {"model": self.served_model_name, "prompt": prompt,
                                                  "max_tokens": 8}, timeout=60, api_key=self.api_key)

        before = {ep.engine: total(ep) for ep in eps}
        other_before = sum(total(ep) for ep in others)
        n_role = sum(len(s.endpoints) for s in self.slices.values() if s.role == eps[0].role)
        wave = n_role * max(1, len(self.new.proxy.routers))
        sent = 0
        waiting = set(before)
        deadline = time.monotonic() + timeout
        with ThreadPoolExecutor(max_workers=wave) as pool:
            for _ in range(attempts_per_endpoint):
                answers = list(pool.map(probe, range(wave)))
                sent += len(answers)
                bad = next(((code, body) for code, body in answers if code != 200), None)
                if bad:
                    raise HostError(f"a request through the proxy failed after re-adding "
                                    f"{', '.join(s.name for s in slices)}: HTTP {bad[0]}: {health.body_text(bad[1])}",
                                    host=self.new.proxy.host_name, step="proxy smoke",
                                    log_tail=self.ops.log_tail(self.new.proxy.host_name, "proxy"))
                waiting = {e for e in waiting if total(next(x for x in eps if x.engine == e)) <= before[e]}
                if not waiting or time.monotonic() > deadline:
                    break
        moved_other = sum(total(ep) for ep in others) - other_before
        if waiting or moved_other <= 0:
            ep = next(x for x in eps if x.engine in waiting) if waiting else eps[0]
            raise HostError(f"{len(waiting)} endpoint(s) of {', '.join(s.name for s in slices)} got no P/D traffic "
                            f"through the proxy in {sent} requests ({', '.join(sorted(waiting)) or 'other side idle'})",
                            host=ep.host, step="proxy smoke", log_tail=self.ops.log_tail(ep.host, ep.engine))
        return {"requests": sent, "ok": True}

    def _roll_batch(self, b: Batch) -> None:
        names = set(b.names)
        t0 = time.monotonic()
        drained = self._drain(b.slices)
        t1 = time.monotonic()
        for s in b.slices:
            self.reports[s.name].drain_timed_out = [e for e in drained["timed_out"] if e in s.engines]
            self.reports[s.name].result = "failed"
            self.stage[s.name] = "restarted"
        procs = self._restart(b.slices, "new")
        self.ops.wait_ready(procs)
        t2 = time.monotonic()
        probes = self._pair_gate(b.slices, names)
        t3 = time.monotonic()
        self.ops.switch({h: self.new.releases[h] for s in b.slices for h in s.hosts})
        self.switched |= {h for s in b.slices for h in s.hosts}
        t4 = time.monotonic()
        self._readd(b.slices)
        t5 = time.monotonic()
        gate = self._proxy_gate(b.slices)
        t6 = time.monotonic()
        secs = {"drain": t1 - t0, "restart_ready": t2 - t1, "pair_smoke": t3 - t2, "switch_current": t4 - t3,
                "readd": t5 - t4, "proxy_smoke": t6 - t5, "total": t6 - t0}
        for s in b.slices:
            r = self.reports[s.name]
            r.result = "rolled-out"
            r.probes = [p for p in probes if p["prefill"] in s.engines or p["decode"] in s.engines]
            r.seconds = {k: round(v, 2) for k, v in secs.items()}
        self.say(f"{', '.join(b.names)}: rolled out in {secs['total']:.1f}s (" + ", ".join(
            f"{k.replace('_', ' ')} {v:.1f}s" for k, v in secs.items() if k != "total")
                 + f"; {len(probes)} pair probe(s), {gate['requests']} proxy request(s))")

    # --- failure: back to the last good release ---------------------------------------------------------

    def _rollback_all(self, exc: KimictlError) -> None:
        touched = list(dict.fromkeys(self.touched_done))
        self.say(f"gate failed ({exc.message.splitlines()[0][:200]}); rolling back "
                 f"{', '.join(s.name for s in touched) or 'nothing (no slice was changed)'}")
        self.ops.ready_timeout = ROLLBACK_READY_TIMEOUT_S
        for s in reversed(touched):
            try:
                self._rollback_slice(s)
                self.reports[s.name].result = "rolled-back"
            except KimictlError as again:
                self.say(f"rollback of {s.name} incomplete: {again.message}")
                self.reports[s.name].result = "failed"
        back = {h: r for h, r in self.old.releases.items() if h in self.switched}
        if back:
            try:
                self.ops.switch(back)
            except KimictlError as again:
                self.say(f"could not point current back on {', '.join(back)}: {again.message}")

    def _rollback_slice(self, s: Slice) -> None:
        if self.stage.get(s.name) == "restarted":
            if any(ep.url in r.members() for r in self.routers for ep in s.endpoints):
                self._drain([s])
            procs = self._restart([s], "old")
            self.ops.wait_ready(procs)
            self._pair_gate([s], {s.name})
        if not all(ep.url in r.members() for r in self.routers for ep in s.endpoints):
            self._readd([s])
        self.stage.pop(s.name, None)
        self.say(f"{s.name}: back on release {self.previous}")

    def _failure(self, exc: KimictlError) -> HostError:
        rolled = [r.name for r in self.reports.values() if r.result == "rolled-back"]
        failed = [r.name for r in self.reports.values() if r.result == "failed"]
        msg = (f"rollout to release {self.release} failed: {exc.message.splitlines()[0]}; "
               + (f"rolled back {', '.join(rolled)} to release {self.previous}" if rolled else "nothing was changed"))
        details = [*exc.details]
        if failed:
            details.append(f"rollback incomplete for {', '.join(failed)}: see `kimictl status`")
        return HostError(msg, host=getattr(exc, "host", None), step=getattr(exc, "step", None),
                         log_tail=getattr(exc, "log_tail", None), details=details, hint=exc.hint)

    def _check_membership(self) -> None:
        """Every endpoint of the plan is back in every router (a missed re-add would silently lose capacity)."""
        want = {ep.url: ep for s in self.slices.values() for ep in s.endpoints}
        for r in self.routers:
            missing = sorted(set(want) - set(r.members()))
            if missing:
                ep = want[missing[0]]
                raise HostError(f"router {r.url} lacks {len(missing)} endpoint(s) after the rollout: "
                                + ", ".join(missing), host=ep.host, step="membership")

    def _final_smoke(self) -> dict[str, Any]:
        assert self.new.proxy is not None
        eps = [ep for s in self.slices.values() for ep in s.endpoints]
        before = {ep.engine: self.http.metric_totals(ep.ip, ep.port) for ep in eps}
        code, body = self.http.http_post_json(f"http://{self.new.proxy.host}:{self.new.proxy.port}/v1/completions",
                                              {"model": self.served_model_name, "prompt": health.smoke_prompt(),
                                               "max_tokens": 8}, timeout=60, api_key=self.api_key)
        after = {ep.engine: self.http.metric_totals(ep.ip, ep.port) for ep in eps}

        def moved(role: str, metric: str) -> float:
            return sum(after[e.engine].get(metric, 0) - before[e.engine].get(metric, 0) for e in eps if e.role == role)

        p, d = moved("prefill", health.PREFILL_COUNTER), moved("decode", health.DECODE_COUNTER)
        if code != 200 or p <= 0 or d <= 0:
            raise HostError(f"final smoke through the proxy failed: HTTP {code}, prefill +{p:.0f}, decode +{d:.0f}: "
                            f"{health.body_text(body)}", host=self.new.proxy.host_name, step="smoke")
        return {"prefill_prompt_tokens": p, "decode_external_prefix_cache_queries": d}

    # --- the release record ----------------------------------------------------------------------------

    def _record(self, result: str, res: RolloutResult) -> None:
        ok = result == "deployed"
        state.record_release(self.cluster, state.ReleaseRecord.now(
            release=self.release if ok else self.previous, cluster=self.cluster, topology=self.new.plan.topology,
            hosts=self.new.releases if ok else self.old.releases, result=result,
            run_dir=str(self.run_dir) if ok else self.record.run_dir, kind="rollout",
            attempted_release=self.release, previous_release=self.previous, rollout_run_dir=str(self.run_dir),
            sets=[s.raw for s in self.sets], error=res.error,
            changes=[{"slice": r.name, "hosts": r.hosts, "engines": r.engines, "result": r.result}
                     for r in self.reports.values()]))


def prepare_rollout(inventory: Path, topology: str | None, set_items: list[str]) -> tuple[
        Inventory, state.ReleaseRecord, Rendered, Rendered, Topology, list[Setting]]:
    """Validate everything exactly like deploy (plan + render of the new inputs) before any host is touched."""
    from kimictl.inventory import load_inventory
    from kimictl.pipeline import prepare
    from kimictl.plan import make_plan
    from kimictl.render import render

    if topology:
        p = prepare(inventory, topology)
        sets = parse_sets(set_items, p.topology)  # bad --set: exit 2 before the recorded state is read
        record, old = deployed_release(p.inventory.cluster.name)
    else:
        record, old = deployed_release(load_inventory(inventory).cluster.name)
        p = prepare(inventory, recorded_topology(record, old))
        sets = parse_sets(set_items, p.topology)
    topo, inv = apply_sets(p.topology, p.inventory, sets)
    plan = make_plan(inv, topo) if sets else p.plan
    return inv, record, old, render(plan, inv, topo), topo, sets
