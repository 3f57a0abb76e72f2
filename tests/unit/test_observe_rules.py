"""The rendered rules and config under Prometheus' own promtool: `check config`, `check rules`, and `test rules`
with synthetic series for every alert, firing and not firing. Series carry the labels the rendered targets give
them (job, instance, cluster, host, role, ...), so a selector that does not match what Prometheus scrapes fails."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prerequisites import require_or_skip

from kimictl import observe
from kimictl.pipeline import prepare

PROMTOOL = shutil.which("promtool")
REPO = Path(__file__).resolve().parents[2]
LABEL_TEMPLATE = re.compile(r"\{\{ \$labels\.([a-z_]+) \}\}")


@pytest.fixture(scope="module", autouse=True)
def _needs_promtool() -> None:
    if PROMTOOL is None:
        require_or_skip("promtool missing (Debian package prometheus; scripts/bootstrap.sh installs it)")


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> tuple[observe.ObserveRender, Path]:
    """a3-pd on the repo's 2-host inventory, with a TTFT target so every alert is rendered."""
    d = tmp_path_factory.mktemp("observe")
    topo = yaml.safe_load((REPO / "kimictl/data/topologies/a3-pd.yml").read_text())
    topo["slo"] = {"ttft_ms": 2000}
    (d / "topo.yml").write_text(yaml.safe_dump(topo))
    p = prepare(REPO / "inventories/a3-pd.yml", str(d / "topo.yml"))
    r = observe.render_observe(p.plan, p.inventory, p.topology)
    observe.write_observe(r, d / "out")
    return r, d / "out"


def test_promtool_checks_config_targets_and_rules(rendered):
    r, out = rendered
    proc = promtool("check", "config", "prometheus.yml", cwd=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = promtool("check", "rules", *[f for f in r.files if f.startswith("rules/")], cwd=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the fragment for an existing Prometheus is a valid config once its absolute prefix holds the files
    merged = out / "merged"
    shutil.copytree(out, merged / r.prefix.lstrip("/"))
    (merged / "prometheus.yml").write_text((out / "merge.yml").read_text().replace(r.prefix, str(merged) + r.prefix))
    proc = promtool("check", "config", "prometheus.yml", cwd=merged)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _labels(r: observe.ObserveRender, job: str, **match: str) -> dict[str, str]:
    """The labels Prometheus gives a rendered target's series: its file_sd labels, job and instance."""
    for g in r.targets[job]:
        if all(g["labels"].get(k) == v for k, v in match.items()):
            return {**{k: v for k, v in g["labels"].items() if not k.startswith("__")}, "job": job,
                    "instance": g["targets"][0]}
    raise AssertionError(f"no {job} target with {match}")


def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{body}}}", "values": values}


def _expected(rules: dict, alert: str, labels: dict[str, str]) -> dict[str, Any]:
    """An expected alert: the series' labels plus the rule's, annotations expanded from the rule's templates."""
    rule = next(x for g in rules["groups"] for x in g["rules"] if x.get("alert") == alert)
    ann = {}
    for k, text in rule["annotations"].items():
        assert "{{" not in LABEL_TEMPLATE.sub("", text), f"{alert}.{k}: only $labels templates are expected"
        ann[k] = LABEL_TEMPLATE.sub(lambda m: labels.get(m.group(1), ""), text)
    return {"exp_labels": {**labels, **rule.get("labels", {})}, "exp_annotations": ann}


def _bucket(name: str, labels: dict[str, str], le: str, values: str) -> dict[str, str]:
    return _series(f"{name}_bucket", {**labels, "le": le}, values)


