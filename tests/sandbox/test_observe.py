"""`kimictl observe up` on a deployed 2-host A3 sandbox: Prometheus scrapes every rendered target, and the alerts
fire from what really happens on the hosts - a drain left behind in a router copy, a device link down (the
npu-exporter double reads the same fault state as hccn_tool), an engine killed with its supervisor."""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from typing import Any

import pytest
from conftest import _bring_up, kimictl

from kimictl.cluster_secrets import proxy_admin_key
from kimictl.inventory import load_inventory
from kimictl.observe import load_config, seconds

pytestmark = pytest.mark.sandbox

PROFILE = "sandbox"
SD = "/var/lib/kimi"


@pytest.fixture(scope="module")
def monitored(tmp_path_factory):
    """This module's own 2-host A3 sandbox with a3-pd deployed and `observe up` run once."""
    gen = _bring_up(tmp_path_factory.mktemp("sb-observe"), "--hosts", "2", "--hardware", "atlas-800-a3")
    sb = next(gen)
    proc = kimictl("deploy", "-i", str(sb.inventory), "--topology", "a3-pd", "--yes", "--output", "json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = kimictl("observe", "up", "-i", str(sb.inventory), "--profile", PROFILE, "--output", "json")
    sb.up_proc = proc
    sb.up = json.loads(proc.stdout) if proc.stdout.strip() else {}
    yield sb
    gen.close()


def prom(sb, path: str, **params: str) -> Any:
    url = f"{sb.up['prometheus_url']}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())["data"]


def firing(sb, alert: str) -> list[dict[str, str]]:
    return [a["labels"] for a in prom(sb, "/api/v1/alerts")["alerts"]
            if a["labels"]["alertname"] == alert and a["state"] == "firing"]


def wait_firing(sb, alert: str, timeout: float = 90) -> list[dict[str, str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = firing(sb, alert)
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"{alert} did not fire within {timeout}s: {prom(sb, '/api/v1/alerts')}")


def test_observe_up_scrapes_every_rendered_target(monitored):
    sb = monitored
    assert sb.up_proc.returncode == 0, sb.up_proc.stderr[-3000:]
    render = json.loads(kimictl("observe", "render", "-i", str(sb.inventory), "--topology", "a3-pd", "--profile",
                                PROFILE, "--out", str(sb.dir / "obs"), "--output", "json").stdout)
    # 6 engine endpoints, the proxy exporter and its 2 router copies, node_exporter and npu-exporter on each host,
    # Prometheus itself
    assert sb.up["targets"] == render["targets"] == 14 and sb.up["targets_up"] == 14 and sb.up["down"] == []
    assert sb.up["prometheus_url"] == f"http://{sb.host('atlas-01')['ip']}:9090"  # the proxy host by default
    active = [t for t in prom(sb, "/api/v1/targets", state="active")["activeTargets"]
              if t["labels"].get("cluster") == sb.cluster]
    assert len(active) == 14 and {t["health"] for t in active} == {"up"}
    assert {(t["labels"]["job"], t["labels"].get("engine_id")) for t in active if t["labels"]["job"] == "kimi-engine"} \
        == {("kimi-engine", e) for e in ("prefill-0-dp0", "prefill-0-dp1", "decode-0-dp0", "decode-0-dp1",
                                         "decode-0-dp2", "decode-0-dp3")}
    assert not [a for a in prom(sb, "/api/v1/alerts")["alerts"] if a["state"] == "firing"], \
        "a healthy cluster fires no alert"
    # a second run changes nothing and restarts nothing
    again = json.loads(kimictl("observe", "up", "-i", str(sb.inventory), "--profile", PROFILE, "--output",
                               "json").stdout)
    assert all(not a["start"] and not a["stop"] for a in again["actions"].values()) and again["targets_up"] == 14
    st = json.loads(kimictl("status", "-i", str(sb.inventory), "--output", "json").stdout)
    assert st["monitoring"]["prometheus_url"] == sb.up["prometheus_url"] and st["monitoring"]["state"] == "ready"
    # the monitoring processes live apart from the engines: deploy, stop and status do not see them
    supervised = json.loads(sb.ssh("atlas-01", f"python3 {SD}/bin/supervisor.py status --run-dir {SD}/run").stdout)
    assert not {s["name"] for s in supervised} & {"prometheus", "node-exporter", "proxy-exporter"}


def test_a_drain_left_behind_and_a_link_down_fire(monitored):
    sb = monitored
    proxy = f"http://{sb.host('atlas-01')['ip']}:8000"
    decode = f"{sb.host('atlas-02')['ip']}:7101"
    # drain decode-0-dp1 from router copy 0 (vllm-ascend's proxy, idle: removed at once), with kimictl's admin key
    admin = proxy_admin_key(load_inventory(sb.inventory), "atlas-01")
    req = urllib.request.Request(f"{proxy}/kimictl/router/0/instances/remove", method="POST",
                                 data=json.dumps({"type": "decode", "instances": [decode]}).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {admin}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200 and decode not in json.loads(r.read())["current_decode_instances"]
    sb.fault("link-down:atlas-01:3")
    member = wait_firing(sb, "KimiProxyMembership")
    assert [(a["router"], a["worker_type"], a["host"]) for a in member] == [("0", "decode", "atlas-01")]
    link = wait_firing(sb, "KimiDeviceLinkDown")
    assert [(a["host"], a["id"], a["role"]) for a in link] == [("atlas-01", "3", "prefill")]
    assert not firing(sb, "KimiEngineDown")


def test_a_killed_engine_fires_engine_down_within_two_scrapes_and_its_for(monitored):
    sb = monitored
    cfg = load_config(PROFILE)
    scrape, hold = seconds(cfg.prometheus.scrape_interval), seconds(cfg.alerts.engine_down.for_)
    st = json.loads(sb.ssh("atlas-02", f"python3 {SD}/bin/supervisor.py status --run-dir {SD}/run "
                                       "--name decode-0-dp0").stdout)[0]
    # the engine and its supervisor both die (the supervisor alone would restart it within a second)
    killed_at = time.time()
    proc = sb.ssh("atlas-02", f"kill -9 {st['supervisor_pid']} {st['child_pid']}")
    assert proc.returncode == 0, proc.stderr
    alerts = wait_firing(sb, "KimiEngineDown")
    assert [(a["engine_id"], a["host"], a["role"], a["dp_group"], a["severity"]) for a in alerts] == [
        ("decode-0-dp0", "atlas-02", "decode", "decode-0", "critical")]
    # Prometheus' own timeline: the first scrape that failed, and the first evaluation that fired
    sel = 'engine_id="decode-0-dp0"'
    ups = prom(sb, "/api/v1/query", query=f"up{{{sel}}}[2m]")["result"][0]["values"]
    down_at = next(float(t) for t, v in ups if float(t) > killed_at and v == "0")
    fire = prom(sb, "/api/v1/query", query=f'ALERTS{{alertname="KimiEngineDown",alertstate="firing",{sel}}}[2m]')
    fired_at = float(fire["result"][0]["values"][0][0])
    # 0.5 s: a scrape's own duration (its sample is stamped when it starts) and the timestamps' rounding
    assert down_at - killed_at <= scrape + 0.5, (killed_at, ups)
    assert fired_at - killed_at <= 2 * scrape + hold + 0.5, (killed_at, down_at, fired_at)
    st = json.loads(kimictl("status", "-i", str(sb.inventory), "--output", "json").stdout)
    assert "KimiEngineDown" in st["monitoring"]["alerts_firing"]
