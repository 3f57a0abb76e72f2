"""The steps a change to a running P/D cluster takes per slice, shared by `kimictl rollout` and `kimictl heal`:
drain the slice from every router (and wait for its in-flight requests), restart it, pair-smoke it against live
partners, re-add it (at runtime, by holding one router copy at a time behind kimictl's front, or by restarting the
proxy's routers) and gate it with traffic through the proxy.

`SliceSteps` holds what they need (host operations, HTTP, the routers' clients); each is injectable, so the state
machines that use it (`kimictl.rollout.run.Rollout`, `kimictl.heal.Healer`) are unit-tested with fakes. Its user
says which processes a slice runs on a release (`procs`)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kimictl import health
from kimictl.cluster_secrets import engine_api_key
from kimictl.errors import HostError, InvalidInput
from kimictl.facts import engine_profile
from kimictl.hostops import HostOps, Proc
from kimictl.inventory import Inventory
from kimictl.render import Rendered
from kimictl.router_kinds import router_kind
from kimictl.routers import AscendProxyAdmin, FrontControl, RouterAdmin, RouterError, front_admin_key
from kimictl.slices.model import Endpoint, Slice, slices_of
from kimictl.slices.probes import drain_sampler, pair_probe, wait_drained

# The processes a slice runs on a release: "new" or "old" (a rollout), "current" (a heal).
Procs = Callable[[Slice, str], list[Proc]]


@dataclass
class StepOptions:
    """How long a drain may take and how quiet a drained slice must be; routers besides kimictl's own proxy."""

    drain_timeout: float = 300.0
    drain_quiet: float = 5.0
    routers: list[str] = field(default_factory=list)


