"""`kimictl rollout` on a 4-host A3 sandbox (a3-pd = 2P2D, the proxy behind an API key) under client load: every
slice changes one at a time with zero client errors, and a canary that fails its gate is rolled back
automatically, leaving the cluster healthy on the old release.

The proxy kimictl deploys is its front with two copies of vllm-ascend's own P/D proxy (the default router kind)
behind it. A drain is `POST /instances/remove` on every copy; a copy with requests in flight only taints the engine
and takes it back only once idle, so the re-add holds one copy at a time in the front (its clients' next requests go
to the other copy), re-adds, and releases it: no restart, no refused connection. Loads run through the proxy on fresh
and keep-alive connections; none may see an error. With the API key set, the engines require a key of their own
(kimictl's, never the clients') and listen on their host's business IP only.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.sandbox

SD = "/var/lib/kimi"


def kimictl(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kimictl", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


API_KEY = "sk-rollout-test-4b1d"


def _post(url: str, body: dict, timeout: float = 60, api_key: str | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


class KeepAlive:
    """One persistent HTTP/1.1 connection, as SDK clients (httpx, aiohttp) keep them."""

    def __init__(self, url: str, api_key: str | None):
        u = urllib.parse.urlsplit(url)
        self.host, self.port, self.path, self.api_key = u.hostname, u.port, u.path, api_key
        self.conn: http.client.HTTPConnection | None = None

    def post(self, body: dict) -> tuple[int, str]:
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            self.conn.request("POST", self.path, json.dumps(body), headers)
            r = self.conn.getresponse()
            return r.status, r.read().decode()
        except BaseException:
            self.conn.close()
            self.conn = None
            raise


@dataclass
class Load:
    """A bounded client loop through one URL in threads: counts successes and classifies every failure."""

    url: str
    threads: int
    api_key: str | None = None
    keepalive: bool = False
    ok: int = 0
    errors: list[tuple[float, str, str]] = field(default_factory=list)
    first: float | None = None
    last: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _workers: list[threading.Thread] = field(default_factory=list)

    def _loop(self, k: int) -> None:
        i = 0
        ka = KeepAlive(self.url, self.api_key) if self.keepalive else None
        while not self._stop.is_set():
            i += 1
            kind, detail = "ok", ""
            body = {"model": "kimi-k2.5", "prompt": f"client {k} request {i} " * 12, "max_tokens": 16}
            try:
                code, text = ka.post(body) if ka else _post(self.url, body, api_key=self.api_key)
                if code != 200 or not json.loads(text).get("choices"):
                    kind, detail = f"http {code}", text[:200]
            except urllib.error.HTTPError as exc:
                kind, detail = f"http {exc.code}", exc.read().decode(errors="replace")[:200]
            except urllib.error.URLError as exc:
                refused = isinstance(exc.reason, ConnectionRefusedError)
                kind, detail = ("refused" if refused else "network"), str(exc.reason)[:200]
                if refused:
                    time.sleep(0.05)  # a client backs off a little instead of spinning on a closed port
            except (OSError, ValueError, http.client.HTTPException) as exc:
                kind, detail = "network", repr(exc)[:200]
            now = time.time()
            with self._lock:
                if kind == "ok":
                    self.ok += 1
                    self.first = self.first or now
                    self.last = now
                else:
                    self.errors.append((now, kind, detail))

    def start(self) -> Load:
        self._workers = [threading.Thread(target=self._loop, args=(k,), daemon=True) for k in range(self.threads)]
        for t in self._workers:
            t.start()
        return self

    def stop(self) -> Load:
        self._stop.set()
        for t in self._workers:
            t.join(timeout=120)
        return self

    def kinds(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, kind, _ in self.errors:
            out[kind] = out.get(kind, 0) + 1
        return out


@pytest.fixture(scope="module")
def cluster(sandbox_a3_4, tmp_path_factory):
    """a3-pd deployed on the 4-host sandbox (2P2D) with kimi_api_key_file set."""
    sb = sandbox_a3_4
    inv = str(sb.inventory)
    key_file = tmp_path_factory.mktemp("secrets") / "proxy-api-key"
    key_file.write_text(API_KEY + "\n")
    key_file.chmod(0o600)
    doc = yaml.safe_load(sb.inventory.read_text())
    doc["all"]["vars"]["kimi_api_key_file"] = str(key_file)
    sb.inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    dep = kimictl("deploy", "-i", inv, "--topology", "a3-pd", "--yes", "--output", "json")
    assert dep.returncode == 0, dep.stderr[-3000:]
    res = json.loads(dep.stdout)
    # another module of this fixture (test_heal_run) may have deployed this release first: deploy then checked that
    # every process of it answers; otherwise its smoke test passed with the key
    assert res["result"] == "no-changes" or res["smoke"]["decode_external_kv_transfer_tokens"] > 0
    rendered = json.loads(kimictl("render", "-i", inv, "--topology", "a3-pd", "--output", "json").stdout)
    assert rendered["proxy"]["router"] == "vllm-ascend-proxy"
    engines = [e for e in rendered["engines"] if e["serves_http"]]
    assert sorted({e["instance"] for e in engines}) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    sb.engines = engines
    return sb


def _state_dir(sb) -> Path:
    return Path(os.environ["KIMICTL_STATE_DIR"]) / sb.cluster


def _supervised(sb) -> dict[str, dict]:
    out = {}
    for h in sb.hosts:
        res = sb.ssh(h, f"python3 {SD}/bin/supervisor.py status --run-dir {SD}/run")
        out.update({f"{h}:{s['name']}": s for s in json.loads(res.stdout)})
    return out


def _status(sb) -> tuple[int, dict]:
    st = kimictl("status", "-i", str(sb.inventory), "--output", "json", timeout=300)
    return st.returncode, json.loads(st.stdout)


def _front_routers(sb) -> list[dict]:
    """The router copies behind the front (pids, restarts, held), from the front's own state file."""
    return json.loads(sb.ssh("atlas-01", f"cat {SD}/run/proxy-front/state.json").stdout)["routers"]


