"""Status: what runs where (one SSH probe per host + HTTP), judged per engine, proxy and P/D pair, with drift."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kimictl import ascend, health, lease
from kimictl.cluster_secrets import engine_api_key, proxy_api_key
from kimictl.errors import guide
from kimictl.facts import engine_profile
from kimictl.inventory import Host, Inventory
from kimictl.observe_up import monitoring_status
from kimictl.render import PROXY_FRONT_STATE
from kimictl.routers import RouterError, front_admin_key, membership_client, proxy_ready
from kimictl.ssh import Sessions, SSHError
from kimictl.state import ReleaseRecord
from kimictl.state import current as recorded_release

STATUS_SCHEMA_VERSION = 1
_SUPERVISOR_TO_STATE = {"starting": "starting", "backoff": "failed", "failed": "failed", "stopping": "stopped",
                        "stopped": "stopped", "dead": "failed"}
ProcessState = Literal["ready", "starting", "failed", "stopped", "unreachable"]


# --- the `status --output json` document (docs/contract.md) -----------------------------------------------------


class StatusPart(BaseModel):
    """A part of the status document. A field with a default is a key the document holds only once it is set (an
    engine's metrics once it is ready, its supervisor's fields once it runs under one): `to_json` leaves out what
    was never set, so the JSON has the same keys whether a value is known or not."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_unset=True)


class HbmUse(StatusPart):
    """NPU HBM in use on an engine's devices, as npu-smi reports it (MB)."""

    total: int
    max_per_npu: int


class Quantiles(StatusPart):
    """Seconds, from a vLLM histogram; None without observations."""

    p50: float | None
    p90: float | None
    p99: float | None


class EngineMetrics(StatusPart):
    """A ready engine's vLLM metrics."""

    requests_running: float
    requests_waiting: float
    kv_cache_usage: float
    ttft_s: Quantiles
    itl_s: Quantiles


class EngineStatus(StatusPart):
    """One engine process; an unreachable host is one row `<host>:*` with role "?" and the reason in `detail`."""

    id: str
    host: str
    role: str
    port: int | None = None
    ip: str | None = None
    release: str | None = None
    serves_http: bool | None = None
    hbm_used_mb: HbmUse | None = None
    restarts: int | None = None  # restarts, pid, since: set when the engine runs under its supervisor
    pid: int | None = None
    since: str | None = None
    state: ProcessState
    detail: str | None = None
    metrics: EngineMetrics | None = None


class RouterMembership(StatusPart):
    """One router copy behind the proxy against the deployed endpoints: counts and differences, or the error."""

    router: int
    members: int | None = None
    missing: list[str] | None = None
    unknown: list[str] | None = None
    error: str | None = None


class ProxyStatus(StatusPart):
    host: str
    ip: str
    port: int
    routers: int
    router: str
    admin_key: bool = Field(False, exclude=True)  # the routers' API takes kimictl's admin key (not in the document)
    state: ProcessState
    stale_engine_ids: str | None = None
    membership: list[RouterMembership] | None = None  # set when the proxy is ready


class PairStatus(StatusPart):
    prefill: list[str]
    decode: list[str]
    state: Literal["ok", "failed"]
    detail: str
    hint: str | None = None


class Drift(StatusPart):
    host: str
    recorded: str | None
    current: str | None


class Monitoring(StatusPart):
    """Where Prometheus runs (from the last `observe up`), whether it answers, which alerts fire."""

    prometheus_url: str
    monitor_host: str | None
    targets: int | None
    state: Literal["ready", "unreachable"]
    alerts_firing: list[str]


class LeaseHolder(StatusPart):
    """Who holds the cluster lease, as the record on the lock host names them."""

    hostname: str
    user: str
    pid: int | None
    command: str
    since: str


class LeaseStatus(StatusPart):
    """The cluster lease (kimictl/lease.py) on its lock host: free, held (with the holder), or unknown (why)."""

    host: str
    state: Literal["free", "held", "unknown"]
    holder: LeaseHolder | None = None
    detail: str | None = None


class StatusReport(StatusPart):
    """The `status --output json` document of docs/contract.md (schema_version 1); the text view reads it too."""

    schema_version: Literal[1]
    cluster: str
    state: Literal["healthy", "degraded", "down"]
    served_model_name: str | None
    release: str | None
    engines: list[EngineStatus]
    proxy: ProxyStatus | None
    pairs: list[PairStatus]
    drift: list[Drift]
    monitoring: Monitoring | None
    at: str
    lease: LeaseStatus | None = None  # set when the lock host was probed (kimictl/lease.py)
    heal: dict[str, Any] | None = None  # `status --heal`: the heal round's own document (heal --output json)
    record_drift: list[str] | None = None  # set when the record hosts' copies of the release record disagree