class SliceSteps:
    """Drain, restart, pair-smoke, re-add and proxy-gate slices of a deployed P/D cluster. `old` is the render the
    running proxy was deployed from (its routers and front), `new` the one the slices run after their restart (the
    same render for a heal); `procs` says which processes a slice runs on a release; `owner` names its holds of a
    router copy behind kimictl's front (its release frees only its own hold)."""

    def __init__(self, inv: Inventory, old: Rendered, new: Rendered, ops: HostOps, opts: StepOptions,
                 say: Callable[[str], None], *, procs: Procs, http: Any = health,
                 router: Callable[..., RouterAdmin] = RouterAdmin,
                 instances: Callable[..., AscendProxyAdmin] = AscendProxyAdmin,
                 front: Callable[..., FrontControl] = FrontControl, owner: str | None = None):
        self.inv, self.cluster, self.say = inv, new.plan.cluster, say
        # who holds a router copy behind the front (its release frees only this owner's hold)
        self.owner = owner or f"kimictl:{os.getpid()}"
        self.served_model_name = new.plan.served_model_name
        self.old, self.new, self.ops, self.opts, self.procs = old, new, ops, opts, procs
        self.api_key = self.ops.api_key
        self.http, self.make_router, self.make_instances, self.make_front = http, router, instances, front
        self.engine_key = engine_api_key(inv, pd=True)  # what the engines require (None: no key)
        self.front_ctl: FrontControl | None = None  # the front's hold/release, for a router that re-adds only idle
        metrics = engine_profile(inv.cluster.kimi_engine_profile).metrics
        self.drain_sample = drain_sampler(metrics.busy, metrics.activity, http, running=metrics.running)
        self.slices = slices_of(new)
        self.proxy_restarts: list[dict[str, Any]] = []
        self.routers: list[RouterAdmin] = []
        self.own_routers = 0  # the first ones in self.routers: the copies behind kimictl's proxy front
        self.runtime = True
        self.proxy_proc: Proc | None = None  # the running proxy (its user finds it)
        self.touched_done: list[Slice] = []  # slices this run drained (the rollback set), in order
        self.stage: dict[str, str] = {}  # slice -> drained | restarted

    def connect_routers(self) -> None:
        """The routers of kimictl's proxy (and --router extras), and whether all of them add workers at runtime."""
        self.routers = self.own_routers_of(self.old)
        self.own_routers = len(self.routers)
        own = [r.url for r in self.routers]
        self.routers += [self.make_router(u, http=self.http) for u in dict.fromkeys(self.opts.routers) if u not in own]
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

    def own_routers_of(self, rendered: Rendered) -> list[RouterAdmin]:
        """The proxy kimictl deployed: behind its front each router copy has its own membership, reached through
        the front with the admin key (a release made before the admin key: with the client key)."""
        assert rendered.proxy is not None and rendered.plan.proxy is not None
        base = f"http://{rendered.proxy.host}:{rendered.proxy.port}"
        own = [f"{base}/kimictl/router/{i}" for i in range(len(rendered.proxy.routers))] or [base]
        key = (front_admin_key(self.inv, rendered.plan.proxy.host, rendered.proxy.host, rendered.proxy.port,
                               http=self.http) if rendered.plan.proxy.admin_key
               else self.api_key)
        if router_kind(rendered.plan.proxy.router).membership == "instances":
            self.front_ctl = self.make_front(base, api_key=key, http=self.http)
            return [self.make_instances(u, api_key=key, http=self.http) for u in own]
        return [self.make_router(u, api_key=key, http=self.http) for u in own]

    def reconnect_own_routers(self) -> None:
        """After a restart of the proxy on the new render: its routers replace the old ones (extras stay)."""
        own = self.own_routers_of(self.new)
        self.routers[:self.own_routers], self.own_routers = own, len(own)

    def drain(self, slices: list[Slice], timeout: float | None = None, stuck: float | None = None) -> dict[str, Any]:
        """Out of every router, then wait for in-flight requests (`timeout`: at most this long instead of the
        options' drain timeout; `stuck`: an engine whose requests made no progress for this long is not waited
        for, e.g. a hung slice that cannot finish them)."""
        timeout = self.opts.drain_timeout if timeout is None else timeout
        self.touched_done += [s for s in slices if s not in self.touched_done]
        eps = [ep for s in slices for ep in s.endpoints]
        for attempt in range(3):
            self.route_out(slices)
            self.say(f"drained {', '.join(s.name for s in slices)} from {len(self.routers)} router(s); waiting for "
                     "in-flight requests")
            got = wait_drained(eps, timeout=timeout, quiet=min(self.opts.drain_quiet, timeout),
                               sample=self.drain_sample, stuck=stuck)
            # A router restarted meanwhile (by its supervisor) comes back with every worker: drain again.
            back = [ep.engine for r in self.routers for ep in eps if ep.url in r.members()]
            if not back:
                if got["timed_out"]:
                    self.say(f"drain timeout ({timeout:.0f}s): {', '.join(got['timed_out'])} still "
                             "busy; their in-flight requests are cut")
                if got.get("stuck"):
                    self.say(f"{', '.join(got['stuck'])}: requests running, no progress for {stuck:.0f}s; they "
                             "cannot finish and are cut")
                return got
            self.say(f"a router lists {', '.join(back)} again (did it restart?); draining again ({attempt + 1}/3)")
        raise HostError(f"cannot keep {', '.join(s.name for s in slices)} out of the routers", step="drain",
                        host=slices[0].hosts[0])

    def route_out(self, slices: list[Slice]) -> None:
        """Out of every router that lists them, without waiting for anything (a heal routes the slices of a host
        that does not answer out this way: nothing in flight there can finish)."""
        eps = [ep for s in slices for ep in s.endpoints]
        for r in self.routers:
            members = r.members()
            for ep in eps:
                if ep.url in members:
                    r.remove(ep.url, ep.role)
        for s in slices:
            self.stage[s.name] = "drained"

    def restart(self, slices: list[Slice], release: str) -> list[Proc]:
        stops: dict[str, list[str]] = {}
        starts: dict[str, list[dict[str, Any]]] = {}
        procs: list[Proc] = []
        for s in slices:
            for p in self.procs(s, release):
                stops.setdefault(p.host, []).append(p.id)
                starts.setdefault(p.host, []).append(p.start_action())
                procs.append(p)
        self.ops.apply_actions(stops, starts, f"restart on the {release} release")
        return procs

    def _live_partners(self, role: str, exclude: set[str]) -> list[Endpoint]:
        other = "decode" if role == "prefill" else "prefill"
        return [ep for s in self.slices.values() if s.role == other and s.name not in exclude for ep in s.endpoints]

    def pair_gate(self, slices: list[Slice], exclude: set[str]) -> list[dict[str, Any]]:
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

    def readd(self, slices: list[Slice]) -> None:
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
            self.restart_proxy(self.proxy_proc, why)
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
        self.front_ctl.hold(index, seconds=self.opts.drain_timeout + 120, owner=self.owner)
        try:
            r.readd([(ep.url, ep.role) for ep in eps], timeout=self.opts.drain_timeout,
                    check_interval=kind.check_interval)
        finally:
            self.front_ctl.release(index, owner=self.owner)  # only this run's hold: another's (a rollout's) stays
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

    def restart_proxy(self, proc: Proc, why: str) -> None:
        t0 = time.monotonic()
        self.ops.apply_actions({proc.host: ["proxy"]}, {proc.host: [proc.start_action()]}, f"proxy restart ({why})")
        self.ops.wait_ready([proc])
        self.proxy_proc = proc
        self.proxy_restarts.append({"why": why, "seconds": round(time.monotonic() - t0, 2), "kind": "proxy"})

    def proxy_gate(self, slices: list[Slice], attempts_per_endpoint: int = 8, timeout: float = 120.0,
                   skip: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
        """Requests through the deployed proxy until every endpoint of the batch served its side of a P/D hand-over
        (counters moved) and the other side's counters moved too; every request must succeed. They go in waves of
        as many at once as the role has endpoints, per router copy (the front spreads connections over the copies):
        a round-robin router spreads any sequence, but one that picks the least loaded engine, first by order of
        joining (vllm-ascend's proxy), sends one request at a time to the same idle engine, and a re-added engine
        joined last. The slices named in `skip` (routed out, their host does not answer) are not read."""
        from concurrent.futures import ThreadPoolExecutor

        assert self.new.proxy is not None
        url = f"http://{self.new.proxy.host}:{self.new.proxy.port}/v1/completions"
        eps = [ep for s in slices for ep in s.endpoints]
        counter = {"prefill": health.PREFILL_COUNTER, "decode": health.DECODE_COUNTER}
        others = [ep for s in self.slices.values() if s.name not in skip for ep in s.endpoints
                  if ep.role != eps[0].role]

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

