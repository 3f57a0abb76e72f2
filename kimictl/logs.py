"""Logs: tail engine/proxy logs over SSH and write a redacted diagnostics bundle (read-only on hosts)."""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kimictl import remote, state
from kimictl.errors import InvalidInput, did_you_mean, guide
from kimictl.facts import log_lines
from kimictl.inventory import Inventory
from kimictl.secret_file import read_text, regular_file
from kimictl.ssh import Sessions, SSHError

ROLES = ("prefill", "decode", "colocated", "proxy")
MASK = "[REDACTED]"
SECRET_ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "MODELSCOPE_API_TOKEN", "MODELSCOPE_TOKEN",
                   "OPENAI_API_KEY", "VLLM_API_KEY", "KIMICTL_API_KEY")
MIN_LITERAL = 4  # shorter "secrets" would blank out ordinary text; they are reported, not used
MAX_SECRETS_FILE = 4 << 20   # --secrets-file: secret values one per line, not a log
DEFAULT_MAX_FILE_BYTES = 32 * 2**20
CONTROL_DIR_NAME = "_control-node"  # '_' cannot start an inventory host name, so it never collides
# A host's folder in the bundle, <cluster>/<inventory host name>/: kimictl's fixed files and folders (what
# remote/diag_bundle.py collects), each host-reported file name reduced to one safe component (bundle_member).
HOST_FILES = ("npu-smi-info.txt", "supervisor-status.json")
HOST_FOLDERS = ("hccn", "logs", "release", "release/engines", "release/proxy", "run", "weights")
OTHER_FOLDER = "other"  # a file the host reported anywhere else
CONTROL_FILES = ("host.json", "ERROR.txt")  # written by the control node
MAX_MEMBER_NAME = 120

# --- redaction -------------------------------------------------------------------------------------------

_KEY = r"(?:token|secret|password|passwd|api[_-]?key|authorization|cookie|credential)"
# Keys that contain "token" but never hold one (vLLM flags, metrics): keeping them keeps logs useful.
_BENIGN_KEY = re.compile(r"(?i)tokens|tokeniz|token_?(?:ids?|threshold|budget|count|len|length|limit|type)\b")
_KC = r"[A-Za-z0-9_.\-]"
_KEYBODY = rf"{_KC}*{_KEY}{_KC}*"
# Anchored at the start of a name run: without it a long run of name characters backtracks quadratically.
_KEYNAME = rf"(?<!{_KC}){_KEYBODY}"
_QUOTED = r"\"(?:[^\"\\\n]|\\.)*\"|'[^'\n]*'"
_BARE = r"[^\s\"',;&)\]}]+"
_LIST = r"\[[^\]\n]*\]"

_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    # JSON / Python-repr argv items: "--api-key", "sk-1"  |  '--api-key', 'sk-1'
    ("argv-list", re.compile(rf"(?i)(?P<pre>([\"'])--?{_KEYBODY}\2\s*,\s*)(?P<val>{_QUOTED})")),
    # command lines: --api-key sk-1 | --api-key=sk-1 | --hf-token 'x'
    ("argv", re.compile(rf"(?i)(?P<pre>(?<![\w-])--?{_KEYBODY}(?:=|[ \t]+))(?P<val>{_QUOTED}|{_BARE})")),
    # HTTP headers: the whole rest of the line is the credential
    ("header", re.compile(r"(?im)(?P<pre>\b(?:proxy-)?(?:authorization|(?:set-)?cookie)\s*:\s*)(?P<val>[^\n\"']+)")),
    # JSON / YAML / repr: "api_key": "x" | api_key: x | 'token': ['x']
    ("key-colon", re.compile(rf"(?i)(?P<pre>([\"']?)\b{_KEYNAME}\2\s*:[ \t]*)(?P<val>{_QUOTED}|{_LIST}|{_BARE})")),
    # env / shell / URL query: HF_TOKEN=x | export HF_TOKEN='x' | ?token=x
    ("key-equals", re.compile(rf"(?i)(?P<pre>\b{_KEYNAME}\s*=[ \t]*)(?P<val>{_QUOTED}|{_BARE})")),
    ("bearer", re.compile(r"(?i)(?P<pre>\bbearer\s+)(?P<val>[A-Za-z0-9._~+/=-]+)")),
    ("huggingface", re.compile(r"(?P<pre>)(?P<val>\bhf_[A-Za-z0-9]{20,})")),
    ("modelscope", re.compile(r"(?i)(?P<pre>)(?P<val>\bms-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-"
                                    r"[0-9a-f]{12}\b)")),
    ("modelscope-session", re.compile(r"(?i)(?P<pre>\bm_session_id\s*[=:]\s*)(?P<val>[^\s;&\"',]+)")),
    ("openai", re.compile(r"(?P<pre>)(?P<val>\bsk-[A-Za-z0-9_-]{20,})")),
]