def scenarios(r: observe.ObserveRender) -> list[dict[str, Any]]:
    """Per alert: input series, and when it must fire (with which labels) and when it must not."""
    dec = _labels(r, "kimi-engine", engine_id="decode-0-dp0")
    dec1 = _labels(r, "kimi-engine", engine_id="decode-0-dp1")
    pre = _labels(r, "kimi-engine", engine_id="prefill-0-dp0")
    proxy = _labels(r, "kimi-proxy")
    npu = _labels(r, "npu-exporter", role="decode")
    node = _labels(r, "node", role="decode")
    c = {"cluster": r.cluster}
    exp = r.expected_membership
    assert exp == {"prefill": 2, "decode": 4, "routers": 2}
    ttft, tpot = "vllm:time_to_first_token_seconds", "vllm:request_time_per_output_token_seconds"
    return [
        {"alert": "KimiEngineDown", "interval": "15s",
         "series": [_series("up", dec, "1 1 0x12"), _series("up", dec1, "1x14")],
         "quiet_at": ["15s", "45s"], "fire_at": "2m", "fires": [dec]},
        {"alert": "KimiEngineRestarting", "interval": "1m",
         # dec restarted twice in 15 min (a crash loop), dec1 once (a rollout restart)
         "series": [_series("process_start_time_seconds", dec, "100 100 200 200 300 300x10"),
                    _series("process_start_time_seconds", dec1, "100 100 100 200 200x10")],
         "quiet_at": ["3m"], "fire_at": "5m", "fires": [dec]},
        {"alert": "KimiKVHandoverBroken", "interval": "1m",
         "series": [_series("vllm:prompt_tokens_total", pre, "0+500x20"),
                    _series("vllm:prompt_tokens_by_source_total", {**dec, "source": "external_kv_transfer"},
                            "0+500x5 2500x15"),
                    _series("vllm:external_prefix_cache_hits_total", dec, "0+500x5 2500x15")],
         # handing over for 5 min, then decode loads nothing while prefill keeps working
         "quiet_at": ["4m"], "fire_at": "14m", "fires": [c]},
        {"alert": "KimiKVHandoverBroken", "interval": "1m", "note": "older vLLM: only the external prefix cache",
         "series": [_series("vllm:prompt_tokens_total", pre, "0+500x20"),
                    _series("vllm:external_prefix_cache_hits_total", dec, "0+500x20")],
         "quiet_at": ["14m"]},
        {"alert": "KimiHBMNearFull", "interval": "1m",
         "series": [_series("npu_chip_info_hbm_used_memory", {**npu, "id": "0"}, "58982x3 64225x10"),
                    _series("npu_chip_info_hbm_total_memory", {**npu, "id": "0"}, "65536x13"),
                    _series("npu_chip_info_hbm_used_memory", {**npu, "id": "1"}, "58982x13"),
                    _series("npu_chip_info_hbm_total_memory", {**npu, "id": "1"}, "65536x13"),
                    _series("npu_chip_info_hbm_used_memory", {**npu, "id": "2"}, "100x13"),
                    _series("npu_chip_info_hbm_total_memory", {**npu, "id": "2"}, "0x13")],
         "quiet_at": ["6m"], "fire_at": "10m", "fires": [{**npu, "id": "0"}]},
        {"alert": "KimiProxyMembership", "interval": "1m",
         "series": [_series("kimi_proxy_router_up", {**proxy, "router": "0", "port": "8001"}, "1x12"),
                    _series("kimi_proxy_router_up", {**proxy, "router": "1", "port": "8003"}, "1x12"),
                    _series("kimi_proxy_router_workers", {**proxy, "router": "0", "worker_type": "prefill"},
                            f"{exp['prefill']}x12"),
                    _series("kimi_proxy_router_workers", {**proxy, "router": "0", "worker_type": "decode"},
                            f"{exp['decode']}x12"),
                    _series("kimi_proxy_router_workers", {**proxy, "router": "1", "worker_type": "prefill"},
                            f"{exp['prefill']}x12"),
                    # copy 1 lost a decode endpoint at 2m (a drain nobody re-added)
                    _series("kimi_proxy_router_workers", {**proxy, "router": "1", "worker_type": "decode"},
                            f"{exp['decode']}x1 {exp['decode'] - 1}x10")],
         "quiet_at": ["1m", "6m"], "fire_at": "8m",
         "fires": [{**proxy, "router": "1", "worker_type": "decode"}]},
        {"alert": "KimiProxyMembership", "interval": "1m", "note": "a copy that does not answer",
         "series": [_series("kimi_proxy_router_up", {**proxy, "router": "0", "port": "8001"}, "1x12"),
                    _series("kimi_proxy_router_up", {**proxy, "router": "1", "port": "8003"}, "0x12")]
         + [_series("kimi_proxy_router_workers", {**proxy, "router": "0", "worker_type": t}, f"{exp[t]}x12")
            for t in ("prefill", "decode")],
         "fire_at": "6m", "fires": [{**proxy, "router": "1", "port": "8003"}]},
        {"alert": "KimiProxyDown", "interval": "15s",
         "series": [_series("kimi_proxy_front_up", proxy, "1 0x12")], "quiet_at": ["30s"], "fire_at": "2m",
         "fires": [proxy]},
        {"alert": "KimiTPOTSLOBurn", "interval": "1m",
         # every request of decode-0-dp0 at 50-75 ms per token: p90 ~72 ms > 50 ms; dp1 at <= 25 ms
         "series": [_bucket(tpot, dec, "0.025", "0x30"), _bucket(tpot, dec, "0.05", "0x30"),
                    _bucket(tpot, dec, "0.075", "0+10x30"), _bucket(tpot, dec, "+Inf", "0+10x30"),
                    _bucket(tpot, dec1, "0.025", "0+10x30"), _bucket(tpot, dec1, "0.05", "0+10x30"),
                    _bucket(tpot, dec1, "0.075", "0+10x30"), _bucket(tpot, dec1, "+Inf", "0+10x30")],
         "quiet_at": ["3m"], "fire_at": "20m", "fires": [{"cluster": r.cluster, "role": "decode"}]},
        {"alert": "KimiTPOTSLOBurn", "interval": "1m", "note": "both at <= 25 ms",
         "series": [_bucket(tpot, e, le, "0+10x30") for e in (dec, dec1) for le in ("0.025", "0.05", "+Inf")],
         "quiet_at": ["20m"]},
        {"alert": "KimiTTFTSLOBurn", "interval": "1m",
         # prefill and decode each ~1.75 s at p90 (under 2 s), but a client waits for both: 3.5 s
         "series": [_bucket(ttft, e, le, v) for e in (pre, dec)
                    for le, v in (("1.0", "0+8x30"), ("2.5", "0+10x30"), ("+Inf", "0+10x30"))],
         "quiet_at": ["3m"], "fire_at": "20m", "fires": [c]},
        {"alert": "KimiTTFTSLOBurn", "interval": "1m", "note": "~0.9 s in all",
         "series": [_bucket(ttft, e, le, v) for e in (pre, dec)
                    for le, v in (("0.25", "0x30"), ("0.5", "0+10x30"), ("+Inf", "0+10x30"))],
         "quiet_at": ["20m"]},
        {"alert": "KimiDeviceLinkDown", "interval": "15s",
         "series": [_series("npu_chip_info_link_status", {**npu, "id": "3"}, "1 0x12"),
                    _series("npu_chip_info_link_status", {**npu, "id": "2"}, "1x13"),
                    # newer exporters: -1 when hccn_tool itself failed (not a link state)
                    _series("npu_chip_info_link_status", {**npu, "id": "4"}, "-1x13")],
         "quiet_at": ["30s"], "fire_at": "2m", "fires": [{**npu, "id": "3"}]},
        {"alert": "KimiTargetDown", "interval": "1m",
         "series": [_series("up", node, "1 0x10"), _series("up", dec, "0x11")],  # engines have their own alert
         "quiet_at": ["3m"], "fire_at": "7m", "fires": [node]},
    ]


