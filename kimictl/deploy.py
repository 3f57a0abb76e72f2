"""Deploy: converge hosts to the plan - release files, supervised engines, readiness, proxy, smoke, switch.

A `Deployer` composes the host operations (`kimictl.hostops.HostOps`: playbooks, readiness, log tails) and the
HTTP probes (`kimictl.health`); both are injectable, so the rollback logic is unit-tested with fakes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kimictl import cluster_record, health, state
from kimictl.cluster_secrets import proxy_admin_key
from kimictl.errors import HostError, InvalidInput, KimictlError, guide
from kimictl.facts import engine_profile
from kimictl.hostops import (
    ROLLBACK_READY_TIMEOUT_S,
    Change,
    HostOps,
    Proc,
    compute_changes,
    desired_procs,
    installed_command,
)
from kimictl.inventory import Inventory
from kimictl.plan import Plan
from kimictl.render import ENGINE_KEY_ENV, Rendered
from kimictl.routers import front_admin_code, front_admin_key
from kimictl.rundir import run_snapshot, save_run
from kimictl.ssh import Sessions, SSHError


@dataclass
class DeployOptions:
    check: bool = False
    skip_preflight: str | None = None
    limit: list[str] | None = None
    ready_timeout: float | None = None
    accept_new_host_keys: bool = False
    skip_weights: bool = False
    hub_token: str | None = None


@dataclass
class DeployResult:
    cluster: str
    release: str
    changes: list[Change]
    run_dir: str
    result: str  # deployed | no-changes | check
    smoke: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": 1, "cluster": self.cluster, "release": self.release, "result": self.result,
            "run_dir": self.run_dir, "smoke": self.smoke, "seconds": self.seconds,
            "changes": [{"host": c.host, "id": c.id, "action": c.action} for c in self.changes],
        }


class Deployer:
    """One deploy run: preflight, release files, engines, readiness, proxy, smoke, switch; rollback on failure."""

    def __init__(self, inv: Inventory, plan: Plan, rendered: Rendered, opts: DeployOptions,
                 say: Callable[[str], None], on_event: Callable[[str, str, str], None] | None = None, *,
                 ops: HostOps | None = None, http: Any = health):
        self.release = state.release_id(rendered.releases)
        self.inv, self.plan, self.rendered, self.opts, self.say, self.http = inv, plan, rendered, opts, say, http
        self.full_inv, self.full_rendered = inv, rendered  # the smoke test spans the cluster even with --limit
        self.manifest = None   # the hub's listing, read before preflight when weights are staged
        self.ops = ops or HostOps(inv, plan.served_model_name, state.new_run_dir(plan.cluster, self.release[:8]),
                                  say=say, on_event=on_event, accept_new_host_keys=opts.accept_new_host_keys,
                                  ready_timeout=opts.ready_timeout, http=http)
        self.run_dir = self.ops.run_dir
        self.timings = self.ops.timings

    # --- smoke -----------------------------------------------------------------------------------------

    def smoke(self) -> dict[str, Any]:
        """One long-prompt completion; in P/D decode must get the whole prompt over the KV connector."""
        engines = [p for p in desired_procs(self.full_rendered, self.full_inv)
                   if p.kind == "engine" and p.serves_http]
        timeout = engine_profile(self.inv.cluster.kimi_engine_profile).probe_timeout_s or 60.0
        if self.plan.proxy:
            url = f"http://{self.plan.proxy.ip}:{self.plan.proxy.port}/v1/completions"
            side = {r: [(p.ip, p.port) for p in engines if p.role == r] for r in ("prefill", "decode")}
            probe = health.pd_probe(url, self.plan.served_model_name, side["prefill"], side["decode"], words=400,
                                    max_tokens=16, timeout=timeout, api_key=self.ops.api_key, http=self.http)
            if not probe.answered:
                raise HostError(f"smoke completion through {url} failed: HTTP {probe.code}: "
                                f"{health.body_text(probe.body, 300) or '(an empty answer)'}",
                                host=self.plan.proxy.host, step="smoke", hint=guide("t-smoke"))
            if not probe.ok:
                raise HostError(f"smoke completion did not go prefill -> decode over the KV connector ({probe.detail});"
                                " a silent decode-only fallback is a failed deploy", host=self.plan.proxy.host,
                                step="smoke", hint=guide("t-no-kv"))
            return {"url": url, "text": probe.body["choices"][0].get("text", "")[:80], **probe.counters()}
        first = engines[0]
        url = f"http://{first.ip}:{first.port}/v1/completions"
        before = {p.id: self.http.metric_totals(p.ip, p.port) for p in engines}
        code, body = self.http.http_post_json(url, {"model": self.plan.served_model_name,
                                                    "prompt": health.smoke_prompt(), "max_tokens": 16,
                                                    "temperature": 0}, timeout=timeout, api_key=self.ops.api_key)
        if not health.completed(code, body):
            raise HostError(f"smoke completion through {url} failed: HTTP {code}: "
                            f"{health.body_text(body, 300) or '(an empty answer)'}", host=first.host, step="smoke",
                            hint=guide("t-smoke"))
        after = {p.id: self.http.metric_totals(p.ip, p.port) for p in engines}
        moved = sum(after[p.id].get(health.GENERATION_COUNTER, 0) - before[p.id].get(health.GENERATION_COUNTER, 0)
                    for p in engines)
        return {"url": url, "text": body["choices"][0].get("text", "")[:80], "generation_tokens": moved}

    # --- the whole run ---------------------------------------------------------------------------------

    def _limit(self) -> None:
        """--limit: touch only these hosts (the plan still spans the whole cluster)."""
        keep = set(self.opts.limit or [])
        if not keep:
            return
        r = self.rendered
        self.rendered = r.model_copy(update={
            "engines": [e for e in r.engines if e.host in keep],
            "proxy": r.proxy if r.proxy and r.plan.proxy and r.plan.proxy.host in keep else None,
            "files": {h: f for h, f in r.files.items() if h in keep},
            "releases": {h: v for h, v in r.releases.items() if h in keep}})
        self.inv = self.inv.limited(sorted(keep))
        self.ops.limit(sorted(keep))

    def run(self) -> DeployResult:
        t_all = time.monotonic()
        self._limit()
        stage_weights = not (self.opts.skip_weights or self.opts.check or self.inv.cluster.kimi_model_source == "local")
        if stage_weights:   # the hub's listing first: preflight then checks disk room against the real size
            from kimictl.weights.stage import load_manifest

            self.manifest = load_manifest(self.inv, self.opts.hub_token)
        if self.opts.skip_preflight is None and not self.opts.check:
            self._preflight()
        if stage_weights:
            self._weights()
        elif self.inv.cluster.kimi_model_source == "local":
            self.say(f"weights: kimi_model_source is local; engines load what is in {self.inv.cluster.kimi_model_dir}")
        save_run(self.run_dir, self.rendered, self.full_rendered)
        procs = desired_procs(self.rendered, self.inv)
        observed = self.ops.observe()
        changes = compute_changes(procs, observed)
        for c in changes:   # what a rollback would start again: only kimictl's own scripts, checked before any change
            if c.action in ("replace", "stop") and c.old and c.old.get("cmd"):
                c.old["cmd"] = installed_command(c.host, c.id, c.old["cmd"], self.inv.host(c.host).kimi_state_dir)
        todo = [c for c in changes if c.action != "keep"]
        if self.opts.check:
            return DeployResult(self.plan.cluster, self.release, changes, str(self.run_dir), "check")
        if not todo:
            checks = [(p, self.ops.ready(p)) for p in procs if p.serves_http]
            sick = [p for p, r in checks if not r.ok]
            if any(p.kind == "proxy" and "401" in r.detail for p, r in checks if not r.ok) or self._admin_refused():
                # Only a key changed (keys are not part of a release): install them; the front re-reads them.
                self.say("the proxy refuses the inventory's API key or this control node's admin key: installing "
                         "the keys")
                self.ops.install_release(self.rendered, [self.plan.proxy.host] if self.plan.proxy else [])
                sick = [p for p in sick if not self.ops.ready(p).ok]
            if not sick:
                self._restore_routing()
            if sick:
                p = sick[0]
                raise HostError(f"no changes to apply, but {len(sick)} process(es) of this release do not answer: "
                                + ", ".join(x.id for x in sick), host=p.host, step="health",
                                log_tail=self.ops.log_tail(p.host, p.id),
                                hint="see `kimictl status`; fix the cause, or deploy a changed release")
            self.say("no changes: every engine and the proxy already run this release and answer")
            recorded = state.current(self.plan.cluster)
            if recorded is None or recorded.release != self.release:
                # Deployed from another control node, or this one's record is lost: what the hosts run and answer
                # with becomes the current release here (rollout and rollback start from it).
                self.say(f"recorded {self.release} as the current release (this control node's record said "
                         f"{recorded.release if recorded else 'nothing'})")
                self._record("deployed", changes, kind="adopted")
            else:
                self._record("no-changes", changes)
            return DeployResult(self.plan.cluster, self.release, changes, str(self.run_dir), "no-changes")
        try:
            self._converge(changes)
            self._restore_routing()
            self._engines_refuse_keyless()
            t0 = time.monotonic()
            smoke = self.smoke()
            self.timings["smoke"] = round(time.monotonic() - t0, 2)  # the first completion since the engines started
            self.say(f"smoke: {smoke_text(smoke)}")
            self.ops.switch(self.rendered.releases)
        except KimictlError:
            self._rollback(changes)
            self._record("failed", changes, required=False)
            raise
        else:
            self._record("deployed", changes)   # its record playbook's connections close below
        finally:
            self.ops.close()
        self.timings["total"] = round(time.monotonic() - t_all, 2)
        return DeployResult(self.plan.cluster, self.release, changes, str(self.run_dir), "deployed", smoke,
                            self.timings)

    def _engines_refuse_keyless(self) -> None:
        """Keyed engines answer 401 to a request without the key; one that answers anything else runs keyless (its
        key did not reach it), and the deploy fails naming it."""
        if not self.plan.engine_api_key:
            return
        for p in desired_procs(self.rendered, self.inv):
            if p.kind != "engine" or not p.serves_http:
                continue
            code, _ = self.http.http_get(f"http://{p.ip}:{p.port}/v1/models", 5.0)
            if code != 401:
                raise HostError(f"engine {p.id} answers GET /v1/models without the API key with "
                                f"{f'HTTP {code}' if code else 'no answer'}, not 401: it runs without its key",
                                host=p.host, step="engine key",
                                hint=f"see its env file <kimi_state_dir>/{ENGINE_KEY_ENV} and the engine's log; "
                                     "deploy again once it requires the key")

    def _restore_routing(self, timeout: float = 120.0) -> None:
        """Undo the routing a killed command left behind (a lost CI runner, a `kill -9` mid-rollout): a router copy
        held behind the front, an endpoint drained from a copy. A deploy holds the cluster lease, so no other
        command holds or drains anything now: every hold is released, and when a copy lacks an endpoint of this
        release the copies restart one at a time with the rendered membership (the others keep serving)."""
        from kimictl.routers import FrontControl, RouterError, membership_client

        p, rp = self.plan.proxy, self.full_rendered.proxy
        if not (p and rp and rp.routers and p.admin_key) or p.host not in self.rendered.releases:
            return
        base, key = f"http://{p.ip}:{p.port}", proxy_admin_key(self.full_inv, p.host)
        want = {f"http://{x.ip}:{x.port}": x.id for x in desired_procs(self.full_rendered, self.full_inv)
                if x.kind == "engine" and x.serves_http}

        def lacking() -> dict[int, list[str]]:
            out: dict[int, list[str]] = {}
            for i in range(len(rp.routers)):
                got = membership_client(p.router, f"{base}/kimictl/router/{i}", key, http=self.http).members()
                if set(want) - set(got):
                    out[i] = sorted(want[u] for u in set(want) - set(got))
            return out

        try:
            front = FrontControl(base, api_key=key, http=self.http)
            for i in range(len(rp.routers)):
                front.release(i)
            missing = lacking()
            if not missing:
                return
            self.say("router copies lack endpoints of this release (a drain a killed command left: "
                     + "; ".join(f"copy {i}: {', '.join(ids)}" for i, ids in missing.items())
                     + "): restarting them one at a time with this release's membership")
            self.ops.reload_proxy(p.host)
            deadline = time.monotonic() + timeout
            while (missing := lacking()) and time.monotonic() < deadline:
                time.sleep(1.0)
        except RouterError as exc:
            raise HostError(exc.message, host=p.host, step="proxy", log_tail=self.ops.log_tail(p.host, "proxy")) \
                from None
        if missing:
            raise HostError(f"router copies still lack endpoints {timeout:.0f}s after their restart: "
                            + "; ".join(f"copy {i}: {', '.join(ids)}" for i, ids in missing.items()),
                            host=p.host, step="proxy", log_tail=self.ops.log_tail(p.host, "proxy"))

    def _admin_refused(self) -> bool:
        """The deployed front refuses the admin key this deploy would install: a supplied one the cluster does not
        hold yet, or one made here for a front that has none. A copy of this control node's that the front refuses
        is stale (the key was rotated elsewhere): it is dropped and the cluster's own key read back, never replaced
        by this node's."""
        p = self.plan.proxy
        if not p or not p.admin_key:
            return False
        key = front_admin_key(self.full_inv, p.host, p.ip, p.port, http=self.http, create=True)
        return front_admin_code(p.ip, p.port, key, http=self.http) == 403

    def _preflight(self) -> None:
        from kimictl.preflight import run_preflight

        self.say("preflight: checking every host against the plan")
        t0 = time.monotonic()
        report = run_preflight(self.inv, self.plan, accept_new_keys=self.opts.accept_new_host_keys)
        self.timings["preflight"] = round(time.monotonic() - t0, 2)
        state.save_preflight(self.plan.cluster, report.to_json())
        if not report.ok:
            bad = report.failed_errors
            raise HostError(f"preflight found {len(bad)} error(s); nothing was changed", host=bad[0].host,
                            step=f"preflight {bad[0].id}",
                            details=[f"{r.host}: {r.id} {r.message} -> {r.fix}" for r in bad[:12]],
                            hint="fix them, or deploy --skip-preflight REASON to override")

    def _weights(self) -> None:
        """Stage the checkpoint (a no-op when every host already holds the verified copy)."""
        from kimictl.weights import stage

        t0 = time.monotonic()
        self.ops.reserve_ports(self.plan)
        self.timings["reserve_ports"] = round(time.monotonic() - t0, 2)
        t0 = time.monotonic()
        result = stage.pull(self.inv, stage.PullOptions(token=self.opts.hub_token,
                                                        accept_new_host_keys=self.opts.accept_new_host_keys),
                            stage.Reporter(self.say), self.manifest)
        self.timings["weights"] = round(time.monotonic() - t0, 2)
        if not result.ok:
            bad = next(h for h in result.hosts if h.state != "complete")
            raise HostError(f"weights are not staged on {bad.host}: {bad.error or bad.state}", host=bad.host,
                            step="weights", hint="see `kimictl weights status`")

    def _converge(self, changes: list[Change]) -> None:
        self.ops.install_release(self.rendered, sorted(self.rendered.releases))
        engine_changes = [c for c in changes if c.id != "proxy" and c.action != "keep"]
        stops: dict[str, list[str]] = {}
        starts: dict[str, list[dict[str, Any]]] = {}
        for c in engine_changes:
            if c.action in ("stop", "replace"):
                stops.setdefault(c.host, []).append(c.id)
            if c.action in ("start", "replace") and c.new:
                starts.setdefault(c.host, []).append(c.new.start_action())
        # A proxy whose backends restart goes out first and comes back once they answer.
        proxy_change = next((c for c in changes if c.id == "proxy"), None)
        if proxy_change and proxy_change.action in ("stop", "replace"):
            stops.setdefault(proxy_change.host, []).insert(0, "proxy")
        t0 = time.monotonic()
        self.ops.apply_actions(stops, starts, "engines")
        started = [c.new for c in engine_changes if c.new and c.action in ("start", "replace")]
        self.ops.wait_ready([p for p in started if p is not None])
        self.timings["engines_ready"] = round(time.monotonic() - t0, 2)
        if proxy_change and proxy_change.action in ("start", "replace") and proxy_change.new:
            p = proxy_change.new
            self.ops.apply_actions({}, {p.host: [p.start_action()]}, "proxy")
            self.ops.wait_ready([p])

    def _rollback(self, changes: list[Change]) -> None:
        """Stop what this deploy started; bring back what it replaced or stopped (the previous release)."""
        stops: dict[str, list[str]] = {}
        starts: dict[str, list[dict[str, Any]]] = {}
        for c in changes:
            if c.action == "keep":
                continue
            if c.action in ("start", "replace"):
                stops.setdefault(c.host, []).append(c.id)
            if c.action in ("replace", "stop") and c.old and c.old.get("cmd"):
                starts.setdefault(c.host, []).append({"id": c.id, "cmd": c.old["cmd"], "tag": c.old.get("tag") or "",
                                                      "replace": True})
        self.say("rolling back: " + ("restoring the previous release" if starts else "stopping what was started"))
        try:
            self.ops.apply_actions(stops, starts, "rollback")
            restored = [Proc(c.host, c.id, c.new.kind, str(c.old.get("tag")), list(c.old["cmd"]), c.new.ip,
                             c.new.port, c.new.serves_http, c.new.role)
                        for c in changes if c.action == "replace" and c.old and c.new]
            if restored:
                self.ops.wait_ready(restored, timeout=ROLLBACK_READY_TIMEOUT_S)
                self.say("rollback done: the previous release answers again")
        except KimictlError as exc:
            self.say(f"rollback incomplete: {exc.message}")

    def _record(self, result: str, changes: list[Change], kind: str | None = None, required: bool = True) -> None:
        """The release record, here and on the cluster's record hosts (kimictl/cluster_record.py: a host not written
        is a warning; none written is an error unless `required` is off, as for a failed deploy's record)."""
        rec = state.ReleaseRecord.now(
            release=self.release, cluster=self.plan.cluster, topology=self.plan.topology,
            **({"kind": kind} if kind else {}),
            hosts=self.rendered.releases, result=result, run_dir=str(self.run_dir),
            changes=[asdict(c) | {"new": None, "old": None} for c in changes if c.action != "keep"])
        state.record_release(self.plan.cluster, rec)
        cluster_record.publish(self.ops, self.full_inv, rec, say=self.say, required=required)