# Cheap scan (str.find, C speed) for where a pattern could match; the patterns then run on those lines and
# the next only, so a large log without secrets costs a few passes. Every pattern needs one of these words.
_HOT_WORDS = ("token", "secret", "passw", "apikey", "api_key", "api-key", "authoriz", "cookie", "credential",
              "bearer", "m_session", "hf_", "ms-", "sk-")
_ASCII_LOWER = {c: c + 32 for c in range(ord("A"), ord("Z") + 1)}


def _hot_spans(text: str) -> list[tuple[int, int]]:
    """Merged [start, end) ranges: each hot word's line plus the following line (JSON argv wraps)."""
    low = text.lower()
    if len(low) != len(text):  # a few non-ASCII characters change length when lowered
        low = text.translate(_ASCII_LOWER)
    hits: list[int] = []
    for w in _HOT_WORDS:
        i = low.find(w)
        while i >= 0:
            after = low[i + len(w):i + len(w) + 2]
            if w == "token" and ((after[:1] == "s" and not after[1:2].isalnum()) or after == "iz"):
                pass  # "tokens/s", "tokenizer": never a secret, and on every vLLM stats line
            elif w in ("hf_", "ms-", "sk-") and i > 0 and low[i - 1].isalnum():
                pass
            else:
                hits.append(i)
            i = low.find(w, i + 1)
    spans: list[list[int]] = []
    for i in sorted(hits):
        start = text.rfind("\n", 0, i) + 1
        if spans and i < spans[-1][1]:
            continue
        nl = text.find("\n", i)
        nl2 = text.find("\n", nl + 1) if nl >= 0 else -1
        end = len(text) if nl2 < 0 else nl2
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    return [(a, b) for a, b in spans]


def _masked(val: str) -> str:
    """The replacement keeps the quoting so redacted JSON/env files still parse."""
    if len(val) >= 2 and val[0] == val[-1] and val[0] in "\"'":
        return f"{val[0]}{MASK}{val[0]}"
    if val.startswith("["):
        return f"['{MASK}']" if "'" in val else f'["{MASK}"]'
    return MASK


