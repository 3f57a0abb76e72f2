#!/usr/bin/env python3
"""kimictl weights agent: the host side of `kimictl weights` (stdlib only; the hub clients are imported lazily).

`serve` speaks JSON lines with the control node over one SSH channel: stdin carries operations, stdout
events. kimictl does not install it to verify: the source arrives as the first stdin line. `weights pull`
also installs it as a file, because `rsync-serve` is the forced command of the run's peer key.

On-disk protocol inside the model directory (never served, since hubs skip dot-names too):
  .kimi-staging/   downloads and transfers land here; a file is renamed into place only after its hash matches
  .kimi-stamps.json  path -> [size, mtime_ns, inode, digest]: re-verifying an unchanged file does not read it
  .kimi-complete   written last and atomically: the manifest digest the directory holds in full
  .kimi-lock       flock held by the running agent (the kernel drops it when the agent dies: it cannot go stale)
"""

from __future__ import annotations

import os
import sys

# The peer key's forced command accepts exactly what peer_fetch_command makes rsync send to the holder:
#   rsync --server --sender -Re<capabilities> --timeout=<PEER_RSYNC_TIMEOUT> . NAME...
PEER_RSYNC_TIMEOUT = 60
REFUSAL_LOG_MAX = 1 << 20   # the refusal log stops growing here (a key holder may knock as often as it likes)


def unsafe_name(path: str) -> str | None:
    """Why a repo-relative path may not be written under the model directory, or None when it is safe."""
    if not path:
        return "empty name"
    if any(c < " " or c == "\x7f" for c in path):
        return "control character"
    if "\\" in path:
        return "backslash"
    if path.startswith("/"):
        return "absolute path"
    if path.startswith("~"):
        return "leading '~'"
    parts = path.split("/")
    if any(p in (".", "..") for p in parts):
        return "'.' or '..' component"
    if "" in parts:
        return "empty component"
    if any(len(p.encode()) > 255 for p in parts):
        return "component longer than 255 bytes"
    return None


def _flags_ok(word: str) -> bool:
    """-R (kimictl's only short option) then rsync's -e capability string: "." or "<proto>.<sub>", then letters."""
    if not word.startswith("-Re"):
        return False
    proto, dot, caps = word[3:].partition(".")
    if dot != "." or not (proto == "" or (proto.isascii() and proto.isdigit())):
        return False
    caps = caps.lstrip("0123456789") if proto else caps
    return caps == "" or (caps.isascii() and caps.isalpha())


def parse_peer_command(cmd: str) -> tuple[list[str] | None, str]:
    """(the rsync argv to run, "") for an SSH_ORIGINAL_COMMAND kimictl's own peer fetch sends, else (None, why).

    Nothing else passes: no other option (--log-file, --remove-source-files, a receiver...), no name that is
    absolute, climbs out with '..', starts with '-' (rsync would read it as an option) or holds a control character.
    """
    if any(c in cmd for c in "\\'\""):   # rsync escaped a name: let shlex undo it exactly
        import shlex
        try:
            words = shlex.split(cmd)
        except ValueError as exc:
            return None, f"unparsable command ({exc})"
    else:
        words = [w for w in cmd.replace("\t", " ").replace("\r", " ").replace("\n", " ").split(" ") if w]
    head = ["rsync", "--server", "--sender"]
    if words[:3] != head:
        return None, "not a read-only rsync (rsync --server --sender)"
    if len(words) < 7:
        return None, "too few arguments"
    flags, timeout, dot, names = words[3], words[4], words[5], words[6:]
    if not _flags_ok(flags):
        return None, f"option {flags!r}"
    if timeout != f"--timeout={PEER_RSYNC_TIMEOUT}":
        return None, f"option {timeout!r}"
    if dot != ".":
        return None, f"argument {dot!r} where '.' belongs"
    for name in names:
        why = "leading '-'" if name.startswith("-") else unsafe_name(name)
        if why:
            return None, f"name {name!r}: {why}"
    return [*head, flags, timeout, ".", *names], ""


