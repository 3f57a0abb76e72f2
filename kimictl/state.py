"""Control-node state per cluster: where it lives, and the reader and writer of its records.

Everything kimictl remembers about a cluster lives under $KIMICTL_STATE_DIR/<cluster>/ (default
~/.local/state/kimictl/<cluster>/):

  releases.jsonl         the release history: one ReleaseRecord per deploy, rollback and rollout attempt
  current.json           the last `deployed` record (what the cluster runs, per the control node)
  weights-manifest.json  the checkpoint's file list (the hub's listing, cached for offline verify and sizing)
  preflight.json         the last preflight report (for `logs --bundle`)
  heal-events.jsonl      what `kimictl heal` found and did: one JSON event per line (its flap damping counts them)
  runs/<stamp>-<name>/   one directory per run: rendered files, plan.json, rendered.json (a release can be
                         deployed again from it), the rollout's effective topology.yml (written and read back by
                         kimictl/rundir.py), Ansible artifacts
  secrets/               the keys kimictl makes for the cluster (kimictl/cluster_secrets.py)
  record/snapshots/<release>/   render snapshots read back from the cluster's record (kimictl/cluster_record.py)

The cluster keeps the release record too (<kimi_state_dir>/record/ on its record hosts): releases.jsonl and
current.json here are a cache of it that kimictl/cluster_record.py brings up to date and that can be deleted.
  weights.lock, weights-small/   the weights stage's lock and small-file cache

Error policy, the same for every file: a missing record is "nothing recorded" (None, or an empty history); a
damaged one (not JSON, a truncated line, a record without its release id) raises StateError naming the file and
line, with how to repair it - never a guess and never a traceback. A damaged cache (the weights manifest) is
reported the same way by `read_manifest_cache`; `cached_manifest_bytes` treats it as absent because the caller
can read the hub's listing again.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from kimictl.errors import StateError

RELEASES = "releases.jsonl"
CURRENT = "current.json"
MANIFEST_CACHE = "weights-manifest.json"
PREFLIGHT = "preflight.json"
HEAL_EVENTS = "heal-events.jsonl"


def control_dir(cluster: str) -> Path:
    """$KIMICTL_STATE_DIR/<cluster> (default ~/.local/state/kimictl/<cluster>)."""
    base = os.environ.get("KIMICTL_STATE_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "kimictl")
    return Path(base) / cluster


def new_run_dir(cluster: str, name: str) -> Path:
    """runs/<UTC stamp>-<name>: where one run keeps its files (created by whoever writes first)."""
    return control_dir(cluster) / "runs" / f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}-{name}"


def release_id(host_releases: dict[str, str]) -> str:
    """The cluster release id: a hash of every host's release id (each a hash of that host's files)."""
    h = hashlib.sha256()
    for host, rel in sorted(host_releases.items()):
        h.update(f"{host}:{rel}".encode() + b"\0")
    return h.hexdigest()[:16]


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def read_text(path: Path) -> str | None:
    """The file's text; None when it does not exist; StateError when it exists but cannot be read."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise StateError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None


# --- release records -----------------------------------------------------------------------------------------


class ReleaseRecord(BaseModel):
    """One line of releases.jsonl (and current.json): what was deployed where, when, by whom, with what result.
    Rollout records carry the rollout fields too (kind "rollout")."""

    model_config = ConfigDict(extra="allow")

    release: str
    at: str = ""
    by: str = ""
    cluster: str = ""
    topology: str = ""
    hosts: dict[str, str] = {}
    result: str = ""  # deployed | no-changes | failed | rolled-back
    run_dir: str | None = None
    kind: str | None = None  # None: a deploy (or rollback); "rollout"; "adopted": the hosts already ran it
    attempted_release: str | None = None
    previous_release: str | None = None
    rollout_run_dir: str | None = None
    sets: list[str] | None = None
    changes: list[dict[str, Any]] = []
    error: str | None = None

    @classmethod
    def now(cls, **fields: Any) -> ReleaseRecord:
        import getpass

        return cls(at=datetime.now(UTC).isoformat(timespec="seconds"), by=getpass.getuser(), **fields)

    def to_line(self) -> str:
        return json.dumps(self.model_dump(mode="json", exclude_unset=True))