@dataclass
class Redactor:
    """Masks secrets in text: configured literal values first, then the key/value and token patterns."""

    literals: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    skipped_short: int = 0

    @classmethod
    def from_config(cls, environ: dict[str, str] | None = None, secrets_file: Path | None = None,
                    known: Iterable[str] = ()) -> Redactor:
        """known: secret values kimictl itself holds (the proxy's API key)."""
        env = os.environ if environ is None else environ
        values = [env.get(k, "") for k in SECRET_ENV_VARS] + list(known)
        if secrets_file is not None:
            with regular_file(Path(secrets_file), "--secrets-file") as (fd, st):
                if st.st_size > MAX_SECRETS_FILE:
                    raise InvalidInput(f"--secrets-file {secrets_file} is {st.st_size} bytes: more than secret "
                                       f"values one per line (at most {MAX_SECRETS_FILE})")
                values += [line.strip() for line in read_text(fd, secrets_file, "--secrets-file",
                                                              MAX_SECRETS_FILE).splitlines()]
        return cls.with_literals(values)

    @classmethod
    def with_literals(cls, values: Iterable[str]) -> Redactor:
        r = cls()
        lits: set[str] = set()
        for v in (v.strip() for v in values):
            if not v:
                continue
            if len(v) < MIN_LITERAL:
                r.skipped_short += 1
                continue
            # the same value as it appears JSON-escaped or URL-encoded in logs and records
            lits |= {v, json.dumps(v)[1:-1], urllib.parse.quote(v, safe=""), urllib.parse.quote_plus(v)}
        r.literals = sorted(lits, key=len, reverse=True)  # longest first: a value containing another
        return r

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _count(self, kind: str, n: int = 1) -> None:
        if n:
            self.counts[kind] = self.counts.get(kind, 0) + n

    def redact(self, text: str) -> str:
        for lit in self.literals:
            if lit in text:
                self._count("literal", text.count(lit))
                text = text.replace(lit, MASK)
        parts: list[str] = []
        pos = 0
        for a, b in _hot_spans(text):
            chunk = text[a:b]
            for kind, pat in _PATTERNS:
                chunk = pat.sub(lambda m, k=kind: self._sub(m, k), chunk)
            parts += [text[pos:a], chunk]
            pos = b
        parts.append(text[pos:])
        return "".join(parts)

    def _sub(self, m: re.Match[str], kind: str) -> str:
        val = m.group("val")
        if MASK in val or m.string.startswith(MASK, m.start("val")):  # already masked (a literal, an earlier pattern)
            return m.group(0)
        if kind in ("argv", "argv-list", "key-colon", "key-equals"):
            key = re.search(_KEYBODY, m.group("pre"), re.I)
            # "max_num_batched_tokens" is no secret, "secret_tokens" is: judge what is left without the benign part
            if key is None or not re.search(_KEY, _BENIGN_KEY.sub("", key.group(0)), re.I):
                return m.group(0)
        self._count(kind)
        return m.group("pre") + _masked(val)


# --- what runs where -------------------------------------------------------------------------------------

def role_of(pid: str) -> str:
    """Role from a supervised id when no manifest says it (ids are <role>-<n>-dp<r> / proxy)."""
    if pid == "proxy":
        return "proxy"
    for r in ("prefill", "decode", "colocated"):
        if pid.startswith(r):
            return r
    return "?"


@dataclass
class Target:
    host: str
    id: str
    role: str
    path: str


def select(found: dict[str, dict[str, Any]], roles: list[str] | None, engines: list[str] | None) -> list[Target]:
    """Filter each host's processes (manifest of `current`, else supervisor states) by role and id."""
    out: list[Target] = []
    for host, info in found.items():
        sd = info["sd"]
        procs: dict[str, str] = {}
        man = info.get("manifest")
        if isinstance(man, dict):
            procs = {e["id"]: e["role"] for e in man.get("engines", [])}
            if man.get("proxy"):
                procs["proxy"] = "proxy"
        else:
            procs = {pid: role_of(pid) for pid in info.get("states", [])}
        for pid, role in procs.items():
            if roles and role not in roles:
                continue
            if engines and pid not in engines:
                continue
            out.append(Target(host, pid, role, f"{sd}/logs/{pid}.log"))
    return out


def collect_tails(inv: Inventory, lines: int, timeout: float = 30.0
                  ) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Per host: manifest, supervised ids and the last `lines` lines of every process's log."""

    def one(name: str, s) -> dict[str, Any]:
        sd = inv.host(name).kimi_state_dir
        res = s.run(f"python3 - {_q(json.dumps({'sd': sd, 'lines': lines}))}", timeout=timeout,
                    stdin=remote.script("log_tail.py"))
        if res.rc != 0:
            raise SSHError(f"{name}: reading logs failed (rc {res.rc}): {res.stderr.strip()[-300:]}")
        return json.loads(res.stdout) | {"sd": sd}

    with Sessions(inv, timeout=timeout) as sessions:
        got = sessions.each(one)
    ok = {h: v for h, v in got.items() if not isinstance(v, SSHError)}
    bad = {h: str(v) for h, v in got.items() if isinstance(v, SSHError)}
    return ok, bad


def check_engine_ids(inv: Inventory, engines: list[str]) -> None:
    """--engine ids against the current release this control node recorded (exit 2 before any host is
    contacted); without a record the hosts' own lists decide (tail_logs)."""
    from kimictl.errors import KimictlError
    from kimictl.rundir import run_snapshot

    rec = state.current(inv.cluster.name)
    if rec is None or not engines:
        return
    try:
        rendered = run_snapshot(rec, "the current release")
    except KimictlError:
        return
    known = {e.id for e in rendered.engines} | ({"proxy"} if rendered.proxy else set())
    unknown = [e for e in engines if e not in known]
    if unknown:
        raise InvalidInput(f"--engine {', '.join(unknown)}: no such engine in release {rec.release[:12]} of "
                           f"{inv.cluster.name}{did_you_mean(unknown[0], known)}",
                           hint="known: " + ", ".join(sorted(known)))


