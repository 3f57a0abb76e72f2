"""The keys of a cluster, each read from its file when needed (kimictl/secret_file.py): the clients' key the
inventory names (all.vars.kimi_api_key_file), and the keys kimictl makes for a cluster and keeps in its
control-node state (secrets/, 0600): the proxy admin key and, P/D, the engines' API key."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from kimictl.secret_file import check_env_key, read_secret_file
from kimictl.state import control_dir

if TYPE_CHECKING:
    from kimictl.inventory import Inventory


def proxy_api_key(inv: Inventory) -> str | None:
    """The key clients send to the proxy (all.vars.kimi_api_key_file), or None when the inventory sets none."""
    f = inv.cluster.kimi_api_key_file
    return read_secret_file(Path(f), "all.vars.kimi_api_key_file") if f else None


def cluster_secret_path(cluster: str, name: str) -> Path:
    """A key kimictl makes for a cluster, kept in its control-node state (0600)."""
    return control_dir(cluster) / "secrets" / name


def cluster_secret(cluster: str, name: str, what: str, create: bool = False) -> str | None:
    """The key, made on first use when `create` (deploy, rollout); None when there is none yet."""
    path = cluster_secret_path(cluster, name)
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        try:
            os.link(tmp, path)  # never replaces a key another kimictl made meanwhile
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    if not path.exists():
        return None
    return read_secret_file(path, what)


def proxy_admin_key_path(cluster: str) -> Path:
    """The admin key of the routers' own API behind kimictl's proxy front: made by kimictl, kept in the cluster's
    control-node state (0600) and installed next to the front like the client key."""
    return cluster_secret_path(cluster, "proxy-admin-key")


def proxy_admin_key(cluster: str, create: bool = False) -> str | None:
    """The admin key, made on first use when `create` (deploy, rollout); None when there is none yet."""
    return cluster_secret(cluster, "proxy-admin-key", "the proxy admin key", create)


def engine_key_file(inv: Inventory, pd: bool, create: bool = False) -> Path | None:
    """The file holding the API key every engine requires (vLLM's VLLM_API_KEY), or None: engines are keyed when
    the inventory sets kimi_api_key_file. Colocated, clients talk to the engines, so it is the clients' key. P/D,
    clients talk to the proxy and only the proxy (and kimictl) to the engines: a key kimictl makes for the cluster,
    so a client key can neither bypass the proxy nor, rotated, need the engines restarted."""
    if not inv.cluster.kimi_api_key_file:
        return None
    if not pd:
        path, what = Path(inv.cluster.kimi_api_key_file), "all.vars.kimi_api_key_file"
    else:
        cluster_secret(inv.cluster.name, "engine-api-key", "the engines' API key", create)
        path, what = cluster_secret_path(inv.cluster.name, "engine-api-key"), "the engines' API key"
        if not path.exists():
            return None
    check_env_key(path, what)  # it goes on the engines' env file line as it is (release.yml)
    return path


def engine_api_key(inv: Inventory, pd: bool) -> str | None:
    """The key kimictl sends engines directly (readiness, pair probes), per engine_key_file."""
    path = engine_key_file(inv, pd)
    return read_secret_file(path, "the engines' API key") if path else None