# --- collecting it ------------------------------------------------------------------------------------------------


def _probe(inv: Inventory, timeout: float) -> dict[str, Any]:
    """Per host: its manifest, supervised processes, HBM use and front state; the lock host's also the lease."""
    lock = lease.lock_host(inv).name

    def one(name: str, s) -> dict[str, Any]:
        got = host_probe(name, s)
        if name == lock:
            got["lease"] = lease.peek_on(s, inv.host(name), timeout)
        return got

    def host_probe(name: str, s) -> dict[str, Any]:
        sd = inv.host(name).kimi_state_dir
        out = s.run(f"cat {sd}/current/manifest.json 2>/dev/null || echo null; echo '@@kimi'; "
                    f"if [ -f {sd}/bin/supervisor.py ]; then python3 {sd}/bin/supervisor.py status --run-dir "
                    f"{sd}/run; else echo '[]'; fi; echo '@@kimi'; "
                    "PATH=/usr/local/bin:/usr/local/sbin:$PATH npu-smi info 2>/dev/null; echo '@@kimi'; "
                    f"cat {sd}/{PROXY_FRONT_STATE} 2>/dev/null", timeout=timeout).stdout
        manifest, _, rest = out.partition("@@kimi")
        sup, _, rest = rest.partition("@@kimi")
        smi, _, front = rest.partition("@@kimi")
        hbm = {n.logical_id: n.hbm_used_mb for n in ascend.parse_npu_smi_info(smi).npus}
        try:
            front_state = json.loads(front) if front.strip() else None
        except ValueError:
            front_state = None
        try:
            return {"manifest": json.loads(manifest), "supervised": {x["name"]: x for x in json.loads(sup or "[]")},
                    "hbm_used_mb": hbm, "front": front_state}
        except ValueError:
            return {"manifest": None, "supervised": {}, "hbm_used_mb": hbm, "front": front_state}

    with Sessions(inv, timeout=timeout) as sessions:
        return sessions.each(one)


def _engine_metrics(ip: str, port: int) -> EngineMetrics:
    m, hist = health.scrape(ip, port)
    quantiles = {key: Quantiles(**{f"p{int(q * 100)}": health.quantile(hist.get(family, []), q)
                                   for q in (0.5, 0.9, 0.99)})
                 for key, family in (("ttft_s", "vllm:time_to_first_token_seconds"),
                                     ("itl_s", "vllm:inter_token_latency_seconds"))}
    return EngineMetrics(requests_running=m.get("vllm:num_requests_running", 0.0),
                         requests_waiting=m.get("vllm:num_requests_waiting", 0.0),
                         kv_cache_usage=m.get("vllm:kv_cache_usage_perc", 0.0), **quantiles)


def collect_status(inv: Inventory, *, timeout: float = 10.0, probe_pairs: bool = True) -> StatusReport:
    """The `status --output json` document of docs/contract.md (schema_version 1): the hosts' probe, then each
    process's readiness over HTTP, the P/D pair, the routers' membership, and the cluster's state from all of it."""
    record = recorded_release(inv.cluster.name)  # a damaged record: exit 2 before any host is contacted
    probes = _probe(inv, timeout)
    seen = _Seen.of(inv, probes, record)
    api_key = proxy_api_key(inv)
    # the key engines require, P/D or not (the cluster's engine key only when it runs P/D engines)
    pd = any(e.role != "colocated" for e in seen.engines)
    engine_keys = {True: engine_api_key(inv, True) if pd else None, False: engine_api_key(inv, False)}
    _judge_readiness(seen, api_key, engine_keys)
    pairs = _pairs(inv, seen, api_key, probe_pairs)
    proxy = seen.proxy
    if proxy and proxy.state == "ready":
        # The routers' own API takes kimictl's admin key (a front made before it had one took the client key).
        admin = front_admin_key(inv, proxy.host, proxy.ip, proxy.port) if proxy.admin_key else api_key
        proxy.membership = _membership(seen.engines, proxy, admin)
    mon = monitoring_status(inv.cluster.name)
    return StatusReport(schema_version=STATUS_SCHEMA_VERSION, cluster=inv.cluster.name,
                        state=_cluster_state(seen, pairs), served_model_name=seen.served,
                        release=record.release if record else None, engines=seen.engines, proxy=proxy, pairs=pairs,
                        drift=seen.drift, monitoring=None if mon is None else Monitoring(**mon),
                        at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        **_lease(inv, probes))


