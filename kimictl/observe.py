"""Monitoring from the plan: Prometheus scrape targets, recording and alert rules and Grafana dashboards
(`observe render`); Prometheus, node_exporter and the proxy exporter on the hosts through Ansible (`observe up`)."""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from kimictl.errors import InvalidInput, RenderError
from kimictl.facts import DATA_DIR
from kimictl.inventory import Inventory
from kimictl.plan import Plan
from kimictl.topology import Topology

OBSERVE_SCHEMA_VERSION = 1
# Scrape jobs, in the order they are rendered; the `job` label every series gets (the scrape config's job_name
# also names the cluster, so several clusters can share one Prometheus).
ENGINE_JOB, PROXY_JOB, ROUTER_JOB, NODE_JOB, NPU_JOB, PROM_JOB = (
    "kimi-engine", "kimi-proxy", "kimi-router", "node", "npu-exporter", "prometheus")
JOBS = (ENGINE_JOB, PROXY_JOB, ROUTER_JOB, NODE_JOB, NPU_JOB, PROM_JOB)
# vLLM histograms the recording rules summarise per role (vllm/v1/metrics/loggers.py; vllm-ascend.md section 8).
HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
}
PROXY_EXPORTER_SRC = Path(__file__).parent / "remote" / "proxy_exporter.py"
_DURATION = re.compile(r"^([0-9]+)(ms|s|m|h|d)$")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def seconds(duration: str) -> float:
    """A Prometheus duration ("15s", "5m") in seconds."""
    m = _DURATION.match(duration)
    if not m:
        raise ValueError(f"'{duration}' is not a Prometheus duration like 15s, 5m or 1h")
    return int(m.group(1)) * _UNIT_S[m.group(2)]


def _duration(v: str) -> str:
    seconds(v)
    return v


Duration = Annotated[str, AfterValidator(_duration)]


