"""The rollout run: check the cluster runs its recorded release, then per batch drain the slices from every router,
restart them on the new release, gate them (readiness, pair smoke, traffic through the proxy), switch `current`
and re-add them; on a failed gate roll the touched slices back in reverse order and leave `current` alone.

`Rollout` takes its steps (drain, restart, pair smoke, re-add, proxy gate) from `kimictl.slices.steps.SliceSteps`,
shared with `kimictl heal`, over the host operations (`kimictl.hostops.HostOps`), HTTP (`kimictl.health`) and the
router clients (`kimictl.routers`); each is injectable, so the batch and rollback state machine is unit-tested with
fakes."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kimictl import health, state
from kimictl.deployed import current_deployment
from kimictl.errors import HostError, InvalidInput, KimictlError
from kimictl.hostops import LIVE_STATES, ROLLBACK_READY_TIMEOUT_S, HostObservation, HostOps, Proc, desired_procs
from kimictl.inventory import Inventory
from kimictl.render import Rendered
from kimictl.rollout.changes import Analysis, Batch, analyze, choose_order, plan_batches
from kimictl.rollout.overrides import Setting, apply_sets, effective_topology_yaml, parse_sets
from kimictl.routers import AscendProxyAdmin, FrontControl, RouterAdmin
from kimictl.rundir import save_run
from kimictl.slices.model import Endpoint, Slice
from kimictl.slices.steps import SliceSteps, StepOptions
from kimictl.topology import Topology

ROLLOUT_SCHEMA_VERSION = 1


@dataclass
class RolloutOptions(StepOptions):
    canary: int = 1
    serial: int = 1
    check: bool = False
    ready_timeout: float | None = None
    allow_proxy_restart: bool = False
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


@dataclass(frozen=True)
class RolloutInputs:
    """What a rollout starts from, validated before any host is touched (`prepare_rollout`): the inventory, the
    current release record and its render (`old`), the render of the change (`new`), the topology it was made from
    and the --set values in it."""

    inventory: Inventory
    record: state.ReleaseRecord
    old: Rendered
    new: Rendered
    topology: Topology
    sets: list[Setting]


class Rollout:
    """One rollout run over a deployed P/D cluster."""

    def __init__(self, inputs: RolloutInputs, opts: RolloutOptions, say: Callable[[str], None],
                 on_event: Callable[[str, str, str], None] | None = None, *, ops: HostOps | None = None,
                 http: Any = health, router: Callable[..., RouterAdmin] = RouterAdmin,
                 instances: Callable[..., AscendProxyAdmin] = AscendProxyAdmin,
                 front: Callable[..., FrontControl] = FrontControl):
        inv, new = inputs.inventory, inputs.new
        self.release = state.release_id(new.releases)
        self.ops = ops or HostOps(inv, new.plan.served_model_name,
                                  state.new_run_dir(new.plan.cluster, f"rollout-{self.release[:8]}"), say=say,
                                  on_event=on_event, accept_new_host_keys=opts.accept_new_host_keys,
                                  ready_timeout=opts.ready_timeout, http=http)
        self.inv, self.old, self.new, self.opts, self.say, self.http = inv, inputs.old, new, opts, say, http
        self.cluster, self.served_model_name = new.plan.cluster, new.plan.served_model_name
        self.record, self.topo, self.sets = inputs.record, inputs.topology, inputs.sets
        self.previous = inputs.record.release
        self.observed: dict[str, HostObservation] = {}
        self.reports: dict[str, SliceReport] = {}
        self.switched: set[str] = set()
        self.steps = SliceSteps(inv, inputs.old, new, self.ops, opts, say, procs=self._procs, http=http,
                                router=router, instances=instances, front=front, owner=f"rollout:{os.getpid()}")

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
            batches, notes = plan_batches(a.touched, self.steps.slices, first, self.opts.canary, self.opts.serial)
        if a.proxy_changed and not self.opts.allow_proxy_restart:
            raise InvalidInput("the change alters the proxy's own command (policy or membership), so the router "
                               "must restart: clients get refused connections meanwhile",
                               hint="add --allow-proxy-restart to accept that, or leave the proxy settings alone")
        return a, first, batches, notes

    def check_inputs(self) -> None:
        """Refuse a change that cannot be rolled out before any host is contacted (the cluster lease included)."""
        self._prepare()

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
            elif proc.id == "proxy":   # runs the recorded release's files (same tag): its command is ours
                self.steps.proxy_proc = proc
        if drift:
            raise HostError(f"the cluster does not run its recorded release {self.previous}: "
                            + ", ".join(drift[:6]), step="check",
                            hint="see `kimictl status`; converge with `kimictl deploy` or `kimictl start` first")
        key = self.steps.engine_key
        sick = [ep for s in self.steps.slices.values() for ep in s.endpoints
                if not self.http.engine_ready(ep.ip, ep.port, self.served_model_name, api_key=key).ok]
        if sick:
            ep = sick[0]
            raise HostError("the cluster is not healthy before the rollout: " + ", ".join(x.engine for x in sick)
                            + " do not answer", host=ep.host, step="check",
                            log_tail=self.ops.log_tail(ep.host, ep.engine),
                            hint="fix it first (kimictl status)")
        assert self.new.proxy is not None and self.old.proxy is not None
        self.steps.connect_routers()

    def _membership(self) -> dict[str, str]:
        return {r.url: "instances" if r.membership == "instances" else "runtime" if r.supports_runtime_add()
                else "reload" if i < self.steps.own_routers and self.steps.front else "restart"
                for i, r in enumerate(self.steps.routers)}

    # --- the run ---------------------------------------------------------------------------------------

    def run(self) -> RolloutResult:
        t_all = time.monotonic()
        a, first, batches, notes = self._prepare()
        self._observe_and_check()
        if a.touched and not self.steps.runtime and self.steps.front:
            notes.append("the proxy's routers (vllm-router, static P/D mode) drop workers at runtime but cannot add "
                         "them back: each batch ends with a restart of the router copies one at a time behind the "
                         "proxy port (clients are not refused)")
        elif a.touched and not self.steps.runtime:
            notes.append(f"the proxy {self.steps.routers[0].url} runs vllm-router in static P/D mode: it drops "
                         "workers at runtime but cannot add them back, so each batch ends with a graceful restart of "
                         "the proxy (in-flight requests finish; new connections are refused for a moment)")
            if not self.opts.allow_proxy_restart and not self.opts.check:
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
        if self.opts.check:
            return result
        if not a.touched and not a.changed_hosts:
            self.say(f"no changes: every slice already runs release {self.previous}")
            result.result = "no-changes"
            return result
        result.run_dir = str(self.ops.run_dir)
        save_run(self.ops.run_dir, self.new, self.new, effective_topology_yaml(self.topo))
        try:
            self._install(sorted(a.changed_hosts))
            for i, b in enumerate(batches):
                self.say(f"batch {i + 1}/{len(batches)}{' (canary)' if b.canary else ''}: {', '.join(b.names)}")
                self._roll_batch(b)
            if a.proxy_changed:
                self.steps.restart_proxy(next(p for p in desired_procs(self.new, self.inv) if p.id == "proxy"),
                                    "proxy change")
                self.steps.reconnect_own_routers()
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
            result.seconds = {**self.ops.timings, "total": round(time.monotonic() - t_all, 2)}
            result.proxy_restarts = self.steps.proxy_restarts
            self._record("rolled-back" if self.steps.touched_done else "failed", result)
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise self._failure(failure) from None
        else:
            result.result = "rolled-out"
            result.proxy_restarts = self.steps.proxy_restarts
            result.seconds = {**self.ops.timings, "total": round(time.monotonic() - t_all, 2)}
            self._record("deployed", result)   # its record playbook's connections close below
        finally:
            self.ops.close()
        return result

    def _install(self, hosts: list[str]) -> None:
        """Unpack the new release next to the running one on every host whose files change (nothing restarts)."""
        if not hosts:
            return
        self.say(f"installing release files on {', '.join(hosts)}")
        self.ops.install_release(self.new, hosts)

    # --- one batch -------------------------------------------------------------------------------------

    def _old_proc(self, host: str, pid: str, ep: Endpoint | None, role: str) -> Proc:
        """The process as the recorded release renders it (the check before the run found it running with that
        release's tag): its command is rebuilt here, never taken from what the host reports."""
        proc = next(p for p in desired_procs(self.old, self.inv) if p.host == host and p.id == pid)
        return Proc(host, pid, "engine", proc.tag, proc.cmd, ep.ip if ep else "", ep.port if ep else 0,
                    ep is not None, role)

    def _procs(self, s: Slice, release: str) -> list[Proc]:
        if release == "new":
            return [p for p in desired_procs(self.new, self.inv) if p.id in s.engines]
        eps = {ep.engine: ep for ep in s.endpoints}
        hosts = {e.id: e.host for e in self.new.engines}
        return [self._old_proc(hosts[e], e, eps.get(e), s.role) for e in s.engines]

    def _roll_batch(self, b: Batch) -> None:
        names = set(b.names)
        t0 = time.monotonic()
        drained = self.steps.drain(b.slices)
        t1 = time.monotonic()
        for s in b.slices:
            self.reports[s.name].drain_timed_out = [e for e in drained["timed_out"] if e in s.engines]
            self.reports[s.name].result = "failed"
            self.steps.stage[s.name] = "restarted"
        procs = self.steps.restart(b.slices, "new")
        self.ops.wait_ready(procs)
        t2 = time.monotonic()
        probes = self.steps.pair_gate(b.slices, names)
        t3 = time.monotonic()
        self.ops.switch({h: self.new.releases[h] for s in b.slices for h in s.hosts})
        self.switched |= {h for s in b.slices for h in s.hosts}
        t4 = time.monotonic()
        self.steps.readd(b.slices)
        t5 = time.monotonic()
        gate = self.steps.proxy_gate(b.slices)
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
        touched = list(dict.fromkeys(self.steps.touched_done))
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
        if self.steps.stage.get(s.name) == "restarted":
            if any(ep.url in r.members() for r in self.steps.routers for ep in s.endpoints):
                self.steps.drain([s])
            procs = self.steps.restart([s], "old")
            self.ops.wait_ready(procs)
            self.steps.pair_gate([s], {s.name})
        if not all(ep.url in r.members() for r in self.steps.routers for ep in s.endpoints):
            self.steps.readd([s])
        self.steps.stage.pop(s.name, None)
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
        want = {ep.url: ep for s in self.steps.slices.values() for ep in s.endpoints}
        for r in self.steps.routers:
            missing = sorted(set(want) - set(r.members()))
            if missing:
                ep = want[missing[0]]
                raise HostError(f"router {r.url} lacks {len(missing)} endpoint(s) after the rollout: "
                                + ", ".join(missing), host=ep.host, step="membership")

    def _final_smoke(self) -> dict[str, Any]:
        assert self.new.proxy is not None
        eps = [ep for s in self.steps.slices.values() for ep in s.endpoints]
        before = {ep.engine: self.http.metric_totals(ep.ip, ep.port) for ep in eps}
        code, body = self.http.http_post_json(f"http://{self.new.proxy.host}:{self.new.proxy.port}/v1/completions",
                                              {"model": self.served_model_name, "prompt": health.smoke_prompt(),
                                               "max_tokens": 8}, timeout=60, api_key=self.ops.api_key)
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
        """The release record, here and on the cluster's record hosts (a rolled-back rollout's record is written
        where it can be; its failure is the error reported)."""
        from kimictl.cluster_record import publish

        ok = result == "deployed"
        rec = state.ReleaseRecord.now(
            release=self.release if ok else self.previous, cluster=self.cluster, topology=self.new.plan.topology,
            hosts=self.new.releases if ok else self.old.releases, result=result,
            run_dir=str(self.ops.run_dir) if ok else self.record.run_dir, kind="rollout",
            attempted_release=self.release, previous_release=self.previous, rollout_run_dir=str(self.ops.run_dir),
            sets=[s.raw for s in self.sets], error=res.error,
            changes=[{"slice": r.name, "hosts": r.hosts, "engines": r.engines, "result": r.result}
                     for r in self.reports.values()])
        state.record_release(self.cluster, rec)
        publish(self.ops, self.inv, rec, say=self.say, required=ok)


def prepare_rollout(inventory: Path, topology: str | None, set_items: list[str], *,
                    read_cluster: bool = False, accept_new_keys: bool = False) -> RolloutInputs:
    """Validate everything exactly like deploy (plan + render of the new inputs) before any host is touched.
    `read_cluster`: read the cluster's release record back first (kimictl/cluster_record.py; the CLI does), once the
    input checks that need no host passed."""
    from kimictl.cluster_secrets import check_supplied_keys
    from kimictl.deployed import cached_deployment
    from kimictl.inventory import load_inventory
    from kimictl.pipeline import prepare
    from kimictl.plan import make_plan
    from kimictl.render import render

    if topology:
        p = prepare(inventory, topology)
        sets = parse_sets(set_items, p.topology)  # bad --set: exit 2 before the recorded state is read
        inv = p.inventory
    else:
        inv = load_inventory(inventory)
        cached = cached_deployment(inv.cluster.name) if read_cluster else None
        try:
            topo_path = cached.topology() if cached is not None else None
        except InvalidInput:
            topo_path = None   # not readable here: the cluster's record may name one that is
        if topo_path:   # bad --set against the cached record's topology: exit 2 before any host is contacted
            parse_sets(set_items, prepare(inventory, topo_path).topology)
    check_supplied_keys(inv)   # a bad supplied key: exit 2 before the record is read from the hosts
    deployed = current_deployment(inv.cluster.name, inv if read_cluster else None, accept_new_keys)
    if not topology:
        p = prepare(inventory, deployed.topology())
        sets = parse_sets(set_items, p.topology)
    topo, inv = apply_sets(p.topology, p.inventory, sets)
    try:
        plan = make_plan(inv, topo) if sets else p.plan
    except InvalidInput as exc:   # the plan the --set items make
        exc.message = f"--set {' '.join(s.raw for s in sets)}: {exc.message}"
        raise
    return RolloutInputs(inv, deployed.record, deployed.rendered, render(plan, inv, topo), topo, sets)
