"""The proxy front (kimictl/remote/proxy_front.py) in front of stand-in routers: API key, the admin channel, failover,
rolling reloads without client errors, HTTP framing, hostile clients, Python 3.9."""

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
from prerequisites import require_or_skip

from kimictl.sandbox.system import floor_python

FRONT = Path(__file__).parents[2] / "kimictl" / "remote" / "proxy_front.py"
FAKE_ROUTER = Path(__file__).parent / "data" / "fake_router.py"
KEY = "k-7f3a9c1e"
# Hosts run the front with their own python3: KIMICTL_HOST_PYTHON=/path/python3.9 checks another one (scripts/test.sh).
FRONT_PY = os.environ.get("KIMICTL_HOST_PYTHON") or sys.executable
ADMIN = "adm-51c0ffee"


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
                 env: dict[str, str] | None = None, admin_key: bool = True, python: str = FRONT_PY,
                 extra: list[str] = (), nofile: int | None = None, router: Path = FAKE_ROUTER):
        ports = free_ports(1 + 2 * routers)
        self.port, self.state = ports[0], tmp / "front.json"
        self.key_file, self.admin_file = tmp / "key", tmp / "admin-key"
        self.key_file.write_text(KEY + "\n")
        self.admin_file.write_text(ADMIN + "\n")
        self.fail_file = tmp / "fail"
        self.python = python
        argv = [python, str(FRONT), "run", "--listen", f"127.0.0.1:{self.port}", "--state", str(self.state),
                "--grace", "10", "--ready-timeout", "20", "--connect-wait", str(connect_wait), *extra]
        for i in range(routers):
            argv += ["--router", f"{ports[1 + 2 * i]}:{ports[2 + 2 * i]}"]
        if api_key:
            argv += ["--api-key-file", str(self.key_file)]
        if admin_key:
            argv += ["--admin-key-file", str(self.admin_file)]
        # The rendered command's --host/--port must be overridden by the front's own.
        argv += ["--", sys.executable, str(router), "--host", "0.0.0.0", "--port", "1", "--policy", "x"]
        self.log_path = tmp / "front.log"
        self.log = self.log_path.open("w")
        if nofile:  # the open-file limit, soft and hard (the front may raise its soft limit up to the hard one)
            argv = ["prlimit", f"--nofile={nofile}:{nofile}", "--", *argv]
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

    def reload(self, timeout: float = 60) -> tuple[int, dict]:
        p = subprocess.run([self.python, str(FRONT), "reload", "--state", str(self.state), "--timeout", str(timeout)],
                           capture_output=True, text=True, check=False)
        return p.returncode, json.loads(p.stdout)

    def raw(self, data: bytes, timeout: float = 15) -> bytes:
        """Send raw bytes on a fresh connection; what comes back until the front closes it."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            s.sendall(data)
            return read_all(s)

    def stop(self) -> int | None:
        """SIGTERM; the front's exit code (None: it had to be killed)."""
        code = self.proc.poll()
        if code is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return code

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")


def read_all(s: socket.socket) -> bytes:
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    return got


def head(path: str = "/v1/completions", method: str = "POST", length: int | None = None, key: str | None = KEY,
         extra: str = "") -> bytes:
    text = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    text += f"Authorization: Bearer {key}\r\n" if key else ""
    text += f"Content-Length: {length}\r\n" if length is not None else ""
    return (text + extra + "\r\n").encode()


def routers_gone(f: Front) -> None:
    for pid in [r["pid"] for r in f.doc()["routers"] if r.get("pid")]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.fixture
def front(tmp_path: Path):
    f = Front(tmp_path)
    yield f
    assert f.stop() == 0
    routers_gone(f)


