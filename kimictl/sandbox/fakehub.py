"""Fake ModelScope + Hugging Face hub that the real client libraries accept, with rate limits and faults."""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import hashlib
import hmac
import http.cookies
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from kimictl.sandbox.checkpoint import parse_size

log = logging.getLogger("kimictl.fakehub")

HF_PAGE_SIZE = 1000
_SEND_CHUNK = 64 * 1024
# Real HF marks these as LFS via .gitattributes; big files are LFS regardless.
_LFS_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".onnx",
    ".model",
    ".gguf",
)
_LFS_MIN_SIZE = 10 * 1024 * 1024
_MALICIOUS_PAYLOAD = b"fakehub: a client must never write this file\n"
MALICIOUS_NAMES = (
    "../x",
    "../../etc/cron.d/evil",
    "/etc/passwd",
    "a\\b",
    "docs/../../escape.json",
    "ctl\x01char.json",
    "new\nline.json",
    "./.hidden/../../dot.json",
)
_MS_BRANCHES = ("master", "main")


class _Dropped(Exception):
    """The handler cut a response short on purpose; close the connection."""


# ---------------------------------------------------------------------------------------------- faults


@dataclass
class Faults:
    """Fault injection settings; file patterns are fnmatch globs matched against repo-relative paths."""

    wrong_sha: list[str] = field(default_factory=list)
    truncate: list[str] = field(default_factory=list)
    truncate_at: int | None = None  # file offset where bodies stop; None = half of the file
    drop: list[str] = field(default_factory=list)
    drop_after: int = 64 * 1024  # body bytes sent before the drop
    drop_times: int = 1  # drops per file, then it is served normally
    fail: list[str] = field(default_factory=list)
    fail_status: int = 503
    fail_times: int = 1
    malicious_names: bool = False
    slow_first_byte: list[str] = field(default_factory=list)
    slow_delay: float = 0.0

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Faults:
        """Accept flat keys or nested {"drop": {"files": [...], "after": N, "times": K}} forms."""
        f = cls()
        if not data:
            return f

        def files(v: Any) -> list[str]:
            if v is True:
                return ["*"]
            if isinstance(v, str):
                return [v]
            if isinstance(v, dict):
                return files(v.get("files", ["*"]))
            return [str(x) for x in v or []]

        for key, value in data.items():
            if key == "wrong_sha":
                f.wrong_sha = files(value)
            elif key == "truncate":
                f.truncate = files(value)
                if isinstance(value, dict) and value.get("at") is not None:
                    f.truncate_at = int(value["at"])
            elif key == "drop":
                f.drop = files(value)
                if isinstance(value, dict):
                    f.drop_after = int(value.get("after", f.drop_after))
                    f.drop_times = int(value.get("times", f.drop_times))
            elif key == "fail":
                f.fail = files(value)
                if isinstance(value, dict):
                    f.fail_status = int(value.get("status", f.fail_status))
                    f.fail_times = int(value.get("times", f.fail_times))
            elif key == "malicious_names":
                f.malicious_names = bool(value)
            elif key == "slow_first_byte":
                f.slow_first_byte = files(value)
                if isinstance(value, dict):
                    f.slow_delay = float(value.get("delay", 1.0))
                elif f.slow_first_byte and not f.slow_delay:
                    f.slow_delay = 1.0
            elif key == "truncate_at" and value is None:
                f.truncate_at = None
            elif key in _SCALARS:
                setattr(f, key, _SCALARS[key](value))
            else:
                raise ValueError(f"unknown fault {key!r}")
        return f

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


_SCALARS = {
    "truncate_at": int,
    "drop_after": int,
    "drop_times": int,
    "fail_status": int,
    "fail_times": int,
    "slow_delay": float,
}


def _matches(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(path, p) for p in patterns)


# ------------------------------------------------------------------------------------------ rate limit