class _S(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class PrometheusCfg(_S):
    port: int = Field(ge=1, le=65535)
    scrape_interval: Duration
    scrape_timeout: Duration
    evaluation_interval: Duration
    retention: Duration
    binaries: list[str]


class NodeExporterCfg(_S):
    port: int = Field(ge=1, le=65535)
    binaries: list[str]


class NpuExporterCfg(_S):
    port: int = Field(ge=1, le=65535)
    scheme: Literal["http", "https"]


class PortCfg(_S):
    port: int = Field(ge=1, le=65535)


class RecordingCfg(_S):
    rate_window: Duration
    quantiles: list[Annotated[float, Field(gt=0, lt=1)]]


class SloCfg(_S):
    quantile: float = Field(gt=0, lt=1)
    tpot_ms: float | None = Field(None, gt=0)
    ttft_ms: float | None = Field(None, gt=0)


class For(_S):
    for_: Duration = Field(alias="for")


class Restarting(_S):
    window: Duration
    restarts: int = Field(ge=1)


class Handover(For):
    window: Duration


class HbmNearFull(For):
    ratio: float = Field(gt=0, le=1)
    margin: float = Field(ge=0, lt=1)
    cap: float = Field(gt=0, le=1)


class SloBurn(For):
    short_window: Duration
    long_window: Duration


class AlertsCfg(_S):
    engine_down: For
    engine_restarting: Restarting
    kv_handover: Handover
    hbm_near_full: HbmNearFull
    proxy_membership: For
    proxy_down: For
    slo_burn: SloBurn
    device_link_down: For
    target_down: For


class ObserveConfig(_S):
    profile: str = "default"
    prometheus: PrometheusCfg
    node_exporter: NodeExporterCfg
    npu_exporter: NpuExporterCfg
    proxy_exporter: PortCfg
    recording: RecordingCfg
    slo: SloCfg
    alerts: AlertsCfg


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@functools.cache
def _data(name: str) -> dict[str, Any]:
    return yaml.safe_load((DATA_DIR / name).read_text())


def profiles() -> list[str]:
    return sorted(_data("observe.yml")["profiles"])


def load_config(profile: str = "default") -> ObserveConfig:
    """kimictl/data/observe.yml with profiles.<profile> overlaid; an unknown profile is exit 2."""
    doc = dict(_data("observe.yml"))
    overlays = doc.pop("profiles")
    if profile not in overlays:
        raise InvalidInput(f"unknown monitoring profile '{profile}'; profiles: {', '.join(sorted(overlays))}")
    try:
        cfg = ObserveConfig(profile=profile, **_merge(doc, overlays[profile] or {}))
    except ValidationError as exc:  # a broken data file is a bug, but say where
        raise RenderError(f"kimictl/data/observe.yml (profile {profile}) is invalid: {exc}") from None
    if seconds(cfg.prometheus.scrape_timeout) > seconds(cfg.prometheus.scrape_interval):
        raise RenderError(f"observe.yml profile {profile}: scrape_timeout exceeds scrape_interval")
    return cfg


def qname(q: float) -> str:
    """Recording-rule suffix of a quantile: 0.9 -> p90, 0.99 -> p99, 0.999 -> p999."""
    return "p" + f"{q * 100:g}".replace(".", "")


def monitor_host(plan: Plan, inv: Inventory) -> str:
    """Where Prometheus runs: kimi_monitor_host, else the proxy host, else the first planned host."""
    if inv.cluster.kimi_monitor_host:
        return inv.cluster.kimi_monitor_host
    if plan.proxy:
        return plan.proxy.host
    return next(h.name for h in inv.hosts if h.name in plan.host_roles)


def effective_slo(topo: Topology, cfg: ObserveConfig) -> dict[str, float | None]:
    """The topology's `slo` over observe.yml's, targets in seconds."""
    t = topo.slo
    q = (t.quantile if t and t.quantile else None) or cfg.slo.quantile
    tpot = (t.tpot_ms if t and t.tpot_ms else None) or cfg.slo.tpot_ms
    ttft = (t.ttft_ms if t and t.ttft_ms else None) or cfg.slo.ttft_ms
    return {"quantile": q, "tpot_s": tpot / 1000 if tpot else None, "ttft_s": ttft / 1000 if ttft else None}


def hbm_thresholds(plan: Plan, cfg: ObserveConfig) -> list[dict[str, Any]]:
    """Per group of roles: the HBM used ratio above which an NPU is near full (vLLM takes its
    gpu-memory-utilization at start; more than that plus the margin is something else filling the NPU)."""
    a = cfg.alerts.hbm_near_full
    by: dict[float, list[str]] = {}
    for role, fit in plan.fits.items():
        t = round(min(a.cap, max(a.ratio, fit.gpu_memory_utilization + a.margin)), 4)
        by.setdefault(t, []).append(role)
    return [{"roles": "|".join(sorted(r)), "ratio": t} for t, r in sorted(by.items())]


# --- targets --------------------------------------------------------------------------------------------


def scrape_targets(plan: Plan, inv: Inventory, cfg: ObserveConfig) -> dict[str, list[dict[str, Any]]]:
    """file_sd target groups per job, one group per target (each has its own labels)."""
    c = plan.cluster
    hosts = [h for h in inv.hosts if h.name in plan.host_roles]

    def group(addr: str, **labels: str) -> dict[str, Any]:
        return {"targets": [addr], "labels": {"cluster": c, **labels}}

    out: dict[str, list[dict[str, Any]]] = {j: [] for j in JOBS}
    for e in plan.engines:
        if e.serves_http:
            out[ENGINE_JOB].append(group(f"{e.host_ip}:{e.port}", host=e.host, role=e.role, dp_group=e.instance,
                                         dp_rank=",".join(map(str, e.dp_ranks)), engine_id=e.id))
    if plan.proxy:
        p, port = plan.proxy, cfg.proxy_exporter.port
        out[PROXY_JOB].append(group(f"{p.ip}:{port}", host=p.host, role="proxy"))
        for i, _r in enumerate(p.routers):
            out[ROUTER_JOB].append(group(f"{p.ip}:{port}", host=p.host, role="proxy", router=str(i),
                                         __metrics_path__=f"/router/{i}/metrics"))
    for h in hosts:
        out[NODE_JOB].append(group(f"{h.ip}:{cfg.node_exporter.port}", host=h.name, role=plan.host_roles[h.name]))
        out[NPU_JOB].append(group(f"{h.ip}:{cfg.npu_exporter.port}", host=h.name, role=plan.host_roles[h.name]))
    mon = inv.host(monitor_host(plan, inv))
    out[PROM_JOB].append(group(f"{mon.ip}:{cfg.prometheus.port}", host=mon.name))
    return {j: groups for j, groups in out.items() if groups}


def check_ports(plan: Plan, inv: Inventory, cfg: ObserveConfig) -> None:
    """A monitoring port that a planned engine, kv_port range or proxy also uses on a host is exit 2."""
    uses = [(h, cfg.node_exporter.port, "node_exporter") for h in plan.host_roles]
    uses += [(h, cfg.npu_exporter.port, "npu-exporter") for h in plan.host_roles]
    if plan.proxy:
        uses.append((plan.proxy.host, cfg.proxy_exporter.port, "the proxy exporter"))
    uses.append((monitor_host(plan, inv), cfg.prometheus.port, "Prometheus"))
    clashes = [f"host {h}: {what} port {port} is inside {u.what} (ports {u.first}-{u.last})"
               for h, port, what in uses for u in plan.ports if u.host == h and u.first <= port <= u.last]
    if clashes:
        raise InvalidInput(f"monitoring ports collide with the plan on {len(clashes)} host(s)", details=clashes,
                           hint="change ports in the topology (ports, proxy.port) or the monitoring ports in "
                                "kimictl/data/observe.yml")


def target_count(targets: dict[str, list[dict[str, Any]]], *, merge: bool = False) -> int:
    return sum(len(g) for j, g in targets.items() if not (merge and j == PROM_JOB))


# --- rules ----------------------------------------------------------------------------------------------


def selector(cluster: str, job: str, **labels: str) -> str:
    """{job="...",cluster="...",k="v"}; a value starting with '~' is a regex match."""
    parts = []
    for k, v in {"job": job, "cluster": cluster, **labels}.items():
        parts.append(f'{k}=~"{v[1:]}"' if v.startswith("~") else f'{k}="{v}"')
    return "{" + ",".join(parts) + "}"


def _rules_context(plan: Plan, inv: Inventory, topo: Topology, cfg: ObserveConfig) -> dict[str, Any]:
    p = plan.proxy
    slo = effective_slo(topo, cfg)
    return {
        "cluster": plan.cluster, "topology": plan.topology, "profile": cfg.profile, "cfg": cfg, "a": cfg.alerts,
        "pd": plan.mode == "pd", "proxy": p,
        "expected": {"prefill": len(p.prefill), "decode": len(p.decode), "routers": len(p.routers)} if p else None,
        "quantiles": [{"value": q, "name": qname(q)} for q in cfg.recording.quantiles],
        "histograms": [{"metric": m, "record": m.replace("vllm:", "vllm_")} for m in HISTOGRAMS.values()],
        "hbm": hbm_thresholds(plan, cfg), "slo": slo, "slo_name": qname(slo["quantile"]),  # type: ignore[arg-type]
        "serving_roles": "decode|colocated", "aux_jobs": "|".join(
            j for j in (PROXY_JOB, ROUTER_JOB, NODE_JOB, NPU_JOB, PROM_JOB) if p or j not in (PROXY_JOB, ROUTER_JOB)),
        "sel": functools.partial(selector, plan.cluster),
    }


# --- dashboards -----------------------------------------------------------------------------------------

_DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}


