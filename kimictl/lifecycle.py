"""Stop and start: every supervised process off (releases, weights and `current` kept), or `current` back up."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kimictl import remote, state
from kimictl.errors import HostError, reported
from kimictl.hostops import LIVE_STATES, PROCESS_ID, RELEASE, HostOps, Proc, compute_changes, observe, process_tag
from kimictl.inventory import Inventory
from kimictl.logs import role_of
from kimictl.ssh import Sessions, SSHError

# Stopping in this order: clients go away before the engines they reach (proxy, then decode, which pulls
# KV from prefill, then prefill and anything else).
STOP_PHASES = (("proxy",), ("decode",), ("prefill", "colocated", "?"))
RUNNING = (*LIVE_STATES, "stopping", "dead")  # "dead": the supervisor is gone, its child may not be


@dataclass
class LifecycleResult:
    cluster: str
    action: str  # stop | start
    result: str  # stopped | already-stopped | started | already-running
    hosts: dict[str, dict[str, Any]] = field(default_factory=dict)
    run_dir: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": 1, "cluster": self.cluster, "action": self.action, "result": self.result,
                "hosts": self.hosts, "run_dir": self.run_dir}


def _ops(inv: Inventory, name: str, served_model_name: str, say: Callable[[str], None],
         on_event: Callable[[str, str, str], None] | None, accept_new_host_keys: bool,
         ready_timeout: float | None = None) -> HostOps:
    return HostOps(inv, served_model_name, state.new_run_dir(inv.cluster.name, name), say=say, on_event=on_event,
                   accept_new_host_keys=accept_new_host_keys, ready_timeout=ready_timeout)


# --- stop ------------------------------------------------------------------------------------------------

def stop_plan(states: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, list[str]]]:
    """Per phase, the running ids to stop on each host; empty phases are left out."""
    phases: list[dict[str, list[str]]] = []
    for roles in STOP_PHASES:
        phase = {h: sorted(pid for pid, st in sts.items() if role_of(pid) in roles and st.get("state") in RUNNING)
                 for h, sts in sorted(states.items())}
        phase = {h: ids for h, ids in phase.items() if ids}
        if phase:
            phases.append(phase)
    return phases


def stop(inv: Inventory, *, say: Callable[[str], None], on_event: Callable[[str, str, str], None] | None = None,
         accept_new_host_keys: bool = False) -> LifecycleResult:
    """Stop every supervised engine and the proxy on the inventory's hosts; idempotent."""
    observed = observe(inv, accept_new_keys=accept_new_host_keys)
    states = {h: o.states for h, o in observed.items()}
    phases = stop_plan(states)
    hosts = {h: {"current": o.current, "stopped": []} for h, o in observed.items()}
    if not phases:
        say("nothing runs: every supervised process is already stopped")
        return LifecycleResult(inv.cluster.name, "stop", "already-stopped", hosts)
    d = _ops(inv, "stop", "", say, on_event, accept_new_host_keys)
    try:
        for phase in phases:
            d.apply_actions(phase, {}, "stop")
            for h, ids in phase.items():
                hosts[h]["stopped"] += ids
    finally:
        d.close()
    after = observe(inv, accept_new_keys=accept_new_host_keys)
    left = [(h, pid, st.get("state")) for h, o in after.items() for pid, st in o.states.items()
            if st.get("state") in RUNNING]
    if left:
        h, pid, _state = left[0]
        raise HostError(f"{len(left)} process(es) still run after stop: "
                        + ", ".join(f"{x[0]}:{x[1]} ({x[2]})" for x in left), host=h, step="stop",
                        log_tail=d.log_tail(h, pid))
    return LifecycleResult(inv.cluster.name, "stop", "stopped", hosts, str(d.run_dir))


# --- start -----------------------------------------------------------------------------------------------

def read_current(inv: Inventory, timeout: float = 30.0, accept_new_keys: bool = False) -> dict[str, Any]:
    """Per host: {release, manifest, files} of `current`, or None when the host has no current release."""

    def one(name: str, s) -> Any:
        res = s.run(f"python3 - {shlex.quote(inv.host(name).kimi_state_dir)}", timeout=timeout,
                    stdin=remote.script("read_current.py"))
        if res.rc != 0:
            raise SSHError(f"{name}: cannot read the current release: {res.stderr.strip()[-300:]}")
        try:
            return json.loads(res.stdout)
        except ValueError:
            raise SSHError(f"{name}: read_current.py answered {reported(res.stdout)}, not JSON") from None

    with Sessions(inv, timeout=timeout, accept_new_keys=accept_new_keys) as sessions:
        got = sessions.each(one)
    bad = {h: r for h, r in got.items() if isinstance(r, SSHError)}
    if bad:
        raise HostError(f"cannot read the current release of {len(bad)} host(s)", host=next(iter(bad)),
                        step="read current", details=[str(e) for e in bad.values()])
    return {h: checked_current(h, cur) for h, cur in got.items()}