def tail_logs(inv: Inventory, *, roles: list[str] | None = None, engines: list[str] | None = None,
              lines: int = 50, redactor: Redactor | None = None) -> dict[str, Any]:
    """The `logs --output json` document: one entry per selected engine/proxy, plus unreachable hosts."""
    found, bad = collect_tails(inv, lines)
    targets = select(found, roles, engines)
    if engines and not bad:
        known = {t.id for t in select(found, None, None)}
        unknown = [e for e in engines if e not in known]
        if unknown:
            raise InvalidInput(f"no such engine: {', '.join(unknown)}", hint="known: " + ", ".join(sorted(known)))
    out = []
    for t in targets:
        got = found[t.host]["logs"].get(t.id)
        text = "\n".join(got) if got is not None else None
        if text and redactor is not None:
            text = redactor.redact(text)
        out.append({"host": t.host, "id": t.id, "role": t.role, "path": t.path, "missing": got is None,
                    "lines": text.split("\n") if text else []})
    return {"schema_version": 1, "cluster": inv.cluster.name, "lines": lines, "logs": out, "hints": log_hints(out),
            "redactions": redactor.total if redactor else 0,
            "errors": [{"host": h, "error": e} for h, e in sorted(bad.items())]}


def log_hints(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The log lines of these tails the operator's guide explains (data/log_lines.yml): per row, the engines whose
    tails hold one, how many, the last one, and the row."""
    out = []
    for known in log_lines():
        rx = re.compile(known.pattern)
        hits = [(e["id"], ln) for e in logs for ln in e["lines"] if rx.search(ln)]
        if hits:
            out.append({"engines": sorted({i for i, _ in hits}), "count": len(hits), "line": hits[-1][1][-300:],
                        "what": known.what, "hint": guide(known.anchor)})
    return out


# --- bundle ----------------------------------------------------------------------------------------------

_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")


def safe_component(name: str) -> str:
    """One path component from a name a host reported: letters, digits and ._+- only (anything else '_'), no
    leading '.' or '-' (so never '..', a hidden file or an option), at most MAX_MEMBER_NAME characters."""
    out = _UNSAFE.sub("_", name)[:MAX_MEMBER_NAME]
    return "_" + out[1:] if out[:1] in (".", "-") else out or "_"


def bundle_member(rel: str) -> str:
    """Where a file the host reported as `rel` goes in its folder: a fixed file as it is, a file of a fixed folder
    under that folder with a safe name, anything else flat under other/."""
    if rel in HOST_FILES:
        return rel
    folder, _, name = rel.rpartition("/")
    if folder in HOST_FOLDERS:
        return f"{folder}/{safe_component(name)}"
    return f"{OTHER_FOLDER}/{safe_component(rel.replace('/', '_'))}"


def host_members(files: dict[str, Any]) -> dict[str, str]:
    """A host's reported {relpath: text} as {member path in its folder: text}: names from bundle_member, made unique
    (a name already taken, or a folder's, gets -2, -3, ...), texts that are not text as JSON."""
    taken = {*HOST_FOLDERS, OTHER_FOLDER, *CONTROL_FILES}
    out: dict[str, str] = {}
    for rel, text in sorted(files.items(), key=lambda kv: str(kv[0])):
        name = base = bundle_member(str(rel))
        n = 1
        while name in taken:
            n += 1
            name = f"{base}-{n}"
        taken.add(name)
        out[name] = text if isinstance(text, str) else json.dumps(text)
    return out


def _q(s: str) -> str:
    import shlex

    return shlex.quote(s)


def collect_host_files(inv: Inventory, max_file_bytes: int, timeout: float = 300.0
                       ) -> dict[str, dict[str, Any] | SSHError]:
    """Per host {files: {relpath: text}, meta}; one SSH round trip per host, all hosts in parallel."""

    def one(name: str, s) -> dict[str, Any]:
        h = inv.host(name)
        arg = json.dumps({"sd": h.kimi_state_dir, "cap": max_file_bytes, "npus": h.hardware.npus,
                          "model_dir": inv.cluster.kimi_model_dir})
        res = s.run(f"python3 - {_q(arg)}", timeout=timeout, stdin=remote.script("diag_bundle.py"))
        if res.rc != 0:
            raise SSHError(f"{name}: collecting files failed (rc {res.rc}): {res.stderr.strip()[-300:]}")
        try:
            doc = json.loads(res.stdout)
        except ValueError as exc:
            raise SSHError(f"{name}: collecting files: the host's report is not JSON ({exc})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
            raise SSHError(f"{name}: collecting files: the host's report has no files object")
        return doc

    with Sessions(inv, timeout=15.0) as sessions:
        return sessions.each(one)


@dataclass
class BundleResult:
    path: str
    files: int
    bytes: int
    redactions: int
    redactions_by_kind: dict[str, int]
    hosts: dict[str, str]  # host -> "ok" | error
    skipped_short_secrets: int

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": 1, "path": self.path, "files": self.files, "bytes": self.bytes,
                "redactions": self.redactions, "redactions_by_kind": self.redactions_by_kind,
                "hosts": self.hosts, "skipped_short_secrets": self.skipped_short_secrets}


def check_bundle_dest(dest: Path) -> Path:
    """--bundle FILE: its directory exists and FILE is not a directory (exit 2 before anything is collected)."""
    dest = Path(dest)
    parent = dest.parent if str(dest.parent) else Path(".")
    if not parent.is_dir():
        raise InvalidInput(f"cannot write the bundle: directory {parent} does not exist")
    if dest.is_dir():
        raise InvalidInput(f"cannot write the bundle: {dest} is a directory",
                           hint=f"give a file name, e.g. {dest / 'kimi-diagnostics.tar.gz'}")
    return parent


def write_tarball(dest: Path, members: dict[str, str]) -> int:
    """gzip tarball with mode 0600, written to a temp file in the same directory and renamed into place."""
    dest = Path(dest)
    parent = check_bundle_dest(dest)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=parent)
    try:
        os.fchmod(fd, 0o600)
        now = time.time()
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
            for name in sorted(members):
                data = members[name].encode()
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), now, 0o600
                tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest.stat().st_size


