"""`kimictl deploy` of a real vLLM engine (CPU build, tiny Kimi-shaped checkpoint) to sandbox hosts: colocated, and
P/D through vllm-router with KV moving over ExampleConnector. Same code path as production: plan, render,
release/engines playbooks, supervisor, readiness, proxy, smoke test, status, stop."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

import pytest
import yaml
from conftest import TINY_ID, TOPOLOGIES, engine_cmdline, lane_inventory, run_json, stop_cluster, supervised

from kimictl import health
from kimictl.facts import engine_profile
from kimictl.sandbox.fakehub import FakeHub

pytestmark = [pytest.mark.real_engine, pytest.mark.sandbox, pytest.mark.slow]
PROFILE = engine_profile("cpu-smoke")
SERVED = PROFILE.facts().served_model_name


def _is_lane_vllm(argv: list[str], lane_python: str) -> bool:
    return argv[:3] == [lane_python, "-m", "vllm.entrypoints.openai.api_server"]


def _complete(url: str, prompt: str, max_tokens: int = 8) -> dict:
    code, body = health.http_post_json(url, {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens,
                                             "temperature": 0}, timeout=120)
    assert code == 200 and isinstance(body, dict), f"{url}: HTTP {code}: {str(body)[:500]}"
    return body


def test_colocated_deploy_serves_a_real_engine(lane_sandbox, tiny_model, lane_python, tmp_path: Path) -> None:
    sb = lane_sandbox
    inv = lane_inventory(sb, tmp_path, cluster="lane-colocated", hosts=["atlas-01"], lane_python=lane_python,
                         model_dir=tiny_model)
    ip = sb.host("atlas-01")["ip"]
    t0 = time.monotonic()
    code, doc, err = run_json("deploy", "-i", str(inv), "--topology", str(TOPOLOGIES / "cpu-smoke-colocated.yml"),
                              "--yes")
    try:
        took = time.monotonic() - t0
        assert code == 0, err[-4000:]
        assert doc["result"] == "deployed"
        assert doc["smoke"]["generation_tokens"] >= 16, doc["smoke"]  # deploy's own smoke: 16 real tokens
        print(f"colocated: deploy {took:.1f}s, engine ready after {doc['seconds'].get('engines_ready')}s")

        # The supervised process is vLLM from the lane, not the simulator.
        st = supervised(sb, "atlas-01")["colocated-0-n0"]
        assert st["state"] == "running"
        assert _is_lane_vllm(engine_cmdline(sb, "atlas-01", st["child_pid"]), lane_python)
        _, models = health.http_get(f"http://{ip}:7100/v1/models")
        card = json.loads(models)["data"][0]
        assert (card["id"], card["root"], card["max_model_len"]) == (SERVED, str(tiny_model), 4096)

        # A completion through kimictl's endpoint moves real vLLM counters.
        before = health.metric_totals(ip, 7100)
        body = _complete(f"http://{ip}:7100/v1/completions", "The proxy receives a completion request", 12)
        assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] == 12
        after = health.metric_totals(ip, 7100)
        assert after["vllm:generation_tokens"] - before["vllm:generation_tokens"] == 12
        assert after["vllm:prompt_tokens"] - before["vllm:prompt_tokens"] == body["usage"]["prompt_tokens"]

        code, status, err = run_json("status", "-i", str(inv), timeout=120)
        assert code == 0 and status["state"] == "healthy", json.dumps(status)[:3000] + err[-2000:]
        (eng,) = status["engines"]
        assert eng["state"] == "ready" and eng["id"] == "colocated-0-n0"
        assert set(eng["metrics"]) >= {"requests_running", "kv_cache_usage", "ttft_s", "itl_s"}
        assert eng["metrics"]["ttft_s"]["p50"] is not None  # real TTFT histogram with observations
    finally:
        stop_cluster(inv)
    assert "colocated-0-n0" not in {n for n, s in supervised(sb, "atlas-01").items() if s["state"] == "running"}


def test_pd_deploy_moves_kv_from_prefill_to_decode(lane_sandbox, tiny_model, lane_python, tmp_path: Path) -> None:
    sb = lane_sandbox
    cluster = "lane-pd"
    # the tiny checkpoint comes from a hub on the sandbox bridge: deploy stages it (weights pull) on both hosts
    bridge = yaml.safe_load(sb.inventory.read_text())["all"]["vars"]["kimi_model_endpoint"].split("//")[1]
    hub = FakeHub({TINY_ID: tiny_model}, bridge.split(":")[0], 0)
    hub.start()
    inv = lane_inventory(sb, tmp_path, cluster=cluster, hosts=["atlas-01", "atlas-02"], lane_python=lane_python,
                         model_dir=tiny_model, hub_url=hub.url)
    shared = Path("/tmp/kimictl-kv") / cluster  # the cpu-smoke profile's ExampleConnector directory
    shutil.rmtree(shared, ignore_errors=True)
    p_ip, d_ip = sb.host("atlas-01")["ip"], sb.host("atlas-02")["ip"]
    t0 = time.monotonic()
    try:
        code, doc, err = run_json("deploy", "-i", str(inv), "--topology", str(TOPOLOGIES / "cpu-smoke-pd.yml"),
                                  "--yes")
    finally:
        hub.stop()
    try:
        took = time.monotonic() - t0
        assert code == 0, err[-4000:]
        smoke = doc["smoke"]
        # deploy's smoke already refuses a decode-only fallback; the counters come from the real engines
        assert smoke["prefill_prompt_tokens"] > 0 and smoke["decode_external_prefix_cache_queries"] > 0, smoke
        print(f"P/D: deploy {took:.1f}s, engines ready after {doc['seconds'].get('engines_ready')}s; smoke {smoke}")
        assert "weights" in doc["seconds"], doc["seconds"]   # staged from the hub by deploy itself
        for h in ("atlas-01", "atlas-02"):
            assert sb.ssh(h, "test -s /var/lib/kimi/models/Kimi-K2.5-tiny/.kimi-complete").returncode == 0, h

        sup = {**supervised(sb, "atlas-01"), **supervised(sb, "atlas-02")}
        assert {n for n, s in sup.items() if s["state"] == "running"} >= {"prefill-0-dp0", "decode-0-dp0", "proxy"}
        assert _is_lane_vllm(engine_cmdline(sb, "atlas-01", sup["prefill-0-dp0"]["child_pid"]), lane_python)
        assert _is_lane_vllm(engine_cmdline(sb, "atlas-02", sup["decode-0-dp0"]["child_pid"]), lane_python)

        # One more request through the proxy: prefill computes the prompt, decode loads its KV from the connector.
        p0, d0 = health.metric_totals(p_ip, 7100), health.metric_totals(d_ip, 7100)
        prompt = health.smoke_prompt(120)
        body = _complete(f"http://{p_ip}:8000/v1/completions", prompt, 8)
        assert body["choices"][0]["text"]
        p1, d1 = health.metric_totals(p_ip, 7100), health.metric_totals(d_ip, 7100)
        prompt_tokens = p1["vllm:prompt_tokens"] - p0["vllm:prompt_tokens"]
        queries = d1["vllm:external_prefix_cache_queries"] - d0["vllm:external_prefix_cache_queries"]
        hits = d1["vllm:external_prefix_cache_hits"] - d0["vllm:external_prefix_cache_hits"]
        print(f"P/D request: prefill prompt tokens +{prompt_tokens:.0f}, decode external prefix cache queries "
              f"+{queries:.0f}, hits +{hits:.0f}")
        assert prompt_tokens > 0
        assert queries > 0, "decode never asked the connector for the prompt's KV"
        assert hits > 0, "decode found none of the prompt's KV that prefill stored"
        assert d1["vllm:generation_tokens"] > d0["vllm:generation_tokens"]  # decode generated the answer
        assert any(shared.rglob("*.safetensors")), f"no KV files under {shared}"

        code, status, err = run_json("status", "-i", str(inv), timeout=180)
        assert code == 0 and status["state"] == "healthy", json.dumps(status)[:3000] + err[-2000:]
        (pair,) = status["pairs"]
        assert pair["state"] == "ok", pair
        assert status["proxy"]["state"] == "ready"
    finally:
        stop_cluster(inv)
        shutil.rmtree(shared, ignore_errors=True)
        with contextlib.suppress(OSError):
            shared.parent.rmdir()  # only when no other cluster's KV is there
