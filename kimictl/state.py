"""Control-node state per cluster: releases, the checkpoint manifest cache, run directories."""

from __future__ import annotations

import json
import os
from pathlib import Path


def control_dir(cluster: str) -> Path:
    """$KIMICTL_STATE_DIR/<cluster> (default ~/.local/state/kimictl/<cluster>)."""
    base = os.environ.get("KIMICTL_STATE_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "kimictl")
    return Path(base) / cluster


def manifest_path(cluster: str) -> Path:
    return control_dir(cluster) / "manifest.json"


def cached_manifest_bytes(cluster: str) -> tuple[int | None, bool]:
    """Total checkpoint bytes from the cached manifest (exact), or (None, False) when none is cached."""
    path = manifest_path(cluster)
    try:
        files = json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, False
    return sum(int(f["size"]) for f in files), True


def write_manifest(cluster: str, files: list[dict], source: dict) -> Path:
    path = manifest_path(cluster)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"source": source, "files": files}, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def save_preflight(cluster: str, report: dict) -> None:
    """The last preflight report (for `logs --bundle`)."""
    path = control_dir(cluster) / "preflight.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(path)


def deployed_diff(cluster: str, releases: dict[str, str]) -> dict:
    """Compare a render's per-host release ids with the last successful deploy (control-node record only)."""
    path = control_dir(cluster) / "current.json"
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"release": None, "changed_hosts": sorted(releases), "removed_hosts": []}
    old = rec.get("hosts", {})
    return {"release": rec.get("release"), "deployed_at": rec.get("at"),
            "changed_hosts": sorted(h for h, r in releases.items() if old.get(h) != r),
            "removed_hosts": sorted(h for h in old if h not in releases)}
