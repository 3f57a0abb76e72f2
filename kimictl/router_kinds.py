"""P/D router kinds (data/routers.yml): the facts plan, render, the proxy front, smoke and status read about the router
behind kimictl's front, and the clients of each kind's runtime-membership API that rollout (and heal) drain and
re-add engines through."""

from __future__ import annotations

import functools
import json
import time
from typing import Any, Literal

from pydantic import Field

from kimictl import health
from kimictl.errors import InvalidInput, KimictlError
from kimictl.facts import DATA_DIR, Strict, _load
from kimictl.health import Ready, http_request

# A client path every kind's front checks the API key on; a router without a models list answers it 404.
CLIENT_PROBE_PATH = "/v1/models"


class RouterKind(Strict):
    name: str
    description: str
    why: str
    script: str | None = None         # path of the upstream script inside a vllm-ascend source tree
    image_root: str | None = None     # where the image has that source tree
    python_modules: list[str] = Field(default_factory=list)
    health_path: str
    models_path: str | None
    metrics_flag: str | None
    membership: Literal["instances", "workers"]
    replays_recompute: bool
    engine_key: Literal["env", "argv"]
    args: list[str] = Field(default_factory=list)

    @property
    def check_interval(self) -> float:
        """Seconds between the router's own membership checks (vllm-ascend-proxy: --waiting-retry-interval)."""
        flag = "--waiting-retry-interval"
        return float(self.args[self.args.index(flag) + 1]) if flag in self.args else 10.0

    @property
    def image_script(self) -> str:
        assert self.script and self.image_root
        return f"{self.image_root}/{self.script}"


@functools.cache
def router_kinds() -> dict[str, RouterKind]:
    return {k: RouterKind(name=k, **v) for k, v in _load(DATA_DIR / "routers.yml").items()}


def router_kind(name: str) -> RouterKind:
    kinds = router_kinds()
    if name not in kinds:
        raise InvalidInput(f"unknown P/D router kind '{name}'; known: {', '.join(kinds)}")
    return kinds[name]


# --- readiness through the proxy port ----------------------------------------------------------------------------


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


# --- runtime membership ------------------------------------------------------------------------------------------


class RouterError(KimictlError):
    """A router refused or failed an admin call."""


def _hostport(url: str) -> str:
    return url.removeprefix("http://").rstrip("/")


class AscendProxyAdmin:
    """Runtime membership of one vllm-ascend proxy (reached directly, or as one copy behind kimictl's front):
    `GET /healthcheck`, `POST /instances/add|remove {"type", "instances": ["IP:PORT"]}`.

    Its rules (load_balance_proxy_server_example.py, 0.23.0.post1): a removal while the proxy has requests in
    flight only *taints* the instance (no new request picks it; it stays listed) until a check of its NodeListener
    thread (every --waiting-retry-interval) finds it idle; an add of a listed instance is a no-op, any other add
    waits until a check finds the instance answering `GET /v1/models`. So re-adding an instance that is still
    tainted needs the proxy idle first: `readd` waits for that (kimictl's front holds the copy, see FrontCopy)."""

    membership = "instances"

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 10.0):
        self.url = url.rstrip("/")
        self.api_key, self.timeout = api_key, timeout

    def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        code, text = http_request(method, f"{self.url}{path}", body, timeout=self.timeout, api_key=self.api_key)
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

    def members(self) -> dict[str, str]:
        """Endpoint URL -> role of every listed instance (tainted ones too). The proxy has no listing endpoint; its
        add answer lists the current instances, and an add of nothing changes nothing."""
        doc = self._adjust("add", "prefill", [])
        return {**{f"http://{x}": "prefill" for x in doc.get("current_prefill_instances", [])},
                **{f"http://{x}": "decode" for x in doc.get("current_decode_instances", [])}}

    def remove(self, url: str, role: str) -> None:
        """No new request goes to `url` from now on (removed, or tainted until the proxy is idle)."""
        self._adjust("remove", role, [url])

    def add(self, url: str, role: str) -> None:
        """Ask for `url` back; the proxy activates it at a later check (see wait)."""
        self._adjust("add", role, [url])

    def wait(self, what: str, done, timeout: float, sleep=time.sleep, clock=time.monotonic) -> None:
        deadline = clock() + timeout
        while not done():
            if clock() > deadline:
                raise RouterError(f"router {self.url}: {what} did not happen within {timeout:.0f}s")
            sleep(0.2)

    def readd(self, eps: list[tuple[str, str]], timeout: float, check_interval: float, sleep=time.sleep,
              clock=time.monotonic) -> None:
        """Put (url, role) endpoints back. The caller keeps new requests away from this proxy meanwhile: an instance
        still tainted from its drain leaves only at a check (every `check_interval` s) that finds the proxy idle, and
        only then can it be added again; one still listed after two idle checks was never removed here."""
        want = {u for u, _ in eps}
        self.wait("going idle (request_num 0)", lambda: int(self.health().get("request_num", 1)) == 0, timeout,
                  sleep, clock)
        settle = clock() + 2 * check_interval + 1
        while want & set(self.members()) and clock() < settle:
            sleep(0.2)
        listed = set(self.members())
        for url, role in eps:
            if url not in listed:
                self.add(url, role)
        self.wait(f"activating {', '.join(sorted(want))}", lambda: want <= set(self.members()), timeout, sleep, clock)


class VllmRouterMembership:
    """vllm-router's worker list (`GET /workers`), read-only; rollout drives its admin API (kimictl.rollout)."""

    membership = "workers"

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 10.0):
        self.url, self.api_key, self.timeout = url.rstrip("/"), api_key, timeout

    def members(self) -> dict[str, str]:
        code, text = http_request("GET", f"{self.url}/workers", timeout=self.timeout, api_key=self.api_key)
        if code != 200:
            raise RouterError(f"router {self.url}: GET /workers -> {code or 'unreachable'}: {text[:200]}")
        try:
            workers = json.loads(text)["workers"]
            return {str(w["url"]).rstrip("/"): str(w.get("worker_type") or "regular") for w in workers}
        except (ValueError, KeyError, TypeError):
            raise RouterError(f"router {self.url}: GET /workers is not a worker list: {text[:200]}") from None


def membership_client(router: str | None, url: str, api_key: str | None = None, timeout: float = 10.0):
    """The membership client of a router kind (a release recorded before router kinds ran vllm-router)."""
    kind = router_kind(router or "vllm-router")
    cls = AscendProxyAdmin if kind.membership == "instances" else VllmRouterMembership
    return cls(url, api_key=api_key, timeout=timeout)