def _lease(inv: Inventory, probes: dict[str, Any]) -> dict[str, Any]:
    """{"lease": LeaseStatus} from the lock host's probe ({} when the probe did not look, so the key stays out)."""
    host = lease.lock_host(inv).name
    got = probes.get(host)
    if isinstance(got, SSHError):
        return {"lease": LeaseStatus(host=host, state="unknown", detail=str(got))}
    if not isinstance(got, dict) or "lease" not in got:
        return {}
    return {"lease": LeaseStatus(host=host, **got["lease"])}


def _supervised(sup: dict[str, Any] | None) -> ProcessState:
    """A process's state from its supervisor's record (none: stopped); "starting" until readiness says more."""
    return "stopped" if sup is None else _SUPERVISOR_TO_STATE.get(sup.get("state"), "starting")


@dataclass
class _Seen:
    """What the hosts' probe shows: engines and the proxy as their supervisors see them, drift, the served name."""

    engines: list[EngineStatus]
    proxy: ProxyStatus | None
    drift: list[Drift]
    served: str | None

    @classmethod
    def of(cls, inv: Inventory, probes: dict[str, Any], record: ReleaseRecord | None) -> _Seen:
        seen = cls([], None, [], None)
        for h in inv.hosts:
            got = probes[h.name]
            if isinstance(got, SSHError):
                seen.engines.append(EngineStatus(id=f"{h.name}:*", host=h.name, role="?", state="unreachable",
                                                 detail=str(got)))
                continue
            man = got["manifest"]
            if record and man and record.hosts.get(h.name) != man.get("release"):
                seen.drift.append(Drift(host=h.name, recorded=record.hosts.get(h.name), current=man.get("release")))
            if not man:
                continue
            seen.served = seen.served or man.get("served_model_name")
            seen.engines += [_engine_row(h, e, man.get("release"), got) for e in man["engines"]]
            if man.get("proxy"):
                seen.proxy = _proxy_row(h, man["proxy"], got)
        return seen


def _engine_row(h: Host, e: dict[str, Any], release: str | None, got: dict[str, Any]) -> EngineStatus:
    """One engine of a host's manifest, with its supervisor's record and its devices' HBM use."""
    sup = got["supervised"].get(e["id"])
    row = EngineStatus(id=e["id"], host=h.name, role=e["role"], port=e["port"], ip=h.ip, release=release,
                       serves_http=e["serves_http"], state=_supervised(sup))
    used = [got["hbm_used_mb"][d] for d in e.get("devices", []) if d in got["hbm_used_mb"]]
    if used:  # NPU HBM in use on this engine's devices, as npu-smi reports it
        row.hbm_used_mb = HbmUse(total=sum(used), max_per_npu=max(used))
    if sup is not None:
        row.restarts, row.pid, row.since = sup.get("restarts", 0), sup.get("child_pid"), sup.get("child_started_at")
    return row


def _proxy_row(h: Host, man_proxy: dict[str, Any], got: dict[str, Any]) -> ProxyStatus:
    proxy = ProxyStatus(host=h.name, ip=h.ip, port=man_proxy["port"], routers=int(man_proxy.get("routers", 0)),
                        admin_key=bool(man_proxy.get("admin_key")),
                        router=man_proxy.get("router") or "vllm-router",  # releases before router kinds
                        state=_supervised(got["supervised"].get("proxy")))
    stale = _stale_engine_ids((got.get("front") or {}).get("watch"))
    if stale:
        proxy.stale_engine_ids = stale
    return proxy


def _judge_readiness(seen: _Seen, api_key: str | None, engine_keys: dict[bool, str | None]) -> None:
    """Each process its supervisor runs ("starting") is ready once it answers over HTTP; all asked at once."""
    served = seen.served or ""

    def engine(row: EngineStatus) -> None:
        if not row.serves_http:
            row.state = "ready"  # headless internal-DP workers have no HTTP; alive under the supervisor
        elif health.engine_ready(row.ip, row.port, served, timeout=3,
                                 api_key=engine_keys[row.role != "colocated"]).ok:
            row.state = "ready"
            row.metrics = _engine_metrics(row.ip, row.port)  # the proxy port has no vLLM metrics of its own

    def front(row: ProxyStatus) -> None:
        if proxy_ready(row.router, row.ip, row.port, served, timeout=3, api_key=api_key).ok:
            row.state = "ready"

    checks = [(engine, r) for r in seen.engines if r.state == "starting"]
    if seen.proxy and seen.proxy.state == "starting":
        checks.append((front, seen.proxy))
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda check: check[0](check[1]), checks))


