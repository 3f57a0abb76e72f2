"""The routers over HTTP, the one place their clients live: readiness through the proxy port (deploy, start and
status wait for it), and per router kind (kimictl.router_kinds) the client of its runtime-membership API that status
reads and rollout and heal drain and re-add engines through, and kimictl's proxy front's hold and release.

HTTP goes through `http` (default `kimictl.health`); tests pass fakes."""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from kimictl import health
from kimictl.errors import InvalidInput, KimictlError
from kimictl.health import Ready
from kimictl.router_kinds import CLIENT_PROBE_PATH, STATIC_PD_ROUTER_MARK, router_kind

# --- readiness through the proxy port ----------------------------------------------------------------------------


def check_router_url(url: str) -> str:
    """`--router URL`: an http(s) URL of a host (and port), before any host is contacted (exit 2 naming it)."""
    if any(c.isspace() or not c.isprintable() for c in url):   # urlsplit drops them around the URL
        raise InvalidInput(f"--router {url!r}: a URL has no blanks or control characters; give the URL alone")
    try:
        u = urllib.parse.urlsplit(url)
        port = u.port
    except ValueError as exc:
        raise InvalidInput(f"--router {url!r}: {exc}") from None
    if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment or u.username or u.password:
        raise InvalidInput(f"--router {url!r}: give the router's base URL, http(s)://HOST[:PORT] (no credentials, "
                           "query or fragment)")
    if port == 0:
        raise InvalidInput(f"--router {url!r}: port 0 is not a TCP port")
    return url


def proxy_ready(router: str | None, ip: str, port: int, served_name: str, timeout: float = 3.0,
                api_key: str | None = None, http: Any = None) -> Ready:
    """The proxy answers for its kind: /health (the front asks the router's own health path) and, for a router with a
    models list, the served name in it; for one without, both roles have engines in its health answer. A release
    recorded before router kinds ran vllm-router."""
    kind = router_kind(router or "vllm-router")
    http = http or health
    if kind.models_path:
        return http.engine_ready(ip, port, served_name, timeout, api_key)
    code, text = http.http_get(f"http://{ip}:{port}/health", timeout, api_key)
    if code != 200:
        return Ready(False, f"/health {code or 'unreachable'}: {text[:120]}")
    try:
        doc = json.loads(text)
        counts = {role: int(doc[f"{role}_instances"]) for role in ("prefill", "decode")}
    except (ValueError, KeyError, TypeError):
        return Ready(False, f"/health ({kind.health_path} of {kind.name}) is not its health answer: {text[:120]}")
    empty = [role for role, n in counts.items() if n < 1]
    if empty:
        return Ready(False, f"{kind.name} lists no {' and no '.join(empty)} engine")
    if api_key:  # /health is open; a client path tells whether the front takes this key (the router answers 404)
        code, text = http.http_get(f"http://{ip}:{port}{CLIENT_PROBE_PATH}", timeout, api_key)
        if code in (0, 401, 403):
            return Ready(False, f"{CLIENT_PROBE_PATH} {code or 'unreachable'}: {text[:120]}")
    return Ready(True, "ready")


# --- runtime membership: one client per router kind (rollout drains and re-adds through them; status reads them) ---


def front_admin_code(ip: str, port: int, key: str | None, timeout: float = 5.0, http: Any = None,
                     path: str = "/health") -> int:
    """What kimictl's proxy front answers GET /kimictl/router/0<path> with `key` as the admin key (403: it refuses
    the key; 0: no answer; else router copy 0's own answer to `path`, its router kind's health path for a 200):
    deploy asks whether the front holds the cluster's key, `keys rotate` whether it took the new one."""
    return (http or health).http_get(f"http://{ip}:{port}/kimictl/router/0{path}", timeout, key)[0]


def front_admin_key(inv: Any, proxy_host: str, ip: str, port: int, http: Any = None,
                    create: bool = False) -> str | None:
    """The cluster's admin key as the front at ip:port takes it: this control node's copy, or - when the front
    refuses the copy because the key was rotated from another control node - the cluster's own, read back after
    the stale copy is dropped. A key the operator supplies is used as it is. `create`: as proxy_admin_key's
    (deploy makes one for a cluster that holds none)."""
    from kimictl.cluster_secrets import ADMIN_KEY, forget_copy, proxy_admin_key, supplied_key

    key = proxy_admin_key(inv, proxy_host, create=create)
    if key is None or supplied_key(inv, ADMIN_KEY) is not None:
        return key
    if front_admin_code(ip, port, key, http=http) != 403 or not forget_copy(inv.cluster.name, ADMIN_KEY):
        return key
    return proxy_admin_key(inv, proxy_host, create=create)


