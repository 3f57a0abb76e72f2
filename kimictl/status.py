"""Status: what runs where (one SSH probe per host + HTTP), judged per engine, proxy and P/D pair, with drift."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kimictl import ascend, health
from kimictl.errors import guide
from kimictl.facts import engine_profile
from kimictl.inventory import Inventory
from kimictl.observe_up import monitoring_status
from kimictl.render import PROXY_FRONT_STATE
from kimictl.routers import RouterError, membership_client, proxy_ready
from kimictl.secret_file import engine_api_key, proxy_admin_key, proxy_api_key
from kimictl.ssh import Sessions, SSHError
from kimictl.state import current as recorded_release

STATUS_SCHEMA_VERSION = 1
_SUPERVISOR_TO_STATE = {"starting": "starting", "backoff": "failed", "failed": "failed", "stopping": "stopped",
                        "stopped": "stopped", "dead": "failed"}


def _probe(inv: Inventory, timeout: float) -> dict[str, Any]:
    def one(name: str, s) -> dict[str, Any]:
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


def _engine_metrics(ip: str, port: int) -> dict[str, Any]:
    m, hist = health.scrape(ip, port)
    out: dict[str, Any] = {"requests_running": m.get("vllm:num_requests_running", 0.0),
                           "requests_waiting": m.get("vllm:num_requests_waiting", 0.0),
                           "kv_cache_usage": m.get("vllm:kv_cache_usage_perc", 0.0)}
    for key, family in (("ttft_s", "vllm:time_to_first_token_seconds"), ("itl_s", "vllm:inter_token_latency_seconds")):
        b = hist.get(family, [])
        out[key] = {f"p{int(q * 100)}": health.quantile(b, q) for q in (0.5, 0.9, 0.99)}
    return out


def collect_status(inv: Inventory, *, timeout: float = 10.0, probe_pairs: bool = True) -> dict[str, Any]:
    """The `status --output json` document of docs/contract.md (schema_version 1)."""
    record = recorded_release(inv.cluster.name)  # a damaged record: exit 2 before any host is contacted
    probes = _probe(inv, timeout)
    api_key = proxy_api_key(inv)
    engine_keys = {pd: engine_api_key(inv, pd) for pd in (True, False)}  # the key engines require, P/D or not
    engines: list[dict[str, Any]] = []
    proxy: dict[str, Any] | None = None
    drift: list[dict[str, Any]] = []
    served = None
    for h in inv.hosts:
        got = probes[h.name]
        if isinstance(got, SSHError):
            engines.append({"id": f"{h.name}:*", "host": h.name, "role": "?", "state": "unreachable",
                            "detail": str(got)})
            continue
        man = got["manifest"]
        if record and man and record.hosts.get(h.name) != man.get("release"):
            drift.append({"host": h.name, "recorded": record.hosts.get(h.name), "current": man.get("release")})
        if not man:
            continue
        served = served or man.get("served_model_name")
        for e in man["engines"]:
            sup = got["supervised"].get(e["id"])
            row = {"id": e["id"], "host": h.name, "role": e["role"], "port": e["port"], "ip": h.ip,
                   "release": man.get("release"), "serves_http": e["serves_http"]}
            used = [got["hbm_used_mb"][d] for d in e.get("devices", []) if d in got["hbm_used_mb"]]
            if used:  # NPU HBM in use on this engine's devices, as npu-smi reports it
                row["hbm_used_mb"] = {"total": sum(used), "max_per_npu": max(used)}
            if sup is None:
                row["state"] = "stopped"
            else:
                row.update(restarts=sup.get("restarts", 0), pid=sup.get("child_pid"),
                           since=sup.get("child_started_at"))
                row["state"] = _SUPERVISOR_TO_STATE.get(sup.get("state"), "starting")
            engines.append(row)
        if man.get("proxy"):
            sup = got["supervised"].get("proxy")
            proxy = {"host": h.name, "ip": h.ip, "port": man["proxy"]["port"],
                     "routers": int(man["proxy"].get("routers", 0)), "admin_key": bool(man["proxy"].get("admin_key")),
                     "router": man["proxy"].get("router") or "vllm-router",  # releases before router kinds
                     "state": "stopped" if sup is None else _SUPERVISOR_TO_STATE.get(sup.get("state"), "starting")}
            stale = _stale_engine_ids((got.get("front") or {}).get("watch"))
            if stale:
                proxy["stale_engine_ids"] = stale

    def readiness(row: dict[str, Any]) -> None:
        if row["state"] == "starting" and row.get("serves_http", True):
            ok = (proxy_ready(row["router"], row["ip"], row["port"], served or "", timeout=3, api_key=api_key)
                  if row is proxy else health.engine_ready(row["ip"], row["port"], served or "", timeout=3,
                                                           api_key=engine_keys[row["role"] != "colocated"])).ok
            row["state"] = "ready" if ok else "starting"
            if ok and row is not proxy:  # engines' vLLM metrics; the proxy port has none of its own
                row["metrics"] = _engine_metrics(row["ip"], row["port"])
        elif row["state"] == "starting":
            row["state"] = "ready"  # headless internal-DP workers have no HTTP; alive under the supervisor

    live = [r for r in engines if r["state"] == "starting"] + ([proxy] if proxy else [])
    for r in live:
        r.setdefault("serves_http", True)
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(readiness, live))

    pairs: list[dict[str, Any]] = []
    pd = any(r["role"] == "prefill" for r in engines) and any(r["role"] == "decode" for r in engines)
    if pd and proxy and proxy.get("stale_engine_ids"):  # a probe now would wait on a dead peer
        pairs.append({"prefill": [r["id"] for r in engines if r["role"] == "prefill"],
                      "decode": [r["id"] for r in engines if r["role"] == "decode"], "state": "failed",
                      "detail": proxy["stale_engine_ids"]})
    elif pd and proxy and probe_pairs:
        wait = engine_profile(inv.cluster.kimi_engine_profile).probe_timeout_s or 30.0
        pairs.append(_pair_probe(engines, proxy, served or "", api_key, wait))
    if proxy and proxy["state"] == "ready":
        # The routers' own API takes kimictl's admin key (a front made before it had one took the client key).
        admin = proxy_admin_key(inv.cluster.name) if proxy["admin_key"] else api_key
        proxy["membership"] = _membership(engines, proxy, admin)

    states = [r["state"] for r in engines] + ([proxy["state"]] if proxy else [])
    members_ok = not proxy or all(not m.get("missing") and "error" not in m for m in proxy.get("membership", []))
    if (engines and all(s == "ready" for s in states) and all(p["state"] == "ok" for p in pairs) and not drift
            and members_ok):
        state = "healthy"
    elif not engines or not any(s == "ready" for s in states) or (proxy and proxy["state"] != "ready"):
        state = "down"
    else:
        state = "degraded"
    if proxy:
        proxy.pop("serves_http", None)
        proxy.pop("admin_key", None)
    return {"schema_version": STATUS_SCHEMA_VERSION, "cluster": inv.cluster.name, "state": state,
            "served_model_name": served,
            "release": record.release if record else None, "engines": engines, "proxy": proxy,
            "pairs": pairs, "drift": drift, "monitoring": monitoring_status(inv.cluster.name),
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


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


def _membership(engines: list[dict[str, Any]], proxy: dict[str, Any], api_key: str | None) -> list[dict[str, Any]]:
    """Each router copy behind the proxy against the deployed endpoints, from the copy's own membership API: a router
    that lost one (a drain left behind, a restart with another membership) routes around capacity the plan has."""
    want = {f"http://{r['ip']}:{r['port']}": r["id"] for r in engines
            if r["role"] in ("prefill", "decode") and r.get("serves_http")}
    base = f"http://{proxy['ip']}:{proxy['port']}"
    urls = [f"{base}/kimictl/router/{i}" for i in range(proxy["routers"])] or [base]
    out = []
    for i, url in enumerate(urls):
        try:
            members = set(membership_client(proxy["router"], url, api_key, timeout=5).members())
        except RouterError as exc:
            out.append({"router": i, "error": exc.message.removeprefix(f"router {url}: ")[:160]})
            continue
        out.append({"router": i, "members": len(members), "missing": sorted(want[u] for u in set(want) - members),
                    "unknown": sorted(members - set(want))})
    return out


def _pair_probe(engines: list[dict[str, Any]], proxy: dict[str, Any], served: str,
                api_key: str | None = None, timeout: float = 30.0) -> dict[str, Any]:
    """One request through the proxy: decode must get the whole prompt over the KV connector (health.pd_probe)."""
    pre = [r for r in engines if r["role"] == "prefill" and r["state"] == "ready"]
    dec = [r for r in engines if r["role"] == "decode" and r["state"] == "ready"]
    if proxy["state"] != "ready" or not pre or not dec:
        return {"prefill": [r["id"] for r in pre], "decode": [r["id"] for r in dec], "state": "failed",
                "detail": "proxy or one side not ready"}
    probe = health.pd_probe(f"http://{proxy['ip']}:{proxy['port']}/v1/completions", served,
                            [(r["ip"], r["port"]) for r in pre], [(r["ip"], r["port"]) for r in dec],
                            timeout=timeout, api_key=api_key)
    # vllm-ascend's proxy has sent 200 before the decode leg runs: when decode fails the request, the answer is empty
    return {"prefill": [r["id"] for r in pre], "decode": [r["id"] for r in dec],
            "state": "ok" if probe.ok else "failed",
            "detail": probe.detail + ("" if probe.answered else
                                      f": {health.body_text(probe.body) or '(an empty answer)'}"),
            **({} if probe.ok else {"hint": guide("t-no-kv" if probe.answered else "t-pair-probe")})}
