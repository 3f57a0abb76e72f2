"""The keys of a cluster, each read from its file when needed (kimictl/secret_file.py): the clients' key the
inventory names (all.vars.kimi_api_key_file), and the cluster's own keys: the proxy admin key and, P/D, the
engines' API key.

A cluster has one of each, and it lives on the cluster. A command takes it from, in this order: the inventory's
file (all.vars.kimi_proxy_admin_key_file, kimi_engine_api_key_file), the environment (KIMICTL_PROXY_ADMIN_KEY,
KIMICTL_ENGINE_API_KEY: CI secrets), this control node's copy (secrets/ in its state, 0600: a cache that may be
deleted any time), the cluster's hosts (read back over SSH, kimictl/key_readback.py, then kept as the copy), and
only when every host that would hold it answered without one, a new key (the first deploy). A control node never
makes a second key for a cluster that has one; a host it cannot reach while it has no copy is an error (step keys).
A deploy keeps the key it installs as the copy, so a supplied key the cluster does not hold yet becomes the
cluster's with the next deploy."""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kimictl.errors import HostError, InvalidInput
from kimictl.secret_file import check_env_key, key_problem, read_secret_file
from kimictl.state import control_dir

if TYPE_CHECKING:
    from kimictl.inventory import Inventory


@dataclass(frozen=True)
class ClusterKey:
    """One of the cluster's own keys: its copy's name in secrets/, the inventory variable and the environment
    variable that may supply it, and its file on the hosts (under <kimi_state_dir>; `env_line`: VLLM_API_KEY=)."""

    name: str
    what: str
    inv_var: str
    env_var: str
    host_file: str
    env_line: bool
    hint: str


ADMIN_KEY = ClusterKey("proxy-admin-key", "the proxy admin key", "kimi_proxy_admin_key_file",
                       "KIMICTL_PROXY_ADMIN_KEY", "secrets/proxy-admin-key", False,
                       "a cluster has one admin key: `kimictl keys rotate -i INV` installs a new one")
ENGINE_KEY = ClusterKey("engine-api-key", "the engines' API key", "kimi_engine_api_key_file",
                        "KIMICTL_ENGINE_API_KEY", "secrets/engine-api-key.env", True,
                        "a cluster has one engine key: supply it (all.vars.kimi_engine_api_key_file or "
                        "KIMICTL_ENGINE_API_KEY) and deploy; engines read it when they start")


def proxy_api_key(inv: Inventory) -> str | None:
    """The key clients send to the proxy (all.vars.kimi_api_key_file), or None when the inventory sets none."""
    f = inv.cluster.kimi_api_key_file
    return read_secret_file(Path(f), "all.vars.kimi_api_key_file") if f else None


def cluster_secret_path(cluster: str, name: str) -> Path:
    """This control node's copy of one of the cluster's keys (0600)."""
    return control_dir(cluster) / "secrets" / name


def supplier(inv: Inventory, spec: ClusterKey) -> str | None:
    """Who supplies the key, if the operator does: `all.vars.<inv_var>` or the environment variable's name."""
    if getattr(inv.cluster, spec.inv_var):
        return f"all.vars.{spec.inv_var}"
    return spec.env_var if os.environ.get(spec.env_var) else None


def supplied_key(inv: Inventory, spec: ClusterKey) -> str | None:
    """The key the operator supplies: the inventory's file, else the environment variable (its value is never
    shown); None when neither does. Exit 2 when it is not one valid key."""
    f = getattr(inv.cluster, spec.inv_var)
    if f:
        return check_env_key(Path(f), f"all.vars.{spec.inv_var}")
    value = os.environ.get(spec.env_var, "")
    if not value:
        return None
    why = key_problem(value)
    if why:
        raise InvalidInput(f"{spec.env_var}: {why}", hint=f"it supplies {spec.what}; unset it to use the cluster's")
    return value


def check_supplied_keys(inv: Inventory) -> None:
    """Every key the operator supplies for the cluster (the inventory's files, else the environment variables)
    checked once, before a command that talks to the cluster contacts any host: exit 2 naming the file or the
    variable. Engines are keyed only where clients are (all.vars.kimi_api_key_file): an engine key supplied
    without it would be silently unused, so it is refused (as the inventory's kimi_engine_api_key_file is)."""
    if not inv.cluster.kimi_api_key_file:
        if os.environ.get(ENGINE_KEY.env_var):
            raise InvalidInput(f"{ENGINE_KEY.env_var} is set but {inv.path} has no all.vars.kimi_api_key_file: "
                               "engines are keyed only with kimi_api_key_file (clients' key), so this key would "
                               "be unused", hint=f"set kimi_api_key_file in all.vars, or unset {ENGINE_KEY.env_var}")
        supplied_key(inv, ADMIN_KEY)
        return
    for spec in (ADMIN_KEY, ENGINE_KEY):
        supplied_key(inv, spec)


def keep_copy(cluster: str, spec: ClusterKey, key: str, *, replace: bool) -> Path:
    """Write the control node's copy (0600, atomically); without `replace` a copy another kimictl wrote meanwhile
    stays."""
    return write_key(cluster_secret_path(cluster, spec.name), key, replace=replace)


