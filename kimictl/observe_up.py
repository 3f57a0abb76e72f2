"""`kimictl observe up`: Prometheus on the monitoring host, node_exporter on every host and the proxy exporter on the
proxy host, each under kimictl's supervisor (playbooks/observe.yml), then wait until Prometheus has scraped every
rendered target. The monitoring processes live in <state>/observe/run, apart from the engines: deploy, rollout,
stop and status never touch them."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kimictl import health, remote
from kimictl.errors import HostError, KimictlError, reported
from kimictl.hostops import LIVE_STATES, Change, HostObservation, HostOps, Proc, compute_changes, reported_states
from kimictl.inventory import Inventory
from kimictl.observe import PROXY_EXPORTER_SRC, ObserveConfig, ObserveRender, load_config, seconds, write_observe
from kimictl.plan import Plan
from kimictl.router_kinds import router_kind
from kimictl.ssh import Sessions, SSHError
from kimictl.state import control_dir, new_run_dir

OBSERVE_DIR = "observe"  # under a host's kimi_state_dir: run/, logs/, data/ and Prometheus' files
PROMETHEUS, NODE_EXPORTER, PROXY_EXPORTER = "prometheus", "node-exporter", "proxy-exporter"
# The system user the monitoring processes run as (observe.yml creates it; the supervisor switches to it): none of
# them needs root. It reads Prometheus' files and owns its data; it can traverse the state dir and bin/, no more.
OBSERVE_USER = "kimi-observe"
STOP_GRACE_S = 10
RECORD = "observe.json"  # in the cluster's control directory: where Prometheus runs (for `kimictl status`)


@dataclass
class HostProbe:
    binaries: dict[str, str]  # name -> path on the host, for the binaries found
    states: dict[str, dict[str, Any]]  # the supervisor's monitoring processes
    node_port_open: bool
    root: bool = True  # kimictl logs in as root there (else the processes run as that login, unprivileged already)

    @property
    def user(self) -> str | None:
        """Whom the monitoring processes run as: OBSERVE_USER, or None for the login user when that is not root."""
        return OBSERVE_USER if self.root else None


@dataclass
class UpResult:
    cluster: str
    prometheus_url: str
    monitor_host: str
    profile: str
    targets: int
    up: list[dict[str, Any]] = field(default_factory=list)
    down: list[dict[str, Any]] = field(default_factory=list)
    actions: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    node_exporter: dict[str, str] = field(default_factory=dict)
    files: str = ""
    run_dir: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": 1, "cluster": self.cluster, "result": "up" if not self.down else "degraded",
                "prometheus_url": self.prometheus_url, "monitor_host": self.monitor_host, "profile": self.profile,
                "targets": self.targets, "targets_up": len(self.up), "down": self.down, "actions": self.actions,
                "node_exporter": self.node_exporter, "files": self.files, "run_dir": self.run_dir}


_BINARY_PATH = re.compile(r"/[A-Za-z0-9._+-]+(/[A-Za-z0-9._+-]+)*")


def probe_hosts(inv: Inventory, hosts: list[str], cfg: ObserveConfig, *, timeout: float = 20.0,
                accept_new_keys: bool = False) -> dict[str, HostProbe]:
    """One SSH round trip per host (read-only): the binaries, the monitoring processes, node_exporter's port."""
    names = [*cfg.prometheus.binaries, *cfg.node_exporter.binaries]

    def one(name: str, s) -> HostProbe:
        h = inv.host(name)
        sd, od = h.kimi_state_dir, f"{h.kimi_state_dir}/{OBSERVE_DIR}"
        cmd = ("PATH=$PATH:/usr/local/sbin:/usr/local/bin:/usr/sbin:/sbin; "
               + "".join(f"printf '%s=%s\\n' {shlex.quote(b)} \"$(command -v {shlex.quote(b)} || true)\"; "
                         for b in names)
               + f"echo @@kimi; if [ -f {sd}/bin/supervisor.py ] && [ -d {od}/run ]; then "
               f"python3 {sd}/bin/supervisor.py status --run-dir {od}/run || echo '[]'; else echo '[]'; fi; "
               "echo @@kimi; python3 -c 'import socket,sys; s=socket.socket(); s.settimeout(1); "
               f"print(s.connect_ex((sys.argv[1], int(sys.argv[2]))))' {h.ip} {cfg.node_exporter.port}; "
               "echo @@kimi; id -u")
        out = s.run(cmd, timeout=timeout).stdout
        bins, _, rest = out.partition("@@kimi")
        sup, _, rest = rest.partition("@@kimi")
        port, _, uid = rest.partition("@@kimi")
        found = {k: v for k, v in (line.split("=", 1) for line in bins.splitlines() if "=" in line) if v}
        for b, path in found.items():   # run as commands on that host: the names asked, absolute plain paths only
            if b not in names or not _BINARY_PATH.fullmatch(path):
                raise HostError(f"`command -v` answered {reported(b)}={reported(path)}, not an absolute path of "
                                "one of the binaries asked for", host=name, step="probe")
        try:
            states = reported_states(name, json.loads(sup or "[]"))
        except ValueError:
            states = {}
        return HostProbe(found, states, port.strip() == "0", uid.strip() == "0")

    with Sessions(inv.limited(hosts), timeout=timeout, accept_new_keys=accept_new_keys) as sessions:
        got = sessions.each(one)
    bad = {h: r for h, r in got.items() if isinstance(r, SSHError)}
    if bad:
        h = next(iter(bad))
        raise HostError(f"cannot reach {len(bad)} host(s): {bad[h]}", host=h, step="probe",
                        details=[f"{k}: {v}" for k, v in bad.items()])
    return got  # type: ignore[return-value]


