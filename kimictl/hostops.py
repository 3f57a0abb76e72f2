"""Host operations: the one way kimictl changes and watches supervised processes on hosts.

Deploy, start/stop, rollout (and heal) compose a `HostOps`: every change goes through a playbook run in one run
directory (engines.yml starts/stops/reloads, release.yml unpacks a release, switch.yml moves `current`), and
readiness, supervisor state and log tails are read over SSH (paramiko, read-only) and HTTP. SSH (`connect`) and
HTTP (`http`) are injectable; tests replace the whole component with a fake that records what was asked.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kimictl import health, remote
from kimictl.cluster_secrets import (
    engine_api_key,
    engine_key_file,
    proxy_admin_key,
    proxy_admin_key_path,
    proxy_api_key,
)
from kimictl.errors import HostError, guide, reported
from kimictl.inventory import Inventory
from kimictl.remote import reserve_ports
from kimictl.remote.supervisor import NAME_RE as PROCESS_ID
from kimictl.routers import proxy_ready
from kimictl.ssh import Sessions, SSHError, ansible_host_key_args

if TYPE_CHECKING:
    from kimictl.ansible import PlaybookResult
    from kimictl.plan import Plan
    from kimictl.render import Rendered

LIVE_STATES = ("starting", "running", "backoff")
STOP_GRACE_S = 30
ROLLBACK_READY_TIMEOUT_S = 300.0  # readiness wait when a rollback restores the previous release
# Files every host gets in <state>/bin/ (release.yml): the supervisor and the proxy front (and the engine profile's
# connector shim when the plan's connector names one: render.engine_shims).
HOST_BIN = ("supervisor.py", "proxy_front.py")


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
    router: str | None = None  # the proxy's router kind (data/routers.yml): how its readiness is judged

    def start_action(self, replace: bool = False) -> dict[str, Any]:
        """The engines.yml start entry for this process (`replace`: stop whatever runs under its id first)."""
        return {"id": self.id, "cmd": self.cmd, "tag": self.tag, "replace": replace}


def _sha(*texts: str) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode() + b"\0")
    return h.hexdigest()[:16]


def process_tag(files: dict[str, str], pid: str) -> str:
    """A process's tag: the hash of exactly the release files it runs (its restart trigger)."""
    prefix = "proxy/" if pid == "proxy" else f"engines/{pid}."
    return _sha(*(files[p] for p in sorted(files) if p.startswith(prefix)))


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
                        rendered.proxy.host, rendered.proxy.port, True, "proxy", plan.proxy.router))
    return out


@dataclass
class HostObservation:
    states: dict[str, dict[str, Any]]
    current: str | None


RELEASE = re.compile(r"[0-9a-f]{1,64}")   # render.release_id


def reported_states(host: str, records: Any) -> dict[str, dict[str, Any]]:
    """`supervisor.py status` as a host reported it, by process id; a host whose report is not that is refused (its
    strings go back to it in playbooks: an id must be one, a command a list of strings)."""
    if not isinstance(records, list) or not all(isinstance(st, dict) for st in records):
        raise HostError(f"supervisor.py status reported {reported(records)}, not a list of process records",
                        host=host, step="observe")
    for st in records:
        if not isinstance(st.get("name"), str) or not PROCESS_ID.match(st["name"]):
            raise HostError(f"supervisor.py status reported a process named {reported(st.get('name'))}, which is not "
                            "a process id", host=host, step="observe")
        cmd, tag = st.get("cmd"), st.get("tag")
        if not (cmd is None or (isinstance(cmd, list) and all(isinstance(a, str) for a in cmd))) \
                or not (tag is None or isinstance(tag, str)):
            raise HostError(f"supervisor.py status reported {st['name']} with the command {reported(cmd)} and tag "
                            f"{reported(tag)}, not a list of strings and a string", host=host, step="observe")
    return {st["name"]: st for st in records}


def installed_command(host: str, pid: str, cmd: Any, state_dir: str) -> list[str]:
    """The command a host reports for one of kimictl's processes, accepted only in the one shape kimictl installs
    (`desired_procs`): bash running that process's own script in a release under the host's state dir. Deploy runs
    it again when it rolls back; anything else a host reports is refused, never run."""
    script = r"proxy/proxy\.sh" if pid == "proxy" else rf"engines/{re.escape(pid)}(\.container)?\.sh"
    if (isinstance(cmd, list) and len(cmd) == 2 and cmd[0] == "bash" and isinstance(cmd[1], str)
            and re.fullmatch(rf"{re.escape(state_dir)}/releases/{RELEASE.pattern}/{script}", cmd[1])):
        return list(cmd)
    raise HostError(f"supervisor.py status reported {pid}'s command as {reported(cmd)}, which kimictl never "
                    "installs", host=host, step="observe")