def _parse_record(text: str, where: str, repair: str) -> ReleaseRecord:
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise StateError(f"{where} is damaged: not JSON ({exc.msg} at column {exc.colno})", hint=repair) from None
    try:
        return ReleaseRecord.model_validate(doc)
    except ValidationError as exc:
        bad = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'record'}: {e['msg']}" for e in exc.errors()[:3])
        raise StateError(f"{where} is damaged: {bad}", hint=repair) from None


def history(cluster: str) -> list[ReleaseRecord]:
    """Every recorded release attempt, oldest first (empty when nothing was ever deployed)."""
    path = control_dir(cluster) / RELEASES
    text = read_text(path)
    out: list[ReleaseRecord] = []
    for n, line in enumerate((text or "").splitlines(), 1):
        if line.strip():
            out.append(_parse_record(line, f"the release history {path} (line {n})",
                                     "each line is one JSON record; a cut-off last line is an interrupted write: "
                                     "delete that line (the lines before it are intact)"))
    return out


def current(cluster: str) -> ReleaseRecord | None:
    """The last deployed release (current.json), or None when none is recorded."""
    path = control_dir(cluster) / CURRENT
    text = read_text(path)
    if text is None:
        return None
    return _parse_record(text, f"the current-release record {path}",
                         f"it is a copy of the last `deployed` line of {RELEASES} next to it: copy that line back "
                         "into it, or delete it (then `kimictl deploy` converges from scratch)")


def _append_line(path: Path, line: str) -> None:
    """Append one line to a JSONL file; an interrupted earlier write left a partial line: keep it apart, so only
    that line is damaged."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+b") as f:
        cut = False
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
        f.write((b"\n" if cut else b"") + line.encode() + b"\n")


def current_json(rec: ReleaseRecord) -> str:
    """current.json's text for this record."""
    return json.dumps(json.loads(rec.to_line()), indent=1)


def record_release(cluster: str, rec: ReleaseRecord) -> None:
    """Append to the history; a deployed release also becomes `current`."""
    _append_line(control_dir(cluster) / RELEASES, rec.to_line())
    if rec.result == "deployed":
        _write_atomic(control_dir(cluster) / CURRENT, current_json(rec))


def cache_records(cluster: str, records: list[ReleaseRecord], cur: ReleaseRecord | None) -> None:
    """Replace the history and the current record with the cluster's record as read back from its hosts
    (kimictl/cluster_record.py): this control node's copy is a cache of it."""
    _write_atomic(control_dir(cluster) / RELEASES, "".join(r.to_line() + "\n" for r in records))
    if cur is not None:
        _write_atomic(control_dir(cluster) / CURRENT, current_json(cur))


def deployed_diff(cluster: str, releases: dict[str, str]) -> dict:
    """Compare a render's per-host release ids with the last successful deploy (control-node record only)."""
    rec = current(cluster)
    if rec is None:
        return {"release": None, "changed_hosts": sorted(releases), "removed_hosts": []}
    old = rec.hosts
    return {"release": rec.release, "deployed_at": rec.at or None,
            "changed_hosts": sorted(h for h, r in releases.items() if old.get(h) != r),
            "removed_hosts": sorted(h for h in old if h not in releases)}


# --- the heal event log ------------------------------------------------------------------------------------


def heal_events_path(cluster: str) -> Path:
    return control_dir(cluster) / HEAL_EVENTS