class RouterError(KimictlError):
    """A router refused or failed an admin call."""


class RouterAdmin:
    """Runtime membership of one vllm-router: `GET /workers`, `POST /remove_worker?url=` (static P/D mode and
    IGW mode), `POST /workers {"url", "worker_type"}` (IGW mode only; static P/D mode answers 400)."""

    membership = "workers"

    def __init__(self, url: str, timeout: float = 10.0, api_key: str | None = None, http: Any = health):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.api_key = api_key
        self.http = http
        self._runtime_add: bool | None = None

    def _call(self, method: str, path: str, body: Any = None) -> tuple[int, str]:
        return self.http.http_request(method, f"{self.url}{path}", body, timeout=self.timeout, api_key=self.api_key)

    def members(self) -> dict[str, str]:
        code, text = self._call("GET", "/workers")
        if code != 200:
            raise RouterError(f"router {self.url}: GET /workers -> {code or 'unreachable'}: {text[:200]}")
        try:
            doc = json.loads(text)
            return {str(w["url"]).rstrip("/"): str(w.get("worker_type") or "regular") for w in doc["workers"]}
        except (ValueError, KeyError, TypeError):
            raise RouterError(f"router {self.url}: GET /workers is not a worker list: {text[:200]}") from None

    def supports_runtime_add(self) -> bool:
        """Probe with a member it already has: IGW mode re-adds it (idempotent, 200), static P/D mode refuses."""
        if self._runtime_add is None:
            members = self.members()
            if not members:
                raise RouterError(f"router {self.url} has no workers; nothing to probe its admin API with")
            url, role = next(iter(members.items()))
            code, text = self._call("POST", "/workers", {"url": url, "worker_type": role})
            self._runtime_add = code == 200 and STATIC_PD_ROUTER_MARK not in text
        return self._runtime_add

    def remove(self, url: str, role: str | None = None) -> None:
        quoted = urllib.parse.quote(url, safe=":/")
        code, text = self._call("POST", f"/remove_worker?url={quoted}")
        if code != 200:
            raise RouterError(f"router {self.url}: cannot remove {url}: HTTP {code or 'unreachable'}: {text[:200]}")
        if url in self.members():
            raise RouterError(f"router {self.url} still lists {url} after removing it")

    def add(self, url: str, role: str) -> None:
        code, text = self._call("POST", "/workers", {"url": url, "worker_type": role})
        if code != 200 or STATIC_PD_ROUTER_MARK in text:
            raise RouterError(f"router {self.url}: cannot add {role} {url}: HTTP {code or 'unreachable'}: "
                              f"{text[:200]}")
        if url not in self.members():
            raise RouterError(f"router {self.url} does not list {url} after adding it")


def _hostport(url: str) -> str:
    return url.removeprefix("http://").rstrip("/")


