"""P/D router kinds (data/routers.yml): the facts plan, render, the proxy front, smoke and status read about the router
behind kimictl's front. Static facts only: the HTTP clients of each kind's membership API are kimictl.routers."""

from __future__ import annotations

import functools
from typing import Literal

from pydantic import Field

from kimictl.errors import InvalidInput
from kimictl.facts import DATA_DIR, Strict, _load

# A client path every kind's front checks the API key on; a router without a models list answers it 404.
CLIENT_PROBE_PATH = "/v1/models"

# vllm-router's answer when its static P/D mode is asked to add a worker at runtime.
STATIC_PD_ROUTER_MARK = "add_prefill_server or add_decode_server"


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
