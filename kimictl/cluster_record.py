"""The cluster is the record: the release history, the current release and the render snapshots a rollback or a
rollout starts from are kept on the cluster's record hosts (`record_hosts`: the first three hosts by name), so a
control node with an empty state dir (a CI runner with the same inventory and key) reads them back.

Writing (`publish`): every record deploy, rollout and rollback make goes to each record host through
playbooks/record.yml (this module writes the files, Ansible copies them) under <kimi_state_dir>/record/. A host it
cannot write is a warning naming it; no record host written is an error (step "record").

Reading (`sync`): one SSH round trip per record host (remote/read_record.py). Everything a host answers is checked
as data: size caps, each history line a `ReleaseRecord` whose release ids are release ids (a garbled line is
skipped and named), each snapshot a `Rendered` of this cluster whose release ids are its record's; a host that fails
a check is refused (named) and the others count. Histories are merged, the newest current record wins (by time,
then release id), hosts that disagree are reported as drift, and the result is cached in the control node's state
dir (`state.cache_records`; snapshots under record/snapshots/<release>/, which the records read back name as their
run_dir, so `rundir.run_snapshot` and `run_topology` read them). No record host answering: the cache is used, with a
warning.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kimictl import remote, state
from kimictl.errors import HostError, reported
from kimictl.hostops import RELEASE
from kimictl.inventory import Inventory
from kimictl.remote import read_record as host_side
from kimictl.ssh import Sessions, SSHError

RECORD_HOSTS = 3
SNAPSHOT_FILES = ("rendered.json", "topology.yml")
HISTORY_MAX = host_side.HISTORY_MAX
CURRENT_MAX = host_side.CURRENT_MAX
SNAPSHOT_MAX = host_side.SNAPSHOT_MAX
TOPOLOGY_MAX = host_side.TOPOLOGY_MAX


def answer_max() -> int:
    """The most a record host's answer may hold (JSON quoting may double a text)."""
    return 2 * (HISTORY_MAX + CURRENT_MAX + host_side.BUDGET + SNAPSHOT_MAX + TOPOLOGY_MAX)


def record_hosts(inv: Inventory) -> list[str]:
    """The hosts that keep the cluster's record: the first three of the inventory by name (all when fewer)."""
    return sorted(h.name for h in inv.hosts)[:RECORD_HOSTS]


def snapshot_cache(cluster: str, release: str) -> Path:
    """Where this control node keeps a render snapshot read back from the cluster (a run directory of its own)."""
    return state.control_dir(cluster) / "record" / "snapshots" / release


def _stderr(msg: str) -> None:
    sys.stderr.write(f"record: {msg}\n")


# --- writing ------------------------------------------------------------------------------------------------


def publish(ops: Any, inv: Inventory, rec: state.ReleaseRecord, *, say: Callable[[str], None],
            required: bool = True) -> dict[str, str]:
    """Write `rec` (and, for a deployed release, current.json and its run directory's render snapshot) to every
    record host through `ops.write_record` (HostOps: record.yml). Returns the hosts not written, with why; each is
    a warning. None written: HostError (step "record") when `required`, else one more warning."""
    hosts = record_hosts(inv)
    files = Path(ops.run_dir) / "record"
    files.mkdir(parents=True, exist_ok=True)
    current, snapshot = None, {}
    if rec.result == "deployed":
        current = files / "current.json"
        current.write_text(state.current_json(rec))
        run_dir = Path(rec.run_dir) if rec.run_dir else None
        snapshot = {n: str(run_dir / n) for n in SNAPSHOT_FILES if run_dir and (run_dir / n).is_file()}
    release = rec.release if "rendered.json" in snapshot else None
    failed = ops.write_record({"state_dir_of": {h: inv.host(h).kimi_state_dir for h in hosts}, "line": rec.to_line(),
                               "current": str(current) if current else None, "release": release,
                               "snapshot": snapshot if release else {}}, hosts)
    for h, why in sorted(failed.items()):
        say(f"warning: the release record of {rec.release} was not written to record host {h}: {why}")
    if len(failed) < len(hosts):
        return failed
    msg = (f"the release record of {rec.release} ({rec.result}) could not be written to any record host "
           f"({', '.join(hosts)})")
    if required:
        raise HostError(msg, host=hosts[0], step="record", details=[f"{h}: {why}" for h, why in sorted(failed.items())],
                        hint=f"only this control node has it ({state.control_dir(inv.cluster.name)}); once a record "
                             "host answers, `kimictl deploy` again writes the record (no engine restarts)")
    say(f"warning: {msg}")
    return failed