def checked_current(host: str, cur: Any) -> Any:
    """A host's current release as it reported it, refused unless it is what deploy installs: a hex release name,
    engines whose ids are process ids and whose command is their own rendered script, integer ports (start runs
    these commands on the host again)."""
    if cur is None:
        return None

    def refuse(what: str, value: Any) -> HostError:
        return HostError(f"the current release reports {what} {reported(value)}, which kimictl never installs",
                         host=host, step="read current")

    if not (isinstance(cur, dict) and isinstance(cur.get("manifest"), dict) and isinstance(cur.get("files"), dict)
            and all(isinstance(x, str) for kv in cur["files"].items() for x in kv)
            and isinstance(cur["manifest"].get("engines") or [], list)):
        raise refuse("itself as", cur)
    if not isinstance(cur.get("release"), str) or not RELEASE.fullmatch(cur["release"]):
        raise refuse("the release name", cur.get("release"))
    engines, proxy = cur["manifest"].get("engines") or [], cur["manifest"].get("proxy")
    for e in [*engines, *([proxy] if proxy else [])]:
        if not isinstance(e, dict):
            raise refuse("the process", e)
        pid = "proxy" if e is proxy else e.get("id")
        if not isinstance(pid, str) or not PROCESS_ID.match(pid):
            raise refuse("the process id", pid)
        scripts = (["bash", "proxy/proxy.sh"],) if e is proxy else (["bash", f"engines/{pid}.sh"],
                                                                     ["bash", f"engines/{pid}.container.sh"])
        if e.get("command") not in scripts:
            raise refuse(f"{pid}'s command as", e.get("command"))
        if type(e.get("port")) is not int:
            raise refuse(f"{pid}'s port as", e.get("port"))
    return cur


def current_procs(inv: Inventory, current: dict[str, Any]) -> list[Proc]:
    """The processes of each host's current release, as `desired_procs` would describe them at deploy time."""
    procs: list[Proc] = []
    for name, cur in current.items():
        h = inv.host(name)
        base = f"{h.kimi_state_dir}/releases/{cur['release']}"
        man, files = cur["manifest"], cur["files"]
        for e in man.get("engines", []):
            procs.append(Proc(name, e["id"], "engine", process_tag(files, e["id"]),
                              ["bash", f"{base}/{e['command'][1]}"], h.ip, int(e["port"]), bool(e["serves_http"]),
                              e["role"]))
        if man.get("proxy"):
            p = man["proxy"]
            procs.append(Proc(name, "proxy", "proxy", process_tag(files, "proxy"),
                              ["bash", f"{base}/{p['command'][1]}"], h.ip, int(p["port"]), True, "proxy",
                              p.get("router")))
    return procs


def start(inv: Inventory, *, say: Callable[[str], None], on_event: Callable[[str, str, str], None] | None = None,
          ready_timeout: float | None = None, accept_new_host_keys: bool = False) -> LifecycleResult:
    """Start each host's current release (engines, readiness, then the proxy); idempotent."""
    current = read_current(inv, accept_new_keys=accept_new_host_keys)
    missing = sorted(h for h, c in current.items() if not c)
    if missing:
        raise HostError(f"no current release on {', '.join(missing)}; nothing was started", host=missing[0],
                        step="read current", hint="deploy first: kimictl deploy -i INV --topology T")
    procs = current_procs(inv, current)
    observed = observe(inv, accept_new_keys=accept_new_host_keys)
    changes = compute_changes(procs, observed)
    # Something else runs under a current id (another release): that is deploy's or rollback's job.
    conflicts = [c for c in changes if c.action == "replace"]
    if conflicts:
        c = conflicts[0]
        raise HostError(f"{len(conflicts)} process(es) run another release than current: "
                        + ", ".join(f"{x.host}:{x.id}" for x in conflicts) + "; nothing was started",
                        host=c.host, step="start", hint="converge with `kimictl deploy` or `kimictl rollback`")
    todo = {(c.host, c.id) for c in changes if c.action == "start"}
    served = next((c["manifest"].get("served_model_name") for c in current.values()), "") or ""
    hosts: dict[str, dict[str, Any]] = {h: {"release": c["release"], "started": [], "kept": []}
                                        for h, c in current.items()}
    for p in procs:
        hosts[p.host]["started" if (p.host, p.id) in todo else "kept"].append(p.id)
    d = _ops(inv, "start", served, say, on_event, accept_new_host_keys, ready_timeout)

    def starts(group: list[Proc]) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for p in group:
            if (p.host, p.id) in todo:
                out.setdefault(p.host, []).append(p.start_action())
        return out

    engines = [p for p in procs if p.kind == "engine"]
    proxies = [p for p in procs if p.kind == "proxy"]
    try:
        d.apply_actions({}, starts(engines), "engines")
        d.wait_ready(engines)  # returns at once for engines that already answer
        d.apply_actions({}, starts(proxies), "proxy")
        d.wait_ready(proxies)
    finally:
        d.close()
    return LifecycleResult(inv.cluster.name, "start", "started" if todo else "already-running", hosts,
                           str(d.run_dir) if todo else None)
