"""P/D on two sandbox hosts with real vLLM engines (CPU build, tiny Kimi-shaped checkpoint) moving the prompt's KV
over the network: NIXL (UCX over TCP, the cpu-smoke default) and Mooncake (TCP transport, kimictl's CPU shim), each
deployed by `kimictl deploy` behind the proxy (vllm-ascend's proxy for NIXL, vllm-router for Mooncake) and judged
by what really moved: decode counts every prompt token as external_kv_transfer and computes none, the KV crosses the
hosts' NIC between their addresses. Each class deploys once and kills its prefill engine at the end (peer restart);
the sandbox is shared by every lane test.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import (
    TINY_ID,
    TOPOLOGIES,
    engine_cmdline,
    front_state,
    lane_inventory,
    lane_logs,
    nic_rx_bytes,
    run_json,
    stop_cluster,
    supervised,
    tcp_links,
)

from kimictl import health
from kimictl.facts import engine_profile
from kimictl.sandbox.fakehub import FakeHub

pytestmark = [pytest.mark.real_engine, pytest.mark.sandbox, pytest.mark.slow]
PROFILE = engine_profile("cpu-smoke")
SERVED = PROFILE.facts().served_model_name
HTTP = 7100  # the lane topology's engine port on both hosts
TOPOLOGY = TOPOLOGIES / "cpu-smoke-pd.yml"


@dataclass
class Pd:
    sb: object
    inventory: Path
    deploy: dict
    p_ip: str
    d_ip: str

    def probe(self, url: str | None = None, words: int = 300) -> health.PdProbe:
        return health.pd_probe(url or f"http://{self.p_ip}:8000/v1/completions", SERVED, [(self.p_ip, HTTP)],
                               [(self.d_ip, HTTP)], words=words, max_tokens=8, timeout=PROFILE.probe_timeout_s)


def _deploy(sb, tmp: Path, lane_python: str, tiny_model: Path, cluster: str, **extra: str) -> Iterator[Pd]:
    """Deploy the lane's 1P1D (prefill on atlas-01, decode on atlas-02) and stop it afterwards."""
    hub = None
    if not extra:  # the default connector's deploy also stages the checkpoint from a hub (weights pull)
        bridge = yaml.safe_load(sb.inventory.read_text())["all"]["vars"]["kimi_model_endpoint"].split("//")[1]
        hub = FakeHub({TINY_ID: tiny_model}, bridge.split(":")[0], 0)
        hub.start()
    inv = lane_inventory(sb, tmp, cluster=cluster, hosts=["atlas-01", "atlas-02"], lane_python=lane_python,
                         model_dir=tiny_model, hub_url=hub.url if hub else None, **extra)
    try:
        code, doc, err = run_json("deploy", "-i", str(inv), "--topology", str(TOPOLOGY), "--yes")
    finally:
        if hub:
            hub.stop()
    try:
        assert code == 0, err[-4000:] + lane_logs(sb)
        print(f"{cluster}: engines ready after {doc['seconds'].get('engines_ready')}s; smoke {doc['smoke']}")
        yield Pd(sb, inv, doc, sb.host("atlas-01")["ip"], sb.host("atlas-02")["ip"])
    finally:
        stop_cluster(inv)


