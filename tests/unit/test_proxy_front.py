"""The proxy front (kimictl/proxy_front.py) in front of stand-in routers: API key, failover, rolling reloads
without client errors, HTTP framing."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

FRONT = Path(__file__).parents[2] / "kimictl" / "proxy_front.py"
FAKE_ROUTER = Path(__file__).parent / "data" / "fake_router.py"
KEY = "k-7f3a9c1e"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Front:
    def __init__(self, tmp: Path, routers: int = 2, api_key: bool = True, connect_wait: float = 30.0,
                 env: dict[str, str] | None = None):
        ports = free_ports(1 + 2 * routers)
        self.port, self.state = ports[0], tmp / "front.json"
        self.key_file = tmp / "key"
        self.key_file.write_text(KEY + "\n")
        self.fail_file = tmp / "fail"
        argv = [sys.executable, str(FRONT), "run", "--listen", f"127.0.0.1:{self.port}", "--state", str(self.state),
                "--grace", "10", "--ready-timeout", "20", "--connect-wait", str(connect_wait)]
        for i in range(routers):
            argv += ["--router", f"{ports[1 + 2 * i]}:{ports[2 + 2 * i]}"]
        if api_key:
            argv += ["--api-key-file", str(self.key_file)]
        # The rendered command's --host/--port must be overridden by the front's own.
        argv += ["--", sys.executable, str(FAKE_ROUTER), "--host", "0.0.0.0", "--port", "1", "--policy", "x"]
        self.log = (tmp / "front.log").open("w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "FAKE_ROUTER_FAIL_FILE": str(self.fail_file), **(env or {})})
        self.wait(lambda d: all(r["state"] == "ready" for r in d["routers"]))

    def doc(self) -> dict:
        try:
            return json.loads(self.state.read_text())
        except (OSError, ValueError):
            return {"routers": [{"state": "none"}]}

    def wait(self, pred, timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            d = self.doc()
            if pred(d):
                return d
            assert self.proc.poll() is None, "the front exited"
            time.sleep(0.05)
        raise AssertionError(f"timed out; state {self.doc()}")

    def request(self, method: str, path: str, body: dict | None = None, key: str | None = KEY,
                conn: http.client.HTTPConnection | None = None) -> tuple[int, dict]:
        c = conn or http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        c.request(method, path, None if body is None else json.dumps(body), headers)
        r = c.getresponse()
        data = r.read()
        if conn is None:
            c.close()
        return r.status, (json.loads(data) if data else {})

    def reload(self) -> tuple[int, dict]:
        p = subprocess.run([sys.executable, str(FRONT), "reload", "--state", str(self.state), "--timeout", "60"],
                           capture_output=True, text=True, check=False)
        return p.returncode, json.loads(p.stdout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


@pytest.fixture
def front(tmp_path: Path):
    f = Front(tmp_path)
    yield f
    f.stop()
    router_pids = [r["pid"] for r in f.doc()["routers"] if r.get("pid")]
    for pid in router_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_api_key_on_every_request_but_health(front: Front) -> None:
    assert front.request("GET", "/health", key=None)[0] == 200
    assert front.request("POST", "/v1/completions", {"prompt": "x"}, key=None)[0] == 401
    assert front.request("POST", "/v1/completions", {"prompt": "x"}, key="wrong")[0] == 401
    code, doc = front.request("POST", "/v1/completions", {"prompt": "x"})
    assert code == 200 and doc["choices"][0]["text"].startswith("router ")
    # The router's admin API is behind the key too.
    assert front.request("GET", "/kimictl/router/0/workers", key=None)[0] == 401
    # A request without the key on a connection that already sent one with it is refused as well.
    c = http.client.HTTPConnection("127.0.0.1", front.port, timeout=10)
    assert front.request("POST", "/v1/completions", {"prompt": "x"}, conn=c)[0] == 200
    assert front.request("POST", "/v1/completions", {"prompt": "x"}, key=None, conn=c)[0] == 401
    c.close()
    # Rotating the key file takes effect without a restart.
    time.sleep(0.01)
    front.key_file.write_text("k-rotated-22\n")
    os.utime(front.key_file, (time.time() + 5, time.time() + 5))
    assert front.request("POST", "/v1/completions", {"prompt": "x"})[0] == 401
    assert front.request("POST", "/v1/completions", {"prompt": "x"}, key="k-rotated-22")[0] == 200


def test_admin_path_reaches_one_router_and_ports_are_overridden(front: Front) -> None:
    ports = [r["port"] for r in front.doc()["routers"]]
    for i, port in enumerate(ports):
        code, doc = front.request("GET", f"/kimictl/router/{i}/whoami?x=1")
        assert code == 200 and doc["port"] == port and doc["path"] == "/whoami?x=1"
    assert front.request("GET", "/kimictl/router/7/whoami")[0] == 404
    # Each copy listens on loopback only (the front's --host wins over the rendered 0.0.0.0).
    out = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, check=False).stdout
    for port in ports:
        assert f"127.0.0.1:{port} " in out and f"0.0.0.0:{port} " not in out


def test_round_robin_and_failover_when_a_router_dies(front: Front) -> None:
    seen = {front.request("POST", "/v1/completions", {"prompt": "x"})[1]["choices"][0]["text"] for _ in range(6)}
    assert len(seen) == 2
    victim = front.doc()["routers"][0]
    os.kill(victim["pid"], signal.SIGKILL)
    for _ in range(10):  # no client sees the dead router
        assert front.request("POST", "/v1/completions", {"prompt": "x"})[0] == 200
    d = front.wait(lambda d: d["routers"][0]["state"] == "ready" and d["routers"][0]["pid"] != victim["pid"])
    assert d["routers"][0]["restarts"] == 1


def test_rolling_reload_under_load_has_no_client_errors(front: Front) -> None:
    before = [r["pid"] for r in front.doc()["routers"]]
    errors: list[str] = []
    ok = [0]
    stop = threading.Event()

    def keepalive() -> None:
        c = http.client.HTTPConnection("127.0.0.1", front.port, timeout=10)
        while not stop.is_set():
            try:
                code, _ = front.request("POST", "/v1/completions?slow" if ok[0] % 7 == 0 else "/v1/completions",
                                        {"prompt": "x"}, conn=c)
                ok[0] += code == 200
                if code != 200:
                    errors.append(f"HTTP {code}")
            except (OSError, http.client.HTTPException) as exc:
                errors.append(repr(exc))
                c.close()
                c = http.client.HTTPConnection("127.0.0.1", front.port, timeout=10)
        c.close()

    def fresh() -> None:
        while not stop.is_set():
            try:
                code, _ = front.request("POST", "/v1/completions", {"prompt": "y"})
                ok[0] += code == 200
                if code != 200:
                    errors.append(f"HTTP {code}")
            except (OSError, http.client.HTTPException) as exc:
                errors.append(repr(exc))

    threads = [threading.Thread(target=f) for f in (keepalive, keepalive, fresh)]
    for t in threads:
        t.start()
    try:
        for _ in range(2):
            code, doc = front.reload()
            assert code == 0 and doc["ok"], doc
    finally:
        stop.set()
        for t in threads:
            t.join()
    after = [r["pid"] for r in front.doc()["routers"]]
    assert all(a != b for a, b in zip(after, before, strict=True))
    assert errors == [] and ok[0] > 20


def test_reload_that_cannot_start_a_router_fails_and_keeps_serving(front: Front) -> None:
    front.fail_file.write_text("")
    code, doc = front.reload()
    assert code == 1 and "router 0" in doc["error"] and "not ready" in doc["error"]
    assert front.doc()["routers"][1]["state"] == "ready"
    for _ in range(4):
        assert front.request("POST", "/v1/completions", {"prompt": "x"})[0] == 200
    front.fail_file.unlink()
    front.wait(lambda d: all(r["state"] == "ready" for r in d["routers"]), timeout=40)


def test_http_framing(front: Front) -> None:
    s = socket.create_connection(("127.0.0.1", front.port), timeout=10)
    # Chunked request bodies are refused with 411 (the front frames requests by Content-Length).
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
              + b"\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    assert s.recv(100).startswith(b"HTTP/1.1 411")
    s.close()
    # Expect: 100-continue gets its interim answer from the front, then the response.
    body = json.dumps({"prompt": "z" * 5000}).encode()
    s = socket.create_connection(("127.0.0.1", front.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
              + b"\r\nContent-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n")
    assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
    s.sendall(body)
    got = b""
    while b"echo_bytes" not in got:
        got += s.recv(4096)
    assert got.startswith(b"HTTP/1.1 200") and f'"echo_bytes": {len(body)}'.encode() in got
    s.close()
    # A streamed (chunked) response arrives whole, and the connection stays usable.
    c = http.client.HTTPConnection("127.0.0.1", front.port, timeout=10)
    c.request("POST", "/v1/completions", json.dumps({"stream": True}), {"Authorization": f"Bearer {KEY}"})
    r = c.getresponse()
    assert r.status == 200 and r.read().count(b"data: ") == 3
    assert front.request("POST", "/v1/completions", {"prompt": "x"}, conn=c)[0] == 200
    c.request("HEAD", "/health")
    r = c.getresponse()
    assert r.status == 200 and r.read() == b""
    c.close()


def test_a_request_the_router_drops_unanswered_is_sent_again(tmp_path: Path) -> None:
    f = Front(tmp_path, api_key=False, env={"FAKE_ROUTER_DROP_EVERY": "3"})
    try:
        c = http.client.HTTPConnection("127.0.0.1", f.port, timeout=10)
        for _ in range(12):  # every third request on an upstream connection goes unanswered
            assert f.request("POST", "/v1/completions", {"prompt": "x"}, key=None, conn=c)[0] == 200
        c.close()
    finally:
        f.stop()


def test_no_router_up_waits_then_503(tmp_path: Path) -> None:
    f = Front(tmp_path, routers=1, api_key=False, connect_wait=1.0)
    try:
        f.fail_file.write_text("")
        os.kill(f.doc()["routers"][0]["pid"], signal.SIGKILL)
        f.wait(lambda d: d["routers"][0]["state"] == "backoff")
        code, doc = f.request("POST", "/v1/completions", {"prompt": "x"}, key=None)
        assert code == 503 and "no router" in doc["error"]["message"]
    finally:
        f.stop()


def test_routers_restart_when_the_watched_engine_ids_change(tmp_path: Path) -> None:
    """--watch: a router that learns prefill engine ids at its start (vllm-router asking a Mooncake bootstrap
    server) is restarted when a prefill engine comes back under a new id; meanwhile the state says they are stale."""
    import http.server

    ids = {"now": "prefill-a"}

    class Bootstrap(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the shape of vLLM's MooncakeBootstrapServer /query
            body = json.dumps({"0": {"engine_id": ids["now"], "worker_addr": {"0": {"0": "tcp://10.0.0.1:5"}}}})
            self.send_response(200 if ids["now"] else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Bootstrap)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/query"
    ports = free_ports(3)
    state = tmp_path / "front.json"
    argv = [sys.executable, str(FRONT), "run", "--listen", f"127.0.0.1:{ports[0]}", "--state", str(state),
            "--router", f"{ports[1]}:{ports[2]}", "--watch", url, "--watch-interval", "0.2", "--grace", "10",
            "--", sys.executable, str(FAKE_ROUTER)]
    with (tmp_path / "front.log").open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    f = Front.__new__(Front)
    f.state, f.proc = state, proc
    try:
        doc = f.wait(lambda d: (d.get("watch") or {}).get("routers_know") is not None)
        assert doc["watch"]["routers_know"] == doc["watch"]["engine_ids"] == {url: ["prefill-a"]}
        first_start = doc["routers"][0]["started_at"]
        ids["now"] = ""  # the prefill engine is down: nothing to learn, nothing restarted
        time.sleep(1)
        assert f.doc()["routers"][0]["restarts"] == 0
        ids["now"] = "prefill-b"  # back under a new id
        doc = f.wait(lambda d: d["watch"]["routers_know"] == {url: ["prefill-b"]})
        assert doc["routers"][0]["restarts"] == 1 and doc["routers"][0]["started_at"] > first_start
        assert doc["watch"]["changed_at"] is not None and doc["reload"]["state"] == "done"
        time.sleep(1)
        assert f.doc()["routers"][0]["restarts"] == 1  # the same ids again: no further restart
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        server.shutdown()