def test_api_key_on_every_request_but_health(front: Front) -> None:
    assert front.request("GET", "/health", key=None)[0] == 200
    assert front.request("POST", "/v1/completions", {"prompt": "x"}, key=None)[0] == 401
    assert front.request("POST", "/v1/completions", {"prompt": "x"}, key="wrong")[0] == 401
    code, doc = front.request("POST", "/v1/completions", {"prompt": "x"})
    assert code == 200 and doc["choices"][0]["text"].startswith("router ")
    # The scheme is case-insensitive (RFC 9110); the key is not.
    for scheme in ("bearer", "BEARER", "bEaReR"):
        assert front.raw(head(key=None, length=2, extra=f"Authorization: {scheme} {KEY}\r\n") + b"{}"
                         ).startswith(b"HTTP/1.1 200")
    assert front.raw(head(key=KEY.upper(), length=2) + b"{}").startswith(b"HTTP/1.1 401")
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
        code, doc = front.request("GET", f"/kimictl/router/{i}/whoami?x=1", key=ADMIN)
        assert code == 200 and doc["port"] == port and doc["path"] == "/whoami?x=1"
    assert front.request("GET", "/kimictl/router/7/whoami", key=ADMIN)[0] == 404
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
    f = Front(tmp_path, api_key=False, admin_key=False, env={"FAKE_ROUTER_DROP_EVERY": "3"})
    try:
        c = http.client.HTTPConnection("127.0.0.1", f.port, timeout=10)
        for _ in range(12):  # every third request on an upstream connection goes unanswered
            assert f.request("POST", "/v1/completions", {"prompt": "x"}, key=None, conn=c)[0] == 200
        c.close()
        # A body too big to keep is streamed through, so when it is the one dropped it cannot be sent again: 502.
        c = http.client.HTTPConnection("127.0.0.1", f.port, timeout=10)
        assert f.request("POST", "/v1/completions", {"prompt": "x"}, key=None, conn=c)[0] == 200
        assert f.request("POST", "/v1/completions", {"prompt": "x"}, key=None, conn=c)[0] == 200
        code, doc = f.request("POST", "/v1/completions", {"prompt": "z" * (1 << 20)}, key=None, conn=c)
        assert code == 502 and "not sent twice" in doc["error"]["message"]
        c.close()
        # Without an admin key file the routers' own API is closed to everyone; client paths stay open.
        assert f.request("GET", "/kimictl/router/0/workers", key=None)[0] == 403
        assert f.request("GET", "/kimictl/router/0/workers", key="")[0] == 403
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


def test_router_admin_api_is_closed_to_client_keys(front: Front) -> None:
    """Only client paths reach the routers with the client key; their own API needs the admin key."""
    workers = ["http://10.0.0.1:7100", "http://10.0.0.2:7100"]
    for method, path in [("POST", "/remove_worker?url=http://10.0.0.1:7100"), ("GET", "/workers"),
                         ("POST", "/workers"), ("POST", "/add_worker?url=http://10.9.9.9:1"),
                         ("POST", "/instances/remove"), ("GET", "/metrics"), ("POST", "/%72emove_worker")]:
        code, doc = front.request(method, path, {"instances": workers})
        assert code == 404 and "not a client path" in doc["error"]["message"], (path, code, doc)
    for key in (KEY, None, "adm"):
        code, doc = front.request("POST", "/kimictl/router/0/remove_worker?url=http://10.0.0.1:7100", key=key)
        assert code == 403 and "admin key" in doc["error"]["message"]
    # What a router could read as another path is refused before any routing.
    for target in ("/v1/../remove_worker", "/v1/%2e%2e/remove_worker", "/v1/..%2fremove_worker",
                   "http://127.0.0.1/remove_worker", "*"):
        assert front.raw(head(target, length=0)).startswith(b"HTTP/1.1 400"), target
    for i in range(2):  # every copy still has its whole membership
        code, doc = front.request("GET", f"/kimictl/router/{i}/workers", key=ADMIN)
        assert code == 200 and [w["url"] for w in doc["workers"]] == workers
    # kimictl's own drain (rollout's RouterAdmin) goes through the admin channel.
    from kimictl.routers import RouterAdmin, RouterError

    admin = RouterAdmin(f"http://127.0.0.1:{front.port}/kimictl/router/1", api_key=ADMIN)
    admin.remove("http://10.0.0.2:7100")
    assert list(admin.members()) == ["http://10.0.0.1:7100"]
    with pytest.raises(RouterError, match="403"):
        RouterAdmin(f"http://127.0.0.1:{front.port}/kimictl/router/1", api_key=KEY).members()
    # The admin key rotates like the client key.
    front.admin_file.write_text("adm-rotated-9\n")
    assert front.request("GET", "/kimictl/router/0/workers", key=ADMIN)[0] == 403
    assert front.request("GET", "/kimictl/router/0/workers", key="adm-rotated-9")[0] == 200