def _panel(i: int, spec: dict[str, Any], exprs: list[tuple[str, str]]) -> dict[str, Any]:
    kind = spec.get("type", "timeseries")
    panel: dict[str, Any] = {
        "id": i + 1, "type": kind, "title": spec["title"], "description": spec.get("description", ""),
        "datasource": _DS, "gridPos": {"h": 8, "w": 12, "x": (i % 2) * 12, "y": (i // 2) * 8},
        "fieldConfig": {"defaults": {"unit": spec.get("unit", "none")}, "overrides": []},
        "targets": [{"refId": chr(ord("A") + k), "datasource": _DS, "expr": e, "legendFormat": legend, "range": True}
                    for k, (e, legend) in enumerate(exprs)],
    }
    panel["options"] = ({"reduceOptions": {"calcs": ["lastNotNull"]}} if kind == "stat" else
                        {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                         "tooltip": {"mode": "multi"}})
    return panel


def _dashboard(plan: Plan, page: str, spec: dict[str, Any], role: str | None) -> dict[str, Any]:
    c = plan.cluster
    subst = {"@role_npu": f'job="{NPU_JOB}",cluster="$cluster",role="{role}"',
             "@role": f'job="{ENGINE_JOB}",cluster="$cluster",role="{role}",engine_id=~"$engine_id"',
             "@engine": f'job="{ENGINE_JOB}",cluster="$cluster"', "@npu": f'job="{NPU_JOB}",cluster="$cluster"',
             "@proxy": f'job="{PROXY_JOB}",cluster="$cluster"'}
    panels = []
    for p in spec["panels"]:
        if (p.get("only") == "pd" and plan.mode != "pd") or (p.get("only") == "proxy" and not plan.proxy):
            continue
        if role and role not in p.get("roles", [role]):
            continue
        exprs = []
        for t in p["targets"]:
            for q in p.get("quantiles") or [None]:
                expr, legend = t["expr"], t["legend"]
                for k, v in subst.items():  # @role_npu before @role
                    expr = expr.replace(k, v)
                if q is not None:
                    expr, legend = expr.replace("$q", qname(q)[1:]), legend.replace("$q", qname(q)[1:])
                exprs.append((expr, legend))
        panels.append(_panel(len(panels), p, exprs))
    variables: list[dict[str, Any]] = [
        {"name": "cluster", "type": "custom", "query": c, "hide": 2, "current": {"text": c, "value": c},
         "options": [{"text": c, "value": c, "selected": True}]}]
    if role:
        q = f'label_values(up{{job="{ENGINE_JOB}",cluster="$cluster",role="{role}"}}, engine_id)'
        variables.append({"name": "engine_id", "label": "engine", "type": "query", "datasource": _DS,
                          "query": {"query": q, "refId": "engine_id"}, "definition": q, "refresh": 2,
                          "multi": True, "includeAll": True, "current": {"text": "All", "value": "$__all"}})
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "pluginId": "prometheus",
                      "pluginName": "Prometheus"}],
        "uid": "kimi-" + hashlib.sha256(f"{c}/{page}".encode()).hexdigest()[:12],
        "title": spec["title"].format(cluster=c, role=role or ""), "tags": ["kimictl", c], "editable": True,
        "schemaVersion": 39, "version": 1, "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "templating": {"list": variables}, "panels": panels,
    }