def test_promtool_unit_tests_every_alert_firing_and_quiet(rendered, tmp_path):
    r, out = rendered
    rules_file = next(f for f in r.files if f.startswith("rules/"))
    rules = yaml.safe_load(r.files[rules_file])
    tests = []
    for s in scenarios(r):
        cases = [{"eval_time": t, "alertname": s["alert"], "exp_alerts": []} for t in s.get("quiet_at", [])]
        if "fire_at" in s:
            cases.append({"eval_time": s["fire_at"], "alertname": s["alert"],
                          "exp_alerts": [_expected(rules, s["alert"], labels) for labels in s["fires"]]})
        tests.append({"name": f"{s['alert']} {s.get('note', '')}".strip(), "interval": s["interval"],
                      "input_series": s["series"], "alert_rule_test": cases})
    # every rendered alert is tested both ways
    fired = {s["alert"] for s in scenarios(r) if "fire_at" in s}
    quiet = {s["alert"] for s in scenarios(r) if s.get("quiet_at")}
    assert fired == quiet == set(r.alerts), (set(r.alerts) - fired, set(r.alerts) - quiet)
    spec = tmp_path / "tests.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(out / rules_file)], "evaluation_interval": "15s",
                                    "tests": tests}, sort_keys=False))
    proc = promtool("test", "rules", str(spec), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
