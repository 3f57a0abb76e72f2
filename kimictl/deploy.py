"""Deploy: converge hosts to the plan - release files, supervised engines, readiness, proxy, smoke, switch."""

from __future__ import annotations

import getpass
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kimictl import health
from kimictl.ansible import build_run_spec, close_control_masters, run_playbook
from kimictl.errors import HostError, KimictlError
from kimictl.facts import engine_profile
from kimictl.inventory import Inventory
from kimictl.plan import Plan
from kimictl.render import Rendered, engine_shims, write_rendered
from kimictl.secret_file import proxy_api_key
from kimictl.ssh import Sessions, SSHError, ansible_host_key_args
from kimictl.state import cached_manifest_bytes, control_dir, save_preflight

SUPERVISOR_SRC = Path(__file__).parent / "supervisor.py"
PROXY_FRONT_SRC = Path(__file__).parent / "proxy_front.py"
LIVE_STATES = ("starting", "running", "backoff")
STOP_GRACE_S = 30
ROLLBACK_READY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Proc:
    """A process kimictl wants supervised on a host (an engine or the proxy)."""

    host: str
    id: str
    kind: str
    tag: str
    cmd: list[str]
    ip: str
    port: int
    serves_http: bool
    role: str


@dataclass
class Change:
    host: str
    id: str
    action: str  # start | replace | stop | keep
    new: Proc | None = None
    old: dict[str, Any] | None = None


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


def _sha(*texts: str) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode() + b"\0")
    return h.hexdigest()[:16]


def process_tag(files: dict[str, str], pid: str) -> str:
    """A process's tag: the hash of exactly the release files it runs (its restart trigger)."""
    if pid == "proxy":
        return _sha(files["proxy/proxy.sh"])
    return _sha(*(files[p] for p in sorted(files) if p.startswith(f"engines/{pid}.")))


def desired_procs(rendered: Rendered, inv: Inventory) -> list[Proc]:
    """Supervised processes per host; the tag hashes exactly the files that process runs."""
    plan = rendered.plan
    out: list[Proc] = []
    for e in rendered.engines:
        files = rendered.files[e.host]
        sd = inv.host(e.host).kimi_state_dir
        rel = f"{sd}/releases/{rendered.releases[e.host]}"
        script = f"engines/{e.id}.container.sh" if plan.runtime == "container" else f"engines/{e.id}.sh"
        tag = process_tag(files, e.id)
        out.append(Proc(e.host, e.id, "engine", tag, ["bash", f"{rel}/{script}"], e.host_ip, e.port, e.serves_http,
                        e.role))
    if rendered.proxy and plan.proxy:
        host = plan.proxy.host
        sd = inv.host(host).kimi_state_dir
        out.append(Proc(host, "proxy", "proxy", process_tag(rendered.files[host], "proxy"),
                        ["bash", f"{sd}/releases/{rendered.releases[host]}/proxy/proxy.sh"],
                        rendered.proxy.host, rendered.proxy.port, True, "proxy"))
    return out


@dataclass
class HostObservation:
    states: dict[str, dict[str, Any]]
    current: str | None


def observe(inv: Inventory, timeout: float = 15.0, accept_new_keys: bool = False) -> dict[str, HostObservation]:
    """What the supervisor on each host runs now, and where `current` points (one SSH round trip per host)."""

    def probe(name: str, s) -> HostObservation:
        sd = inv.host(name).kimi_state_dir
        res = s.run(f"if [ -f {sd}/bin/supervisor.py ]; then python3 {sd}/bin/supervisor.py status "
                    f"--run-dir {sd}/run; else echo '[]'; fi; echo '@@current'; readlink {sd}/current || true",
                    timeout=timeout)
        body, _, cur = res.stdout.partition("@@current")
        try:
            states = {st["name"]: st for st in json.loads(body or "[]")}
        except ValueError:
            states = {}
        current = cur.strip().rsplit("/", 1)[-1] or None
        return HostObservation(states, current)

    with Sessions(inv, timeout=timeout, accept_new_keys=accept_new_keys) as sessions:
        got = sessions.each(probe)
    bad = {h: r for h, r in got.items() if isinstance(r, SSHError)}
    if bad:
        host = next(iter(bad))
        raise HostError(f"cannot read the current state of {len(bad)} host(s)", host=host, step="observe",
                        details=[str(e) for e in bad.values()])
    return got  # type: ignore[return-value]