class TokenBucket:
    """Byte-rate limiter shared by every connection: reservations serialize on one virtual clock."""

    def __init__(self, rate: float | None, burst: float | None = None) -> None:
        self._lock = threading.Lock()
        self._next = time.monotonic()
        self.set_rate(rate, burst)

    def set_rate(self, rate: float | None, burst: float | None = None) -> None:
        with self._lock:
            self.rate = float(rate) if rate else None
            # A small burst keeps short replies snappy without letting a big file escape the limit.
            self.burst = float(burst) if burst is not None else (self.rate / 20 if self.rate else 0.0)
            self._next = time.monotonic()

    def chunk_size(self) -> int:
        rate = self.rate
        return _SEND_CHUNK if not rate else max(1024, min(_SEND_CHUNK, int(rate / 50)))

    def consume(self, n: int) -> None:
        with self._lock:
            if not self.rate:
                return
            now = time.monotonic()
            start = max(self._next, now - self.burst / self.rate)
            self._next = start + n / self.rate
            wait = self._next - now - self.burst / self.rate
        if wait > 0:
            time.sleep(wait)


# ------------------------------------------------------------------------------------------ repo files


@dataclass(frozen=True)
class FileInfo:
    """A servable file: repo-relative path, size, sha256 and (for non-LFS) git blob sha1."""

    path: str
    size: int
    sha256: str
    git_sha1: str
    lfs: bool
    local: Path | None  # None for in-memory payloads (malicious entries)

    @property
    def pointer(self) -> bytes:
        spec = "version https://git-lfs.github.com/spec/v1"
        return f"{spec}\noid sha256:{self.sha256}\nsize {self.size}\n".encode()

    @property
    def oid(self) -> str:
        """Git object id as HF reports it: blob sha1 of the file, or of the LFS pointer for LFS files."""
        return _git_sha1(self.pointer) if self.lfs else self.git_sha1

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_sha1


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


class _HashCache:
    """sha256 (and git sha1 for small files) per file, recomputed only when (size, mtime) changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[Path, tuple[int, int, str, str]] = {}

    def get(self, path: Path, lfs: bool) -> tuple[int, str, str]:
        st = path.stat()
        with self._lock:
            hit = self._cache.get(path)
        if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
            return hit[0], hit[2], hit[3]
        h = hashlib.sha256()
        g = None if lfs else hashlib.sha1(b"blob %d\0" % st.st_size, usedforsecurity=False)
        with open(path, "rb") as fh:
            while chunk := fh.read(4 << 20):
                h.update(chunk)
                if g:
                    g.update(chunk)
        entry = (st.st_size, st.st_mtime_ns, h.hexdigest(), g.hexdigest() if g else "")
        with self._lock:
            self._cache[path] = entry
        return entry[0], entry[2], entry[3]


class Repo:
    """One served repository backed by a local directory (hidden files and directories are not served)."""

    def __init__(self, repo_id: str, root: Path | str, hashes: _HashCache) -> None:
        self.repo_id = repo_id
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ValueError(f"repo {repo_id}: {self.root} is not a directory")
        self._hashes = hashes

    def _is_lfs(self, rel: str, size: int) -> bool:
        return rel.endswith(_LFS_SUFFIXES) or size >= _LFS_MIN_SIZE

    def paths(self) -> list[str]:
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for fn in filenames:
                if not fn.startswith("."):
                    out.append((Path(dirpath) / fn).relative_to(self.root).as_posix())
        return sorted(out)

    def info(self, rel: str) -> FileInfo | None:
        """FileInfo for a request path, or None if it is not a servable file inside the repo."""
        parts = rel.split("/")
        if not rel or rel.startswith("/") or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
            return None
        # The lexical check above keeps requests inside root; symlinks are followed on purpose so an HF
        # cache snapshot (symlinks into blobs/) can be served as a repo.
        local = self.root.joinpath(*parts)
        try:
            if not local.is_file():
                return None
            size = local.stat().st_size
            lfs = self._is_lfs(rel, size)
            size, sha, sha1 = self._hashes.get(local, lfs)
        except OSError:
            return None
        return FileInfo(rel, size, sha, sha1, lfs, local)

    def files(self) -> list[FileInfo]:
        return [i for i in (self.info(p) for p in self.paths()) if i is not None]

    def commit(self, files: list[FileInfo]) -> str:
        """A 40-hex commit id that changes whenever any file's content changes."""
        h = hashlib.sha1(self.repo_id.encode(), usedforsecurity=False)
        for f in files:
            h.update(f"{f.path}\0{f.size}\0{f.sha256}\n".encode())
        return h.hexdigest()


def _listed(files: list[FileInfo], faults: Faults, root: str):
    """The files a listing under `root` shows (plus the malicious names when that fault is on), each with its path
    segments below `root`."""
    if faults.malicious_names:
        files = files + _malicious_files()
    for f in files:
        if not root or f.path.startswith(root + "/"):
            yield f, (f.path[len(root) + 1 :] if root else f.path).split("/")