def test_hostile_request_heads_are_refused_cleanly(front: Front) -> None:
    """What the front and a router could read differently is 400, and never costs the front a traceback."""
    cases = {
        "a Content-Length of 5000 digits": head(extra="Content-Length: " + "9" * 5000 + "\r\n"),
        "a negative Content-Length": head(extra="Content-Length: -1\r\n"),
        "two Content-Lengths": head(extra="Content-Length: 2\r\nContent-Length: 3\r\n"),
        "a bare LF inside a header value": head(length=2, extra="X-A: a\nTransfer-Encoding: chunked\r\n"),
        "a bare CR inside a header value": head(length=2, extra="X-A: a\rb\r\n"),
        "an obs-fold line": head(length=2, extra="X-A: a\r\n b\r\n"),
        "a space before the colon": head(length=2, extra="Content-Length : 5\r\n"),
        "a NUL in the target": head("/v1/comp\x00letions", length=2),
        "an HTTP/2 request line": b"POST /v1/completions HTTP/2.0\r\nHost: x\r\n\r\n",
    }
    for what, data in cases.items():
        got = front.raw(data + b"{}")
        assert got.startswith(b"HTTP/1.1 400"), (what, got[:80])
    assert front.request("POST", "/v1/completions", {"prompt": "x"})[0] == 200
    log = front.log_path.read_text()
    assert "Traceback" not in log and "internal error" not in log, log[-2000:]


def test_slow_clients_get_408_and_idle_connections_close(tmp_path: Path) -> None:
    f = Front(tmp_path, routers=1, extra=["--header-timeout", "1", "--io-timeout", "1", "--idle-timeout", "1"])
    try:
        # A request head that never ends.
        assert f.raw(head()[:-4]).startswith(b"HTTP/1.1 408")
        # Bodies that stop: a small one (kept for a second attempt) and a big one (streamed to the router).
        assert f.raw(head(length=100) + b"{" * 10).startswith(b"HTTP/1.1 408")
        assert f.raw(head(length=50 << 20) + b"{" * (2 << 20)).startswith(b"HTTP/1.1 408")
        # A keep-alive connection with no next request is closed without a word.
        with socket.create_connection(("127.0.0.1", f.port), timeout=15) as s:
            s.sendall(head(length=2).replace(b"Connection: close", b"X-K: v") + b"{}")
            got = read_all(s)
            assert got.startswith(b"HTTP/1.1 200") and got.count(b"HTTP/1.1") == 1
        assert f.request("POST", "/v1/completions", {"prompt": "x"})[0] == 200
        assert "Traceback" not in f.log_path.read_text()
    finally:
        f.stop()


def test_body_limit_and_streamed_bodies_keep_memory_bounded(tmp_path: Path) -> None:
    f = Front(tmp_path, routers=1, extra=["--max-body", str(200 << 20)])
    socks: list[socket.socket] = []
    try:
        assert f.raw(head(length=(200 << 20) + 1)).startswith(b"HTTP/1.1 413")
        # A whole big body arrives at the router byte for byte.
        body = json.dumps({"prompt": "b" * (3 << 20)}).encode()
        got = f.raw(head(length=len(body)) + body)
        assert got.startswith(b"HTTP/1.1 200") and f'"echo_bytes": {len(body)}'.encode() in got
        # Four unfinished 100 MiB bodies, 40 MiB of each sent: the front holds none of it.
        before = f.rss_kib()
        socks = [socket.create_connection(("127.0.0.1", f.port), timeout=30) for _ in range(4)]
        for s in socks:
            s.sendall(head(length=100 << 20))
        chunk = b"x" * (1 << 20)
        for _ in range(40):
            for s in socks:
                s.sendall(chunk)
        grown = f.rss_kib() - before
        assert grown < 48 * 1024, f"the front grew by {grown} KiB while 160 MiB of bodies went through"
    finally:
        for s in socks:
            s.close()
        f.stop()