def build_bundle(inv: Inventory, dest: Path, redactor: Redactor, *,
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 say: Callable[[str], None] = lambda _m: None) -> BundleResult:
    """Collect every host's diagnostics and the control node's records; redact; write one tarball."""
    cluster = inv.cluster.name
    check_bundle_dest(dest)
    say(f"collecting from {len(inv.hosts)} host(s)")
    got = collect_host_files(inv, max_file_bytes)
    members: dict[str, str] = {}
    hosts: dict[str, str] = {}
    by_file: dict[str, int] = {}

    def add(name: str, text: str) -> None:
        before = redactor.total
        members[name] = redactor.redact(text)
        if redactor.total > before:
            by_file[name] = redactor.total - before

    for h in inv.hosts:
        res = got.get(h.name)
        if isinstance(res, SSHError) or res is None:
            hosts[h.name] = str(res) if res else "not collected"
            add(f"{cluster}/{h.name}/ERROR.txt", f"{hosts[h.name]}\n")
            continue
        hosts[h.name] = "ok"
        for rel, text in host_members(res["files"]).items():
            add(f"{cluster}/{h.name}/{rel}", text)
        add(f"{cluster}/{h.name}/host.json", json.dumps(res.get("meta"), indent=1) + "\n")
    for rel, text in state.bundle_files(cluster).items():
        add(f"{cluster}/{CONTROL_DIR_NAME}/{rel}", text)
    index = {"schema_version": 1, "cluster": cluster, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "hosts": hosts, "redactions": redactor.total, "redactions_by_kind": redactor.counts,
             "redactions_by_file": by_file, "files": sorted(members)}
    add(f"{cluster}/bundle.json", json.dumps(index, indent=1) + "\n")
    size = write_tarball(dest, members)
    return BundleResult(str(dest), len(members), size, redactor.total, dict(redactor.counts), hosts,
                        redactor.skipped_short)
