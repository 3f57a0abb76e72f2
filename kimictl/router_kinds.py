"""P/D router kinds (data/routers.yml): the facts plan, render, the proxy front, smoke and status read about the router
behind kimictl's front, and the clients of each kind's runtime-membership API that rollout (and heal) drain and
re-add engines through."""

from __future__ import annotations

import functools
import json
from typing import Literal

from pydantic import Field

from kimictl.errors import InvalidInput
from kimictl.facts import DATA_DIR, Strict, _load
from kimictl.health import Ready, engine_ready, http_get

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
                api_key: str | None = None) -> Ready:
    """The proxy answers for its kind: /health (the front asks the router's own health path) and, for a router with a
    models list, the served name in it; for one without, both roles have engines in its health answer. A release
    recorded before router kinds ran vllm-router."""
    kind = router_kind(router or "vllm-router")
    if kind.models_path:
        return engine_ready(ip, port, served_name, timeout, api_key)
    code, text = http_get(f"http://{ip}:{port}/health", timeout, api_key)
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
        code, text = http_get(f"http://{ip}:{port}{CLIENT_PROBE_PATH}", timeout, api_key)
        if code in (0, 401, 403):
            return Ready(False, f"{CLIENT_PROBE_PATH} {code or 'unreachable'}: {text[:120]}")
    return Ready(True, "ready")