def smoke_text(smoke: dict[str, Any]) -> str:
    """The smoke result in words: where the completion went, what it answered, which counters moved."""
    moved = ", ".join(f"{k.replace('_', ' ')} +{v:.0f}" for k, v in smoke.items() if k not in ("url", "text"))
    return f"{smoke.get('url', '?')} answered {smoke.get('text', '')[:40]!r} ({moved})"


def change_diffs(inv: Inventory, rendered: Rendered, changes: list[Change]) -> dict[str, str]:
    """Unified diffs of each replaced process's files: the running release's copy against the new render."""
    import difflib

    wanted = [c for c in changes if c.action == "replace" and c.old and c.new]
    if not wanted:
        return {}
    out: dict[str, str] = {}
    by_host: dict[str, list[Change]] = {}
    for c in wanted:
        by_host.setdefault(c.host, []).append(c)

    def fetch(name: str, s) -> dict[str, str]:
        texts = {}
        for c in by_host.get(name, []):
            old_script = c.old["cmd"][-1] if c.old.get("cmd") else ""
            rel_dir = old_script.rsplit("/engines/", 1)[0] if "/engines/" in old_script else \
                old_script.rsplit("/proxy/", 1)[0]
            files = ([f"engines/{c.id}.env", f"engines/{c.id}.sh"] if c.id != "proxy" else
                     sorted(p for p in rendered.files[name] if p.startswith("proxy/")))
            for rel in files:
                texts[f"{c.id}|{rel}"] = s.run(f"cat {rel_dir}/{rel} 2>/dev/null || true").stdout
        return texts

    with Sessions(inv.limited(sorted(by_host))) as sessions:
        got = sessions.each(fetch)
    for host, texts in got.items():
        if isinstance(texts, SSHError):
            continue
        for key, old in texts.items():
            pid, rel = key.split("|", 1)
            new = rendered.files[host].get(rel, "")
            diff = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                f"{host}:current/{rel}", f"{host}:new/{rel}"))
            if diff:
                out[f"{host}:{pid}:{rel}"] = diff
    return out