def test_connection_cap_queues_evicts_idle_then_503(tmp_path: Path) -> None:
    f = Front(tmp_path, routers=1, extra=["--max-connections", "3", "--header-timeout", "60"])
    stuck: list[socket.socket] = []
    try:
        assert f.doc()["max_connections"] == 3
        # Three clients that never finish a request head hold every slot: the next one waits briefly, then 503.
        for _ in range(3):
            stuck.append(socket.create_connection(("127.0.0.1", f.port), timeout=30))
            stuck[-1].sendall(b"POST /v1/completions HTTP/1.1\r\n")
        got = f.raw(head(length=2) + b"{}")
        assert got.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in got
        for s in stuck:
            s.close()
        # Slots held by idle keep-alive connections are given to new clients: a healthy front refuses nobody.
        conns = [http.client.HTTPConnection("127.0.0.1", f.port, timeout=30) for _ in range(3)]
        for c in conns:
            assert f.request("POST", "/v1/completions", {"prompt": "x"}, conn=c)[0] == 200
        for _ in range(3):
            assert f.request("POST", "/v1/completions", {"prompt": "y"})[0] == 200
        for c in conns:
            c.close()
    finally:
        for s in stuck:
            s.close()
        f.stop()


def test_a_flood_under_a_low_file_limit_keeps_the_front_serving_and_its_log_small(tmp_path: Path) -> None:
    """300 half-sent requests against a front allowed 256 open files (it was 1024 under systemd and the front
    wrote ~20 MB/s of accept() tracebacks): a lowered cap, 408s and 503s, a log of a few lines, and then service."""
    f = Front(tmp_path, routers=1, nofile=256, extra=["--header-timeout", "2"])
    socks: list[socket.socket] = []
    try:
        cap = f.doc()["max_connections"]
        assert 0 < cap < 1024 and f"connection cap lowered from 1024 to {cap}" in f.log_path.read_text()
        for _ in range(300):
            socks.append(socket.create_connection(("127.0.0.1", f.port), timeout=30))
            socks[-1].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        answers = [read_all(s)[:12] for s in socks]
        assert set(answers) <= {b"HTTP/1.1 408", b"HTTP/1.1 503"} and answers.count(b"HTTP/1.1 408") >= cap
        assert f.request("POST", "/v1/completions", {"prompt": "x"})[0] == 200
        log = f.log_path.read_text()
        assert len(log) < 8000 and "Traceback" not in log, log[-3000:]
    finally:
        for s in socks:
            s.close()
        f.stop()


# --- clients without the key: no body read, a deadline per request, a cap per address, no credential forwarded ----


def connect(f: Front, source: str = "127.0.0.1", timeout: float = 30) -> socket.socket:
    """A connection to the front from `source` (any 127.x address is this host's loopback)."""
    return socket.create_connection(("127.0.0.1", f.port), timeout=timeout, source_address=(source, 0))


def trickle(s: socket.socket, first: bytes, seconds: float = 30.0, stop: threading.Event | None = None) -> bytes:
    """Send `first`, then one byte every 0.1 s until the front answers (or `seconds` pass, or `stop` is set): what
    it answered."""
    import select

    s.sendall(first)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (stop and stop.is_set()):
        if select.select([s], [], [], 0.1)[0]:
            return read_all(s)
        try:
            s.send(b"a")
        except OSError:
            break
    if stop and stop.is_set():
        return b""
    try:
        return read_all(s)
    except OSError:
        return b""