def observe(inv: Inventory, timeout: float = 15.0, accept_new_keys: bool = False,
            connect: Callable[..., Sessions] = Sessions) -> dict[str, HostObservation]:
    """What the supervisor on each host runs now, and where `current` points (one SSH round trip per host); a host
    that does not answer is a HostError naming it."""
    got, bad = observe_reachable(inv, timeout, accept_new_keys, connect)
    if bad:
        host = next(iter(bad))
        raise HostError(f"cannot read the current state of {len(bad)} host(s)", host=host, step="observe",
                        details=[str(e) for e in bad.values()])
    return got


def observe_reachable(inv: Inventory, timeout: float = 15.0, accept_new_keys: bool = False,
                      connect: Callable[..., Sessions] = Sessions,
                      ) -> tuple[dict[str, HostObservation], dict[str, SSHError]]:
    """`observe` of the hosts that answer, and the SSH error of each host that does not (heal watches on)."""

    def probe(name: str, s) -> HostObservation:
        sd = inv.host(name).kimi_state_dir
        res = s.run(f"if [ -f {sd}/bin/supervisor.py ]; then python3 {sd}/bin/supervisor.py status "
                    f"--run-dir {sd}/run; else echo '[]'; fi; echo '@@current'; readlink {sd}/current || true",
                    timeout=timeout)
        body, _, cur = res.stdout.partition("@@current")
        try:
            states = reported_states(name, json.loads(body or "[]"))
        except ValueError:
            states = {}
        current = cur.strip().rsplit("/", 1)[-1] or None
        if current is not None and not RELEASE.fullmatch(current):
            raise HostError(f"`current` points at {reported(current)}, not a release", host=name, step="observe")
        return HostObservation(states, current)

    with connect(inv, timeout=timeout, accept_new_keys=accept_new_keys) as sessions:
        got = sessions.each(probe)
    bad = {h: r for h, r in got.items() if isinstance(r, SSHError)}
    return {h: r for h, r in got.items() if not isinstance(r, SSHError)}, bad


@dataclass
class Change:
    host: str
    id: str
    action: str  # start | replace | stop | keep
    new: Proc | None = None
    old: dict[str, Any] | None = None


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


def exit_text(last_exit: dict[str, Any] | None) -> str:
    """The supervisor's record of a child's last exit, in words."""
    if not last_exit:
        return "none recorded"
    at = f" at {last_exit['at']}" if last_exit.get("at") else ""
    if "signal" in last_exit:
        return f"killed by {last_exit.get('signal_name') or 'signal ' + str(last_exit['signal'])}{at}"
    if "code" in last_exit:
        return f"exit code {last_exit['code']}{at}"
    return f"{last_exit.get('error') or 'unknown'}{at}"


