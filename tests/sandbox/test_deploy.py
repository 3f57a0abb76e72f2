"""Deploy a3-pd to a 2-host A3 sandbox: serve through the proxy, idempotence, --check --diff, rollback."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from conftest import _bring_up, kimictl

pytestmark = pytest.mark.sandbox
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """A separate sandbox with a3-pd deployed once for this module."""
    gen = _bring_up(tmp_path_factory.mktemp("sb-deploy"), "--hosts", "2", "--hardware", "atlas-800-a3")
    sb = next(gen)
    proc = kimictl("deploy", "-i", str(sb.inventory), "--topology", "a3-pd", "--yes", "--output", "json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    sb.first = json.loads(proc.stdout)
    yield sb
    sb.fault("clear:all", check=False)
    gen.close()


def _complete(sb, prompt: str = "hello from the deploy test") -> dict:
    ip = sb.host("atlas-01")["ip"]
    req = urllib.request.Request(f"http://{ip}:8000/v1/completions", method="POST",
                                 headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "kimi-k2.5", "prompt": prompt, "max_tokens": 8}).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _supervised(sb, host: str) -> dict[str, dict]:
    out = sb.ssh(host, "python3 /var/lib/kimi/bin/supervisor.py status --run-dir /var/lib/kimi/run").stdout
    return {s["name"]: s for s in json.loads(out)}


def _tuned_topology(tmp_path: Path) -> Path:
    text = (ROOT / "kimictl/data/topologies/a3-pd.yml").read_text()
    path = tmp_path / "a3-pd-tuned.yml"
    path.write_text(text.replace("name: a3-pd", "name: a3-pd-tuned").replace("max-num-seqs: 32", "max-num-seqs: 24"))
    return path


def test_first_deploy_serves_through_the_proxy(deployed) -> None:
    doc = deployed.first
    assert doc["result"] == "deployed"
    smoke = doc["smoke"]  # decode got the whole prompt over the KV hand-over and computed none of it
    assert smoke["prefill_prompt_tokens"] > 0 and smoke["decode_local_compute_tokens"] == 0
    assert smoke["decode_external_kv_transfer_tokens"] == smoke["prompt_tokens"] > 0
    assert len([c for c in doc["changes"] if c["action"] == "start"]) == 7  # 6 engines + proxy
    assert _complete(deployed)["choices"][0]["text"].strip()
    states = {**_supervised(deployed, "atlas-01"), **_supervised(deployed, "atlas-02")}
    assert sorted(states) == ["decode-0-dp0", "decode-0-dp1", "decode-0-dp2", "decode-0-dp3", "prefill-0-dp0",
                              "prefill-0-dp1", "proxy"]
    assert all(s["state"] == "running" for s in states.values())
    current = deployed.ssh("atlas-02", "readlink /var/lib/kimi/current").stdout.strip()
    assert current.startswith("releases/")


def test_deploy_keeps_every_planned_port_out_of_the_ephemeral_range(deployed) -> None:
    from kimictl.remote.reserve_ports import parse, spell

    plan = json.loads(kimictl("plan", "-i", str(deployed.inventory), "--topology", "a3-pd", "--output", "json").stdout)
    assert {u["host"] for u in plan["ports"]} == set(deployed.hosts)
    for host in deployed.hosts:
        live = parse(deployed.ssh(host, "cat /proc/sys/net/ipv4/ip_local_reserved_ports").stdout)
        conf = deployed.ssh(host, "cat /etc/sysctl.d/90-kimictl-reserved-ports.conf").stdout
        assert f"net.ipv4.ip_local_reserved_ports = {spell(live)}\n" in conf
        for use in (u for u in plan["ports"] if u["host"] == host):
            assert any(a <= use["first"] and use["last"] <= b for a, b in live), (host, use, live)


def test_second_deploy_is_a_no_op(deployed) -> None:
    before = {h: {n: s["child_pid"] for n, s in _supervised(deployed, h).items()} for h in deployed.hosts}
    proc = kimictl("deploy", "-i", str(deployed.inventory), "--topology", "a3-pd", "--yes", "--output", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["result"] == "no-changes"
    after = {h: {n: s["child_pid"] for n, s in _supervised(deployed, h).items()} for h in deployed.hosts}
    assert after == before
    plan = kimictl("plan", "-i", str(deployed.inventory), "--topology", "a3-pd", "--detailed-exitcode")
    assert plan.returncode == 0 and "no changes" in plan.stdout


def test_check_diff_shows_only_the_changed_role(deployed, tmp_path: Path) -> None:
    topo = _tuned_topology(tmp_path)
    before = _supervised(deployed, "atlas-02")
    proc = kimictl("deploy", "-i", str(deployed.inventory), "--topology", str(topo), "--check", "--diff",
                   "--output", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    todo = {(c["host"], c["id"], c["action"]) for c in doc["changes"] if c["action"] != "keep"}
    assert todo == {("atlas-02", f"decode-0-dp{r}", "replace") for r in range(4)}
    assert all("-  --max-num-seqs 32" in d and "+  --max-num-seqs 24" in d for d in doc["diffs"].values())
    assert {k.rsplit(":", 1)[1] for k in doc["diffs"]} == {f"engines/decode-0-dp{r}.sh" for r in range(4)}
    assert _supervised(deployed, "atlas-02") == before  # --check changed nothing
    plan = kimictl("plan", "-i", str(deployed.inventory), "--topology", str(topo), "--detailed-exitcode",
                   "--output", "json")
    assert plan.returncode == 3 and json.loads(plan.stdout)["deployed"]["changed_hosts"] == ["atlas-02"]


def test_crashing_release_rolls_back_and_old_release_keeps_answering(deployed, tmp_path: Path) -> None:
    tags = {n: s["tag"] for n, s in _supervised(deployed, "atlas-02").items()}
    deployed.fault("engine-crash:atlas-02:decode")
    proc = kimictl("deploy", "-i", str(deployed.inventory), "--topology", str(_tuned_topology(tmp_path)), "--yes",
                   "--skip-preflight", "test")
    assert proc.returncode == 1
    assert "host atlas-02" in proc.stderr and "decode-0-dp" in proc.stderr
    assert "--- log tail ---" in proc.stderr and "engine_crash_at_start" in proc.stderr
    assert "hint: the log tail's last ERROR line says why: docs/operators.md#t-engine-start" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert {n: s["tag"] for n, s in _supervised(deployed, "atlas-02").items()} == tags
    assert _complete(deployed, "still serving after the failed deploy")["choices"]


def test_status_healthy_then_degraded_names_the_stopped_engine(deployed) -> None:
    proc = kimictl("status", "-i", str(deployed.inventory), "--output", "json")
    doc = json.loads(proc.stdout)
    assert proc.returncode == 0, doc
    assert doc["state"] == "healthy" and len(doc["engines"]) == 6 and len(doc["pairs"]) == 1
    assert doc["pairs"][0]["state"] == "ok" and doc["proxy"]["state"] == "ready" and doc["drift"] == []
    assert any((e.get("metrics") or {}).get("ttft_s", {}).get("p50") is not None for e in doc["engines"])
    # engines hold their NPUs: npu-smi shows HBM in use on each engine's devices
    assert all(e["hbm_used_mb"]["max_per_npu"] > 30000 for e in doc["engines"])
    stop = deployed.ssh("atlas-02", "python3 /var/lib/kimi/bin/supervisor.py stop --name decode-0-dp2 "
                                    "--run-dir /var/lib/kimi/run")
    assert stop.returncode == 0, stop.stderr
    proc = kimictl("status", "-i", str(deployed.inventory), "--output", "json", "--no-pair-probe")
    doc = json.loads(proc.stdout)
    assert proc.returncode == 3 and doc["state"] == "degraded"
    assert [(e["id"], e["state"]) for e in doc["engines"] if e["state"] != "ready"] == [("decode-0-dp2", "stopped")]
    # deploy brings the missing engine back and nothing else
    proc = kimictl("deploy", "-i", str(deployed.inventory), "--topology", "a3-pd", "--yes", "--output", "json",
                   "--skip-preflight", "test")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [(c["id"], c["action"]) for c in json.loads(proc.stdout)["changes"] if c["action"] != "keep"] == [
        ("decode-0-dp2", "start")]


def test_limit_narrows_the_changes(deployed, tmp_path: Path) -> None:
    topo = str(_tuned_topology(tmp_path))
    for host, expect in (("atlas-01", set()), ("atlas-02", {f"decode-0-dp{r}" for r in range(4)})):
        proc = kimictl("deploy", "-i", str(deployed.inventory), "--topology", topo, "--check", "--limit", host,
                       "--output", "json")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert {c["id"] for c in json.loads(proc.stdout)["changes"] if c["action"] != "keep"} == expect
    proc = kimictl("deploy", "-i", str(deployed.inventory), "--topology", topo, "--check", "--limit", "atlas-9")
    assert proc.returncode == 2 and "atlas-9" in proc.stderr


def test_rollback_returns_to_the_previous_release(deployed, tmp_path: Path) -> None:
    deployed.fault("clear:all")
    original = {n: s["tag"] for n, s in _supervised(deployed, "atlas-02").items()}
    proc = kimictl("deploy", "-i", str(deployed.inventory), "--topology", str(_tuned_topology(tmp_path)), "--yes",
                   "--skip-preflight", "test", "--output", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    tuned = {n: s["tag"] for n, s in _supervised(deployed, "atlas-02").items()}
    assert tuned != original
    proc = kimictl("rollback", "-i", str(deployed.inventory), "--yes", "--skip-preflight", "test", "--output", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["result"] == "deployed"
    assert {n: s["tag"] for n, s in _supervised(deployed, "atlas-02").items()} == original
    assert "--max-num-seqs 32" in deployed.ssh("atlas-02", "cat /var/lib/kimi/current/engines/decode-0-dp0.sh").stdout
    assert _complete(deployed)["choices"]


def test_a2_colocated_internal_dp_with_a_headless_host(sandbox_a2) -> None:
    proc = kimictl("deploy", "-i", str(sandbox_a2.inventory), "--topology", "a2-colocated", "--yes", "--output", "json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["smoke"]["generation_tokens"] > 0
    headless = sandbox_a2.ssh("atlas-02", "cat /var/lib/kimi/current/engines/colocated-0-n1.sh").stdout
    assert "--headless" in headless and "--data-parallel-start-rank 1" in headless
    status = kimictl("status", "-i", str(sandbox_a2.inventory), "--output", "json")
    engines = json.loads(status.stdout)["engines"]
    assert status.returncode == 0 and [(e["id"], e["state"]) for e in engines] == [
        ("colocated-0-n0", "ready"), ("colocated-0-n1", "ready")]
    stop = kimictl("stop", "-i", str(sandbox_a2.inventory), "--yes")
    assert stop.returncode == 0, stop.stderr[-2000:]


def test_bench_through_the_proxy_and_its_gate(deployed) -> None:
    args = ["bench", "-i", str(deployed.inventory), "--requests", "12", "--concurrency", "4", "--input-tokens", "64",
            "--output-tokens", "16", "--timeout", "120", "--gate", "--output", "json"]
    proc = kimictl(*args)
    doc = json.loads(proc.stdout)
    assert proc.returncode == 0, doc
    assert doc["succeeded"] == 12 and doc["url"].endswith(":8000/v1/completions")
    assert 0 < doc["tpot_ms"]["p50"] <= 50 and doc["ttft_ms"]["p90"] > 0 and doc["output_tokens_per_s"] > 0
    proc = kimictl(*args, "--slo-tpot-ms", "1")
    assert proc.returncode == 1 and "TPOT p90" in json.loads(proc.stdout)["slo"]["misses"][0]


# --- the P/D proxy: vllm-ascend's own, in front of the engines ------------------------------------------------------


def _ask(sb, path: str, body: dict, timeout: float = 120) -> tuple[dict | None, list[dict]]:
    """(the JSON answer, or None when streamed; the choices of every streamed chunk)."""
    ip = sb.host("atlas-01")["ip"]
    req = urllib.request.Request(f"http://{ip}:8000{path}", method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read().decode()
    if not body.get("stream"):
        return json.loads(raw), []
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", raw[-300:]
    return None, [c for e in events[:-1] for c in json.loads(e)["choices"]]


def test_the_default_proxy_is_vllm_ascends_own_and_serves_every_kind_of_request(deployed) -> None:
    ps = deployed.ssh("atlas-01", "ps -eo args | grep load_balance_proxy_server_example | grep -v grep").stdout
    copies = [line for line in ps.splitlines() if "proxy_front.py" not in line]  # the front's argv names it too
    script = "/opt/vllm-ascend/examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py"
    assert len(copies) == 2 and all(script in c and "--host 127.0.0.1" in c for c in copies), ps
    assert all("--prefiller-ports 7100 7101" in c and "--decoder-ports 7100 7101 7102 7103" in c for c in copies)
    msgs = [{"role": "user", "content": "hello from the proxy test"}]
    doc, _ = _ask(deployed, "/v1/completions", {"model": "kimi-k2.5", "prompt": "x y z", "max_tokens": 5,
                                                "ignore_eos": True})
    assert doc["usage"]["completion_tokens"] == 5
    _, chunks = _ask(deployed, "/v1/completions", {"model": "kimi-k2.5", "prompt": "x y z", "max_tokens": 5,
                                                   "ignore_eos": True, "stream": True})
    assert sum(1 for c in chunks if c.get("text")) == 5
    doc, _ = _ask(deployed, "/v1/chat/completions", {"model": "kimi-k2.5", "messages": msgs, "max_tokens": 6,
                                                     "ignore_eos": True})
    assert doc["usage"]["completion_tokens"] == 6
    _, chunks = _ask(deployed, "/v1/chat/completions", {"model": "kimi-k2.5", "messages": msgs, "max_tokens": 6,
                                                        "ignore_eos": True, "stream": True})
    assert sum(1 for c in chunks if c.get("delta", {}).get("content")) == 6
    with urllib.request.urlopen(f"http://{deployed.host('atlas-01')['ip']}:8000/health", timeout=10) as r:
        assert json.loads(r.read()) | {"request_num": 0} == {"status": "ok", "prefill_instances": 2,
                                                              "decode_instances": 4, "request_num": 0}


def test_kv_pressure_on_the_decode_host_is_replayed_by_the_proxy(deployed) -> None:
    """Every decode engine ends every request after 4 tokens as "recomputed" (vllm-ascend's RecomputeScheduler);
    the proxy prefills again with the text so far and decodes on, until the request is whole."""
    deployed.fault("kv-pressure:atlas-02")
    try:
        body = {"model": "kimi-k2.5", "max_tokens": 64, "ignore_eos": True, "stream": True}
        counts = []
        for i in range(20):
            _, chunks = _ask(deployed, "/v1/completions", {**body, "prompt": f"request {i} under KV pressure"})
            counts.append(sum(1 for c in chunks if c.get("text")))
            assert chunks[-1]["finish_reason"] == "length"
            assert not any(c.get("stop_reason") == "recomputed" for c in chunks)  # replays stay inside the proxy
        assert counts == [64] * 20
        # Not streamed, upstream's arithmetic adds one token per replay (docs/operate.md): 20 replays -> 84.
        doc, _ = _ask(deployed, "/v1/completions", {**body, "stream": False, "prompt": "one more"})
        assert len(doc["choices"][0]["text"].split()) == 84 and doc["choices"][0]["finish_reason"] == "length"
    finally:
        deployed.fault("clear:atlas-02")
    _, chunks = _ask(deployed, "/v1/completions", {**body, "prompt": "pressure cleared"})
    assert sum(1 for c in chunks if c.get("text")) == 64


def test_vllm_router_with_the_recompute_scheduler_is_refused_at_plan_time(deployed, tmp_path: Path) -> None:
    text = (ROOT / "kimictl/data/topologies/a3-pd.yml").read_text()
    topo = tmp_path / "a3-pd-vllm-router.yml"
    topo.write_text(text.replace("proxy: {port: 8000}", "proxy: {port: 8000, router: vllm-router}"))
    proc = kimictl("plan", "-i", str(deployed.inventory), "--topology", str(topo), "--output", "json")
    assert proc.returncode == 2, proc.stdout
    err = json.loads(proc.stdout)["error"]
    assert "recompute_scheduler" in err["message"] and "proxy.router: vllm-ascend-proxy" in err["hint"]
    off = tmp_path / "a3-pd-vllm-router-no-recompute.yml"  # the other way out: recompute off
    off.write_text(topo.read_text().replace("recompute_scheduler: true", "recompute_scheduler: false"))
    ok = kimictl("plan", "-i", str(deployed.inventory), "--topology", str(off), "--output", "json")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout)["proxy"]["router"] == "vllm-router"