def dashboards(plan: Plan) -> dict[str, dict[str, Any]]:
    """Grafana dashboards: the overview and one page per role of the plan (kimictl/data/dashboards.yml)."""
    spec = _data("dashboards.yml")
    out = {"overview": _dashboard(plan, "overview", spec["overview"], None)}
    for role in plan.role_config:
        out[role] = _dashboard(plan, role, spec["role"], role)
    return out


# --- the rendered bundle --------------------------------------------------------------------------------


class ObserveRender(BaseModel):
    """Everything `observe render` writes, plus what `observe up` needs to know about it."""

    model_config = ConfigDict(frozen=True)

    cluster: str
    profile: str
    monitor_host: str
    prometheus_url: str
    targets: dict[str, list[dict[str, Any]]]
    files: dict[str, str]  # path relative to the output directory -> content
    alerts: list[str]
    records: list[str]
    expected_membership: dict[str, int] | None
    slo: dict[str, float | None]
    prefix: str

    @property
    def target_total(self) -> int:
        return target_count(self.targets)

    def summary(self) -> dict[str, Any]:
        return {"schema_version": OBSERVE_SCHEMA_VERSION, "cluster": self.cluster, "profile": self.profile,
                "monitor_host": self.monitor_host, "prometheus_url": self.prometheus_url,
                "targets": self.target_total, "jobs": {j: len(g) for j, g in self.targets.items()},
                "alerts": self.alerts, "records": self.records, "expected_membership": self.expected_membership,
                "slo": self.slo, "merge_prefix": self.prefix, "files": sorted(self.files)}