# --- reading back -------------------------------------------------------------------------------------------


class Refused(ValueError):
    """A record host's answer failed a check; the message says which."""


@dataclass
class HostRecord:
    """One record host's copy, checked."""

    history: list[state.ReleaseRecord]
    current: state.ReleaseRecord | None
    snapshots: dict[str, dict[str, str | None]]


@dataclass
class SyncReport:
    """What `sync` read: which record hosts answered, which were refused or unreachable (why), the drift between
    the ones that answered, and how many records were new to this control node."""

    hosts: list[str]
    answered: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    unreachable: dict[str, str] = field(default_factory=dict)
    drift: list[str] = field(default_factory=list)
    added: int = 0
    current: str | None = None

    def problems(self) -> list[str]:
        """Drift and refused hosts, one line each (status --output json: `record_drift`)."""
        return [*self.drift, *(f"record host {h} refused: {why}" for h, why in sorted(self.refused.items()))]


def _key(rec: state.ReleaseRecord) -> str:
    """A record's identity across hosts and control nodes (run directories are each control node's own)."""
    doc = rec.model_dump(mode="json", exclude_defaults=True)
    return json.dumps({k: v for k, v in doc.items() if k not in ("run_dir", "rollout_run_dir")}, sort_keys=True)


def _checked_record(text: str, cluster: str) -> state.ReleaseRecord:
    """One record a host reported, or Refused: a ReleaseRecord of this cluster whose release ids are release ids."""
    try:
        rec = state.ReleaseRecord.model_validate_json(text)
    except ValidationError as exc:
        raise Refused(f"not a release record ({exc.error_count()} error(s))") from None
    ids = [rec.release, rec.attempted_release, rec.previous_release, *rec.hosts.values()]
    bad = next((r for r in ids if r is not None and not (isinstance(r, str) and RELEASE.fullmatch(r))), None)
    if bad is not None or not rec.release:
        raise Refused(f"a record names the release {reported(bad)}, which is not a release id")
    if rec.cluster and rec.cluster != cluster:
        raise Refused(f"a record of cluster {reported(rec.cluster)}, not {cluster}")
    return rec


def _history(host: str, text: str, cluster: str, say: Callable[[str], None]) -> list[state.ReleaseRecord]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(_checked_record(line, cluster))
        except Refused as exc:
            say(f"warning: record host {host}: line {n} of its release history is skipped: {exc}")
    return out


def _snapshot(rel: str, files: Any, cluster: str, records: list[state.ReleaseRecord]) -> dict[str, str | None]:
    """One render snapshot a host sent, or Refused: a Rendered of this cluster and of release `rel`, matching every
    deployed record of that release."""
    from kimictl.render import Rendered

    if not RELEASE.fullmatch(rel) or not isinstance(files, dict):
        raise Refused(f"a render snapshot named {reported(rel)}")
    text, topo = files.get("rendered.json"), files.get("topology.yml")
    if not isinstance(text, str) or not (topo is None or isinstance(topo, str)):
        raise Refused(f"the render snapshot of {rel} is not text")
    if len(text) > SNAPSHOT_MAX or len(topo or "") > TOPOLOGY_MAX:
        raise Refused(f"the render snapshot of {rel} is over its cap ({SNAPSHOT_MAX} bytes, topology {TOPOLOGY_MAX})")
    try:
        snap = Rendered.model_validate_json(text)
    except ValidationError as exc:
        raise Refused(f"the render snapshot of {rel} is not a render ({exc.error_count()} error(s))") from None
    if snap.plan.cluster != cluster or state.release_id(snap.releases) != rel:
        raise Refused(f"the render snapshot of {rel} is release {state.release_id(snap.releases)} of cluster "
                      f"{reported(snap.plan.cluster)}")
    for r in records:
        if r.release == rel and r.result == "deployed" and any(snap.releases.get(h) != v for h, v in r.hosts.items()):
            raise Refused(f"the render snapshot of {rel} does not match its record (the hosts' release ids differ)")
    return {"rendered.json": text, "topology.yml": topo}