def test_keyless_slow_clients_cannot_starve_a_keyed_client(tmp_path: Path) -> None:
    """Finding 3 of issue 27: clients without the key, as many as the front has slots, trickling a request head or
    the body of a keyless GET /health (one byte at a time, reconnecting when cut), from one address; the keyed
    client on another address is served every time (it got 503 while they held every slot)."""
    f = Front(tmp_path, routers=1, extra=["--max-connections", "4", "--max-conns-per-client", "2",
                                          "--header-timeout", "60", "--request-timeout", "60"])
    stop = threading.Event()
    answers: list[bytes] = []

    def loris(first: bytes) -> None:
        while not stop.is_set():
            try:
                with connect(f, "127.0.0.2") as s:
                    answers.append(trickle(s, first, seconds=60, stop=stop)[:400])
            except OSError:
                pass
            time.sleep(0.05)

    patterns = [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-A: ",  # a head that never ends
                b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n"]  # a keyless body
    threads = [threading.Thread(target=loris, args=(patterns[i % 2],)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)  # every slow client has connected (on the old front they held all 4 slots)
        for _ in range(5):
            assert f.request("POST", "/v1/completions", {"prompt": "x"})[0] == 200
            time.sleep(0.2)
        assert f.request("GET", "/health", key=None)[0] == 200  # the keyless health check still answers
        stop.set()
        for t in threads:
            t.join(90)
        # Each slow client was cut: a keyless body is never read (400), and past two the address is refused (503).
        assert {a[:12] for a in answers if a} <= {b"HTTP/1.1 400", b"HTTP/1.1 503"}, answers
        assert any(b"too many connections from 127.0.0.2" in a for a in answers)
        assert "Traceback" not in f.log_path.read_text()
    finally:
        stop.set()
        f.stop()


def test_keyed_connections_do_not_count_against_their_address(tmp_path: Path) -> None:
    """A load balancer's address carries many keyed connections: only connections that have shown no key count
    against --max-conns-per-client; and one of those idle since it connected gives its place to a new one."""
    f = Front(tmp_path, routers=1, extra=["--max-conns-per-client", "2", "--header-timeout", "60"])
    held: list[socket.socket] = []
    conns = [http.client.HTTPConnection("127.0.0.1", f.port, timeout=30) for _ in range(5)]
    try:
        for c in conns:  # five keep-alive connections with the key, all open at once
            assert f.request("POST", "/v1/completions", {"prompt": "x"}, conn=c)[0] == 200
        for c in conns:
            assert f.request("POST", "/v1/completions", {"prompt": "y"}, conn=c)[0] == 200
        # Two connections from one address that never send a byte: once idle a while, a third one takes the place
        # of the one idle longest.
        held = [connect(f, "127.0.0.3") for _ in range(2)]
        time.sleep(1.5)  # EVICT_IDLE_AFTER
        with connect(f, "127.0.0.3") as s:
            s.sendall(head("/health", "GET", key=None))
            assert read_all(s).startswith(b"HTTP/1.1 200")
        assert read_all(held[0]) == b""  # the oldest was closed
        # Two that are busy sending a head are not idle: a third one from their address gets 503.
        held[1].close()
        held = [connect(f, "127.0.0.4") for _ in range(2)]
        for s in held:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        with connect(f, "127.0.0.4") as s:
            got = read_all(s)
        assert got.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in got
        assert b"from 127.0.0.4 that have shown no API key" in got
        assert f.request("POST", "/v1/completions", {"prompt": "z"})[0] == 200  # other addresses are served
    finally:
        for c in conns:
            c.close()
        for s in held:
            s.close()
        f.stop()


def test_a_request_without_the_key_gets_no_body_read(front: Front) -> None:
    """The key is checked on the head: the answer comes, and the connection ends, before any body byte is sent."""
    for data in (head(key=None, length=1 << 20),  # 1 MiB announced, not one byte of it sent
                 head(key="wrong", length=1 << 20, extra="Expect: 100-continue\r\n"),
                 head("/kimictl/router/0/workers", key=KEY, length=1 << 20)):
        with socket.create_connection(("127.0.0.1", front.port), timeout=15) as s:
            s.sendall(data)
            got = read_all(s)  # the front closes: it waits for no body
        assert got.startswith((b"HTTP/1.1 401", b"HTTP/1.1 403")) and b"100 Continue" not in got, got[:80]
    # The keyless GET /health takes no body at all (it was read, up to 1 MiB, one byte per --io-timeout).
    with socket.create_connection(("127.0.0.1", front.port), timeout=15) as s:
        s.sendall(head("/health", "GET", key=None, length=1 << 20))
        got = read_all(s)
    assert got.startswith(b"HTTP/1.1 400") and b"takes no body" in got
    assert front.request("GET", "/health", key=None)[0] == 200


def test_a_trickling_client_is_cut_at_the_request_deadline(tmp_path: Path) -> None:
    """One byte every 0.1 s never trips --header-timeout or --io-timeout (30 s); --request-timeout (1 s) ends it."""
    f = Front(tmp_path, routers=1, extra=["--request-timeout", "1", "--header-timeout", "30", "--io-timeout", "30"])
    try:
        cases = {"a head": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-A: ",
                 "a small body": head(length=1000),
                 "a streamed body": head(length=3 << 20) + b"{" * (2 << 20)}
        for what, first in cases.items():
            with socket.create_connection(("127.0.0.1", f.port), timeout=30) as s:
                got = trickle(s, first)
            assert got.startswith(b"HTTP/1.1 408") and b"within 1s" in got, (what, got[:200])
        assert f.request("POST", "/v1/completions", {"prompt": "x"})[0] == 200  # a prompt request is in time
        assert "Traceback" not in f.log_path.read_text()
    finally:
        f.stop()


def test_the_routers_never_see_the_clients_credentials(front: Front) -> None:
    """The front checks the keys; the routers send the engines their own (vllm-ascend's proxy: OPENAI_API_KEY)."""
    code, doc = front.request("GET", "/v1/whoami")
    assert code == 200 and doc["auth"] is None
    got = front.raw(head("/v1/whoami", "GET", extra="X-Api-Key: k-other\r\nProxy-Authorization: Basic eDp5\r\n"))
    doc = json.loads(got.partition(b"\r\n\r\n")[2])
    assert got.startswith(b"HTTP/1.1 200") and doc["auth"] is doc["x_api_key"] is doc["proxy_auth"] is None
    code, doc = front.request("GET", "/kimictl/router/0/whoami", key=ADMIN)  # nor the admin key
    assert code == 200 and doc["auth"] is None


def test_rate_limited_log_counts_what_it_leaves_out(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("proxy_front_under_test", FRONT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    now = [1000.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: now[0])
    for i in range(1000):
        mod.warn("client 408", f"client 10.0.0.{i % 250}: 408")
    mod.warn("router", "router 0 exited")
    now[0] += mod.LOG_WINDOW
    mod.warn("client 408", "client 10.0.0.1: 408")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == mod.LOG_BURST + 1 + 2
    assert lines[-2] == f"proxy-front: ({1000 - mod.LOG_BURST} more 'client 408' line(s) left out in 10s)"


def test_front_on_python_3_9_reloads_and_stops_its_routers(tmp_path: Path) -> None:
    py39 = floor_python()
    if py39 is None:
        require_or_skip("no Python 3.9 (hosts' python3 on openEuler 22.03) on this machine: see floor_python")
    f = Front(tmp_path, python=py39)
    try:
        before = [r["pid"] for r in f.doc()["routers"]]
        code, doc = f.reload(timeout=30)
        assert code == 0 and doc["ok"], doc
        assert all(r["pid"] not in before for r in f.doc()["routers"])
        assert f.request("POST", "/v1/completions", {"prompt": "x"})[0] == 200
    finally:
        assert f.stop() == 0, f.log_path.read_text()[-2000:]
    routers_gone(f)


# --- router kinds: health path, metrics flag, holding a copy ---------------------------------------------------


def test_a_router_kind_without_health_or_metrics_of_vllm_routers_shape(tmp_path: Path) -> None:
    """vllm-ascend's proxy: the front checks its copies on /healthcheck, passes no --prometheus-port, and the proxy
    port's open /health asks the copies' /healthcheck."""
    f = Front(tmp_path, routers=2, extra=["--router-health", "/healthcheck", "--no-router-metrics"])
    try:
        code, doc = f.request("GET", "/health", key=None)
        assert code == 200 and doc["status"] == "ok" and "prefill_instances" in doc
        argv = doc["argv"]
        last_port = argv[len(argv) - 1 - argv[::-1].index("--port") + 1]  # argparse: the last one wins
        assert "--prometheus-port" not in argv and last_port in {str(r["port"]) for r in f.doc()["routers"]}
        assert f.request("POST", "/v1/completions", {"prompt": "x"})[0] == 200
    finally:
        f.stop()


def test_a_held_copy_gets_no_new_client_request_until_released_or_its_lease_ends(tmp_path: Path) -> None:
    f = Front(tmp_path, routers=2)
    try:
        ports = [r["port"] for r in f.doc()["routers"]]
        keep = http.client.HTTPConnection("127.0.0.1", f.port, timeout=10)

        def served(n: int) -> set[int]:
            out = set()
            for i in range(n):  # fresh connections and one keep-alive connection (its upstream is reused)
                code, doc = f.request("POST", "/v1/completions", {"prompt": "x"}, conn=keep if i % 2 else None)
                assert code == 200
                out.add(int(doc["choices"][0]["text"].split()[1]))
            return out

        assert served(8) == set(ports)
        assert f.request("POST", "/kimictl/front/router/0/hold", key=KEY)[0] == 403  # the client key cannot
        code, doc = f.request("POST", "/kimictl/front/router/0/hold?seconds=30", key=ADMIN)
        assert code == 200 and doc["held"] is True and f.doc()["routers"][0]["held"] is True
        assert served(8) == {ports[1]}
        # copy 0's own API still answers (the rollout re-adds through it while it is held)
        assert f.request("GET", "/kimictl/router/0/workers", key=ADMIN)[0] == 200
        assert f.request("POST", "/kimictl/front/router/1/hold", key=ADMIN)[0] == 409  # nobody left to serve
        assert f.request("POST", "/kimictl/front/router/0/release", key=ADMIN) == (200, {
            "router": 0, "held": False, "active": f.doc()["routers"][0]["active"]})
        assert served(8) == set(ports)
        assert f.request("POST", "/kimictl/front/router/1/hold?seconds=0.5", key=ADMIN)[0] == 200
        assert served(4) == {ports[0]}
        time.sleep(0.6)  # the lease ends by itself (a kimictl that died holding a copy cannot keep it out)
        assert served(8) == set(ports)
        assert f.request("GET", "/kimictl/front/router/0/hold", key=ADMIN)[0] == 405
        assert f.request("POST", "/kimictl/front/router/5/hold", key=ADMIN)[0] == 404
        keep.close()
    finally:
        f.stop()


def test_a_hold_has_an_owner_and_a_release_frees_only_that_owner_s_hold(tmp_path: Path) -> None:
    """A rollout and a heal hold the same copy: heal's release leaves the rollout's hold (clients still go to the
    other copy); the rollout's own release frees it. A release without an owner frees every hold, as before."""
    f = Front(tmp_path, routers=2)
    try:
        ports = [r["port"] for r in f.doc()["routers"]]

        def served(n: int) -> set[int]:
            out = set()
            for _ in range(n):
                code, doc = f.request("POST", "/v1/completions", {"prompt": "x"})
                assert code == 200
                out.add(int(doc["choices"][0]["text"].split()[1]))
            return out

        hold = "/kimictl/front/router/0/hold?seconds=30&owner="
        assert f.request("POST", hold + "rollout:11", key=ADMIN)[0] == 200
        assert f.request("POST", hold + "heal:22", key=ADMIN)[0] == 200
        assert f.doc()["routers"][0]["holders"] == ["heal:22", "rollout:11"]
        assert f.request("POST", "/kimictl/front/router/0/release?owner=heal:22", key=ADMIN)[1]["held"] is True
        assert f.doc()["routers"][0]["holders"] == ["rollout:11"] and served(6) == {ports[1]}
        assert f.request("POST", "/kimictl/front/router/0/release?owner=nobody", key=ADMIN)[1]["held"] is True
        assert f.request("POST", "/kimictl/front/router/0/release?owner=rollout:11", key=ADMIN)[1]["held"] is False
        assert served(6) == set(ports)
        # without owners: a hold of its own, and a release that frees every hold (the front's behaviour before)
        assert f.request("POST", hold + "rollout:11", key=ADMIN)[0] == 200
        assert f.request("POST", "/kimictl/front/router/0/hold?seconds=30", key=ADMIN)[1]["held"] is True
        assert f.doc()["routers"][0]["holders"] == ["", "rollout:11"]
        assert f.request("POST", "/kimictl/front/router/0/release", key=ADMIN)[1]["held"] is False
        assert f.request("POST", hold + "a%20b", key=ADMIN)[0] == 400  # owners are logged: no spaces
        assert f.request("POST", hold + "x" * 129, key=ADMIN)[0] == 400
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