class AscendProxyAdmin:
    """Runtime membership of one vllm-ascend proxy (reached directly, or as one copy behind kimictl's front):
    `GET /healthcheck`, `POST /instances/add|remove {"type", "instances": ["IP:PORT"]}`.

    Its rules (load_balance_proxy_server_example.py, 0.23.0.post1): a removal while the proxy has requests in
    flight only *taints* the instance (no new request picks it; it stays listed) until a check of its NodeListener
    thread (every --waiting-retry-interval) finds the proxy idle; an add of a listed instance is a no-op, any other
    add waits until a check finds the instance answering `GET /v1/models`. So `members` leaves out what this client
    removed (listed or not), and `readd` needs the proxy idle first: the caller keeps new requests away from it
    meanwhile (kimictl's front holds the copy: FrontControl)."""

    membership = "instances"

    def __init__(self, url: str, timeout: float = 10.0, api_key: str | None = None, http: Any = health):
        self.url = url.rstrip("/")
        self.api_key, self.timeout, self.http = api_key, timeout, http
        self.removed: set[str] = set()

    def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        code, text = self.http.http_request(method, f"{self.url}{path}", body, timeout=self.timeout,
                                            api_key=self.api_key)
        try:
            doc = json.loads(text) if code == 200 else None
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or "error" in doc:
            raise RouterError(f"router {self.url}: {method} {path} -> {code or 'unreachable'}: {text[:200]}")
        return doc

    def health(self) -> dict[str, Any]:
        """{"status", "prefill_instances", "decode_instances", "request_num"}."""
        return self._call("GET", "/healthcheck")

    def _adjust(self, mode: str, role: str, urls: list[str]) -> dict[str, Any]:
        return self._call("POST", f"/instances/{mode}", {"type": role, "instances": [_hostport(u) for u in urls]})

    def listed(self) -> dict[str, str]:
        """Endpoint URL -> role of every instance the proxy lists (tainted ones too). It has no listing endpoint;
        its add answer lists the current instances, and an add of nothing changes nothing."""
        doc = self._adjust("add", "prefill", [])
        return {**{f"http://{x}": "prefill" for x in doc.get("current_prefill_instances", [])},
                **{f"http://{x}": "decode" for x in doc.get("current_decode_instances", [])}}

    def members(self) -> dict[str, str]:
        """The instances new requests may go to, as far as this client knows (not the ones it removed)."""
        return {u: r for u, r in self.listed().items() if u not in self.removed}

    def supports_runtime_add(self) -> bool:
        return True

    def remove(self, url: str, role: str | None = None) -> None:
        """No new request goes to `url` from now on (removed at once, or tainted until the proxy is idle)."""
        if role not in ("prefill", "decode"):
            raise RouterError(f"router {self.url}: removing {url} needs its role (prefill or decode)")
        self._adjust("remove", role, [url])
        self.removed.add(url)

    def add(self, url: str, role: str) -> None:
        """Ask for `url` back; the proxy activates it at a later check (see readd)."""
        self._adjust("add", role, [url])
        self.removed.discard(url)

    def wait(self, what: str, done: Callable[[], bool], timeout: float, sleep: Callable[[float], None] = time.sleep,
             clock: Callable[[], float] = time.monotonic) -> None:
        deadline = clock() + timeout
        while not done():
            if clock() > deadline:
                raise RouterError(f"router {self.url}: {what} did not happen within {timeout:.0f}s")
            sleep(0.2)

    def readd(self, eps: list[tuple[str, str]], timeout: float, check_interval: float,
              sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> None:
        """Put (url, role) endpoints back while the caller keeps new requests away: wait until the proxy is idle,
        let a check finish the removal of drained (tainted) instances (one still listed after two idle checks was
        never removed here, or its removal finished), add the missing ones and wait until they are active."""
        want = {u for u, _ in eps}
        self.wait("going idle (request_num 0)", lambda: int(self.health().get("request_num", 1)) == 0, timeout,
                  sleep, clock)
        settle = clock() + 2 * check_interval + 1
        while want & set(self.listed()) and clock() < settle:
            sleep(0.2)
        listed = self.listed()
        for url, role in eps:
            if url not in listed:
                self.add(url, role)
        self.removed -= want
        self.wait(f"activating {', '.join(sorted(want))}", lambda: want <= set(self.listed()), timeout, sleep, clock)


class FrontControl:
    """kimictl's proxy front's own admin commands (admin key): hold router copy i (no new client request goes to
    it; leased) and release it. A hold carries its owner (e.g. "heal:<pid>", "rollout:<pid>"): a release with an
    owner frees only that owner's hold, so one command never lets another's held copy take clients. (A front older
    than owners ignores them: its release frees the copy.)"""

    def __init__(self, base_url: str, api_key: str | None = None, http: Any = health, timeout: float = 10.0):
        self.url, self.api_key, self.http, self.timeout = base_url.rstrip("/"), api_key, http, timeout

    def _post(self, index: int, verb: str, query: dict[str, str]) -> None:
        path = f"/kimictl/front/router/{index}/{verb}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        code, text = self.http.http_request("POST", f"{self.url}{path}", timeout=self.timeout, api_key=self.api_key)
        if code != 200:
            raise RouterError(f"proxy front {self.url}: POST {path} -> {code or 'unreachable'}: {text[:200]}")

    def hold(self, index: int, seconds: float, owner: str | None = None) -> None:
        self._post(index, "hold", {"seconds": f"{seconds:g}", **({"owner": owner} if owner else {})})

    def release(self, index: int, owner: str | None = None) -> None:
        """Free `owner`'s hold of copy `index` (without an owner: every hold of it)."""
        self._post(index, "release", {"owner": owner} if owner else {})


def membership_client(router: str | None, url: str, api_key: str | None = None, timeout: float = 10.0,
                      http: Any = health) -> RouterAdmin | AscendProxyAdmin:
    """The membership client of a router kind (a release recorded before router kinds ran vllm-router)."""
    kind = router_kind(router or "vllm-router")
    cls = AscendProxyAdmin if kind.membership == "instances" else RouterAdmin
    return cls(url, timeout=timeout, api_key=api_key, http=http)