def parse_answer(host: str, text: str, cluster: str, say: Callable[[str], None]) -> HostRecord:
    """A record host's answer (remote/read_record.py's JSON), checked; Refused names what is wrong with it."""
    if len(text) > answer_max():
        raise Refused(f"its answer is {len(text)} bytes, over the {answer_max()}-byte cap")
    try:
        doc = json.loads(text)
    except ValueError:
        raise Refused(f"read_record.py answered {reported(text)}, not JSON") from None
    if not (isinstance(doc, dict) and all(isinstance(doc.get(k), (str, type(None))) for k in ("releases", "current"))
            and isinstance(doc.get("snapshots"), dict)):
        raise Refused(f"read_record.py answered {reported(doc)}, not a record")
    if len(doc["releases"] or "") > HISTORY_MAX or len(doc["current"] or "") > CURRENT_MAX:
        raise Refused(f"its release history or current record is over its cap ({HISTORY_MAX}, {CURRENT_MAX} bytes)")
    history = _history(host, doc["releases"] or "", cluster, say)
    current = None
    if doc["current"] is not None:
        try:
            current = _checked_record(doc["current"], cluster)
        except Refused as exc:
            raise Refused(f"its current.json: {exc}") from None
        if current.result != "deployed":
            raise Refused(f"its current.json records a {reported(current.result)} release, not a deployed one")
    records = [*history, *([current] if current else [])]
    return HostRecord(history, current, {rel: _snapshot(rel, files, cluster, records)
                                         for rel, files in doc["snapshots"].items()})


def _have(cluster: str, local: list[state.ReleaseRecord]) -> list[str]:
    """Releases whose render snapshot this control node holds (the hosts need not send them)."""
    base = state.control_dir(cluster) / "record" / "snapshots"
    cached = [d.name for d in base.iterdir() if (d / "rendered.json").is_file()] if base.is_dir() else []
    own = [r.release for r in local if r.run_dir and (Path(r.run_dir) / "rendered.json").is_file()]
    return sorted({r for r in [*cached, *own] if RELEASE.fullmatch(r)})


def read_hosts(inv: Inventory, have: list[str], *, timeout: float = 30.0, accept_new_keys: bool = False,
               connect: Callable[..., Sessions] | None = None) -> dict[str, str | SSHError]:
    """Each record host's answer as it sent it (one SSH round trip per host), or why it did not answer."""
    script = remote.script("read_record.py")

    def one(name: str, s) -> str:
        res = s.run(f"python3 - {shlex.quote(inv.host(name).kimi_state_dir)} {shlex.quote(','.join(have))}",
                    timeout=timeout, stdin=script)
        if res.rc != 0:
            raise SSHError(f"{name}: read_record.py failed: {res.stderr.strip()[-300:] or f'exit {res.rc}'}")
        return res.stdout

    with (connect or Sessions)(inv.limited(record_hosts(inv)), timeout=timeout,
                               accept_new_keys=accept_new_keys) as sessions:
        return sessions.each(one)


def _drift(answers: dict[str, HostRecord]) -> list[str]:
    """How the record hosts that answered disagree: their current records, and records some lack."""
    out = []
    curs = {h: a.current for h, a in sorted(answers.items())}
    if len({_key(c) if c else None for c in curs.values()}) > 1:
        out.append("record hosts disagree on the current release: " + ", ".join(
            f"{h} {c.release} ({c.at or 'no time'})" if c else f"{h} none" for h, c in curs.items()))
    keys = {h: {_key(r) for r in a.history} for h, a in sorted(answers.items())}
    union = set().union(*keys.values())
    for h, mine in keys.items():
        if union - mine:
            out.append(f"record host {h} lacks {len(union - mine)} of the {len(union)} release record(s) the others "
                       "hold")
    return out


def _cache_snapshots(cluster: str, answers: dict[str, HostRecord]) -> set[str]:
    """Keep each snapshot read back (checked) under record/snapshots/<release>/; the releases cached."""
    done: set[str] = set()
    for h in sorted(answers):
        for rel, files in answers[h].snapshots.items():
            if rel in done:
                continue
            d = snapshot_cache(cluster, rel)
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            for name, text in files.items():
                if text is not None:
                    tmp = d / f".{name}.tmp"
                    tmp.write_text(text)
                    os.chmod(tmp, 0o600)
                    tmp.replace(d / name)
            done.add(rel)
    return done