def _moves_kv_over_the_network(pd: Pd, lane_python: str) -> health.PdProbe:
    """The deploy's smoke and one more completion through the proxy: decode got every prompt token over the
    connector (none computed), the engines are the lane's vLLM, and the KV crossed between the hosts' addresses."""
    smoke = pd.deploy["smoke"]
    assert smoke["decode_external_kv_transfer_tokens"] == smoke["prompt_tokens"] > 0, smoke
    assert smoke["decode_local_compute_tokens"] == 0 and smoke["prefill_prompt_tokens"] > 0, smoke
    sup = {**supervised(pd.sb, "atlas-01"), **supervised(pd.sb, "atlas-02")}
    assert {n for n, s in sup.items() if s["state"] == "running"} >= {"prefill-0-dp0", "decode-0-dp0", "proxy"}
    for host, name in (("atlas-01", "prefill-0-dp0"), ("atlas-02", "decode-0-dp0")):
        argv = engine_cmdline(pd.sb, host, sup[name]["child_pid"])
        assert argv[:3] == [lane_python, "-m", "vllm.entrypoints.openai.api_server"], argv

    rx0 = nic_rx_bytes(pd.sb, "atlas-02")
    probe = pd.probe()
    rx = nic_rx_bytes(pd.sb, "atlas-02") - rx0
    print(f"{pd.inventory.stem}: {probe.detail}; decode's NIC received {rx} bytes")
    assert probe.ok, probe.detail + "\n" + lane_logs(pd.sb)
    assert probe.external_kv_transfer == probe.prompt_tokens == probe.prefill_prompt_tokens > 300
    assert probe.local_compute == 0
    # The prompt's KV (bytes per token from the model's facts) came in over decode's NIC, not over loopback ...
    assert rx >= 0.9 * probe.prompt_tokens * PROFILE.facts().kv_bytes_per_token, rx
    # ... on TCP connections between the two hosts' addresses that are not the router's HTTP.
    kv_links = [c for c in tcp_links(pd.sb, "atlas-02") if c[0] == pd.d_ip and c[2] == pd.p_ip and HTTP not in
                (c[1], c[3])]
    assert kv_links, tcp_links(pd.sb, "atlas-02")

    code, status, err = run_json("status", "-i", str(pd.inventory), timeout=600)
    assert code == 0 and status["state"] == "healthy", str(status)[:3000] + err[-2000:]
    (pair,) = status["pairs"]
    assert pair["state"] == "ok" and "computed +0" in pair["detail"], pair
    return probe


def _restart_prefill(pd: Pd) -> tuple[dict, dict]:
    """Kill the prefill engine; the supervisor restarts it; the pair answers again with real KV transfer within the
    profile's start-up bound. Returns the supervisor's view of prefill before and after."""
    before = supervised(pd.sb, "atlas-01")["prefill-0-dp0"]
    pd.sb.ssh("atlas-01", f"kill -9 {before['child_pid']}")
    # while it starts again (~40+ s): the only prefill is gone, so the pair fails and status names the engine
    code, status, _ = run_json("status", "-i", str(pd.inventory), timeout=600)
    assert code in (1, 3) and status["state"] in ("down", "degraded"), str(status)[:2000]
    assert [(e["id"], e["state"] == "ready") for e in status["engines"]] == [("prefill-0-dp0", False),
                                                                          ("decode-0-dp0", True)], status["engines"]
    assert status["pairs"][0]["state"] == "failed", status["pairs"]
    deadline = time.monotonic() + PROFILE.min_ready_timeout_s + PROFILE.probe_timeout_s
    probe = None
    while time.monotonic() < deadline:
        if health.engine_ready(pd.p_ip, HTTP, SERVED).ok:
            probe = pd.probe(words=80)
            if probe.ok:
                break
        time.sleep(5)
    after = supervised(pd.sb, "atlas-01")["prefill-0-dp0"]
    assert after["restarts"] == before["restarts"] + 1 and after["child_pid"] != before["child_pid"]
    assert probe is not None and probe.ok, (probe.detail if probe else "prefill never answered again") + "\n" + \
        lane_logs(pd.sb)
    assert probe.external_kv_transfer == probe.prompt_tokens and probe.local_compute == 0
    code, status, err = run_json("status", "-i", str(pd.inventory), timeout=600)
    assert code == 0 and status["state"] == "healthy", str(status)[:3000] + err[-2000:]
    return before, after


@pytest.fixture(scope="class")
def nixl(lane_sandbox, tiny_model, lane_python, tmp_path_factory) -> Iterator[Pd]:
    yield from _deploy(lane_sandbox, tmp_path_factory.mktemp("nixl"), lane_python, tiny_model, "lane-nixl")


