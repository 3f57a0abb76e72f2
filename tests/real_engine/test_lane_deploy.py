"""`kimictl deploy` of a real vLLM engine (CPU build, tiny Kimi-shaped checkpoint) to one sandbox host, colocated.
Same code path as production: plan, render, release/engines playbooks, supervisor, readiness, smoke test, status,
stop. P/D with KV moving between two hosts: test_lane_pd.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import TOPOLOGIES, engine_cmdline, lane_inventory, run_json, stop_cluster, supervised

from kimictl import health
from kimictl.facts import engine_profile

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