def test_rollout_of_a_serve_flag_changes_every_slice_with_zero_client_errors(cluster) -> None:
    sb = cluster
    inv = str(sb.inventory)
    args = ["rollout", "-i", inv, "--set", "serve.seed=7", "--yes", "--output", "json"]
    check = kimictl(*args, "--check")
    assert check.returncode == 0, check.stderr[-3000:]
    plan = json.loads(check.stdout)
    assert plan["result"] == "check" and plan["first_role"] == "decode"
    assert plan["batches"] == [["decode-0"], ["decode-1"], ["prefill-0"], ["prefill-1"]]
    proxy = f"http://{sb.host('atlas-01')['ip']}:8000"
    assert plan["membership"] == {f"{proxy}/kimictl/router/0": "instances", f"{proxy}/kimictl/router/1": "instances"}
    # Without the key the proxy answers 401 (the upstream proxy itself does not check client keys).
    with pytest.raises(urllib.error.HTTPError) as denied:
        _post(f"{proxy}/v1/completions", {"model": "kimi-k2.5", "prompt": "x", "max_tokens": 1})
    assert denied.value.code == 401

    before, copies_before = _supervised(sb), _front_routers(sb)
    through_proxy = Load(f"{proxy}/v1/completions", threads=2, api_key=API_KEY).start()
    keepalive = Load(f"{proxy}/v1/completions", threads=1, api_key=API_KEY, keepalive=True).start()
    time.sleep(3)
    t0 = time.time()
    proc = kimictl(*args)
    t1 = time.time()
    time.sleep(3)
    for load in (through_proxy, keepalive):
        load.stop()
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)
    print(f"\nrollout wall time {t1 - t0:.1f}s; per slice: "
          + ", ".join(f"{s['name']} {s['seconds']}" for s in doc["slices"]))
    print(f"re-adds: {doc['proxy_restarts']}")
    print(f"client load through the proxy: {through_proxy.ok} ok, errors {through_proxy.kinds()}; "
          f"keep-alive: {keepalive.ok} ok, errors {keepalive.kinds()}")

    assert doc["result"] == "rolled-out" and doc["batches"] == plan["batches"]
    assert [s["result"] for s in doc["slices"]] == ["rolled-out"] * 4
    assert all(len(s["probes"]) == len([e for e in s["engines"]]) and all(p["ok"] for p in s["probes"])
               for s in doc["slices"])
    # zero errors (no refused connection among them) on every load, and each kept being served the whole time
    for load in (through_proxy, keepalive):
        assert load.errors == [], load.errors[:5]
        assert load.ok >= 50 and load.first < t0 + 5 and load.last > t1 - 5
    # each batch re-added its slice to each copy while the front held that copy: no router restarted
    assert [r["kind"] for r in doc["proxy_restarts"]] == ["held"] * 8
    copies_after = _front_routers(sb)
    assert [(r["pid"], r["restarts"], r["held"]) for r in copies_after] == [
        (r["pid"], r["restarts"], False) for r in copies_before]

    after = _supervised(sb)
    assert after["atlas-01:proxy"]["child_pid"] == before["atlas-01:proxy"]["child_pid"]
    engines = [k for k in before if not k.endswith(":proxy")]
    assert len(engines) == 12
    assert all(after[k]["child_pid"] != before[k]["child_pid"] and after[k]["tag"] != before[k]["tag"]
               for k in engines)
    for h in sb.hosts:
        scripts = sb.ssh(h, f"cat {SD}/current/engines/*.sh").stdout
        assert scripts.count("--seed 7") == (2 if h in ("atlas-01", "atlas-02") else 4), h

    current = json.loads((_state_dir(sb) / "current.json").read_text())
    assert current["release"] == doc["release"] and current["kind"] == "rollout"
    assert Path(current["run_dir"], "topology.yml").exists()
    code, st = _status(sb)
    assert code == 0 and st["state"] == "healthy" and st["drift"] == [] and st["release"] == doc["release"]
    assert [(m["router"], m["members"], m["missing"]) for m in st["proxy"]["membership"]] == [(0, 12, []), (1, 12, [])]

    again = kimictl("rollout", "-i", inv, "--yes", "--output", "json")
    assert again.returncode == 0 and json.loads(again.stdout)["result"] == "no-changes", again.stderr[-2000:]