def _refuse(why: str, cmd: str, log: str | None) -> int:
    """Tell the caller, and leave a trace on this host: syslog (auth) and the refusal log (kimictl logs bundle)."""
    import syslog
    import time

    client = os.environ.get("SSH_CLIENT", "?").split(" ")[0]
    text = f"kimi weights: peer key from {client}: refused rsync arguments ({why}): {cmd[:400]!r}"
    sys.stderr.write(text + "\n")
    syslog.openlog("kimictl-weights", 0, syslog.LOG_AUTH)
    syslog.syslog(syslog.LOG_WARNING, text)
    if log:
        try:
            os.makedirs(os.path.dirname(log), 0o755, exist_ok=True)
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                if os.fstat(fd).st_size < REFUSAL_LOG_MAX:
                    os.write(fd, f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {text}\n".encode(errors="replace"))
            finally:
                os.close(fd)
        except OSError:
            pass   # syslog and the caller have it
    return 1


def rsync_serve(model_dir: str, log: str | None = None) -> int:
    """Forced command of the peer key: only kimictl's own read-only rsync of names inside model_dir."""
    cmd = os.environ.get("SSH_ORIGINAL_COMMAND", "")
    argv, why = parse_peer_command(cmd)
    if argv is None:
        return _refuse(why, cmd, log)
    root = os.path.realpath(model_dir)
    for name in argv[6:]:   # a symlink inside the directory must not lead out of it
        if not os.path.realpath(os.path.join(root, name)).startswith(root + os.sep):
            return _refuse(f"name {name!r} resolves outside {model_dir}", cmd, log)
    os.chdir(root)
    os.execvpe("rsync", argv, {"PATH": os.environ.get("PATH") or "/usr/bin:/bin"})
    return 1  # pragma: no cover


if __name__ == "__main__" and sys.argv[1:2] == ["rsync-serve"] and len(sys.argv) in (3, 4):
    # the forced command runs once per peer transfer: serve before importing the rest (~100 ms of CPU each)
    sys.exit(rsync_serve(*sys.argv[2:]))

import fcntl  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import stat  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

STAGING = ".kimi-staging"
STAMPS = ".kimi-stamps.json"
MARKER = ".kimi-complete"
LOCK = ".kimi-lock"
# The run's peer key expires this long after it was installed or last renewed; the agent of a running pull renews
# it every KEY_RENEW_S, so a key outlives a killed run by at most KEY_TTL_S (and only until a weights command).
KEY_TTL_S = 3600
KEY_RENEW_S = 600
BLOCK = 8 << 20
FOLLOW_MIN = 16 << 20   # files at least this big that come alone from a peer are hashed while they arrive
PROGRESS_EVERY_S = 0.5
# AES-GCM runs on AES-NI / ARMv8 crypto at several GB/s; chacha20 is the fallback for CPUs without them
FAST_CIPHERS = ["-o", "Ciphers=aes128-gcm@openssh.com,chacha20-poly1305@openssh.com,aes128-ctr"]


def try_lock(path: Path, holder: dict, mode: int = 0o644) -> tuple[int | None, dict]:
    """flock path without waiting: (fd, holder) on success, (None, the current holder's record) when held.

    The kernel drops the lock when its holder dies, so it cannot go stale; the record only names the holder.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, mode)   # a planted symlink is refused (ELOOP)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            who = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            who = {}
        os.close(fd)
        return None, who
    record = {**holder, "pid": os.getpid()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    return fd, record


def untrusted_dir(d: Path) -> str:
    """Why the agent (root) must not write in d, or "": d must be a directory owned by the agent's own user (root on
    the hosts) that neither group nor others may write, or anyone who can write there plants symlinks for it."""
    st = d.stat()
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not {os.geteuid()} (chown it)"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {st.st_mode & 0o777:o}; chmod go-w it)"
    return ""


def new_hash(algo: str, size: int):
    """sha256, or the git blob sha1 ("blob <size>\\0" + bytes) that HF lists for small non-LFS files."""
    return hashlib.sha256() if algo == "sha256" else hashlib.sha1(b"blob %d\0" % size)


def file_digest(path: Path, algo: str) -> str:
    h = new_hash(algo, path.stat().st_size)
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(BLOCK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
        os.fsync(f.fileno())  # what we hashed is what survives a power cut
    return h.hexdigest()


def expected(entry: dict) -> tuple[str, str]:
    return ("sha256", entry["sha256"]) if entry.get("sha256") else ("git_sha1", entry["git_sha1"])


def _atomic_write(path: Path, text: str) -> None:
    """Write path whole or not at all. The temp file is made afresh (O_EXCL, O_NOFOLLOW): whatever someone put
    under its name (a symlink to /etc/shadow) is removed, never written through."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Agent:
    def __init__(self, model_dir: str, out=None):
        self.dir = Path(model_dir)
        self.stage = self.dir / STAGING
        self.out = out or sys.stdout
        self.out_lock = threading.Lock()
        self.state_lock = threading.Lock()
        self.manifest: dict[str, dict] = {}
        self.meta: dict = {}
        self.stamps: dict[str, list] = {}
        self.children: set[subprocess.Popen] = set()
        self.lock_fd: int | None = None
        self.secrets: list[str] = []
        self.threads = max(1, min(16, os.cpu_count() or 1))

    # --- plumbing --------------------------------------------------------------------------------------
    def emit(self, **event) -> None:
        line = json.dumps(event)
        for s in self.secrets:
            line = line.replace(s, "***")
        with self.out_lock:
            self.out.write(line + "\n")
            self.out.flush()

    def _load_stamps(self) -> None:
        try:
            self.stamps = json.loads((self.dir / STAMPS).read_text())
        except (OSError, ValueError):
            self.stamps = {}

    def _save_stamps(self) -> None:
        with self.state_lock:
            _atomic_write(self.dir / STAMPS, json.dumps(self.stamps, sort_keys=True))

    def _lock(self, holder: dict) -> bool:
        self.dir.mkdir(parents=True, exist_ok=True)
        why = untrusted_dir(self.dir)
        if why:
            self.emit(ev="error", message=f"refusing model dir {str(self.dir)!r}: {why}")
            return False
        fd, who = try_lock(self.dir / LOCK, holder)
        if fd is None:
            self.emit(ev="locked", holder=who)
            return False
        self.lock_fd = fd
        return True

    # --- checking what is there ------------------------------------------------------------------------
    def _check_one(self, path: str, mode: str) -> tuple[str, int]:
        """(ok | missing | bad | unverified, bytes read) for one manifest file."""
        entry, f = self.manifest[path], self.dir / path
        try:
            st = f.stat()
        except OSError:
            return "missing", 0
        if st.st_size != entry["size"]:
            return "bad", 0
        algo, want = expected(entry)
        stamp = self.stamps.get(path)
        if mode != "full" and stamp == [st.st_size, st.st_mtime_ns, st.st_ino, want]:
            return "ok", 0
        if mode == "stat":
            return "unverified", 0
        if file_digest(f, algo) != want:
            return "bad", st.st_size
        st = f.stat()
        with self.state_lock:
            self.stamps[path] = [st.st_size, st.st_mtime_ns, st.st_ino, want]
        return "ok", st.st_size

    def op_hello(self, op: dict) -> None:
        """Load the manifest, check what is present (mode stat | stamps | full), report; pull also locks."""
        t0 = time.monotonic()
        self.manifest = {e["path"]: e for e in op["manifest"]["files"]}
        self.meta = {k: op["manifest"].get(k) for k in ("source", "model_id", "revision")} | {"digest": op["digest"]}
        for p in self.manifest:
            if why := unsafe_name(p):
                self.emit(ev="error", message=f"refusing manifest entry {p!r}: {why}")
                return
        if op.get("pull") and not self._lock(op.get("holder") or {}):
            return
        if op.get("pull"):   # an agent that died mid-write (its control node was killed) left its temp file
            for name in (STAMPS, MARKER):
                for stale in self.dir.glob(f".{name}.tmp*"):
                    stale.unlink(missing_ok=True)
        peer_key = self._stale_peer_key(op)
        if op.get("pull") and op.get("key_comment"):
            threading.Thread(target=self._renew_peer_key, args=(op["key_comment"],), daemon=True).start()
        self._load_stamps()
        results: dict[str, list[str]] = {"ok": [], "missing": [], "bad": [], "unverified": []}
        read = 0
        if self.dir.is_dir():
            with ThreadPoolExecutor(self.threads) as pool:
                for path, (state, n) in zip(self.manifest, pool.map(lambda p: self._check_one(p, op["mode"]),
                                                                     self.manifest)):
                    results[state].append(path)
                    read += n
        else:
            results["missing"] = list(self.manifest)
        marker = self._marker()
        complete = marker.get("digest") == op["digest"] and not (results["missing"] or results["bad"]
                                                                   or results["unverified"])
        if op.get("pull"):
            for p in results["bad"]:  # never serve or load it; it is fetched again
                (self.dir / p).unlink(missing_ok=True)
                self.stamps.pop(p, None)
        if not complete and (op.get("pull") or (op.get("invalidate") and (results["missing"] or results["bad"]))):
            (self.dir / MARKER).unlink(missing_ok=True)
        if self.dir.is_dir() and os.access(self.dir, os.W_OK):
            self._save_stamps()
        self.emit(ev="state", have=results["ok"], missing=results["missing"], bad=results["bad"],
                  unverified=results["unverified"], complete=complete, marker=marker, bytes_read=read,
                  seconds=round(time.monotonic() - t0, 3), peer_key=peer_key,
                  sources=source_addresses(op.get("peers") or []))

    def _stale_peer_key(self, op: dict) -> dict | None:
        """The cluster's peer key when one is installed here: removed unless a running pull holds this directory.

        A pull's agents take their key away when every host is complete; a killed run leaves it behind, and the
        next weights command that talks to this host (pull, verify, status; deploy pulls) removes it.
        """
        comment = op.get("key_comment")
        lines = peer_key_lines(comment) if comment else []
        if not lines:
            return None
        report = {"expires": expiry_of(lines[0]), "lines": len(lines)}
        holder = None if self.lock_fd is not None else lock_holder(self.dir / LOCK)
        if holder is not None:   # a running pull's own key
            return {**report, "state": "in use", "holder": holder}
        try:
            authorize(comment, None)
            if op.get("key_dir"):
                shutil.rmtree(op["key_dir"], ignore_errors=True)
        except OSError as exc:
            return {**report, "state": "present", "error": f"cannot remove it: {exc}"}
        return {**report, "state": "removed"}

    def _renew_peer_key(self, comment: str) -> None:
        """While this pull runs, push its key's expiry forward (the key is installed after hello, by Ansible)."""
        while True:
            time.sleep(KEY_RENEW_S)
            try:
                renew_peer_key(comment, time.time() + KEY_TTL_S)
            except OSError as exc:
                self.emit(ev="warning", message=f"cannot renew the peer key's expiry: {exc}")

    def _marker(self) -> dict:
        try:
            return json.loads((self.dir / MARKER).read_text())
        except (OSError, ValueError):
            return {}

    # --- landing a file -------------------------------------------------------------------------------
    def _install(self, path: str, tmp: Path, via: str, t0: float, hashed: _Follow | None = None) -> None:
        """Hash the landed file (or take what `hashed` read of it while it arrived); rename it into place only
        when it matches."""
        self.emit(ev="received", path=path)   # its bytes are in: the control node may start the next transfer
        entry = self.manifest[path]
        algo, want = expected(entry)
        size = tmp.stat().st_size if tmp.exists() else -1
        if size != entry["size"]:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"size {size} != {entry['size']}")
        got = hashed.digest_of(tmp) if hashed else None
        if got is None:
            got = file_digest(tmp, algo)
        if got != want:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"{algo} mismatch: got {got[:16]}..., manifest says {want[:16]}...")
        final = self.dir / path
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, final)
        st = final.stat()
        with self.state_lock:
            self.stamps[path] = [st.st_size, st.st_mtime_ns, st.st_ino, want]
        self._save_stamps()
        self.emit(ev="done", path=path, via=via, bytes=entry["size"], seconds=round(time.monotonic() - t0, 3))

    def _guard(self, path: str, via: str, fn) -> None:
        t0 = time.monotonic()
        try:
            fn(t0)
        except Exception as exc:  # reported to the control node, which retries or fails the run
            self.emit(ev="fail", path=path, via=via, error=str(exc)[-1500:])

    # --- sources ---------------------------------------------------------------------------------------
    def op_hub(self, op: dict) -> None:
        """Pull these files from the hub, one after another, with the real client library (own thread)."""
        if op.get("token") and op["token"] not in self.secrets:   # one op per file
            self.secrets.append(op["token"])
        threading.Thread(target=self._hub_files, args=(op,), daemon=True).start()

    def _hub_files(self, op: dict) -> None:
        try:
            pull = self._hub_client(op)
        except Exception as exc:
            for p in op["files"]:
                self.emit(ev="fail", path=p, via="hub", error=f"hub client unavailable: {exc}")
            return
        for path in op["files"]:
            self._guard(path, "hub", lambda t0, path=path: self._install(path, pull(path), "hub", t0))

    def _hub_client(self, op: dict):
        stage = self.stage / f"hub{int(op.get('lane', 0))}"   # one client download area per concurrent pull
        stage.mkdir(parents=True, exist_ok=True)
        token = op.get("token") or ""
        os.environ["TQDM_DISABLE"] = "1"   # progress goes to the control node as events
        if op["source"] == "modelscope":
            os.environ.update({"MODELSCOPE_ENDPOINT": op["endpoint"] or "https://www.modelscope.cn",
                               "MODELSCOPE_DOWNLOAD_INTRA_CLOUD": "false",
                               "MODELSCOPE_CACHE": str(self.stage / "ms-cache")})
            if token:
                os.environ["MODELSCOPE_API_TOKEN"] = token
            from modelscope.hub.snapshot_download import snapshot_download
            from modelscope_hub import ProgressCallback

            agent = self

            class Progress(ProgressCallback):
                def __init__(self, filename: str, file_size: int):
                    super().__init__(filename, file_size)
                    self.seen, self.last = 0, 0.0

                def update(self, size: int) -> None:
                    self.seen += size
                    if time.monotonic() - self.last > PROGRESS_EVERY_S:
                        self.last = time.monotonic()
                        agent.emit(ev="progress", path=self.filename, bytes=self.seen)

            def pull(path: str) -> Path:
                snapshot_download(op["model_id"], revision=op["revision"], local_dir=str(stage),
                                  allow_patterns=[_glob_escape(path)], max_workers=1, progress_callbacks=[Progress])
                return stage / path
            return pull

        os.environ.update({"HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                           "HF_HOME": str(self.stage / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1"})
        if op["endpoint"]:
            os.environ["HF_ENDPOINT"] = op["endpoint"]  # read once, at import
        from huggingface_hub import hf_hub_download

        def pull_hf(path: str) -> Path:
            watch = _Watch(self, path, stage / ".cache")
            try:
                return Path(hf_hub_download(op["model_id"], path, revision=op["revision"], local_dir=str(stage),
                                            token=token or None))
            finally:
                watch.stop()
        return pull_hf

    def op_fetch(self, op: dict) -> None:
        """rsync verified files from one peer (read-only forced command there) in one stream, own thread."""
        threading.Thread(target=self._fetch, args=(op,), daemon=True).start()

    def _fetch(self, op: dict) -> None:
        paths, peer, t0 = op["paths"], op["peer"], time.monotonic()
        root = self.stage / "peer"
        root.mkdir(parents=True, exist_ok=True)
        cmd = peer_fetch_command(op, root)
        entry = self.manifest[paths[0]]
        follow = _Follow(root / paths[0], entry["size"], expected(entry)[0]) \
            if len(paths) == 1 and entry["size"] >= FOLLOW_MIN else None
        try:
            rc, tail = run_rsync(cmd, lambda p, n: self.emit(ev="progress", path=p, bytes=n), self.children, paths)
        except OSError as exc:
            rc, tail = -1, str(exc)
        if follow:
            follow.stop()
        for path in paths:   # what arrived whole is kept even when the stream broke later
            dest = root / path
            if rc == 0 or (dest.exists() and dest.stat().st_size == self.manifest[path]["size"]):
                self._guard(path, peer["name"], lambda t, path=path, dest=dest: self._install(path, dest,
                                                                                            peer["name"], t0, follow))
            else:
                self.emit(ev="fail", path=path, via=peer["name"], error=f"rsync from {peer['name']} exited {rc}: "
                                                                         f"{tail}")

    def op_adopt(self, op: dict) -> None:
        """A file the control node pushed into .kimi-staging/push: verify it and rename it into place."""
        path = op["path"]
        self._guard(path, "control", lambda t0: self._install(path, self.stage / "push" / path, "control", t0))

    # --- the end ---------------------------------------------------------------------------------------
    def op_finish(self, op: dict) -> None:
        """Every manifest file in place and stamped: write the marker last, drop the staging area."""
        missing = [p for p in self.manifest if self._check_one(p, "stamps")[0] != "ok"]
        if missing:
            self.emit(ev="error", message=f"{len(missing)} file(s) not in place: {', '.join(missing[:5])}")
            return
        self._save_stamps()
        _atomic_write(self.dir / MARKER, json.dumps({**self.meta, "files": len(self.manifest),
                                                      "bytes": sum(e["size"] for e in self.manifest.values()),
                                                      "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
        shutil.rmtree(self.stage, ignore_errors=True)
        self.emit(ev="complete", digest=self.meta["digest"])

    def op_cleanup(self, op: dict) -> None:
        """Every host is complete: take this run's peer key away (the playbook does it if we cannot)."""
        authorize(op["key_comment"], None)
        shutil.rmtree(op["key_dir"], ignore_errors=True)
        self.emit(ev="cleaned")

    def shutdown(self) -> None:
        for p in list(self.children):
            p.kill()

    def serve(self) -> int:
        ops = {"hello": self.op_hello, "hub": self.op_hub, "fetch": self.op_fetch, "adopt": self.op_adopt,
               "finish": self.op_finish, "cleanup": self.op_cleanup}
        signal.signal(signal.SIGTERM, lambda *_: (self.shutdown(), os._exit(143)))
        try:
            for line in sys.stdin.buffer:
                op = json.loads(line)
                fn = ops.get(op.get("op"))
                if fn is None:
                    self.emit(ev="error", message=f"unknown op {op.get('op')!r}")
                    continue
                try:
                    fn(op)
                except Exception as exc:
                    self.emit(ev="error", message=f"{op.get('op')}: {type(exc).__name__}: {exc}")
        finally:
            # stdin closed: the control node is gone or done; no transfer outlives it
            self.shutdown()
        os._exit(0)  # hub threads may still be blocked in the client; the lock goes with the process


def peer_fetch_command(op: dict, root: Path) -> list[str]:
    """rsync of op["paths"] from op["peer"] into root in one stream, with the run's key. The holder's forced command
    accepts exactly what these options make rsync send (parse_peer_command): change one, change both."""
    paths, peer = op["paths"], op["peer"]
    addr = f"[{peer['address']}]" if ":" in peer["address"] else peer["address"]
    ssh = shlex.join(["ssh", "-i", op["key"], "-p", str(peer["port"]),
                      "-o", f"UserKnownHostsFile={op['known_hosts']}", "-o", "StrictHostKeyChecking=yes",
                      "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-o", "ConnectTimeout=10",
                      "-o", "ServerAliveInterval=15", *_multiplex(op["key"])])
    # -R keeps each name's directories under the staging root; one remote host, several sources
    sources = [f"{peer['user']}@{addr}:{paths[0]}", *(f":{p}" for p in paths[1:])]
    return ["rsync", "-R", "--partial", "--partial-dir=.kimi-partial", "--progress",
            f"--timeout={PEER_RSYNC_TIMEOUT}", "-e", ssh, *sources, f"{root}/"]


class _Follow:
    """Hash a file while rsync writes it, so it need not be read again once it is in.

    rsync's receiver writes a new file front to back into a temp file next to the destination
    (.<name>.XXXXXX) and renames it at the end: the bytes are hashed as they land. The digest counts only when
    the file that ends up at the destination is the very inode that was read, and whole; otherwise the file is
    hashed after all.
    """

    def __init__(self, dest: Path, size: int, algo: str):
        self.dest, self.size, self.algo = dest, size, algo
        self.ended = threading.Event()
        self.opened = threading.Event()   # rsync's temp file was found and is being read
        self.digest: str | None = None
        self.ino: int | None = None
        self.since = time.time()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _temp(self):
        """rsync's temp file for dest, once it is there (made since we started)."""
        name = self.dest.name
        try:
            for c in self.dest.parent.iterdir():
                n = c.name
                if n.startswith(f".{name}.") and len(n) == len(name) + 8:
                    f = open(c, "rb")   # noqa: SIM115 (closed by _run)
                    st = os.fstat(f.fileno())
                    if st.st_mtime >= self.since - 1:
                        return f, st.st_ino
                    f.close()
        except OSError:
            pass
        return None, None

    def _run(self) -> None:
        f, ino = self._temp()
        while f is None:
            if self.ended.wait(0.05):
                return
            f, ino = self._temp()
        self.opened.set()
        h, got = new_hash(self.algo, self.size), 0
        buf = bytearray(BLOCK)
        view = memoryview(buf)
        with f:
            while got < self.size:
                n = f.readinto(buf)
                if n:
                    h.update(view[:n])
                    got += n
                elif self.ended.is_set():
                    if not f.readinto(buf):   # what was written before rsync ended is all there is
                        break
                    f.seek(got)
                else:
                    time.sleep(0.02)
        if got == self.size:
            self.ino, self.digest = ino, h.hexdigest()

    def stop(self) -> None:
        """rsync has ended: read what is left."""
        self.ended.set()
        self.thread.join()

    def digest_of(self, path: Path) -> str | None:
        """The digest of path, if it is the file that was followed; then make it durable, as file_digest does."""
        try:
            with open(path, "rb") as f:
                if self.digest is None or os.fstat(f.fileno()).st_ino != self.ino:
                    return None
                os.fsync(f.fileno())
        except OSError:
            return None
        return self.digest


class _Watch:
    """Byte progress for clients without a callback: the size of their in-progress files."""

    def __init__(self, agent: Agent, path: str, root: Path):
        self.stop_ev = threading.Event()

        def run() -> None:
            while not self.stop_ev.wait(PROGRESS_EVERY_S):
                n = sum(f.stat().st_size for f in root.rglob("*.incomplete") if f.is_file()) if root.exists() else 0
                agent.emit(ev="progress", path=path, bytes=n)

        threading.Thread(target=run, daemon=True).start()

    def stop(self) -> None:
        self.stop_ev.set()


def _multiplex(key: str) -> list[str]:
    """One SSH connection per peer for all its files (a handshake per file costs more than a small file)."""
    return ["-o", "ControlMaster=auto", "-o", f"ControlPath={Path(key).parent}/cm-%C", "-o", "ControlPersist=5",
            *FAST_CIPHERS]


def _authorized_keys() -> Path:
    return Path(os.path.expanduser("~/.ssh/authorized_keys"))


def _edit_authorized_keys(edit) -> None:
    """Rewrite authorized_keys as edit(lines) says (atomic, 0600), one editor at a time (the installer, the renewing
    agent and a cleaning agent are different processes)."""
    keys = _authorized_keys()
    keys.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(keys.parent / ".kimictl-authorized_keys.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            lines = keys.read_text().splitlines(keepends=True)
        except FileNotFoundError:
            lines = []
        new = edit(lines)
        if new != lines:
            _atomic_write(keys, "".join(new))
            keys.chmod(0o600)
    finally:
        os.close(fd)


# The one line kimictl writes to authorized_keys, whole: restrict, an expiry, from= IP literals, the forced command
# (printable ASCII words but `"` and `\`, one space apart), the key, and the run's comment last. A value holding a
# quote, a line break, a NUL or other whitespace could end the option early and start a line of its own.
_WORD = r'[!#-\[\]-~]+'
_ADDRESSES = r'[0-9A-Fa-f.:]+(?:,[0-9A-Fa-f.:]+)*'
_AUTHORIZED_LINE = re.compile(rf'restrict(?:,expiry-time="\d{{8,14}}")?,from="{_ADDRESSES}",'
                              rf'command="{_WORD}(?: {_WORD})*" [a-z0-9@.-]+ [A-Za-z0-9+/]+=* (\S+)')
_COMMENT = re.compile(r"[A-Za-z0-9._:@-]+")


def authorized_line_problem(line: str, comment: str) -> str | None:
    """Why `line` is not a peer-key line kimictl may write to authorized_keys (None when it is one)."""
    if not _COMMENT.fullmatch(comment):
        return f"the key comment {comment[:80]!r} is not [A-Za-z0-9._:@-]+"
    m = _AUTHORIZED_LINE.fullmatch(line)
    if m is None:
        return (f"{line[:300]!r} is not one line of restrict, from=\"<IP addresses>\", command=\"<printable words>\" "
                "and the key (no quote, line break, NUL or other whitespace inside a value)")
    if m.group(1) != comment:
        return f"the line ends in {m.group(1)[:80]!r}, not the run's comment {comment!r}"
    return None


def _is_peer_key(line: str, comment: str) -> bool:
    """A line of this run's key: its last field is the comment (a line that merely ends in it is someone else's)."""
    return line.split()[-1:] == [comment]


def authorize(comment: str, line: str | None) -> None:
    """Drop the authorized_keys lines of the key with this comment, then add `line` when given (refused with
    ValueError unless it is exactly the one line authorized_line_problem allows)."""
    if line is not None and (why := authorized_line_problem(line, comment)):
        raise ValueError(f"refusing to write the peer key's authorized_keys line: {why}")

    def edit(lines: list[str]) -> list[str]:
        kept = [ln for ln in lines if not _is_peer_key(ln, comment)]
        if not line:
            return kept
        if kept and not kept[-1].endswith("\n"):   # else the line would run on from the last key's
            kept[-1] += "\n"
        return [*kept, line + "\n"]
    _edit_authorized_keys(edit)


def peer_key_lines(comment: str) -> list[str]:
    try:
        return [ln.strip() for ln in _authorized_keys().read_text().splitlines() if _is_peer_key(ln, comment)]
    except OSError:
        return []


_EXPIRY = re.compile(r'expiry-time="(\d{8,14})"')


def with_expiry(line: str, until: float) -> str:
    """The line with expiry-time set to `until`, in this host's local time, which is how sshd reads it (OpenSSH
    7.7+; the "Z" suffix for UTC came later)."""
    stamp = time.strftime("%Y%m%d%H%M%S", time.localtime(until))
    if _EXPIRY.search(line):
        return _EXPIRY.sub(f'expiry-time="{stamp}"', line, count=1)
    return line.replace("restrict,", f'restrict,expiry-time="{stamp}",', 1)


def expiry_of(line: str) -> str | None:
    """expiry-time as YYYY-MM-DD HH:MM:SS (host local time), or None when the line has none."""
    m = _EXPIRY.search(line)
    if not m:
        return None
    d = m.group(1).ljust(14, "0")
    return f"{d[:4]}-{d[4:6]}-{d[6:8]} {d[8:10]}:{d[10:12]}:{d[12:14]}"


def renew_peer_key(comment: str, until: float) -> None:
    _edit_authorized_keys(lambda lines: [with_expiry(ln, until) if _is_peer_key(ln, comment) else ln
                                         for ln in lines])


def lock_holder(path: Path) -> dict | None:
    """The record of whoever holds path's flock, or None when nobody does (never creates the file)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            return json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            return {}
    finally:
        os.close(fd)   # also drops the shared lock we may have got
    return None


def source_addresses(peers: list[str]) -> list[str]:
    """The local addresses this host's connections to these peers leave from (the kernel's route choice; no packet
    is sent): what the peer key's from= must allow."""
    out = set()
    for addr in peers:
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(addr, 22, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                out.add(s.getsockname()[0].split("%")[0])
        except OSError:
            continue
    return sorted(out)


def install_peer_key(d: dict) -> None:
    """What playbooks/weights.yml (prepare) applies: the agent, the run's key and host keys, the key's line."""
    key_dir = Path(d["key_dir"])
    key_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    key_dir.chmod(0o700)
    Path(d["model_dir"]).mkdir(parents=True, exist_ok=True)
    for name, text, mode in (("kimi_weights_agent.py", d["agent_src"], 0o755), ("peer_key", d["peer_key"], 0o600),
                             ("known_hosts", d["known_hosts"], 0o644)):
        fd = os.open(key_dir / f".{name}.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(key_dir / f".{name}.tmp", mode)
        os.replace(key_dir / f".{name}.tmp", key_dir / name)
    authorize(d["key_comment"], with_expiry(d["authorized_line"], time.time() + KEY_TTL_S))


def _glob_escape(path: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", path)


def run_rsync(cmd: list[str], on_bytes, children: set | None = None, names: list[str] | None = None
              ) -> tuple[int, str]:
    """Run rsync --progress; on_bytes(name, bytes of that file so far) at most every PROGRESS_EVERY_S.

    rsync prints each file's name on a line of its own before that file's progress lines.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if children is not None:
        children.add(proc)
    known = set(names or [])
    current = (names or [""])[0]
    tail: list[str] = []
    last, buf = 0.0, b""
    try:
        while chunk := proc.stdout.read1(65536):
            buf += chunk
            *lines, buf = re.split(rb"[\r\n]", buf)
            for line in lines:
                m = re.match(rb"^\s*([\d,]+)\s+\d+%", line)
                text = line.decode(errors="replace").strip()
                if m:
                    if time.monotonic() - last > PROGRESS_EVERY_S:
                        last = time.monotonic()
                        on_bytes(current, int(m.group(1).replace(b",", b"")))
                elif text in known:
                    current = text
                elif text:
                    tail = [*tail[-5:], text]
        return proc.wait(), " | ".join(tail)
    finally:
        if children is not None:
            children.discard(proc)


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "serve" and argv[1] == "--model-dir":
        return Agent(argv[2]).serve()
    if len(argv) in (2, 3) and argv[0] == "rsync-serve":
        return rsync_serve(*argv[1:])
    sys.stderr.write("usage: agent.py serve --model-dir DIR | rsync-serve DIR [REFUSAL_LOG]\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