def compute_changes(procs: list[Proc], observed: dict[str, HostObservation]) -> list[Change]:
    changes: list[Change] = []
    wanted = {(p.host, p.id) for p in procs}
    for p in procs:
        old = observed.get(p.host, HostObservation({}, None)).states.get(p.id)
        live = old is not None and old.get("state") in LIVE_STATES
        if live and old.get("tag") == p.tag:
            changes.append(Change(p.host, p.id, "keep", p, old))
        else:
            changes.append(Change(p.host, p.id, "replace" if live else "start", p, old if live else None))
    for host, obs in observed.items():
        for pid, st in obs.states.items():
            if (host, pid) not in wanted and st.get("state") in LIVE_STATES:
                changes.append(Change(host, pid, "stop", None, st))
    return changes


class EngineOps:
    """Changes to supervised processes on hosts: playbook runs in a run directory, readiness, log tails."""

    def __init__(self, inv: Inventory, cluster: str, served_model_name: str, run_name: str, opts: DeployOptions,
                 say: Callable[[str], None], on_event: Callable[[str, str, str], None] | None = None):
        self.inv, self.cluster, self.served_model_name, self.opts = inv, cluster, served_model_name, opts
        self.say, self.on_event = say, on_event
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        self.run_dir = control_dir(cluster) / "runs" / f"{stamp}-{run_name}"
        self.state_dir_of = {h.name: h.kimi_state_dir for h in inv.hosts}
        self.api_key = proxy_api_key(inv)
        self.n_runs = 0
        self.timings: dict[str, float] = {}

    # --- playbooks -------------------------------------------------------------------------------------

    def _playbook(self, name: str, extravars: dict[str, Any], hosts: list[str]) -> None:
        self.n_runs += 1
        ident = f"{self.n_runs:02d}-{name.removesuffix('.yml')}"
        spec = build_run_spec(self.run_dir, name, Path(self.inv.path), {"kimi": extravars}, ident=ident,
                              hosts=[h.name for h in self.inv.hosts], limit=hosts,
                              host_key_args=ansible_host_key_args(self.inv, self.opts.accept_new_host_keys))
        t0 = time.monotonic()
        res = run_playbook(spec, self.on_event)
        self.timings[ident] = round(time.monotonic() - t0, 2)
        if not res.ok:
            f = res.failures[0] if res.failures else None
            raise HostError(f"playbook {name} failed" + (f": {f.message.splitlines()[0][:300]}" if f else ""),
                            host=f.host if f else None, step=f.task if f else name,
                            log_tail=f.message if f else None,
                            details=[f"{x.host}: {x.task}" for x in res.failures[1:5]],
                            hint=f"ansible artifacts: {res.artifacts}")

    def apply_actions(self, stops: dict[str, list[str]], starts: dict[str, list[dict[str, Any]]], what: str) -> None:
        hosts = sorted(set(stops) | set(starts))
        if not hosts:
            return
        actions = {h: {"stop": stops.get(h, []), "start": starts.get(h, [])} for h in hosts}
        self.say(f"{what}: " + ", ".join(f"{h} (stop {len(a['stop'])}, start {len(a['start'])})"
                                         for h, a in actions.items()))
        self._playbook("engines.yml", {"state_dir_of": self.state_dir_of, "actions": actions,
                                       "grace": STOP_GRACE_S}, hosts)

    def install_release(self, rendered: Rendered, hosts: list[str]) -> None:
        """Unpack each host's release next to the running one (nothing restarts); the tools in bin/ and the proxy's
        API key are brought up to date on the way."""
        proxy_host = rendered.plan.proxy.host if rendered.plan.proxy else None
        self._playbook("release.yml", {
            "state_dir_of": self.state_dir_of,
            "bin": {"supervisor.py": str(SUPERVISOR_SRC), "proxy_front.py": str(PROXY_FRONT_SRC),
                    **engine_shims(rendered.plan)},
            "hosts": {h: {"release": rendered.releases[h], "bundle": str(self._bundle(h))} for h in hosts},
            "proxy_host": proxy_host, "api_key_file": self.inv.cluster.kimi_api_key_file}, hosts)

    def ready(self, p: Proc) -> health.Ready:
        return health.engine_ready(p.ip, p.port, self.served_model_name,
                                   api_key=self.api_key if p.kind == "proxy" else None)

    def _bundle(self, host: str) -> Path:
        """The host's rendered files as one tarball: one transfer instead of one per file."""
        import tarfile

        src = self.run_dir / "rendered" / host
        out = self.run_dir / "bundles" / f"{host}.tar.gz"
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:gz") as tar:
            for path in sorted(src.rglob("*")):
                tar.add(path, arcname=str(path.relative_to(src)), recursive=False)
        return out

    # --- readiness -------------------------------------------------------------------------------------

    def _ready_timeout(self) -> float:
        if self.opts.ready_timeout:
            return self.opts.ready_timeout
        size, _ = cached_manifest_bytes(self.cluster)
        prof = engine_profile(self.inv.cluster.kimi_engine_profile)
        # Real K2.5 loads take ~10 min; size the wait to the checkpoint (>= 0.5 GiB/s) plus start-up, and never
        # below the profile's floor (a CPU engine's start-up is imports and compilation, not bytes).
        size = size or prof.facts(self.inv.cluster.kimi_model_id).total_bytes
        return max(prof.min_ready_timeout_s, 180.0 + size / (0.5 * 2**30))

    def _supervisor_states(self, hosts: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
        sub = self.inv.limited(hosts)
        return {h: o.states for h, o in observe(sub, accept_new_keys=self.opts.accept_new_host_keys).items()}

    def log_tail(self, host: str, pid: str, lines: int = 30) -> str:
        sd = self.state_dir_of[host]
        with Sessions(self.inv.limited([host]), accept_new_keys=self.opts.accept_new_host_keys) as s:
            got = s.each(lambda _n, sess: sess.run(f"tail -n {lines} {sd}/logs/{pid}.log 2>&1").stdout)
        out = got[host]
        return str(out)

    def wait_ready(self, procs: list[Proc]) -> None:
        """Poll HTTP readiness; fail fast when the supervisor reports a crash (restart or failed state)."""
        if not procs:
            return
        deadline = time.monotonic() + self._ready_timeout()
        pending = {(p.host, p.id): p for p in procs if p.serves_http}
        headless = [p for p in procs if not p.serves_http]
        last_check = 0.0
        t0 = time.monotonic()
        self.say(f"waiting for {len(pending)} endpoint(s) to load and answer (timeout {deadline - t0:.0f}s)")
        while pending:
            for key, p in list(pending.items()):
                if self.ready(p).ok:
                    del pending[key]
                    self.say(f"ready: {p.id} on {p.host} ({time.monotonic() - t0:.1f}s)")
            if not pending:
                break
            now = time.monotonic()
            if now - last_check > 2.0:
                last_check = now
                self._check_crashes(list(pending.values()) + headless)
            if now > deadline:
                p = next(iter(pending.values()))
                raise HostError(f"{p.id} did not become ready within {deadline - t0:.0f}s", host=p.host,
                                step="readiness", log_tail=self.log_tail(p.host, p.id))
            time.sleep(0.3)

    def _check_crashes(self, procs: list[Proc]) -> None:
        states = self._supervisor_states(sorted({p.host for p in procs}))
        for p in procs:
            st = states.get(p.host, {}).get(p.id)
            if st is None:
                continue
            if st.get("state") in ("failed", "stopped", "dead") or int(st.get("restarts", 0)) > 0:
                exit_ = st.get("last_exit") or {}
                raise HostError(f"{p.kind} {p.id} crashed during start-up (state {st.get('state')}, "
                                f"restarts {st.get('restarts', 0)}, last exit {exit_})", host=p.host,
                                step="engines", log_tail=self.log_tail(p.host, p.id))



class Deployer(EngineOps):
    """One deploy run: preflight, release files, engines, readiness, proxy, smoke, switch; rollback on failure."""

    def __init__(self, inv: Inventory, plan: Plan, rendered: Rendered, opts: DeployOptions,
                 say: Callable[[str], None], on_event: Callable[[str, str, str], None] | None = None):
        self.release = _sha(*(f"{h}:{r}" for h, r in sorted(rendered.releases.items())))
        super().__init__(inv, plan.cluster, plan.served_model_name, self.release[:8], opts, say, on_event)
        self.plan, self.rendered = plan, rendered
        self.full_inv, self.full_rendered = inv, rendered  # the smoke test spans the cluster even with --limit
        self.manifest = None   # the hub's listing, read before preflight when weights are staged

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
                                    max_tokens=16, timeout=timeout, api_key=self.api_key)
            if probe.code != 200 or not isinstance(probe.body, dict) or not probe.body.get("choices"):
                raise HostError(f"smoke completion through {url} failed: HTTP {probe.code}: {str(probe.body)[:300]}",
                                host=self.plan.proxy.host, step="smoke")
            if not probe.ok:
                raise HostError(f"smoke completion did not go prefill -> decode over the KV connector ({probe.detail});"
                                " a silent decode-only fallback is a failed deploy", host=self.plan.proxy.host,
                                step="smoke")
            return {"url": url, "text": probe.body["choices"][0].get("text", "")[:80], **probe.counters()}
        first = engines[0]
        url = f"http://{first.ip}:{first.port}/v1/completions"
        before = {p.id: health.metric_totals(p.ip, p.port) for p in engines}
        code, body = health.http_post_json(url, {"model": self.plan.served_model_name,
                                                 "prompt": health.smoke_prompt(), "max_tokens": 16,
                                                 "temperature": 0}, timeout=timeout, api_key=self.api_key)
        if code != 200 or not isinstance(body, dict) or not body.get("choices"):
            raise HostError(f"smoke completion through {url} failed: HTTP {code}: {str(body)[:300]}",
                            host=first.host, step="smoke")
        after = {p.id: health.metric_totals(p.ip, p.port) for p in engines}
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
        write_rendered(self.rendered, self.run_dir / "rendered")
        (self.run_dir / "plan.json").write_text(json.dumps(self.plan.model_dump(mode="json"), indent=1))
        # Everything needed to deploy this release again (`kimictl rollback`), without the topology file.
        (self.run_dir / "rendered.json").write_text(self.full_rendered.model_dump_json())
        procs = desired_procs(self.rendered, self.inv)
        observed = observe(self.inv, accept_new_keys=self.opts.accept_new_host_keys)
        changes = compute_changes(procs, observed)
        todo = [c for c in changes if c.action != "keep"]
        if self.opts.check:
            return DeployResult(self.plan.cluster, self.release, changes, str(self.run_dir), "check")
        if not todo:
            checks = [(p, self.ready(p)) for p in procs if p.serves_http]
            sick = [p for p, r in checks if not r.ok]
            if any(p.kind == "proxy" and "401" in r.detail for p, r in checks if not r.ok):
                # Only the key changed (it is not part of a release): install it; the front re-reads it.
                self.say("the proxy refuses the inventory's API key: installing the key")
                self.install_release(self.rendered, [self.plan.proxy.host] if self.plan.proxy else [])
                sick = [p for p in sick if not self.ready(p).ok]
            if sick:
                p = sick[0]
                raise HostError(f"no changes to apply, but {len(sick)} process(es) of this release do not answer: "
                                + ", ".join(x.id for x in sick), host=p.host, step="health",
                                log_tail=self.log_tail(p.host, p.id),
                                hint="see `kimictl status`; fix the cause, or deploy a changed release")
            self.say("no changes: every engine and the proxy already run this release and answer")
            self._record("no-changes", changes)
            return DeployResult(self.plan.cluster, self.release, changes, str(self.run_dir), "no-changes")
        try:
            self._converge(changes, procs)
            t0 = time.monotonic()
            smoke = self.smoke()
            self.timings["smoke"] = round(time.monotonic() - t0, 2)  # the first completion since the engines started
            self.say(f"smoke: {smoke}")
            self._playbook("switch.yml", {"state_dir_of": self.state_dir_of,
                                          "hosts": {h: {"release": r} for h, r in self.rendered.releases.items()}},
                           sorted(self.rendered.releases))
        except KimictlError:
            self._rollback(changes)
            self._record("failed", changes)
            raise
        finally:
            close_control_masters(self.run_dir)
        self.timings["total"] = round(time.monotonic() - t_all, 2)
        self._record("deployed", changes)
        return DeployResult(self.plan.cluster, self.release, changes, str(self.run_dir), "deployed", smoke,
                            self.timings)

    def _preflight(self) -> None:
        from kimictl.preflight import run_preflight

        self.say("preflight: checking every host against the plan")
        t0 = time.monotonic()
        report = run_preflight(self.inv, self.plan, accept_new_keys=self.opts.accept_new_host_keys)
        self.timings["preflight"] = round(time.monotonic() - t0, 2)
        save_preflight(self.plan.cluster, report.to_json())
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
        result = stage.pull(self.inv, stage.PullOptions(token=self.opts.hub_token,
                                                        accept_new_host_keys=self.opts.accept_new_host_keys),
                            stage.Reporter(self.say), self.manifest)
        self.timings["weights"] = round(time.monotonic() - t0, 2)
        if not result.ok:
            bad = next(h for h in result.hosts if h.state != "complete")
            raise HostError(f"weights are not staged on {bad.host}: {bad.error or bad.state}", host=bad.host,
                            step="weights", hint="see `kimictl weights status`")

    def _converge(self, changes: list[Change], procs: list[Proc]) -> None:
        self.install_release(self.rendered, sorted(self.rendered.releases))
        engine_changes = [c for c in changes if c.id != "proxy" and c.action != "keep"]
        stops: dict[str, list[str]] = {}
        starts: dict[str, list[dict[str, Any]]] = {}
        for c in engine_changes:
            if c.action in ("stop", "replace"):
                stops.setdefault(c.host, []).append(c.id)
            if c.action in ("start", "replace") and c.new:
                starts.setdefault(c.host, []).append({"id": c.id, "cmd": c.new.cmd, "tag": c.new.tag,
                                                      "replace": False})
        # A proxy whose backends restart goes out first and comes back once they answer.
        proxy_change = next((c for c in changes if c.id == "proxy"), None)
        if proxy_change and proxy_change.action in ("stop", "replace"):
            stops.setdefault(proxy_change.host, []).insert(0, "proxy")
        t0 = time.monotonic()
        self.apply_actions(stops, starts, "engines")
        started = [c.new for c in engine_changes if c.new and c.action in ("start", "replace")]
        self.wait_ready([p for p in started if p is not None])
        self.timings["engines_ready"] = round(time.monotonic() - t0, 2)
        if proxy_change and proxy_change.action in ("start", "replace") and proxy_change.new:
            p = proxy_change.new
            self.apply_actions({}, {p.host: [{"id": p.id, "cmd": p.cmd, "tag": p.tag, "replace": False}]}, "proxy")
            self.wait_ready([p])

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
            self.apply_actions(stops, starts, "rollback")
            restored = [Proc(c.host, c.id, "engine", str(c.old.get("tag")), list(c.old["cmd"]), c.new.ip,
                             c.new.port, c.new.serves_http, c.new.role)
                        for c in changes if c.action == "replace" and c.old and c.new]
            if restored:
                self.opts.ready_timeout = ROLLBACK_READY_TIMEOUT_S
                self.wait_ready(restored)
                self.say("rollback done: the previous release answers again")
        except KimictlError as exc:
            self.say(f"rollback incomplete: {exc.message}")

    def _record(self, result: str, changes: list[Change]) -> None:
        rec = {"release": self.release, "at": datetime.now(UTC).isoformat(timespec="seconds"),
               "by": getpass.getuser(), "cluster": self.plan.cluster, "topology": self.plan.topology,
               "hosts": self.rendered.releases, "result": result, "run_dir": str(self.run_dir),
               "changes": [asdict(c) | {"new": None, "old": None} for c in changes if c.action != "keep"]}
        path = control_dir(self.plan.cluster) / "releases.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        if result == "deployed":
            cur = control_dir(self.plan.cluster) / "current.json"
            tmp = cur.with_suffix(".tmp")
            tmp.write_text(json.dumps(rec, indent=1))
            tmp.replace(cur)


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
            files = ([f"engines/{c.id}.env", f"engines/{c.id}.sh"] if c.id != "proxy" else ["proxy/proxy.sh"])
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


def rollback_target(cluster: str, to: str | None = None) -> tuple[dict[str, Any], Rendered]:
    """The release to go back to: `to`, or the last deployed release before the current one."""
    from kimictl.errors import InvalidInput

    path = control_dir(cluster) / "releases.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    deployed = [r for r in records if r.get("result") == "deployed"]
    if not deployed:
        raise InvalidInput(f"no deployed release of cluster {cluster} is recorded in {path}")
    current = deployed[-1]["release"]
    if to:
        matches = [r for r in deployed if r["release"].startswith(to)]
        if not matches:
            raise InvalidInput(f"release {to} was never deployed to {cluster}; deployed: "
                               + ", ".join(dict.fromkeys(r["release"] for r in deployed)))
        target = matches[-1]
    else:
        older = [r for r in deployed if r["release"] != current]
        if not older:
            raise InvalidInput(f"cluster {cluster} has only one deployed release ({current}); nothing to roll back to")
        target = older[-1]
    snap = Path(target["run_dir"]) / "rendered.json"
    if not snap.exists():
        raise InvalidInput(f"release {target['release']} cannot be restored: {snap} is missing")
    return target, Rendered.model_validate_json(snap.read_text())
