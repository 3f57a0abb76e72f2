"""`kimictl keys rotate`: a new admin key for the routers' own API behind kimictl's proxy front.

The key is made on the control node (0600, next to its copy), installed on the proxy host by release.yml (the
current release again, so nothing restarts; the front re-reads its key files), and then checked: the front must
answer GET /kimictl/router/0/health with the new key with 200, not 403. Only then does it become this control
node's copy. When the install or the check fails the copy is dropped: the cluster may hold either key, and the
next command reads back the one it holds (kimictl/cluster_secrets.py). The key never reaches argv, logs or the
run directory: release.yml copies the file (no_log) whose path is all its extravars carry.

The engines' key is not rotated here: engines read it when they start, so a new one needs every engine restarted
(supply it with all.vars.kimi_engine_api_key_file or KIMICTL_ENGINE_API_KEY, then restart the engines)."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kimictl import health, state
from kimictl.cluster_secrets import ADMIN_KEY, cluster_secret_path, forget_copy, supplier, write_key
from kimictl.errors import HostError, InvalidInput
from kimictl.hostops import HostOps
from kimictl.inventory import Inventory
from kimictl.render import Rendered
from kimictl.router_kinds import router_kind
from kimictl.routers import front_admin_code
from kimictl.rundir import save_run

CHECK_TIMEOUT_S = 10.0   # the front re-reads its key files when they change; a few seconds cover a slow disk


@dataclass
class RotateResult:
    cluster: str
    proxy_host: str
    run_dir: str
    check: int   # the front's answer to the new key
    path: str = "/kimictl/router/0/health"   # what it was asked: router copy 0's health path behind the front

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": 1, "cluster": self.cluster, "rotated": ["admin"], "proxy_host": self.proxy_host,
                "check": {"path": self.path, "code": self.check}, "run_dir": self.run_dir}


def check_rotatable(inv: Inventory, rendered: Rendered) -> None:
    """Exit 2 before the lease and the hosts when there is nothing kimictl may rotate."""
    p = rendered.plan.proxy
    if p is None or not p.admin_key:
        raise InvalidInput(f"cluster {rendered.plan.cluster} runs no proxy front with an admin key (topology "
                           f"{rendered.plan.topology}): there is no admin key to rotate",
                           hint="deploy a P/D topology; its front takes kimictl's admin key")
    check_not_supplied(inv)


def check_not_supplied(inv: Inventory) -> None:
    """Exit 2 (before the record is read from the hosts) when the operator supplies the admin key: kimictl does
    not keep it, so it cannot rotate it."""
    src = supplier(inv, ADMIN_KEY)
    if src:
        where = f"{inv.path}: " if src.startswith("all.vars.") else ""
        raise InvalidInput(f"{where}the admin key is supplied by {src}: kimictl cannot rotate a key it does not "
                           "keep", hint=f"put a new key in {src}, then `kimictl deploy` installs it (the front "
                                        "re-reads it)")


def rotate_admin_key(inv: Inventory, rendered: Rendered, say: Callable[[str], None], *, ops: HostOps | None = None,
                     on_event: Callable[[str, str, str], None] | None = None, http: Any = health,
                     accept_new_host_keys: bool = False, check_timeout: float = CHECK_TIMEOUT_S) -> RotateResult:
    """Install a new admin key on the proxy host and check the front takes it; the copy follows only then."""
    check_rotatable(inv, rendered)
    p = rendered.plan.proxy
    assert p is not None
    cluster = rendered.plan.cluster
    ops = ops or HostOps(inv, rendered.plan.served_model_name, state.new_run_dir(cluster, "keys"), say=say,
                         on_event=on_event, accept_new_host_keys=accept_new_host_keys, http=http)
    pending = cluster_secret_path(cluster, f"{ADMIN_KEY.name}.new")
    write_key(pending, secrets.token_urlsafe(32), replace=True)
    try:
        save_run(ops.run_dir, rendered, rendered)   # the release is installed again from its own files
        ops.observe([p.host])   # kimictl's SSH first: host keys checked, an unreachable host named
        say(f"installing a new admin key on {p.host}")
        ops.install_release(rendered, [p.host], admin_key_file=pending)
        new = pending.read_text().strip()
        path = router_kind(p.router).health_path
        code = _front_answer(p.ip, p.port, new, http, check_timeout, path)
        if code != 200:
            raise HostError(f"the proxy front answers GET /kimictl/router/0{path} with the new admin key with "
                            f"{f'HTTP {code}' if code else 'no answer'}, not 200", host=p.host, step="keys check",
                            hint="see `kimictl status` and the proxy's log; run `kimictl keys rotate` again once "
                                 "the front answers")
    except BaseException:
        pending.unlink(missing_ok=True)
        forget_copy(cluster, ADMIN_KEY)   # the cluster holds the old key or the new: the next command reads it back
        raise
    finally:
        ops.close()
    os.replace(pending, cluster_secret_path(cluster, ADMIN_KEY.name))   # the cluster's key: this node's copy now
    say(f"the front on {p.host} takes the new admin key")
    return RotateResult(cluster, p.host, str(ops.run_dir), code, f"/kimictl/router/0{path}")


def _front_answer(ip: str, port: int, key: str, http: Any, timeout: float, path: str) -> int:
    """The front's answer to the new key, asked again while it refuses it (403) or does not answer, up to
    `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        code = front_admin_code(ip, port, key, http=http, path=path)
        if code == 200 or time.monotonic() >= deadline:
            return code
        time.sleep(0.5)