_PREFIX = re.compile(r"[A-Za-z0-9._/+@-]+")


def default_prefix(cluster: str) -> str:
    return f"/etc/prometheus/kimictl/{cluster}"


def render_observe(plan: Plan, inv: Inventory, topo: Topology, profile: str = "default",
                   prefix: str | None = None) -> ObserveRender:
    """Render the monitoring of one plan (deterministic: same input, byte-identical files)."""
    from kimictl.render import render_template

    cfg = load_config(profile)
    check_ports(plan, inv, cfg)
    if prefix is not None and not _PREFIX.fullmatch(prefix):
        raise InvalidInput(f"--prefix {prefix!r}: a directory path of letters, digits and . _ / + @ - (it is written "
                           "into merge.yml's file lists as it is)")
    prefix = (prefix or default_prefix(plan.cluster)).rstrip("/")
    targets = scrape_targets(plan, inv, cfg)
    ctx = _rules_context(plan, inv, topo, cfg)
    rules_name = f"rules/kimi-{plan.cluster}.yml"
    rules = render_template("observe/rules.yml.j2", **ctx)
    doc = yaml.safe_load(rules)
    alerts = [r["alert"] for g in doc["groups"] for r in g["rules"] if "alert" in r]
    records = [r["record"] for g in doc["groups"] for r in g["rules"] if "record" in r]
    jobs = [{"name": j, "scheme": cfg.npu_exporter.scheme if j == NPU_JOB else "http"} for j in targets]
    common = {"cluster": plan.cluster, "cfg": cfg, "rule_files": [rules_name]}
    files = {
        "prometheus.yml": render_template("observe/prometheus.yml.j2", **common, jobs=jobs, prefix="", merge=False),
        "merge.yml": render_template("observe/prometheus.yml.j2", **common, prefix=prefix + "/", merge=True,
                                     jobs=[j for j in jobs if j["name"] != PROM_JOB]),
        rules_name: rules,
    }
    for job, groups in targets.items():
        files[f"targets/{job}.json"] = json.dumps(groups, indent=2) + "\n"
    for page, dash in dashboards(plan).items():
        files[f"dashboards/kimi-{plan.cluster}-{page}.json"] = json.dumps(dash, indent=2) + "\n"
    mon = inv.host(monitor_host(plan, inv))
    out = ObserveRender(
        cluster=plan.cluster, profile=cfg.profile, monitor_host=mon.name,
        prometheus_url=f"http://{mon.ip}:{cfg.prometheus.port}", targets=targets,
        files={**files, "observe.json": ""}, alerts=alerts, records=records, expected_membership=ctx["expected"],
        slo=ctx["slo"], prefix=prefix)
    return out.model_copy(update={"files": {**files, "observe.json": json.dumps(out.summary(), indent=2) + "\n"}})


def write_observe(r: ObserveRender, out_dir: Path) -> list[Path]:
    written = []
    for rel, content in sorted(r.files.items()):
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        written.append(path)
    return written