def _tag(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() + b"\0")
    return h.hexdigest()[:16]


def desired_procs(plan: Plan, inv: Inventory, r: ObserveRender, cfg: ObserveConfig,
                  probes: dict[str, HostProbe]) -> tuple[list[Proc], dict[str, str]]:
    """The monitoring processes per host, and per host whose node_exporter is scraped (kimictl's or one that
    already listens on the port: a site's own node_exporter is kept, not doubled)."""
    procs: list[Proc] = []
    node: dict[str, str] = {}
    missing: list[str] = []

    def binary(host: str, names: list[str]) -> str | None:
        found = next((probes[host].binaries[b] for b in names if b in probes[host].binaries), None)
        if found is None:
            missing.append(f"{host}: none of {', '.join(names)} is installed")
        return found

    for host in (h.name for h in inv.hosts if h.name in plan.host_roles):
        h, pr = inv.host(host), probes[host]
        ours = pr.states.get(NODE_EXPORTER, {}).get("state") in LIVE_STATES
        if pr.node_port_open and not ours:
            node[host] = "existing"
            continue
        node[host] = "kimictl"
        b = binary(host, cfg.node_exporter.binaries)
        cmd = [b or "", f"--web.listen-address={h.ip}:{cfg.node_exporter.port}"]
        procs.append(Proc(host, NODE_EXPORTER, "monitor", _tag(*cmd, f"user={pr.user}"), cmd, h.ip,
                          cfg.node_exporter.port, True, "node"))
    if plan.proxy:
        p, h = plan.proxy, inv.host(plan.proxy.host)
        probe_s = max(0.2, min(1.5, seconds(cfg.prometheus.scrape_timeout) * 0.6))
        cmd = ["python3", f"{h.kimi_state_dir}/bin/proxy_exporter.py", "--listen",
               f"{h.ip}:{cfg.proxy_exporter.port}", "--front-port", str(p.port), "--timeout", f"{probe_s:g}"]
        for rp in p.routers:
            cmd += ["--router", f"{rp.port}:{rp.metrics_port}"]
        kind = router_kind(p.router)
        if kind.membership != "workers":
            cmd += ["--membership", kind.membership]
        if kind.metrics_flag is None:
            cmd += ["--no-router-metrics"]
        procs.append(Proc(h.name, PROXY_EXPORTER, "monitor",
                          _tag(*cmd, PROXY_EXPORTER_SRC.read_text(), f"user={probes[h.name].user}"), cmd, h.ip,
                          cfg.proxy_exporter.port, True, "proxy"))
    m = inv.host(r.monitor_host)
    od = f"{m.kimi_state_dir}/{OBSERVE_DIR}"
    b = binary(m.name, cfg.prometheus.binaries)
    # No --web.enable-lifecycle (it opens POST /-/quit to the business network): a changed config changes the
    # process's tag, so the supervisor restarts Prometheus.
    cmd = [b or "", f"--config.file={od}/prometheus.yml", f"--storage.tsdb.path={od}/data",
           f"--storage.tsdb.retention.time={cfg.prometheus.retention}",
           f"--web.listen-address={m.ip}:{cfg.prometheus.port}"]
    files = [c for k, c in sorted(r.files.items()) if _on_monitor(k)]
    procs.append(Proc(m.name, PROMETHEUS, "monitor", _tag(*cmd, *files, f"user={probes[m.name].user}"), cmd, m.ip,
                      cfg.prometheus.port, True, "monitor"))
    if missing:
        raise KimictlError("monitoring binaries are missing: " + "; ".join(missing), details=missing,
                           hint="install them on those hosts (Debian/Ubuntu: apt-get install prometheus "
                                "prometheus-node-exporter; or upstream's prometheus / node_exporter on the PATH), "
                                "or merge into an existing Prometheus: kimictl observe up --print")
    return procs, node