def _listed_sha(f: FileInfo, faults: Faults) -> str:
    """The sha256 a listing states for a file (a wrong one under the wrong-sha fault)."""
    return hashlib.sha256(b"wrong:" + f.sha256.encode()).hexdigest() if _matches(f.path, faults.wrong_sha) else f.sha256


def _malicious_files() -> list[FileInfo]:
    sha = hashlib.sha256(_MALICIOUS_PAYLOAD).hexdigest()
    return [
        FileInfo(n, len(_MALICIOUS_PAYLOAD), sha, _git_sha1(_MALICIOUS_PAYLOAD), False, None) for n in MALICIOUS_NAMES
    ]


# ---------------------------------------------------------------------------------------------- server


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    hub: FakeHub


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "kimictl-fakehub/1"
    server: _Server

    # -- plumbing --------------------------------------------------------------------------------------

    def setup(self) -> None:
        super().setup()
        self.server.hub._connections_add(self.connection)

    def finish(self) -> None:
        self.server.hub._connections_discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        # Request lines and errors only; headers (which carry tokens) are never logged.
        log.debug("%s %s", self.client_address[0], format % args)

    def _dispatch(self) -> None:
        hub = self.server.hub
        self._sent = 0
        self._status = 0
        self._file_key: str | None = None
        self._auth: str | None = None
        # Read any request body up front so keep-alive stays in sync whatever the reply is.
        n = int(self.headers.get("Content-Length") or 0)
        self._posted = self.rfile.read(n) if n > 0 else b""
        split = urlsplit(self.path)
        path, query = unquote(split.path), parse_qs(split.query, keep_blank_values=True)
        # Admin calls are neither egress nor "in flight" (wait_idle() from /_admin/stats?wait=1).
        tracked = not path.startswith("/_admin/")
        if tracked:
            hub._begin()
        try:
            self._auth = hub._auth_method(self.headers)
            if self._auth is None:
                self._json(
                    401,
                    {
                        "Code": 10010205001,
                        "Success": False,
                        "Message": "unauthorized",
                        "error": "Invalid credentials in Authorization header",
                    },
                    extra={"X-Error-Code": "Unauthorized"},
                )
            elif path.startswith("/_admin/"):
                self._admin(path)
            elif path.startswith("/api/v1/"):
                self._modelscope(path, query)
            elif path.startswith("/api/models/"):
                self._hf_api(split.path, query)
            else:
                self._hf_resolve(path)
        except _Dropped:
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            hub._record(
                tracked,
                self.client_address[0],
                self.command,
                self.path,
                status=self._status,
                sent=self._sent,
                file_key=self._file_key,
                rng=self.headers.get("Range"),
                auth=self._auth,
            )
            if tracked:
                hub._end()

    do_GET = _dispatch
    do_HEAD = _dispatch
    do_POST = _dispatch

    def _body(self) -> bytes:
        return self._posted

    def _send_head(self, status: int, headers: dict[str, str]) -> None:
        self._status = status
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()

    def _json(self, status: int, obj: Any, extra: dict[str, str] | None = None) -> None:
        data = json.dumps(obj).encode()
        headers = {"Content-Type": "application/json", "Content-Length": str(len(data))}
        headers.update(extra or {})
        self._send_head(status, headers)
        if self.command != "HEAD":
            self._write(data)

    def _write(self, data: bytes) -> None:
        bucket = self.server.hub._bucket
        step = bucket.chunk_size()
        for i in range(0, len(data), step):
            piece = data[i : i + step]
            bucket.consume(len(piece))
            self.wfile.write(piece)
            self._sent += len(piece)

    # -- file bodies (both APIs) -----------------------------------------------------------------------

    def _serve_file(self, repo: Repo, info: FileInfo, headers: dict[str, str]) -> None:
        hub = self.server.hub
        faults = hub.faults
        key = f"{repo.repo_id}/{info.path}"
        self._file_key = key
        head = self.command == "HEAD"
        if not head and _matches(info.path, faults.slow_first_byte):
            time.sleep(faults.slow_delay)
        if not head and _matches(info.path, faults.fail) and hub._take("fail", key, faults.fail_times):
            self._json(
                faults.fail_status,
                {"Code": faults.fail_status, "Success": False, "Message": "injected failure"},
            )
            return
        start, end = 0, info.size - 1
        status = 200
        rng = self.headers.get("Range")
        if rng:
            parsed = _parse_range(rng, info.size)
            if parsed == "unsatisfiable":
                self._json(
                    416,
                    {"Code": 416, "Success": False, "Message": "range not satisfiable"},
                    extra={"Content-Range": f"bytes */{info.size}", **headers},
                )
                return
            if parsed is not None:
                start, end = parsed
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end}/{info.size}"
        length = end - start + 1
        headers.update(
            {
                "Content-Length": str(length),
                "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream",
            }
        )
        self._send_head(status, headers)
        if head:
            return
        # Fault limits: where to stop this body, if anywhere.
        stop = None
        if _matches(info.path, faults.truncate):
            cut = faults.truncate_at if faults.truncate_at is not None else info.size // 2
            stop = max(0, min(length, cut - start))
        if (
            _matches(info.path, faults.drop)
            and length > faults.drop_after
            and hub._take("drop", key, faults.drop_times)
        ):
            stop = faults.drop_after if stop is None else min(stop, faults.drop_after)
        send = length if stop is None else stop
        if info.local is None:
            self._write(_MALICIOUS_PAYLOAD[start : start + send])
        else:
            with open(info.local, "rb") as fh:
                fh.seek(start)
                left = send
                while left > 0:
                    chunk = fh.read(min(1 << 20, left))
                    if not chunk:
                        break
                    self._write(chunk)
                    left -= len(chunk)
        if stop is not None and stop < length:
            self.wfile.flush()
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            raise _Dropped

    # -- ModelScope -----------------------------------------------------------------------------------

    def _ms_ok(self, data: Any, request_id: bool = False) -> None:
        """ModelScope's success envelope around `data`."""
        doc: dict[str, Any] = {"Code": 200, "Success": True, "Message": "success"}
        if request_id:
            doc["RequestId"] = uuid.uuid4().hex
        self._json(200, {**doc, "Data": data})

    def _ms_error(self, status: int, message: str) -> None:
        self._json(
            status,
            {
                "Code": 10010205001 if status == 404 else status,
                "Success": False,
                "Message": message,
                "RequestId": uuid.uuid4().hex,
                "Data": None,
            },
        )

    def _modelscope(self, path: str, query: dict[str, list[str]]) -> None:
        hub = self.server.hub
        parts = path.split("/")  # ['', 'api', 'v1', 'models', owner, name, ...]
        if len(parts) < 6 or parts[3] != "models":
            self._ms_error(404, f"not found: {path}")
            return
        repo = hub._repo(f"{parts[4]}/{parts[5]}")
        rest = parts[6:]
        if repo is None:
            self._ms_error(404, f"model {parts[4]}/{parts[5]} does not exist")
            return
        files = repo.files()
        commit = repo.commit(files)
        revision = (query.get("Revision") or ["master"])[0] or "master"
        if rest and rest[0] in ("repo", "repo/files") and revision not in (*_MS_BRANCHES, commit):
            self._ms_error(404, f"revision {revision} does not exist")
            return
        if rest == ["repo", "files"]:
            self._ms_listing(repo, files, commit, query)
        elif rest == ["repo"]:
            file_path = (query.get("FilePath") or [""])[0]
            info = hub._lookup(repo, file_path)
            if info is None:
                self._ms_error(404, f"file {file_path} does not exist")
                return
            self._serve_file(repo, info, {"X-Linked-ETag": info.sha256})
        elif rest == ["revisions"]:
            self._ms_ok({"RevisionMap": {"Branches": [{"Revision": "master", "CreatedAt": 0, "CommitId": commit}],
                                         "Tags": []}})
        elif not rest:
            owner, name = repo.repo_id.split("/", 1)
            self._ms_ok({"Id": 0, "Name": name, "Path": owner, "ChineseName": name, "Revision": "master",
                         "LatestCommitId": commit})
        else:
            self._ms_error(404, f"not found: {path}")

    def _ms_listing(self, repo: Repo, files: list[FileInfo], commit: str, query: dict[str, list[str]]) -> None:
        faults = self.server.hub.faults
        root = (query.get("Root") or [""])[0].strip("/")
        recursive = (query.get("Recursive") or ["false"])[0].lower() == "true"
        entries: list[dict[str, Any]] = []
        dirs: set[str] = set()
        for f, segs in _listed(files, faults, root):
            if not recursive and len(segs) > 1:
                dirs.add(f"{root}/{segs[0]}" if root else segs[0])
                continue
            entries.append(
                {
                    "Name": f.path.rsplit("/", 1)[-1],
                    "Path": f.path,
                    "Type": "blob",
                    "Size": f.size,
                    "Sha256": _listed_sha(f, faults),
                    "Revision": commit,
                    "IsLFS": f.lfs,
                    "Mode": "33188",
                    "CommitMessage": "generated",
                    "CommittedDate": 0,
                    "CommitterName": "fakehub",
                    "Id": f.git_sha1 or f.oid,
                }
            )
        for d in sorted(dirs):
            entries.append(
                {
                    "Name": d.rsplit("/", 1)[-1],
                    "Path": d,
                    "Type": "tree",
                    "Size": 0,
                    "Sha256": "",
                    "Revision": commit,
                    "IsLFS": False,
                    "Mode": "040000",
                }
            )
        self._ms_ok({"Files": entries, "LatestCommitter": {"Name": "fakehub"}}, request_id=True)

    # -- Hugging Face ---------------------------------------------------------------------------------

    def _hf_api(self, raw_path: str, query: dict[str, list[str]]) -> None:
        # /api/models/{owner}/{name}[/revision/{rev} | /tree/{rev}[/{path}]]
        parts = raw_path.split("/")
        if len(parts) < 5:
            self._hf_404("RepoNotFound", "Repository not found")
            return
        found = self._hf_repo(f"{unquote(parts[3])}/{unquote(parts[4])}")
        if found is None:
            return
        repo, files, commit = found
        rest = parts[5:]
        if not rest or (rest[0] == "revision" and len(rest) >= 2):
            if not self._hf_rev_ok(unquote("/".join(rest[1:])) if rest else "main", commit):
                return
            siblings = [{"rfilename": f.path} for f in files]
            total = sum(f.size for f in files)
            self._json(
                200,
                {
                    "_id": commit[:24],
                    "id": repo.repo_id,
                    "modelId": repo.repo_id,
                    "sha": commit,
                    "private": False,
                    "disabled": False,
                    "gated": False,
                    "downloads": 0,
                    "likes": 0,
                    "tags": [],
                    "library_name": "transformers",
                    "siblings": siblings,
                    "usedStorage": total,
                    "lastModified": "2026-01-01T00:00:00.000Z",
                    "createdAt": "2026-01-01T00:00:00.000Z",
                },
            )
        elif rest and rest[0] == "tree" and len(rest) >= 2:
            if not self._hf_rev_ok(unquote(rest[1]), commit):
                return
            prefix = unquote("/".join(rest[2:])).strip("/")
            self._hf_tree(repo=repo, files=files, commit=commit, prefix=prefix, query=query, raw_path=raw_path)
        else:
            self._hf_404("EntryNotFound", f"not found: {raw_path}")

    def _hf_repo(self, repo_id: str) -> tuple[Repo, list[FileInfo], str] | None:
        """The repo, its files and commit; None once a RepoNotFound answer went out."""
        repo = self.server.hub._repo(repo_id)
        if repo is None:
            self._hf_404("RepoNotFound", "Repository not found")
            return None
        files = repo.files()
        return repo, files, repo.commit(files)

    def _hf_rev_ok(self, rev: str, commit: str) -> bool:
        """Whether `rev` names this repo's only revision; else a RevisionNotFound answer went out."""
        if rev in ("main", "master", commit):
            return True
        self._hf_404("RevisionNotFound", f"Invalid rev id: {rev}")
        return False

    def _hf_404(self, code: str, message: str, commit: str | None = None) -> None:
        extra = {"X-Error-Code": code, "X-Error-Message": message}
        if commit:
            extra["X-Repo-Commit"] = commit
        self._json(404, {"error": message}, extra=extra)

    def _hf_tree(
        self,
        *,
        repo: Repo,
        files: list[FileInfo],
        commit: str,
        prefix: str,
        query: dict[str, list[str]],
        raw_path: str,
    ) -> None:
        hub = self.server.hub
        faults = hub.faults
        recursive = (query.get("recursive") or ["false"])[0].lower() in ("true", "1")
        entries: list[dict[str, Any]] = []
        dirs: set[str] = set()
        for f, segs in _listed(files, faults, prefix):
            # HF lists every ancestor directory in recursive mode and only direct children otherwise.
            for i in range(1, len(segs) if recursive else min(2, len(segs))):
                dirs.add("/".join(([prefix] if prefix else []) + segs[:i]))
            if not recursive and len(segs) > 1:
                continue
            entry: dict[str, Any] = {"type": "file", "oid": f.oid, "size": f.size, "path": f.path}
            if f.lfs:
                entry["lfs"] = {"oid": _listed_sha(f, faults), "size": f.size, "pointerSize": len(f.pointer)}
            entries.append(entry)
        entries += [
            {
                "type": "directory",
                "oid": hashlib.sha1(d.encode(), usedforsecurity=False).hexdigest(),
                "size": 0,
                "path": d,
            }
            for d in sorted(dirs)
        ]
        entries.sort(key=lambda e: e["path"])
        if prefix and not entries:
            self._hf_404("EntryNotFound", f"{prefix} does not exist", commit)
            return
        cursor = int((query.get("cursor") or ["0"])[0] or 0)
        page = entries[cursor : cursor + hub.hf_page_size]
        extra = {}
        if cursor + hub.hf_page_size < len(entries):
            params = "&".join(f"{quote(k)}={quote(v[0])}" for k, v in query.items() if k != "cursor")
            nxt = f"{hub.url}{raw_path}?{params}{'&' if params else ''}cursor={cursor + hub.hf_page_size}"
            extra["Link"] = f'<{nxt}>; rel="next"'
        self._json(200, page, extra=extra)

    def _hf_resolve(self, path: str) -> None:
        hub = self.server.hub
        # /{owner}/{name}/resolve/{rev}/{path...}
        parts = path.split("/")
        if len(parts) < 6 or parts[3] != "resolve":
            self._hf_404("EntryNotFound", f"not found: {path}")
            return
        found = self._hf_repo(f"{parts[1]}/{parts[2]}")
        if found is None:
            return
        repo, _, commit = found
        rel = "/".join(parts[5:])
        if not self._hf_rev_ok(parts[4], commit):
            return
        info = hub._lookup(repo, rel)
        if info is None:
            self._hf_404("EntryNotFound", f"{rel} does not exist", commit)
            return
        headers = {"X-Repo-Commit": commit, "ETag": f'"{info.etag}"'}
        if info.lfs:
            headers["X-Linked-Etag"] = f'"{info.sha256}"'
            headers["X-Linked-Size"] = str(info.size)
        self._serve_file(repo, info, headers)

    # -- admin ------------------------------------------------------------------------------------------

    def _admin(self, path: str) -> None:
        hub = self.server.hub
        if path == "/_admin/stats" and self.command == "GET":
            if "wait" in parse_qs(urlsplit(self.path).query):
                hub.wait_idle()
            self._json(200, hub.stats())
        elif path == "/_admin/stats/reset" and self.command == "POST":
            hub.reset_stats()
            self._json(200, hub.stats())
        elif path == "/_admin/requests" and self.command == "GET":
            self._json(200, hub.requests())
        elif path == "/_admin/faults" and self.command == "GET":
            self._json(200, hub.faults.to_json())
        elif path == "/_admin/faults" and self.command == "POST":
            try:
                hub.set_faults(json.loads(self._body() or b"{}"))
            except (ValueError, TypeError) as exc:
                self._json(400, {"error": str(exc)})
                return
            self._json(200, hub.faults.to_json())
        elif path == "/_admin/rate" and self.command == "POST":
            try:
                body = json.loads(self._body() or b"{}")
                rate = body.get("rate")
                hub.set_rate(parse_size(rate) if isinstance(rate, str) else rate)
            except (ValueError, TypeError, AttributeError) as exc:
                self._json(400, {"error": str(exc)})
                return
            self._json(200, {"rate": hub.rate})
        else:
            self._json(404, {"error": f"unknown admin endpoint {self.command} {path}"})