def write_key(path: Path, key: str, *, replace: bool) -> Path:
    """Write a key file in secrets/ (0600, its directory 0700), atomically; without `replace` a file that exists
    stays as it is."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    try:
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # never replaces a key another kimictl kept meanwhile
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path


def forget_copy(cluster: str, spec: ClusterKey) -> bool:
    """Delete the control node's copy (the cluster's hosts are asked again next time); False when there was none."""
    try:
        cluster_secret_path(cluster, spec.name).unlink()
    except FileNotFoundError:
        return False
    return True


def cluster_key(inv: Inventory, spec: ClusterKey, hosts: list[str], *, create: bool = False,
                not_this: str | None = None) -> str | None:
    """The cluster's key per the module's order. `hosts`: the inventory hosts that hold it; `create` (deploy,
    rollout, rollback install it): make one when the cluster holds none, and keep a supplied key as the copy;
    `not_this`: a key the hosts may hold that is not this one (colocated engines hold the clients' key)."""
    cluster = inv.cluster.name
    key = supplied_key(inv, spec)
    if key is not None:
        if create:
            keep_copy(cluster, spec, key, replace=True)  # what this command installs is what the cluster will hold
        return key
    path = cluster_secret_path(cluster, spec.name)
    if os.path.lexists(path):
        return check_env_key(path, spec.what)
    from kimictl.key_readback import agreed, read_back

    held = read_back(inv, hosts, spec.host_file, spec.what, spec.env_line)
    held.keys = {h: k for h, k in held.keys.items() if k != not_this}
    key = agreed(held, spec.what, spec.hint)
    if key is None:
        if held.unreachable:
            host = next(iter(held.unreachable))
            raise HostError(f"cannot read {spec.what} back from {len(held.unreachable)} host(s), and this control "
                            f"node has no copy of it ({path})", host=host, step="keys",
                            details=list(held.unreachable.values()),
                            hint=f"reach the host(s) again, or supply the key (all.vars.{spec.inv_var} or "
                                 f"{spec.env_var}); kimictl makes a new one only when every host answered without one")
        if not create:
            return None
        key = secrets.token_urlsafe(32)
    return check_env_key(keep_copy(cluster, spec, key, replace=False), spec.what)


def proxy_admin_key_path(cluster: str) -> Path:
    """The control node's copy of the admin key of the routers' own API behind kimictl's proxy front (installed
    next to the front like the client key)."""
    return cluster_secret_path(cluster, ADMIN_KEY.name)


def proxy_admin_key(inv: Inventory, proxy_host: str, create: bool = False) -> str | None:
    """The cluster's admin key (held by `proxy_host`), made when the cluster has none and `create` (deploy,
    rollout); None when there is none yet."""
    return cluster_key(inv, ADMIN_KEY, [proxy_host], create=create)


def engine_key_file(inv: Inventory, pd: bool, create: bool = False) -> Path | None:
    """The file holding the API key every engine requires (vLLM's VLLM_API_KEY), or None: engines are keyed when
    the inventory sets kimi_api_key_file. Colocated, clients talk to the engines, so it is the clients' key. P/D,
    clients talk to the proxy and only the proxy (and kimictl) to the engines: the cluster's own key (every host
    holds it), so a client key can neither bypass the proxy nor, rotated, need the engines restarted."""
    if not inv.cluster.kimi_api_key_file:
        return None
    if not pd:
        path = Path(inv.cluster.kimi_api_key_file)
        check_env_key(path, "all.vars.kimi_api_key_file")  # it goes on the engines' env file line as it is
        return path
    key = cluster_key(inv, ENGINE_KEY, [h.name for h in inv.hosts], create=create, not_this=proxy_api_key(inv))
    if key is None:
        return None
    path = cluster_secret_path(inv.cluster.name, ENGINE_KEY.name)
    if create or (path.exists() and read_secret_file(path, ENGINE_KEY.what) == key):
        return path
    return None   # a supplied key a command only talks with: its copy is kept by the deploy that installs it


def engine_api_key(inv: Inventory, pd: bool) -> str | None:
    """The key kimictl sends engines directly (readiness, pair probes), per engine_key_file's order."""
    if not inv.cluster.kimi_api_key_file:
        return None
    if not pd:
        return check_env_key(Path(inv.cluster.kimi_api_key_file), "all.vars.kimi_api_key_file")
    return cluster_key(inv, ENGINE_KEY, [h.name for h in inv.hosts], not_this=proxy_api_key(inv))


def known_keys(inv: Inventory) -> list[str]:
    """Every key of the cluster a command can name, to redact it from logs and bundles; a key the hosts cannot
    give (unreachable, damaged) is left out rather than failing the command."""
    client = proxy_api_key(inv)
    hosts = [h.name for h in inv.hosts]
    out = [client]
    for spec in (ADMIN_KEY, ENGINE_KEY) if client else (ADMIN_KEY,):
        with contextlib.suppress(HostError):
            out.append(cluster_key(inv, spec, hosts, not_this=client))
    return [k for k in out if k]
