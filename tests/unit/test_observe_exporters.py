"""The exporters `kimictl observe` scrapes that kimictl ships: the proxy exporter (real vllm-router copies behind it)
and the sandbox's npu-exporter double (the host state the npu-smi/hccn_tool doubles read)."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prerequisites import require_or_skip
from prometheus_client.parser import text_string_to_metric_families
from test_doubles import make_sim

from kimictl.remote import proxy_exporter
from kimictl.sandbox.doubles import npu_exporter

# Host-side scripts run on the hosts' own python3 (3.9 or newer): KIMICTL_HOST_PYTHON=/path/python3.9 checks one.
HOST_PY = os.environ.get("KIMICTL_HOST_PYTHON", sys.executable)
ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(name, sorted label items): value} of an exposition (parsed by prometheus_client: it must be valid)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            if get(url, 2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer: {log.read_text()[-2000:]}")


class Stub(http.server.ThreadingHTTPServer):
    """An engine stand-in for vllm-router's health checks (200 on everything)."""

    def __init__(self):
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = b'{"data": [{"id": "kimi-k2.5"}]}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        super().__init__(("127.0.0.1", 0), H)
        self.daemon_threads = True
        threading.Thread(target=self.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def procs(tmp_path):
    started: list[subprocess.Popen] = []

    def start(argv: list[str], name: str) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"{name}.log"
        with log.open("wb") as out:
            started.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT))
        return started[-1], log

    yield start
    for p in started:
        p.terminate()
    for p in started:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