def test_a_canary_that_fails_its_gate_is_rolled_back(cluster) -> None:
    sb = cluster
    inv = str(sb.inventory)
    args = ["rollout", "-i", inv, "--set", "decode.serve.max-num-seqs=12", "--yes", "--output", "json"]
    plan = json.loads(kimictl(*args, "--check").stdout)
    canary = next(s for s in plan["slices"] if s["canary"])
    host = canary["hosts"][0]
    current_before = json.loads((_state_dir(sb) / "current.json").read_text())["release"]
    tags_before = {k: v["tag"] for k, v in _supervised(sb).items()}

    # The new release crashes at start on the canary's host (engine-crash spares the tags running now).
    sb.fault(f"engine-crash:{host}:{canary['role']}")
    load = Load(f"http://{sb.host('atlas-01')['ip']}:8000/v1/completions", threads=2, api_key=API_KEY).start()
    try:
        proc = kimictl(*args)
    finally:
        load.stop()
        sb.fault("clear:all")
    print(f"\nfailed canary rollout: client load {load.ok} ok, errors {load.kinds()}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = json.loads(proc.stdout)["error"]
    assert err["type"] == "HostError" and f"rolled back {canary['name']}" in err["message"]
    assert f"host {host}" in proc.stderr and "--- log tail ---" in proc.stderr
    assert "engine_crash_at_start" in proc.stderr and f"{canary['name']}-dp" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert load.errors == [], load.errors[:5]

    records = [json.loads(x) for x in (_state_dir(sb) / "releases.jsonl").read_text().splitlines() if x.strip()]
    assert records[-1]["result"] == "rolled-back" and records[-1]["release"] == current_before
    assert records[-1]["attempted_release"] == plan["release"]
    assert json.loads((_state_dir(sb) / "current.json").read_text())["release"] == current_before
    assert {k: v["tag"] for k, v in _supervised(sb).items()} == tags_before
    code, st = _status(sb)
    assert code == 0 and st["state"] == "healthy" and st["drift"] == [] and st["release"] == current_before


def _admin_key(sb) -> str:
    path = _state_dir(sb) / "secrets" / "proxy-admin-key"
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    return path.read_text().strip()


def _engine_key(sb) -> str:
    path = _state_dir(sb) / "secrets" / "engine-api-key"
    assert path.stat().st_mode & 0o777 == 0o600
    return path.read_text().strip()


def test_the_keys_stay_out_of_files_logs_argv_and_bundles(cluster, tmp_path) -> None:
    sb = cluster
    admin, engine = _admin_key(sb), _engine_key(sb)
    assert engine not in (API_KEY, admin)
    key_file = sb.ssh("atlas-01", f"stat -c '%a %U' {SD}/secrets/proxy-api-key; cat {SD}/secrets/proxy-api-key; "
                                  f"stat -c '%a %U' {SD}/secrets/proxy-admin-key; cat {SD}/secrets/proxy-admin-key")
    assert key_file.stdout.split("\n")[:4] == ["600 root", API_KEY, "600 root", admin]
    for h in sb.hosts:  # the engines' key: a 0600 env file on every host, nowhere else, on no command line
        env = sb.ssh(h, f"stat -c '%a %U' {SD}/secrets/engine-api-key.env; cat {SD}/secrets/engine-api-key.env")
        assert env.stdout.split("\n")[:2] == ["600 root", f"VLLM_API_KEY={engine}"], h
        argv = sb.ssh(h, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '").stdout
        assert "load_balance_proxy" in argv or h != "atlas-01"
        for key in (API_KEY, admin, engine):
            assert key not in argv, (h, key)
    for h in sb.hosts:  # releases, supervisor states, logs, the front's state
        for key in (API_KEY, admin, engine):
            hits = sb.ssh(h, f"grep -rl -- {key} {SD}/releases {SD}/run {SD}/logs {SD}/current/ 2>/dev/null")
            assert hits.stdout.strip() == "", (h, hits.stdout)
    for key in (API_KEY, admin, engine):  # run directories, records, ansible artifacts (the key files aside)
        control = subprocess.run(["grep", "-rl", "--exclude-dir=secrets", "--", key, str(_state_dir(sb))],
                                 capture_output=True, text=True, check=False)
        assert control.stdout.strip() == "", control.stdout
    bundle = tmp_path / "bundle.tar.gz"
    res = kimictl("logs", "-i", str(sb.inventory), "--bundle", str(bundle))
    assert res.returncode == 0, res.stderr[-2000:]
    for key in (API_KEY, admin, engine):
        assert subprocess.run(["zgrep", "-c", "-a", "--", key, str(bundle)], capture_output=True, text=True,
                              check=False).stdout.strip() == "0"
        assert key not in res.stdout + res.stderr


def test_engines_require_their_key_and_listen_on_the_business_ip_only(cluster) -> None:
    """issue 16 item 2: a direct request to an engine without its key is refused (401), the client key does not
    open it either, and through the proxy the client key gets 200; engines bind their host's business IP."""
    sb = cluster
    e = next(x for x in sb.engines if x["role"] == "decode")
    body = {"model": "kimi-k2.5", "prompt": "straight to an engine", "max_tokens": 2}
    for key in (None, API_KEY):
        with pytest.raises(urllib.error.HTTPError) as refused:
            _post(f"http://{e['ip']}:{e['port']}/v1/completions", body, api_key=key)
        assert refused.value.code == 401
    assert _post(f"http://{e['ip']}:{e['port']}/v1/completions", body, api_key=_engine_key(sb))[0] == 200
    assert _post(f"http://{sb.host('atlas-01')['ip']}:8000/v1/completions", body, api_key=API_KEY)[0] == 200
    host = next(h for h in sb.hosts if sb.host(h)["ip"] == e["ip"])
    listening = sb.ssh(host, f"ss -Hltn 'sport = :{e['port']}'").stdout.split()
    assert f"{e['ip']}:{e['port']}" in listening and f"0.0.0.0:{e['port']}" not in listening
    local = sb.ssh(host, f"python3 -c \"import socket; s=socket.socket(); print(s.connect_ex(('127.0.0.1', "
                         f"{e['port']})))\"").stdout.strip()
    assert local != "0", "the engine answers on loopback: it listens on more than the business IP"


def test_the_routers_admin_api_is_closed_to_the_client_key(cluster) -> None:
    """A client key holder cannot drain the routers behind the proxy (a router's membership API reached through the
    front took the service down) nor hold a copy; kimictl reaches them with its admin key."""
    sb = cluster
    proxy = f"http://{sb.host('atlas-01')['ip']}:8000"
    victim = f"{sb.engines[0]['ip']}:{sb.engines[0]['port']}"
    drain = {"type": sb.engines[0]["role"], "instances": [victim]}
    for path, code in (("/instances/remove", 404), ("/kimictl/router/0/instances/remove", 403),
                       ("/kimictl/router/1/instances/remove", 403), ("/kimictl/front/router/0/hold", 403),
                       ("/healthcheck", 404)):
        with pytest.raises(urllib.error.HTTPError) as refused:
            _post(proxy + path, drain, api_key=API_KEY)
        assert refused.value.code == code, path
    code, st = _status(sb)
    assert code == 0 and st["state"] == "healthy"
    assert [(m["router"], m["members"], m["missing"]) for m in st["proxy"]["membership"]] == [(0, 12, []), (1, 12, [])]


def test_a_new_api_key_is_installed_by_deploy_without_restarts(cluster, tmp_path) -> None:
    sb = cluster
    inv = str(sb.inventory)
    current = json.loads((_state_dir(sb) / "current.json").read_text())
    topo = Path(current["run_dir"], "topology.yml")
    key_file = Path(yaml.safe_load(sb.inventory.read_text())["all"]["vars"]["kimi_api_key_file"])
    before = {k: v["child_pid"] for k, v in _supervised(sb).items()}
    key_file.write_text("sk-rotated-9c0e\n")
    old_admin = _admin_key(sb)
    # as on another control node: no copy of the admin key here, so the cluster's is read back (never a new one)
    (_state_dir(sb) / "secrets" / "proxy-admin-key").unlink()
    try:
        res = kimictl("deploy", "-i", inv, "--topology", str(topo) if topo.exists() else "a3-pd", "--yes",
                      "--output", "json")
        assert res.returncode == 0, res.stderr[-3000:]
        assert json.loads(res.stdout)["result"] == "no-changes"
        assert "installing the key" in res.stderr
        proxy = f"http://{sb.host('atlas-01')['ip']}:8000/v1/completions"
        body = {"model": "kimi-k2.5", "prompt": "x", "max_tokens": 1}
        assert _post(proxy, body, api_key="sk-rotated-9c0e")[0] == 200
        with pytest.raises(urllib.error.HTTPError) as old:
            _post(proxy, body, api_key=API_KEY)
        assert old.value.code == 401
        assert _admin_key(sb) == old_admin   # read back and kept as this control node's copy
        assert sb.ssh("atlas-01", f"cat {SD}/secrets/proxy-admin-key").stdout.strip() == old_admin
        _, st = _status(sb)
        assert [(m["router"], m["members"]) for m in st["proxy"]["membership"]] == [(0, 12), (1, 12)], st["proxy"]
        assert {k: v["child_pid"] for k, v in _supervised(sb).items()} == before
    finally:
        key_file.write_text(API_KEY + "\n")