def append_heal_event(cluster: str, event: dict[str, Any]) -> dict[str, Any]:
    """Append one event (stamped with `at`, ISO UTC, and `ts`, epoch seconds, unless it has them). A cut-off last
    line (a writer killed mid-line: the reader ignores it) is cut away first, under a lock every heal writer takes,
    so that it never ends up in the middle of the log; an intact event without its newline keeps its place."""
    import fcntl

    now = datetime.now(UTC)
    doc = {"at": now.isoformat(timespec="seconds"), "ts": round(now.timestamp(), 3), **event}
    path = heal_events_path(cluster)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # released when the file closes
        f.seek(0)
        text = f.read()
        cut = text.rfind(b"\n") + 1
        if text[cut:] and _heal_event(text[cut:].decode(errors="replace")) is None:
            f.truncate(cut)
        f.seek(0, os.SEEK_END)
        lead = b"\n" if text[cut:] and f.tell() > cut else b""
        f.write(lead + json.dumps(doc, separators=(",", ":")).encode() + b"\n")
    return doc


def _heal_event(line: str) -> dict[str, Any] | None:
    """One line of the log as an event, or None when it is not a JSON event with `ts`."""
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("ts"), (int, float)) else None


def heal_events(cluster: str) -> list[dict[str, Any]]:
    """Every recorded heal event, oldest first (empty when heal never ran). A cut-off last line (no newline, not an
    event: its writer was killed mid-line) is ignored; a damaged line before it is a StateError naming the line."""
    path = heal_events_path(cluster)
    text = read_text(path) or ""
    lines = text.splitlines()
    out: list[dict[str, Any]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        doc = _heal_event(line)
        if doc is None and n == len(lines) and not text.endswith("\n"):
            break  # torn: its writer died before the action it announced, or after the one it closed
        if doc is None:
            raise StateError(f"the heal event log {path} (line {n}) is damaged: not a JSON event with `ts`",
                             hint="each line is one JSON event: delete or repair that line (the others are intact)")
        out.append(doc)
    return out


# --- caches and reports ------------------------------------------------------------------------------------


def read_manifest_cache(cluster: str) -> str | None:
    """The cached weights manifest (JSON text), or None when none is cached."""
    return read_text(control_dir(cluster) / MANIFEST_CACHE)


def write_manifest_cache(cluster: str, manifest_json: str) -> None:
    _write_atomic(control_dir(cluster) / MANIFEST_CACHE, manifest_json)


def cached_manifest_bytes(cluster: str) -> tuple[int | None, bool]:
    """Total checkpoint bytes from the cached manifest (exact), or (None, False) when none is cached or the
    cache is damaged (the caller falls back to the hub's listing or the model facts)."""
    try:
        files = json.loads(read_manifest_cache(cluster) or "null")["files"]
        return sum(int(f["size"]) for f in files), True
    except (StateError, ValueError, KeyError, TypeError):
        return None, False


def save_preflight(cluster: str, report: dict) -> None:
    """The last preflight report (for `logs --bundle`)."""
    _write_atomic(control_dir(cluster) / PREFLIGHT, json.dumps(report, indent=1) + "\n")


def bundle_files(cluster: str) -> dict[str, str]:
    """The records a diagnostics bundle carries as they are on disk (damaged ones too: they may be the cause):
    history, current, the last preflight, the weights manifest, the heal event log and the newest deploy run's
    plan.json."""
    base = control_dir(cluster)
    out: dict[str, str] = {}
    for name in (RELEASES, CURRENT, PREFLIGHT, MANIFEST_CACHE, HEAL_EVENTS):
        p = base / name
        if p.is_file():
            out[name] = p.read_text(errors="replace")
    runs = sorted((d for d in (base / "runs").glob("*") if (d / "plan.json").is_file()),
                  key=lambda d: d.name) if (base / "runs").is_dir() else []
    if runs:
        out["plan.json"] = (runs[-1] / "plan.json").read_text(errors="replace")
        out["plan-run.txt"] = f"{runs[-1]}\n"
    return out