class HostOps:
    """Changes to supervised processes on the hosts of one inventory, all recorded in one run directory."""

    def __init__(self, inv: Inventory, served_model_name: str, run_dir: Path, *, say: Callable[[str], None],
                 on_event: Callable[[str, str, str], None] | None = None, accept_new_host_keys: bool = False,
                 ready_timeout: float | None = None, connect: Callable[..., Sessions] = Sessions, http: Any = health):
        self.inv, self.served_model_name, self.run_dir = inv, served_model_name, run_dir
        self.say, self.on_event = say, on_event
        self.accept_new_host_keys = accept_new_host_keys
        self.ready_timeout = ready_timeout  # None: sized to the checkpoint (see default_ready_timeout)
        self.connect, self.http = connect, http
        self.state_dir_of = {h.name: h.kimi_state_dir for h in inv.hosts}
        self.full_inv = inv   # the cluster's keys are read from every host, whatever --limit says
        self.api_key = proxy_api_key(inv)
        self._engine_keys: dict[bool, str | None] = {}
        self.n_runs = 0
        self.timings: dict[str, float] = {}

    def limit(self, hosts: list[str]) -> None:
        """--limit: playbooks and probes reach only these hosts."""
        self.inv = self.inv.limited(hosts)

    # --- playbooks -------------------------------------------------------------------------------------

    def _run(self, name: str, extravars: dict[str, Any], hosts: list[str]) -> PlaybookResult:
        from kimictl.ansible import build_run_spec, run_playbook

        self.n_runs += 1
        ident = f"{self.n_runs:02d}-{name.removesuffix('.yml')}"
        spec = build_run_spec(self.run_dir, name, Path(self.inv.path), {"kimi": extravars}, ident=ident,
                              hosts=[h.name for h in self.inv.hosts], limit=hosts,
                              host_key_args=ansible_host_key_args(self.inv, self.accept_new_host_keys))
        t0 = time.monotonic()
        res = run_playbook(spec, self.on_event)
        self.timings[ident] = round(time.monotonic() - t0, 2)
        return res

    def playbook(self, name: str, extravars: dict[str, Any], hosts: list[str]) -> None:
        res = self._run(name, extravars, hosts)
        if not res.ok:
            f = res.failures[0] if res.failures else None
            raise HostError(f"playbook {name} failed" + (f": {f.message.splitlines()[0][:300]}" if f else ""),
                            host=f.host if f else None, step=f.task if f else name,
                            log_tail=f.message if f else None,
                            details=[f"{x.host}: {x.task}" for x in res.failures[1:5]],
                            hint=f"ansible artifacts: {res.artifacts}")

    def apply_actions(self, stops: dict[str, list[str]], starts: dict[str, list[dict[str, Any]]], what: str) -> None:
        """Stop, then start, supervised processes per host (engines.yml); hosts without actions are left alone."""
        hosts = sorted(set(stops) | set(starts))
        if not hosts:
            return
        actions = {h: {"stop": stops.get(h, []), "start": starts.get(h, [])} for h in hosts}
        self.say(f"{what}: " + ", ".join(f"{h} (stop {len(a['stop'])}, start {len(a['start'])})"
                                         for h, a in actions.items()))
        self.playbook("engines.yml", {"state_dir_of": self.state_dir_of, "actions": actions,
                                      "grace": STOP_GRACE_S}, hosts)

    def write_record(self, extravars: dict[str, Any], hosts: list[str]) -> dict[str, str]:
        """Copy the release record to these hosts (record.yml, vars from kimictl.cluster_record); never raises: the
        hosts it could not write, with why (the caller reports them)."""
        res = self._run("record.yml", extravars, hosts)
        if res.ok:
            return {}
        def first_line(text: str) -> str:
            return (text.strip().splitlines() or ["failed"])[0][:300]

        whole = next((f for f in res.failures if f.host not in hosts), None)  # ansible-playbook itself failed
        if whole is not None or not res.failures:
            return dict.fromkeys(hosts, first_line(whole.message) if whole else f"record.yml ended {res.status}")
        return {f.host: f"{f.task}: {first_line(f.message)}" for f in res.failures}

    def reload_proxy(self, host: str) -> None:
        """Restart the router copies behind kimictl's proxy front one at a time (the front keeps its port)."""
        self.playbook("engines.yml", {"state_dir_of": self.state_dir_of, "grace": STOP_GRACE_S,
                                      "actions": {host: {"reload_proxy": True}}}, [host])

    def install_release(self, rendered: Rendered, hosts: list[str], *, admin_key_file: Path | None = None) -> None:
        """Unpack each host's release next to the running one (nothing restarts); the tools in bin/ and the
        cluster's keys (the clients', the admin key of the proxy's routers' API and the engines', made here when the
        cluster has none: kimictl/cluster_secrets.py) are brought up to date on the way. `admin_key_file`: install
        this admin key instead (`kimictl keys rotate`)."""
        from kimictl.render import engine_shims

        p = rendered.plan.proxy
        admin = admin_key_file is not None or (
            p is not None and p.admin_key and proxy_admin_key(self.full_inv, p.host, create=True) is not None)
        self.playbook("release.yml", {
            "state_dir_of": self.state_dir_of,
            "bin": {**{name: str(remote.source(name)) for name in HOST_BIN}, **engine_shims(rendered.plan)},
            "hosts": {h: {"release": rendered.releases[h], "bundle": str(self._bundle(h))} for h in hosts},
            "proxy_host": p.host if p else None, "api_key_file": self.inv.cluster.kimi_api_key_file,
            "admin_key_file": str(admin_key_file or proxy_admin_key_path(self.inv.cluster.name)) if admin else None,
            "engine_key_file": str(key) if (key := engine_key_file(self.full_inv, rendered.plan.mode == "pd",
                                                                   create=True)) else None,
            **self._reserve_vars(rendered.plan)}, hosts)
        self._engine_keys.clear()   # the engines' key may have been made or supplied just now

    def reserve_ports(self, plan: Plan) -> None:
        """Keep every host's planned ports out of the ephemeral range now (ports.yml; deploy runs it before weights
        staging, whose connections could otherwise take them); install_release does the same on every install."""
        extra = self._reserve_vars(plan)
        limited = {h.name for h in self.inv.hosts}
        hosts = sorted(h for h in extra["reserve_ports"] if h in limited)
        if hosts:
            # kimictl's own SSH first, as before every playbook: it checks host keys (and with
            # --accept-new-host-keys records new ones) and names a host it cannot reach, before Ansible's ssh does
            self.observe(hosts)
            self.playbook("ports.yml", extra, hosts)

    def _reserve_vars(self, plan: Plan) -> dict[str, Any]:
        if not self.inv.cluster.kimi_reserve_ports:
            return {"reserve_ports": {}}
        by_host: dict[str, list[tuple[int, int]]] = {}
        for u in plan.ports:
            by_host.setdefault(u.host, []).append((u.first, u.last))
        return {"reserve_script": str(remote.source("reserve_ports.py")),
                "reserve_ports": {h: reserve_ports.spell(reserve_ports.merge(r)) for h, r in by_host.items()}}

    def switch(self, releases: dict[str, str]) -> None:
        """Point each host's `current` at its release (switch.yml)."""
        self.playbook("switch.yml", {"state_dir_of": self.state_dir_of,
                                     "hosts": {h: {"release": r} for h, r in releases.items()}}, sorted(releases))

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

    def close(self) -> None:
        """End the SSH control masters this run's playbooks opened."""
        from kimictl.ansible import close_control_masters

        close_control_masters(self.run_dir)

    # --- reading the hosts ---------------------------------------------------------------------------

    def observe(self, hosts: list[str] | None = None) -> dict[str, HostObservation]:
        inv = self.inv.limited(hosts) if hosts else self.inv
        return observe(inv, accept_new_keys=self.accept_new_host_keys, connect=self.connect)

    def observe_reachable(self) -> tuple[dict[str, HostObservation], dict[str, str]]:
        """`observe` of the hosts that answer, and why each other host does not (its SSH error)."""
        got, bad = observe_reachable(self.inv, accept_new_keys=self.accept_new_host_keys, connect=self.connect)
        return got, {h: str(e) for h, e in bad.items()}

    def ready(self, p: Proc) -> health.Ready:
        if p.kind == "proxy":
            return proxy_ready(p.router, p.ip, p.port, self.served_model_name, api_key=self.api_key, http=self.http)
        return self.http.engine_ready(p.ip, p.port, self.served_model_name, api_key=self.engine_key(p.role))

    def engine_key(self, role: str) -> str | None:
        """The key engines of this role require (P/D: the cluster's engine key; colocated: the clients'), looked up
        once per run (readiness polls ask for it again and again)."""
        pd = role in ("prefill", "decode")
        if pd not in self._engine_keys:
            self._engine_keys[pd] = engine_api_key(self.full_inv, pd)
        return self._engine_keys[pd]

    def log_tail(self, host: str, pid: str, lines: int = 30) -> str:
        sd = self.state_dir_of[host]
        with self.connect(self.inv.limited([host]), accept_new_keys=self.accept_new_host_keys) as s:
            got = s.each(lambda _n, sess: sess.run(f"tail -n {lines} {sd}/logs/{pid}.log 2>&1").stdout)
        return str(got[host])

    def default_ready_timeout(self) -> float:
        """Real K2.5 loads take ~10 min: the wait is sized to the checkpoint (>= 0.5 GiB/s) plus start-up, and
        never below the engine profile's floor (a CPU engine's start-up is imports and compilation, not bytes)."""
        from kimictl.facts import engine_profile
        from kimictl.state import cached_manifest_bytes

        size, _ = cached_manifest_bytes(self.inv.cluster.name)
        prof = engine_profile(self.inv.cluster.kimi_engine_profile)
        size = size or prof.facts(self.inv.cluster.kimi_model_id).total_bytes
        return max(prof.min_ready_timeout_s, 180.0 + size / (0.5 * 2**30))

    def wait_ready(self, procs: list[Proc], timeout: float | None = None) -> None:
        """Poll HTTP readiness; fail fast when the supervisor reports a crash (restart or failed state)."""
        if not procs:
            return
        deadline = time.monotonic() + (timeout or self.ready_timeout or self.default_ready_timeout())
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
                                step="readiness", log_tail=self.log_tail(p.host, p.id),
                                hint=f"still loading, or hung: {guide('t-readiness')}")
            time.sleep(0.3)

    def _check_crashes(self, procs: list[Proc]) -> None:
        states = {h: o.states for h, o in self.observe(sorted({p.host for p in procs})).items()}
        for p in procs:
            st = states.get(p.host, {}).get(p.id)
            if st is None:
                continue
            if st.get("state") in ("failed", "stopped", "dead") or int(st.get("restarts", 0)) > 0:
                raise HostError(f"{p.kind} {p.id} crashed during start-up (state {st.get('state')}, "
                                f"restarts {st.get('restarts', 0)}, last exit: {exit_text(st.get('last_exit'))})",
                                host=p.host, step="proxy" if p.kind == "proxy" else "engines",
                                log_tail=self.log_tail(p.host, p.id),
                                hint="the log tail's last ERROR line says why: "
                                     + (guide("t-proxy-start") if p.kind == "proxy" else guide("t-engine-start")))