def _local_run_dir(cluster: str, rec: state.ReleaseRecord, local: list[state.ReleaseRecord]) -> state.ReleaseRecord:
    """A record read back, naming this control node's copy of its release's snapshot as its run directory (the
    writer's run directory is on another machine; a host's path is never used here): the cached copy, else the
    run directory of this node's own record of the same release (the hosts did not send it: `_have`)."""
    cache = snapshot_cache(cluster, rec.release)
    if (cache / "rendered.json").is_file():
        return rec.model_copy(update={"run_dir": str(cache)})
    own = next((r.run_dir for r in reversed(local) if r.release == rec.release and r.run_dir
                and (Path(r.run_dir) / "rendered.json").is_file()), None)
    return rec.model_copy(update={"run_dir": own})


def merge(cluster: str, local: list[state.ReleaseRecord], local_current: state.ReleaseRecord | None,
          answers: dict[str, HostRecord]) -> tuple[list[state.ReleaseRecord], state.ReleaseRecord | None]:
    """This control node's records and every answering host's, each once, oldest first; the current record is the
    newest of theirs (by time, then release id)."""
    seen: set[str] = set()
    out: list[state.ReleaseRecord] = []
    theirs = [r for h in sorted(answers) for r in answers[h].history]
    currents = [a.current for _h, a in sorted(answers.items()) if a.current is not None]
    for rec, mine in [*((r, True) for r in local), *((r, False) for r in [*theirs, *currents])]:
        k = _key(rec)
        if k not in seen:
            seen.add(k)
            out.append(rec if mine else _local_run_dir(cluster, rec, local))
    out.sort(key=lambda r: r.at)
    by_key = {_key(r): r for r in out}
    cands = [c for c in [local_current, *currents] if c is not None]
    newest = max(cands, key=lambda c: (c.at, c.release), default=None)
    if newest is not None and newest is not local_current:
        newest = by_key[_key(newest)]
    return out, newest


def sync(inv: Inventory, *, say: Callable[[str], None] = _stderr, accept_new_keys: bool = False,
         connect: Callable[..., Sessions] | None = None) -> SyncReport:
    """Bring this control node's record (history, current, snapshots) up to date from the record hosts; it prints
    what it found (warnings: hosts refused, unreachable or in drift; a line when it brought new records)."""
    cluster = inv.cluster.name
    report = SyncReport(record_hosts(inv))
    # this control node's copy first: a damaged one is a StateError naming the file and line before any host
    local, local_current = state.history(cluster), state.current(cluster)
    raw = read_hosts(inv, _have(cluster, local), accept_new_keys=accept_new_keys, connect=connect)
    answers: dict[str, HostRecord] = {}
    for h in report.hosts:
        got = raw.get(h)
        if isinstance(got, SSHError) or got is None:
            report.unreachable[h] = str(got or "no answer")
            continue
        try:
            answers[h] = parse_answer(h, got, cluster, say)
        except Refused as exc:
            report.refused[h] = str(exc)
            say(f"warning: the release record of record host {h} is refused: {exc}")
    report.answered = sorted(answers)
    if not answers:
        say("warning: no record host answered (" + "; ".join(f"{h}: {why}" for h, why in
                                                            sorted({**report.unreachable, **report.refused}.items()))
            + f"): using this control node's cached record in {state.control_dir(cluster)}")
        report.current = local_current.release if local_current else None
        return report
    for h, why in sorted(report.unreachable.items()):
        say(f"warning: record host {h} did not answer: {why}")
    report.drift = _drift(answers)
    for d in report.drift:
        say(f"warning: record drift: {d}")
    _cache_snapshots(cluster, answers)
    merged, current = merge(cluster, local, local_current, answers)
    report.added = len({_key(r) for r in merged} - {_key(r) for r in local})
    report.current = current.release if current else None
    if report.added or (current is not None and (local_current is None or _key(current) != _key(local_current))):
        state.cache_records(cluster, merged, current)
        say(f"read the cluster's release record from {', '.join(report.answered)}: {report.added} record(s) new to "
            f"this control node; current release {report.current or 'none'}")
    return report