def _parse_range(value: str, size: int) -> tuple[int, int] | str | None:
    """(start, end) inclusive, 'unsatisfiable', or None to ignore the header (multi-range, junk)."""
    value = value.strip()
    if not value.startswith("bytes=") or "," in value:
        return None
    first, _, last = value[6:].strip().partition("-")
    try:
        if not first:
            n = int(last)
            if n <= 0 or size == 0:
                return "unsatisfiable"
            return max(0, size - n), size - 1
        start = int(first)
        end = int(last) if last else size - 1
    except ValueError:
        return None
    if start >= size or end < start:
        return "unsatisfiable"
    return start, min(end, size - 1)


# ------------------------------------------------------------------------------------------------ hub


class FakeHub:
    """A ModelScope + Hugging Face compatible hub serving local directories.

    repos maps repo ids ("Eco-Tech/Kimi-K2.5-W4A8") to directories; ids match case-insensitively, since
    vllm-ascend spells this one "Kimi-K2.5-w4a8". rate is bytes/s (int) or a string like "25MB/s".
    """

    def __init__(
        self,
        repos: dict[str, Path | str],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        rate: float | str | None = None,
        token: str | None = None,
        faults: Faults | dict[str, Any] | None = None,
        hf_page_size: int = HF_PAGE_SIZE,
        max_log: int = 10000,
    ) -> None:
        hashes = _HashCache()
        self._repos = {rid: Repo(rid, d, hashes) for rid, d in repos.items()}
        self.host, self.port = host, port
        self._token = token
        self.hf_page_size = hf_page_size
        self.faults = faults if isinstance(faults, Faults) else Faults.from_json(faults)
        self._bucket = TokenBucket(parse_size(rate) if isinstance(rate, str) else rate)
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, str], int] = {}
        self._clients: dict[str, dict[str, Any]] = {}
        self._log: deque[dict[str, Any]] = deque(maxlen=max_log)
        self._idle = threading.Condition(self._lock)
        self._conns: set[socket.socket] = set()
        self._active = 0
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> FakeHub:
        if self._server is not None:
            raise RuntimeError("already started")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        server_cls = type("_BoundServer", (_Server,), {"address_family": family})
        self._server = server_cls((self.host, self.port), _Handler)
        self._server.hub = self
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"fakehub:{self.port}",
            daemon=True,
        )
        self._thread.start()
        log.info("fake hub serving %s on %s", sorted(self._repos), self.url)
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        # Handler threads are daemons; cut their sockets so no download outlives stop().
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread:
            self._thread.join(timeout=10)
        self._server = self._thread = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def warm(self) -> None:
        """Hash every served file now, so the first listing does not stall a client on a big checkpoint."""
        for repo in self._repos.values():
            repo.files()

    # -- runtime knobs ---------------------------------------------------------------------------------

    @property
    def rate(self) -> float | None:
        return self._bucket.rate

    def set_rate(self, rate: float | None) -> None:
        self._bucket.set_rate(rate)

    def set_faults(self, faults: Faults | dict[str, Any] | None) -> None:
        """Replace the fault settings and reset the drop/fail counters."""
        new = faults if isinstance(faults, Faults) else Faults.from_json(faults)
        with self._lock:
            self.faults = new
            self._counters.clear()

    def _take(self, kind: str, key: str, times: int) -> bool:
        """True while the fault kind has fired fewer than `times` times for this file."""
        with self._lock:
            n = self._counters.get((kind, key), 0)
            if n >= times:
                return False
            self._counters[(kind, key)] = n + 1
            return True

    # -- lookup / auth ---------------------------------------------------------------------------------

    def _repo(self, repo_id: str) -> Repo | None:
        if repo_id in self._repos:
            return self._repos[repo_id]
        low = repo_id.lower()
        return next((r for rid, r in self._repos.items() if rid.lower() == low), None)

    def _lookup(self, repo: Repo, rel: str) -> FileInfo | None:
        if self.faults.malicious_names:
            for m in _malicious_files():
                if m.path == rel:
                    return m
        return repo.info(rel)

    def _auth_method(self, headers: Any) -> str | None:
        """How the request proved the token ("bearer", "cookie:<name>"); "none" without a token; else None."""
        if not self._token:
            return "none"
        expected = self._token.encode()
        auth = headers.get("Authorization") or ""
        if auth.lower().startswith("bearer ") and hmac.compare_digest(auth[7:].strip().encode(), expected):
            return "bearer"
        # modelscope-hub sends the token as cookies on its download paths (m_session_id, modelscope_session).
        for raw in headers.get_all("Cookie") or []:
            jar: http.cookies.SimpleCookie = http.cookies.SimpleCookie()
            with contextlib.suppress(http.cookies.CookieError):
                jar.load(raw)
            for name in ("m_session_id", "modelscope_session"):
                if name in jar and hmac.compare_digest(jar[name].value.encode(), expected):
                    return f"cookie:{name}"
        return None

    # -- accounting ------------------------------------------------------------------------------------

    def _record(
        self,
        tracked: bool,
        ip: str,
        method: str,
        path: str,
        *,
        status: int,
        sent: int,
        file_key: str | None,
        rng: str | None,
        auth: str | None,
    ) -> None:
        log.info("%s %s %s %s %d", ip, method, path, status, sent)
        if not tracked:
            return  # admin calls are not hub egress
        with self._lock:
            c = self._clients.setdefault(ip, {"bytes": 0, "requests": 0, "files": {}})
            c["bytes"] += sent
            c["requests"] += 1
            if file_key and sent:
                c["files"][file_key] = c["files"].get(file_key, 0) + sent
            self._log.append(
                {
                    "ts": time.time(),
                    "client": ip,
                    "method": method,
                    "path": path,
                    "status": status,
                    "bytes": sent,
                    "range": rng,
                    "auth": auth,
                }
            )

    def stats(self) -> dict[str, Any]:
        """Response body bytes served per client IP (and file bodies per repo/file); admin calls excluded."""
        with self._lock:
            clients = {
                ip: {"bytes": c["bytes"], "requests": c["requests"], "files": dict(c["files"])}
                for ip, c in self._clients.items()
            }
        return {
            "total_bytes": sum(c["bytes"] for c in clients.values()),
            "total_requests": sum(c["requests"] for c in clients.values()),
            "clients": clients,
            "rate": self.rate,
        }

    def _connections_add(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.add(conn)

    def _connections_discard(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.discard(conn)

    def _begin(self) -> None:
        with self._lock:
            self._active += 1

    def _end(self) -> None:
        with self._lock:
            self._active -= 1
            if not self._active:
                self._idle.notify_all()

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until no hub request is in flight, so stats include everything a client has received.

        A reply reaches the client just before the server thread records it; call this before reading
        stats() or requests() right after a download.
        """
        with self._lock:
            return self._idle.wait_for(lambda: self._active == 0, timeout)

    def requests(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._log)

    def reset_stats(self) -> None:
        with self._lock:
            self._clients.clear()
            self._log.clear()


# ------------------------------------------------------------------------------------------------ CLI


def _parse_repo(text: str) -> tuple[str, Path]:
    rid, sep, d = text.partition("=")
    if not sep or rid.count("/") != 1 or not d:
        raise argparse.ArgumentTypeError(f"expected OWNER/NAME=DIR, got {text!r}")
    return rid, Path(d)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kimictl.sandbox.fakehub", description=__doc__)
    ap.add_argument("--repo", action="append", type=_parse_repo, required=True, metavar="OWNER/NAME=DIR")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--rate", help="egress limit for the whole server, e.g. 25MB/s, 200Mbit/s")
    ap.add_argument("--token-file", type=Path, help="require this bearer token (or m_session_id cookie)")
    ap.add_argument("--faults", help="fault JSON, or @FILE")
    ap.add_argument("--pidfile", type=Path)
    ap.add_argument("--log-file", type=Path, help="request log (never contains the token)")
    ap.add_argument("--hf-page-size", type=int, default=HF_PAGE_SIZE)
    args = ap.parse_args(argv)

    handler: logging.Handler = logging.FileHandler(args.log_file) if args.log_file else logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)

    token = args.token_file.read_text().strip() if args.token_file else None
    faults = None
    if args.faults:
        faults = json.loads(Path(args.faults[1:]).read_text() if args.faults.startswith("@") else args.faults)
    hub = FakeHub(
        dict(args.repo),
        host=args.host,
        port=args.port,
        rate=args.rate,
        token=token,
        faults=faults,
        hf_page_size=args.hf_page_size,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    hub.warm()
    hub.start()
    try:
        if args.pidfile:
            args.pidfile.write_text(f"{os.getpid()}\n")
        print(hub.url, flush=True)
        stop.wait()
    finally:
        hub.stop()
        if args.pidfile:
            args.pidfile.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