def plan_actions(changes: list[Change], probes: dict[str, HostProbe]
                 ) -> tuple[dict[str, list[str]], dict[str, list[dict[str, Any]]], dict[str, dict[str, list[str]]]]:
    """(stops, starts, the report's actions) per host. A process that changes is stopped before it starts again, so
    observe.yml hands Prometheus' data directory over while nothing writes it; each start names its user."""
    stops: dict[str, list[str]] = {}
    starts: dict[str, list[dict[str, Any]]] = {}
    actions: dict[str, dict[str, list[str]]] = {}
    for c in changes:
        actions.setdefault(c.host, {"start": [], "keep": [], "stop": []})
        if c.action in ("stop", "replace"):
            stops.setdefault(c.host, []).append(c.id)
        if c.action in ("start", "replace") and c.new:
            starts.setdefault(c.host, []).append({"id": c.id, "cmd": c.new.cmd, "tag": c.new.tag,
                                                  "user": probes[c.host].user})
        actions[c.host]["stop" if c.action == "stop" else "keep" if c.action == "keep" else "start"].append(c.id)
    return stops, starts, actions


def user_vars(hosts: list[str], probes: dict[str, HostProbe], monitor_host: str,
              starts: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """observe.yml's user vars: the user per host (None: the login's own, not root), and Prometheus' user when it
    starts now (its data directory is handed to it then)."""
    prom = any(a["id"] == PROMETHEUS for a in starts.get(monitor_host, []))
    return {"user_of": {h: probes[h].user for h in hosts},
            "prometheus_user": probes[monitor_host].user if prom else None}


def _on_monitor(rel: str) -> bool:
    """The rendered files Prometheus reads (the dashboards and the merge fragment stay on the control node)."""
    return rel == "prometheus.yml" or rel.startswith(("targets/", "rules/"))


def _get_json(url: str, timeout: float = 5.0) -> Any:
    code, text = health.http_get(url, timeout)
    if code != 200:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def scraped_targets(url: str, cluster: str) -> list[dict[str, Any]] | None:
    """Prometheus' active targets of this cluster: job, instance, host, health, lastError."""
    doc = _get_json(f"{url}/api/v1/targets?state=active")
    if not doc:
        return None
    return [{"job": t["labels"].get("job"), "instance": t["labels"].get("instance"),
             "host": t["labels"].get("host"), "health": t.get("health"), "error": t.get("lastError", "")}
            for t in doc["data"]["activeTargets"] if t["labels"].get("cluster") == cluster]


def wait_scraped(url: str, r: ObserveRender, cfg: ObserveConfig, timeout: float,
                 say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Wait for Prometheus to answer and to have scraped every rendered target once (health not unknown)."""
    deadline = time.monotonic() + timeout
    while health.http_get(f"{url}/-/ready", 2)[0] != 200:
        if time.monotonic() > deadline:
            raise KimictlError(f"Prometheus at {url} is not ready after {timeout:.0f}s",
                               hint="its log: <state>/observe/logs/prometheus.log on the monitoring host")
        time.sleep(0.5)
    say(f"Prometheus answers at {url}; waiting for the first scrape of {r.target_total} target(s)")
    scrape = seconds(cfg.prometheus.scrape_interval) + seconds(cfg.prometheus.scrape_timeout)
    last = time.monotonic() + 2 * scrape + 5
    targets: list[dict[str, Any]] = []
    while time.monotonic() < last:
        targets = scraped_targets(url, r.cluster) or []
        if len(targets) >= r.target_total and all(t["health"] == "up" for t in targets):
            break
        time.sleep(0.5)
    return targets


def record(cluster: str, doc: dict[str, Any]) -> None:
    path = control_dir(cluster) / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


def observe_up(plan: Plan, inv: Inventory, r: ObserveRender, *, say: Callable[[str], None],
               on_event: Callable[[str, str, str], None] | None = None, ready_timeout: float = 120.0,
               accept_new_host_keys: bool = False) -> UpResult:
    """Converge the monitoring processes to the render, then report what Prometheus scrapes."""
    cfg = load_config(r.profile)
    hosts = [h.name for h in inv.hosts if h.name in plan.host_roles or h.name == r.monitor_host]
    probes = probe_hosts(inv, hosts, cfg, accept_new_keys=accept_new_host_keys)
    procs, node = desired_procs(plan, inv, r, cfg, probes)
    changes = compute_changes(procs, {h: HostObservation(p.states, None) for h, p in probes.items()})
    stops, starts, actions = plan_actions(changes, probes)
    ops = HostOps(inv, "", new_run_dir(plan.cluster, "observe"), say=say, on_event=on_event,
                  accept_new_host_keys=accept_new_host_keys)
    files = ops.run_dir / "observe"
    write_observe(r, files)
    prom_files = ops.run_dir / "prometheus-files"
    for rel, content in r.files.items():
        if _on_monitor(rel):
            (prom_files / rel).parent.mkdir(parents=True, exist_ok=True)
            (prom_files / rel).write_text(content)
    say("monitoring: " + ", ".join(f"{h} (start {', '.join(a['start']) or '-'}; keep {', '.join(a['keep']) or '-'}"
                                   + (f"; stop {', '.join(a['stop'])}" if a["stop"] else "") + ")"
                                   for h, a in sorted(actions.items())))
    if stops or starts:  # every process runs with the tag of exactly these files and commands: nothing to do
        from kimictl.ansible import close_control_masters

        try:
            ops.playbook("observe.yml", {
                "state_dir_of": ops.state_dir_of, "monitor_host": r.monitor_host, "prometheus_files": str(prom_files),
                "bin": {name: str(remote.source(name)) for name in ("supervisor.py", "proxy_exporter.py")},
                "actions": {h: {"stop": stops.get(h, []), "start": starts.get(h, [])} for h in hosts},
                **user_vars(hosts, probes, r.monitor_host, starts), "grace": STOP_GRACE_S}, hosts)
        finally:
            close_control_masters(ops.run_dir)
    targets = wait_scraped(r.prometheus_url, r, cfg, ready_timeout, say)
    res = UpResult(plan.cluster, r.prometheus_url, r.monitor_host, r.profile, r.target_total,
                   up=[t for t in targets if t["health"] == "up"], actions=actions, node_exporter=node,
                   files=str(files), run_dir=str(ops.run_dir))
    res.down = [t for t in targets if t["health"] != "up"]
    for job, groups in r.targets.items():
        absent = len(groups) - sum(1 for t in targets if t["job"] == job)
        if absent > 0:
            res.down.append({"job": job, "instance": None, "host": None, "health": "absent",
                             "error": f"{absent} of {len(groups)} rendered target(s) not among Prometheus' active "
                                      "targets"})
    record(plan.cluster, {"prometheus_url": r.prometheus_url, "monitor_host": r.monitor_host,
                          "targets": r.target_total, "profile": r.profile, "run_dir": str(ops.run_dir),
                          "at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")})
    return res


def monitoring_status(cluster: str, timeout: float = 3.0) -> dict[str, Any] | None:
    """Where Prometheus runs (from the last `observe up`), whether it answers, and which alerts fire."""
    try:
        rec = json.loads((control_dir(cluster) / RECORD).read_text())
    except (OSError, ValueError):
        return None
    url = rec.get("prometheus_url", "")
    out = {"prometheus_url": url, "monitor_host": rec.get("monitor_host"), "targets": rec.get("targets"),
           "state": "unreachable", "alerts_firing": []}
    if health.http_get(f"{url}/-/ready", timeout)[0] == 200:
        out["state"] = "ready"
        doc = _get_json(f"{url}/api/v1/alerts", timeout) or {}
        out["alerts_firing"] = sorted({a["labels"]["alertname"] for a in doc.get("data", {}).get("alerts", [])
                                       if a.get("state") == "firing" and a["labels"].get("cluster") == cluster})
    return out