def rollback_target(cluster: str, to: str | None = None, inv: Inventory | None = None,
                    accept_new_keys: bool = False) -> tuple[state.ReleaseRecord, Rendered]:
    """The release to go back to: `to`, or the last deployed release before the current one. With the inventory,
    the cluster's record is read back from its record hosts first (kimictl/cluster_record.py)."""
    if inv is not None:
        cluster_record.sync(inv, accept_new_keys=accept_new_keys)
    deployed = [r for r in state.history(cluster) if r.result == "deployed"]
    if not deployed:
        raise InvalidInput(f"no deployed release of cluster {cluster} is recorded in "
                           f"{state.control_dir(cluster) / state.RELEASES}"
                           + (f" nor on its record hosts ({', '.join(cluster_record.record_hosts(inv))})"
                              if inv is not None else ""))
    current = deployed[-1].release
    if to:
        matches = [r for r in deployed if r.release.startswith(to)]
        if not matches:
            raise InvalidInput(f"release {to} was never deployed to {cluster}; deployed: "
                               + ", ".join(dict.fromkeys(r.release for r in deployed)))
        target = matches[-1]
    else:
        older = [r for r in deployed if r.release != current]
        if not older:
            raise InvalidInput(f"cluster {cluster} has only one deployed release ({current}); nothing to roll back to")
        target = older[-1]
    return target, run_snapshot(target, "release")