# --- proxy exporter -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_proxy_exporter_reports_real_router_membership_and_relays_its_metrics(procs):
    if not Path(ROUTER).exists():
        require_or_skip("vllm-router not installed (pip install vllm-router)")
    engines = [Stub() for _ in range(3)]  # 1 prefill, 2 decode endpoints
    router = (free_port(), free_port())
    front = Stub()  # the front's GET /health
    r_proc, r_log = procs([ROUTER, "--host", "127.0.0.1", "--port", str(router[0]), "--prometheus-port",
                           str(router[1]), "--policy", "round_robin", "--vllm-pd-disaggregation", "--prefill",
                           engines[0].url, "--decode", engines[1].url, "--decode", engines[2].url], "router")
    wait_http(f"http://127.0.0.1:{router[0]}/health", r_proc, r_log)
    port, dead = free_port(), (free_port(), free_port())  # a second copy that is not running
    e_proc, e_log = procs([HOST_PY, proxy_exporter.__file__, "--listen", f"127.0.0.1:{port}", "--front-port",
                           str(front.server_address[1]), "--router", f"{router[0]}:{router[1]}", "--router",
                           f"{dead[0]}:{dead[1]}", "--timeout", "1"], "exporter")
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/", e_proc, e_log)

    m = samples(get(f"{base}/metrics")[1])
    assert m[("kimi_proxy_front_up", ())] == 1
    assert m[("kimi_proxy_router_up", (("port", str(router[0])), ("router", "0")))] == 1
    assert m[("kimi_proxy_router_up", (("port", str(dead[0])), ("router", "1")))] == 0
    workers = {k[1]: v for k, v in m.items() if k[0] == "kimi_proxy_router_workers"}
    assert workers == {(("router", "0"), ("worker_type", "decode")): 2,
                       (("router", "0"), ("worker_type", "prefill")): 1}
    urls = {dict(k[1])["url"] for k in m if k[0] == "kimi_proxy_router_worker"}
    assert urls == {e.url for e in engines}

    # Each copy's own metrics through the exporter: a Prometheus on another host reaches the loopback port.
    code, text = get(f"{base}/router/0/metrics")
    assert code == 200 and "vllm_router_worker_health" in text
    assert get(f"{base}/router/1/metrics")[0] == 503 and get(f"{base}/router/2/metrics")[0] == 404

    # A drain (runtime remove) shows in the exporter; vllm-router's own health gauge keeps the removed worker.
    req = urllib.request.Request(f"http://127.0.0.1:{router[0]}/remove_worker?url={engines[2].url}", method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200
    m = samples(get(f"{base}/metrics")[1])
    assert m[("kimi_proxy_router_workers", (("router", "0"), ("worker_type", "decode")))] == 1
    relayed = samples(get(f"{base}/router/0/metrics")[1])
    assert any(dict(k[1]).get("worker") == engines[2].url for k in relayed), "the gauge vllm-router leaves behind"

    front.shutdown()
    front.server_close()
    assert samples(get(f"{base}/metrics")[1])[("kimi_proxy_front_up", ())] == 0


@pytest.mark.slow
def test_proxy_exporter_reads_the_upstream_proxys_instances(procs):
    from test_ascend_proxy import KIND, _script

    script = _script()  # vllm-ascend's own proxy from the pinned sdist (skips when it cannot be had)
    engines = [f"127.0.0.1:{free_port()}" for _ in range(3)]  # it checks no engine before it serves
    router = (free_port(), free_port())
    front = Stub()
    argv = [sys.executable, str(script), "--host", "127.0.0.1", "--port", str(router[0]),
            "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", engines[0].split(":")[1],
            "--decoder-hosts", "127.0.0.1", "127.0.0.1", "--decoder-ports", engines[1].split(":")[1],
            engines[2].split(":")[1], *KIND.args]
    r_proc, r_log = procs(argv, "upstream-proxy")
    wait_http(f"http://127.0.0.1:{router[0]}{KIND.health_path}", r_proc, r_log)
    port, dead = free_port(), (free_port(), free_port())
    e_proc, e_log = procs([HOST_PY, proxy_exporter.__file__, "--listen", f"127.0.0.1:{port}", "--front-port",
                           str(front.server_address[1]), "--router", f"{router[0]}:{router[1]}", "--router",
                           f"{dead[0]}:{dead[1]}", "--membership", "instances", "--no-router-metrics", "--timeout",
                           "1"], "exporter")
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/", e_proc, e_log)
    m = samples(get(f"{base}/metrics")[1])
    assert m[("kimi_proxy_router_up", (("port", str(router[0])), ("router", "0")))] == 1
    assert m[("kimi_proxy_router_up", (("port", str(dead[0])), ("router", "1")))] == 0
    assert {k[1]: v for k, v in m.items() if k[0] == "kimi_proxy_router_workers"} == {
        (("router", "0"), ("worker_type", "decode")): 2, (("router", "0"), ("worker_type", "prefill")): 1}
    assert {dict(k[1])["url"] for k in m if k[0] == "kimi_proxy_router_worker"} == {f"http://{e}" for e in engines}
    # no metrics of its own: the copy's target is up while it answers, down when it does not
    assert get(f"{base}/router/0/metrics")[0] == 200 and get(f"{base}/router/1/metrics")[0] == 503

    body = json.dumps({"type": "decode", "instances": [engines[2]]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{router[0]}/instances/remove", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200
    m = samples(get(f"{base}/metrics")[1])
    assert m[("kimi_proxy_router_workers", (("router", "0"), ("worker_type", "decode")))] == 1


def test_proxy_exporter_cuts_slow_clients_and_refuses_past_its_cap(procs):
    """Clients that trickle a request hold a connection for --handler-timeout at most, and past --max-clients at
    once one more gets 503 at once (a flood of slow clients costs neither unbounded threads nor a scrape forever)."""
    import contextlib
    import select

    port, dead = free_port(), (free_port(), free_port())
    e_proc, e_log = procs([HOST_PY, proxy_exporter.__file__, "--listen", f"127.0.0.1:{port}", "--front-port",
                           str(free_port()), "--router", f"{dead[0]}:{dead[1]}", "--timeout", "0.2",
                           "--handler-timeout", "1", "--max-clients", "2"], "exporter")
    wait_http(f"http://127.0.0.1:{port}/", e_proc, e_log)
    slow = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(2)]
    try:
        for s in slow:
            s.sendall(b"GET /metr")
        # once the exporter has taken both (a loaded machine may take a moment), every slot is held
        deadline, got = time.monotonic() + 20, b""
        while not got.startswith(b"HTTP/1.0 503") and time.monotonic() < deadline:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                got = b""
                while chunk := s.recv(65536):
                    got += chunk
        assert got.startswith(b"HTTP/1.0 503") and b"Retry-After: 1" in got
        # One byte every 0.1 s never trips a per-read timeout; the connection's deadline ends it.
        for s in slow:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not select.select([s], [], [], 0.1)[0]:
                with contextlib.suppress(OSError):
                    s.send(b"i")
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(65536) == b""  # closed without an answer (not a timeout: it was readable)
        code, text = get(f"http://127.0.0.1:{port}/metrics")
        assert code == 200 and samples(text)[("kimi_proxy_front_up", ())] == 0
        assert e_proc.poll() is None and "Traceback" not in e_log.read_text()
    finally:
        for s in slow:
            s.close()


def test_proxy_exporter_reads_vllm_router_workers_shape():
    # GET /workers of vllm-router 0.1.17 in P/D mode (measured), and answers that are not that shape.
    body = json.dumps({"workers": [
        {"url": "http://10.0.0.2:7100", "worker_type": "decode", "is_healthy": True, "load": 0},
        {"url": "http://10.0.0.1:7100/", "worker_type": "prefill", "is_healthy": False, "bootstrap_port": None}],
        "total": 2, "stats": {"prefill_count": 1, "decode_count": 1, "regular_count": 0}}).encode()
    assert proxy_exporter.workers_of(body) == [("decode", "http://10.0.0.2:7100", True),
                                               ("prefill", "http://10.0.0.1:7100", False)]
    assert proxy_exporter.workers_of(b"<html>") is None
    assert proxy_exporter.workers_of(b'{"models": []}') is None


# --- npu-exporter double --------------------------------------------------------------------------------------


def test_npu_exporter_double_serves_real_names_from_the_host_state(tmp_path, procs):
    sim = make_sim(tmp_path, "atlas-800-a3", {"link_down": [3], "npu_unhealthy": [5]})
    (sim / "claims" / "npu0").write_text(f"{os.getpid()}\n")  # an engine holds NPU 0
    port = free_port()
    env_argv = ["env", f"KIMI_SIM_DIR={sim}", HOST_PY, "-IS", npu_exporter.__file__, "-ip=127.0.0.1",
                f"-port={port}", "-enableHTTP=true"]
    proc, log = procs(env_argv, "npu-exporter")
    wait_http(f"http://127.0.0.1:{port}/metrics", proc, log)
    m = samples(get(f"http://127.0.0.1:{port}/metrics")[1])

    def val(name: str, npu: int) -> float:
        return next(v for (n, labels), v in m.items() if n == name and dict(labels)["id"] == str(npu))

    assert m[("machine_npu_nums", ())] == 16
    assert val("npu_chip_info_link_status", 3) == 0 and val("npu_chip_info_link_status", 2) == 1
    assert val("npu_chip_info_network_status", 3) == 0
    assert val("npu_chip_info_health_status", 5) == 0 and val("npu_chip_info_health_status", 4) == 1
    assert val("npu_chip_info_hbm_total_memory", 0) == 65536
    assert val("npu_chip_info_hbm_used_memory", 0) == int(65536 * 0.9)  # claimed, as npu-smi shows it
    assert val("npu_chip_info_hbm_used_memory", 1) < 4000
    labels = dict(next(k[1] for k in m if k[0] == "npu_chip_info_link_status"))
    assert set(labels) == {"id", "model_name", "pcie_bus_info", "vdie_id"}  # the real exporter's labels

    (sim / "faults.json").write_text("{}")  # read on every scrape, like the other doubles
    m = samples(get(f"http://127.0.0.1:{port}/metrics")[1])
    assert val("npu_chip_info_link_status", 3) == 1
    assert get(f"http://127.0.0.1:{port}/other")[0] == 404