def _pairs(inv: Inventory, seen: _Seen, api_key: str | None, probe_pairs: bool) -> list[PairStatus]:
    """The P/D pair behind the proxy: failed at once while its routers know stale prefill ids, else probed."""
    proxy, engines = seen.proxy, seen.engines
    if not proxy or not {"prefill", "decode"} <= {r.role for r in engines}:
        return []
    if proxy.stale_engine_ids:  # a probe now would wait on a dead peer
        return [PairStatus(prefill=[r.id for r in engines if r.role == "prefill"],
                           decode=[r.id for r in engines if r.role == "decode"], state="failed",
                           detail=proxy.stale_engine_ids)]
    if not probe_pairs:
        return []
    wait = engine_profile(inv.cluster.kimi_engine_profile).probe_timeout_s or 30.0
    return [_pair_probe(engines, proxy, seen.served or "", api_key, wait)]


def _cluster_state(seen: _Seen, pairs: list[PairStatus]) -> Literal["healthy", "degraded", "down"]:
    """healthy: everything ready, every pair and router copy fine, no drift; down: nothing ready, or the proxy not
    ready; else degraded."""
    engines, proxy = seen.engines, seen.proxy
    states = [r.state for r in engines] + ([proxy.state] if proxy else [])
    members_ok = not proxy or all(not m.missing and m.error is None for m in proxy.membership or [])
    if (engines and all(s == "ready" for s in states) and all(p.state == "ok" for p in pairs) and not seen.drift
            and members_ok):
        return "healthy"
    if not engines or not any(s == "ready" for s in states) or (proxy and proxy.state != "ready"):
        return "down"
    return "degraded"


def _stale_engine_ids(watch: dict[str, Any] | None) -> str | None:
    """Why the proxy's routers cannot reach a prefill engine yet: they learnt the prefill engine ids at their start
    (the proxy front's --watch) and a prefill engine has restarted under a new id since; None when they know."""
    if not watch or watch.get("engine_ids") is None or watch.get("engine_ids") == watch.get("routers_know"):
        return None
    now, known = watch["engine_ids"], watch.get("routers_know") or {}
    changed = sorted(u.split("//")[-1].split("/")[0] for u in now if now[u] != known.get(u))
    return (f"the proxy's routers know prefill engine ids from before a restart of the prefill engine at "
            f"{', '.join(changed) or 'its bootstrap server'} (they learn them only at their start); the proxy front "
            "restarts them")


def _membership(engines: list[EngineStatus], proxy: ProxyStatus, api_key: str | None) -> list[RouterMembership]:
    """Each router copy behind the proxy against the deployed endpoints, from the copy's own membership API: a router
    that lost one (a drain left behind, a restart with another membership) routes around capacity the plan has."""
    want = {f"http://{r.ip}:{r.port}": r.id for r in engines if r.role in ("prefill", "decode") and r.serves_http}
    base = f"http://{proxy.ip}:{proxy.port}"
    urls = [f"{base}/kimictl/router/{i}" for i in range(proxy.routers)] or [base]
    out = []
    for i, url in enumerate(urls):
        try:
            members = set(membership_client(proxy.router, url, api_key, timeout=5).members())
        except RouterError as exc:
            out.append(RouterMembership(router=i, error=exc.message.removeprefix(f"router {url}: ")[:160]))
            continue
        out.append(RouterMembership(router=i, members=len(members),
                                    missing=sorted(want[u] for u in set(want) - members),
                                    unknown=sorted(members - set(want))))
    return out


def _pair_probe(engines: list[EngineStatus], proxy: ProxyStatus, served: str,
                api_key: str | None = None, timeout: float = 30.0) -> PairStatus:
    """One request through the proxy: decode must get the whole prompt over the KV connector (health.pd_probe)."""
    pre = [r for r in engines if r.role == "prefill" and r.state == "ready"]
    dec = [r for r in engines if r.role == "decode" and r.state == "ready"]
    ids = {"prefill": [r.id for r in pre], "decode": [r.id for r in dec]}
    if proxy.state != "ready" or not pre or not dec:
        return PairStatus(**ids, state="failed", detail="proxy or one side not ready")
    probe = health.pd_probe(f"http://{proxy.ip}:{proxy.port}/v1/completions", served,
                            [(r.ip, r.port) for r in pre], [(r.ip, r.port) for r in dec],
                            timeout=timeout, api_key=api_key)
    # vllm-ascend's proxy has sent 200 before the decode leg runs: when decode fails the request, the answer is empty
    pair = PairStatus(**ids, state="ok" if probe.ok else "failed",
                      detail=probe.detail + ("" if probe.answered else
                                             f": {health.body_text(probe.body) or '(an empty answer)'}"))
    if not probe.ok:
        pair.hint = guide("t-no-kv" if probe.answered else "t-pair-probe")
    return pair