@pytest.fixture(scope="class")
def mooncake(lane_sandbox, tiny_model, lane_python, tmp_path_factory) -> Iterator[Pd]:
    yield from _deploy(lane_sandbox, tmp_path_factory.mktemp("mooncake"), lane_python, tiny_model, "lane-mc",
                       kimi_kv_connector="mooncake")


class TestNixl:
    """The default connector, through the default proxy kind: vllm-ascend's own P/D proxy, run from its pinned
    sdist (it hands prefill's kv_transfer_params to decode: NIXL's flow)."""

    @pytest.fixture
    def pd(self, nixl: Pd) -> Pd:
        return nixl

    def test_prefill_to_decode_over_nixl(self, pd: Pd, lane_python: str) -> None:
        _moves_kv_over_the_network(pd, lane_python)
        proxy_sh = pd.sb.ssh("atlas-01", "cat /var/lib/kimi/current/proxy/proxy.sh").stdout
        assert "load_balance_proxy_server_example.py" in proxy_sh and "vllm_router" not in proxy_sh, proxy_sh
        assert pd.deploy["seconds"].get("weights") is not None  # deploy staged the checkpoint from the hub
        # the side channel listens where the plan reserved it (preflight checked it free): the host's IP, kv_port
        listening = pd.sb.ssh("atlas-01", "ss -tlnH").stdout
        assert f"{pd.p_ip}:36000 " in listening, listening

    def test_peer_restart(self, pd: Pd) -> None:
        # vLLM names the restarted prefill afresh; it hands its new engine id over in kv_transfer_params and decode
        # handshakes with it (the old one would be unreachable: NIXL_ERR_REMOTE_DISCONNECT).
        _restart_prefill(pd)


class TestMooncake:
    """kimi_kv_connector: mooncake, through vllm-router (the plan's pick: vllm-ascend's proxy does not speak it) with
    --kv-connector mooncake and prefill's bootstrap port."""

    @pytest.fixture
    def pd(self, mooncake: Pd) -> Pd:
        return mooncake

    def test_prefill_to_decode_over_mooncake(self, pd: Pd, lane_python: str) -> None:
        _moves_kv_over_the_network(pd, lane_python)
        proxy_sh = pd.sb.ssh("atlas-01", "cat /var/lib/kimi/current/proxy/proxy.sh").stdout
        assert "vllm_router" in proxy_sh and "--kv-connector mooncake" in proxy_sh, proxy_sh
        for host in ("atlas-01", "atlas-02"):  # the CPU shim came with the release tools
            assert pd.sb.ssh(host, "test -s /var/lib/kimi/bin/kimictl_mooncake_cpu.py").returncode == 0, host
        assert "Mooncake Transfer Engine is using tcp" in pd.sb.ssh(
            "atlas-02", "cat /var/lib/kimi/logs/decode-0-dp0.log").stdout
        watch = front_state(pd.sb, "atlas-01")["watch"]
        assert watch["urls"] == [f"http://{pd.p_ip}:36000/query"]  # prefill's bootstrap server
        assert watch["routers_know"] == watch["engine_ids"] and watch["engine_ids"]

    def test_peer_restart_refreshes_the_routers(self, pd: Pd) -> None:
        # vllm-router learns prefill's engine id from its bootstrap server once, at its start: the proxy front sees
        # the restarted prefill's new id there and restarts the routers, so they hand decode the live one.
        old = front_state(pd.sb, "atlas-01")
        _restart_prefill(pd)
        new = front_state(pd.sb, "atlas-01")
        assert new["watch"]["engine_ids"] != old["watch"]["engine_ids"]
        assert new["watch"]["routers_know"] == new["watch"]["engine_ids"]
        assert new["watch"]["changed_at"] and new["reload"]["state"] == "done"
        for r_old, r_new in zip(old["routers"], new["routers"], strict=True):
            assert r_new["restarts"] == r_old["restarts"] + 1 and r_new["started_at"] > new["watch"]["changed_at"] - 1
