"""`kimictl observe render`: targets and labels from the plan, rule constants, profiles, the merge fragment, and
dashboards that only query metrics something exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_doubles import make_sim
from typer.testing import CliRunner

from kimictl import observe
from kimictl.cli.main import app
from kimictl.errors import InvalidInput
from kimictl.pipeline import prepare
from kimictl.remote import proxy_exporter
from kimictl.sandbox import engine_sim
from kimictl.sandbox.doubles import npu_exporter

REPO = Path(__file__).resolve().parents[2]
INV = REPO / "inventories"


def render(inv: str, topo: str, profile: str = "default", **kw) -> tuple[observe.ObserveRender, object]:
    p = prepare(INV / inv if "/" not in inv else Path(inv), topo)
    return observe.render_observe(p.plan, p.inventory, p.topology, profile, **kw), p


def test_pd_targets_carry_the_plan_labels():
    r, p = render("a3-pd.yml", "a3-pd")
    plan = p.plan
    engines = {g["labels"]["engine_id"]: g for g in r.targets["kimi-engine"]}
    assert set(engines) == {e.id for e in plan.engines if e.serves_http}
    for e in plan.engines:
        g = engines[e.id]
        assert g["targets"] == [f"{e.host_ip}:{e.port}"]
        assert g["labels"] == {"cluster": plan.cluster, "host": e.host, "role": e.role, "dp_group": e.instance,
                               "dp_rank": str(e.dp_ranks[0]), "engine_id": e.id}
    # the proxy: its exporter, and each router copy's own metrics relayed by it (loopback ports)
    proxy = plan.proxy
    exp = f"{proxy.ip}:9841"
    assert r.targets["kimi-proxy"] == [{"targets": [exp], "labels": {"cluster": plan.cluster, "host": proxy.host,
                                                                      "role": "proxy"}}]
    assert [(g["targets"], g["labels"]["router"], g["labels"]["__metrics_path__"]) for g in r.targets["kimi-router"]] \
        == [([exp], str(i), f"/router/{i}/metrics") for i in range(len(proxy.routers))]
    # node_exporter and Ascend's npu-exporter (default port 8082) on every host, labelled with its role
    for job, port in (("node", 9100), ("npu-exporter", 8082)):
        assert {g["labels"]["host"]: (g["targets"][0], g["labels"]["role"]) for g in r.targets[job]} == {
            h.name: (f"{h.ip}:{port}", plan.host_roles[h.name]) for h in p.inventory.hosts}
    assert r.monitor_host == proxy.host and r.prometheus_url == f"http://{proxy.ip}:9090"
    assert r.targets["prometheus"][0]["targets"] == [f"{proxy.ip}:9090"]
    assert r.target_total == 6 + 1 + 2 + 2 + 2 + 1
    assert r.expected_membership == {"prefill": 2, "decode": 4, "routers": 2}
    rules = r.files[f"rules/kimi-{plan.cluster}.yml"]
    assert 'worker_type="prefill"} != 2' in rules and 'worker_type="decode"} != 4' in rules
    assert "kimi_proxy_router_up" in rules and ") != 2" in rules


def test_colocated_internal_dp_has_no_proxy_and_no_headless_target():
    r, p = render("a2-colocated.yml", "a2-colocated")
    headless = [e for e in p.plan.engines if e.headless]
    assert headless, "a2-colocated runs a headless worker on the second host"
    assert {g["labels"]["engine_id"] for g in r.targets["kimi-engine"]} == {
        e.id for e in p.plan.engines if not e.headless}
    assert r.targets["kimi-engine"][0]["labels"]["dp_rank"] == ",".join(
        map(str, next(e for e in p.plan.engines if e.serves_http).dp_ranks))
    assert len(r.targets["node"]) == len(r.targets["npu-exporter"]) == 2  # every host, headless too
    assert "kimi-proxy" not in r.targets and "kimi-router" not in r.targets
    assert r.monitor_host == p.inventory.hosts[0].name and r.expected_membership is None
    assert "KimiKVHandoverBroken" not in r.alerts and "KimiProxyMembership" not in r.alerts
    assert {"KimiEngineDown", "KimiTPOTSLOBurn", "KimiDeviceLinkDown"} <= set(r.alerts)
    assert set(json.loads(r.files["observe.json"])["jobs"]) == {"kimi-engine", "node", "npu-exporter", "prometheus"}


def test_monitor_host_from_the_inventory(inventory_factory):
    inv = yaml.safe_load((INV / "a3-pd.yml").read_text())
    second = list(inv["all"]["hosts"])[1]
    inv["all"]["vars"]["kimi_monitor_host"] = second
    r, p = render(str(inventory_factory(inv)), "a3-pd")
    assert r.monitor_host == second and r.prometheus_url == f"http://{p.inventory.host(second).ip}:9090"


def test_slo_and_hbm_thresholds_come_from_the_topology_and_data(inventory_factory):
    r, _ = render("a3-pd.yml", "a3-pd")
    assert r.slo == {"quantile": 0.9, "tpot_s": 0.05, "ttft_s": None}  # observe.yml: the article's TPOT target
    assert "KimiTTFTSLOBurn" not in r.alerts
    rules = yaml.safe_load(r.files["rules/kimi-kimi-a3.yml"])
    hbm = next(x for g in rules["groups"] for x in g["rules"] if x.get("alert") == "KimiHBMNearFull")
    assert hbm["expr"].count("> 0.97") == 1 and 'role=~"decode|prefill"' in hbm["expr"]

    topo = yaml.safe_load((REPO / "kimictl/data/topologies/a3-pd.yml").read_text())
    topo["slo"] = {"tpot_ms": 35, "ttft_ms": 1500, "quantile": 0.99}
    topo["roles"]["decode"]["serve"]["gpu-memory-utilization"] = 0.96  # vLLM itself takes 96%: 98% is near full
    r, _ = render("a3-pd.yml", str(inventory_factory(topo, "t.yml")))
    assert r.slo == {"quantile": 0.99, "tpot_s": 0.035, "ttft_s": 1.5}
    rules = yaml.safe_load(r.files["rules/kimi-kimi-a3.yml"])
    by = {x.get("alert"): x for g in rules["groups"] for x in g["rules"]}
    assert "histogram_quantile(0.99," in by["KimiTPOTSLOBurn"]["expr"] and "> 0.035" in by["KimiTPOTSLOBurn"]["expr"]
    assert "> 1.5" in by["KimiTTFTSLOBurn"]["expr"] and "p99" in by["KimiTTFTSLOBurn"]["annotations"]["description"]
    assert 'role=~"prefill"} > 0)) > 0.97' in by["KimiHBMNearFull"]["expr"]
    assert 'role=~"decode"} > 0)) > 0.98' in by["KimiHBMNearFull"]["expr"]


def test_profiles_set_intervals_and_durations():
    d, _ = render("a3-pd.yml", "a3-pd")
    s, _ = render("a3-pd.yml", "a3-pd", "sandbox")
    dcfg, scfg = yaml.safe_load(d.files["prometheus.yml"]), yaml.safe_load(s.files["prometheus.yml"])
    assert dcfg["global"]["scrape_interval"] == "15s" and scfg["global"]["scrape_interval"] == "2s"
    assert all(j["scrape_interval"] == "2s" for j in scfg["scrape_configs"])
    down = {r.profile: next(x for g in yaml.safe_load(r.files["rules/kimi-kimi-a3.yml"])["groups"]
                            for x in g["rules"] if x.get("alert") == "KimiEngineDown") for r in (d, s)}
    assert down["default"]["for"] == "1m" and down["sandbox"]["for"] == "4s"
    with pytest.raises(InvalidInput, match=r"unknown monitoring profile 'fast'.*default, sandbox"):
        observe.load_config("fast")


def test_render_is_deterministic_and_the_merge_fragment_points_at_the_prefix():
    a, _ = render("a3-pd.yml", "a3-pd")
    b, _ = render("a3-pd.yml", "a3-pd")
    assert a.files == b.files
    full, merge = yaml.safe_load(a.files["prometheus.yml"]), yaml.safe_load(a.files["merge.yml"])
    assert full["rule_files"] == ["rules/kimi-kimi-a3.yml"]
    assert merge["rule_files"] == ["/etc/prometheus/kimictl/kimi-a3/rules/kimi-kimi-a3.yml"]
    assert "global" not in merge  # the site's own global section stays
    jobs = {j["job_name"]: j for j in merge["scrape_configs"]}
    assert "kimi-a3/prometheus" not in jobs and "kimi-a3/prometheus" in {j["job_name"] for j in full["scrape_configs"]}
    engine = jobs["kimi-a3/kimi-engine"]
    assert engine["file_sd_configs"] == [{"files": ["/etc/prometheus/kimictl/kimi-a3/targets/kimi-engine.json"]}]
    assert engine["relabel_configs"] == [{"target_label": "job", "replacement": "kimi-engine"}]
    assert yaml.safe_load(a.files["merge.yml"].replace("kimi-a3", "x"))  # still YAML for any cluster name


# --- dashboards -----------------------------------------------------------------------------------------------

PROMQL_WORDS = {"sum", "max", "min", "avg", "count", "by", "rate", "increase", "changes", "histogram_quantile",
                "bool", "and", "or", "unless", "on", "ignoring", "le", "without"}


def exported_names(tmp_path: Path, monkeypatch) -> set[str]:
    """Every metric name something kimictl deploys or scrapes exports: the engine simulator (vLLM's names), the
    proxy exporter, the npu-exporter double, plus Prometheus' own up/ALERTS."""
    names = {"up", "ALERTS"}

    def add(text: str) -> None:  # series names only: a counter's family name (no _total) is not queryable
        for fam in text_string_to_metric_families(text):
            names.update(s.name for s in fam.samples)

    m = engine_sim.Metrics()
    m.register_engine(("kimi-k2.5", "0"))
    add(m.render())
    workers = json.dumps({"workers": [{"url": "http://10.0.0.1:7100", "worker_type": "prefill", "is_healthy": True}]})
    monkeypatch.setattr(proxy_exporter, "fetch", lambda url, _t, _b=None: (200, workers.encode(), "application/json"))
    add(proxy_exporter.Exporter(1, [(2, 3)], 0.1).collect())
    monkeypatch.setenv("KIMI_SIM_DIR", str(make_sim(tmp_path, "atlas-800-a3")))
    add(npu_exporter.metrics())
    return names


@pytest.mark.parametrize("inv,topo", [("a3-pd.yml", "a3-pd"), ("a3-colocated.yml", "a3-colocated")])
def test_dashboards_query_only_metrics_that_exist(inv, topo, tmp_path, monkeypatch):
    r, p = render(inv, topo)
    known = exported_names(tmp_path, monkeypatch) | set(r.records)
    pages = {k: json.loads(v) for k, v in r.files.items() if k.startswith("dashboards/")}
    assert set(pages) == {f"dashboards/kimi-{p.plan.cluster}-{x}.json" for x in ["overview", *p.plan.role_config]}
    exprs = []
    for name, dash in pages.items():
        assert len(dash["uid"]) <= 40 and dash["panels"], name
        for panel in dash["panels"]:
            for t in panel["targets"]:
                exprs.append(t["expr"])
                # every metric a query names is followed by its selector or a range
                for metric in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[{\[]", t["expr"]):
                    assert metric in known, f"{name} / {panel['title']}: {metric} is exported by nothing"
    assert any("vllm:kv_cache_usage_perc" in e for e in exprs) and any("npu_chip_info" in e for e in exprs)
    promtool = shutil.which("promtool")
    if promtool:  # every query parses (as recording rules, with Grafana's variables filled in)
        fill = {"$__rate_interval": "5m", "$cluster": "c", "$engine_id": ".*"}
        rules = {"groups": [{"name": "dash", "rules": [
            {"record": f"dash:q{i}", "expr": re.sub("|".join(re.escape(k) for k in fill), lambda m: fill[m[0]], e)}
            for i, e in enumerate(exprs)]}]}
        (tmp_path / "dash.yml").write_text(yaml.safe_dump(rules))
        proc = subprocess.run([promtool, "check", "rules", str(tmp_path / "dash.yml")], capture_output=True,
                              text=True, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_metric_name_check_catches_an_unknown_name(tmp_path, monkeypatch):
    known = exported_names(tmp_path, monkeypatch)
    assert "vllm:num_requests_waiting" in known and "kimi_proxy_router_workers" in known
    assert "npu_chip_info_link_status" in known and "vllm:prompt_tokens_by_source_total" in known
    assert "kimi_proxy_router_worker" in known and "kimi_proxy_front_up" in known
    assert "vllm:gpu_cache_usage_perc" not in known  # vLLM's removed name (vllm-ascend.md section 8)
    assert "vllm:num_preemptions" not in known and "vllm:num_preemptions_total" in known  # a counter's series


# --- the command ----------------------------------------------------------------------------------------------


def test_observe_render_cli_writes_the_files_and_json(tmp_path):
    out = tmp_path / "obs"
    res = CliRunner().invoke(app, ["observe", "render", "-i", str(INV / "a3-pd.yml"), "--topology", "a3-pd",
                                   "--out", str(out), "--output", "json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["targets"] == 14 and doc["prometheus_url"] == "http://192.168.10.11:9090"
    assert (out / "prometheus.yml").exists() and (out / "targets/kimi-engine.json").exists()
    assert sorted(str(f.relative_to(out)) for f in out.rglob("*") if f.is_file()) == doc["files"]
    res = CliRunner().invoke(app, ["observe", "render", "-i", str(INV / "a3-pd.yml"), "--topology", "a3-pd",
                                   "--out", str(out), "--profile", "nope"])
    assert res.exit_code == 2 and "unknown monitoring profile" in res.stderr


def test_observe_up_print_changes_nothing_and_prints_the_fragment(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path))
    args = ["observe", "up", "-i", str(INV / "a3-pd.yml"), "--print", "--prefix", "/srv/prom/kimi"]
    res = CliRunner().invoke(app, [*args, "--topology", "a3-pd"])
    assert res.exit_code == 0, res.output
    merge = yaml.safe_load(res.stdout)
    assert merge["rule_files"] == ["/srv/prom/kimi/rules/kimi-kimi-a3.yml"] and len(merge["scrape_configs"]) == 5
    assert not list(tmp_path.iterdir()), "--print writes nothing, runs nothing"
    res = CliRunner().invoke(app, [*args, "--output", "json"])  # no --topology and nothing deployed
    assert res.exit_code == 2 and "pass --topology" in json.loads(res.stdout)["error"]["hint"]


def test_a_monitoring_port_inside_a_planned_range_is_refused(inventory_factory):
    topo = yaml.safe_load((REPO / "kimictl/data/topologies/a3-pd.yml").read_text())
    topo["ports"]["http_base"] = 9098  # decode's 4 ranks take 9098-9101: node_exporter's 9100 is one of them
    with pytest.raises(InvalidInput) as e:
        render("a3-pd.yml", str(inventory_factory(topo, "t.yml")))
    assert "monitoring ports collide" in e.value.message
    assert any("node_exporter port 9100 is inside decode-0-dp2 HTTP" in d for d in e.value.details)
