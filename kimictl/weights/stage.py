"""Stage the checkpoint on every host: sharded hub pull + peer all-gather, control push, shared verify.

The control node computes and schedules; one agent per host (kimictl/remote/weights_agent.py, over one SSH channel)
moves and verifies bytes. The hosts pull disjoint shares from the hub, each taking the next file from one queue
whenever its hub pull is free; every file a host has verified becomes a source for the others at once (rarest
first, bounded streams per host, so a file fans out through a tree of hosts rather than from its first owner
alone). Ansible installs the run's peer key
(playbooks/weights.yml); the agents remove it when every host is complete, the playbook's cleanup otherwise.
"""

from __future__ import annotations

import contextlib
import getpass
import ipaddress
import json
import os
import queue
import shlex
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kimictl import state
from kimictl.errors import HostError, InvalidInput, KimictlError, StateError, reported
from kimictl.inventory import Inventory
from kimictl.remote import weights_agent as agent_mod
from kimictl.secret_file import read_secret_file
from kimictl.ssh import Session, Sessions, SSHError, Target, ansible_host_key_args, target_for
from kimictl.state import control_dir
from kimictl.weights.schedule import CONTROL, DEFAULT_STREAMS, HUB, Schedule

AGENT_SRC = Path(agent_mod.__file__)
# The hub clients' own tqdm bars would tear through ours; tqdm reads this once, when it is imported.
os.environ.setdefault("TQDM_DISABLE", "1")
MODES = ("sharded", "control", "shared")
MAX_TRIES = 3
STALL_S = 180.0
TIMELINE_PROGRESS_S = 2.0   # a file's progress goes into the run's timeline at most this often (runs last hours)
TOKEN_ENV = {"modelscope": ("MODELSCOPE_API_TOKEN",), "huggingface": ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}


@dataclass
class PullOptions:
    mode: str = "sharded"
    streams: int = DEFAULT_STREAMS
    full: bool = False
    source_dir: Path | None = None   # control mode: the checkpoint on this machine
    token: str | None = None
    accept_new_host_keys: bool = False


@dataclass
class HostReport:
    host: str
    state: str = "pending"   # complete | incomplete | failed | unreachable
    files: int = 0
    have: int = 0
    missing: list[str] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)
    received: dict[str, int] = field(default_factory=dict)   # via (hub | control | peer host) -> bytes
    bytes_read: int = 0
    seconds: float = 0.0
    error: str | None = None
    # the cluster's peer key when one was installed: {state: removed | in use | present, expires, ...}
    peer_key: dict[str, Any] | None = None


@dataclass
class WeightsResult:
    action: str
    cluster: str
    manifest_digest: str
    total_bytes: int
    hosts: list[HostReport]
    seconds: float
    warnings: list[str] = field(default_factory=list)
    changed: bool = False

    @property
    def ok(self) -> bool:
        return all(h.state == "complete" for h in self.hosts)

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": 1, "action": self.action, "cluster": self.cluster, "ok": self.ok,
                "changed": self.changed, "manifest_digest": self.manifest_digest, "total_bytes": self.total_bytes,
                "seconds": round(self.seconds, 2), "warnings": self.warnings,
                "hosts": [h.__dict__ for h in self.hosts]}


class Reporter:
    """What a caller wants to hear: sentences and per-host byte counts (default: silent)."""

    def __init__(self, say: Callable[[str], None] | None = None):
        self._say = say

    def say(self, text: str) -> None:
        if self._say:
            self._say(text)

    def start(self, totals: dict[str, int]) -> None:
        pass

    def progress(self, host: str, done: int) -> None:
        pass


# --- token and manifest ----------------------------------------------------------------------------------

def read_token(source: str, token_file: Path | None) -> str | None:
    """From --token-file (must be 0600 or stricter) or the client's usual environment variable."""
    if token_file is not None:
        token = read_secret_file(token_file, "--token-file")
        if len(token.split()) > 1:   # it goes whole into an HTTP header
            raise InvalidInput(f"--token-file {token_file} holds {len(token.split())} words or lines; a hub token is "
                               "one")
        if not token.isprintable():   # NUL or another control character: no HTTP header carries it
            raise InvalidInput(f"--token-file {token_file} holds a control character (such as NUL); a hub token is "
                               "printable text")
        return token
    for name in TOKEN_ENV.get(source, ()):
        token = os.environ.get(name)
        if token:
            if len(token.split()) != 1 or not token.strip().isprintable():   # it goes whole into an HTTP header
                raise InvalidInput(f"{name}: a hub token is one printable word (this one holds whitespace, a line "
                                   "break or a control character)", hint=f"unset {name}, or set it to the token")
            return token.strip()
    return None


def load_manifest(inv: Inventory, token: str | None, source_dir: Path | None = None, *, refresh: bool = True,
                  timeout: float = 60.0):
    """The manifest: the hub's listing (cached for offline verify), or a hash of the local copy."""
    from kimictl.weights.manifest import Manifest, fetch_manifest, local_manifest

    c = inv.cluster
    if source_dir is not None:
        m = local_manifest(source_dir, model_id=c.kimi_model_id)
    elif c.kimi_model_source == "local" or not refresh:
        text = state.read_manifest_cache(c.name)
        if text is None:
            if c.kimi_model_source == "local":
                raise InvalidInput(f"kimi_model_source is local and no manifest is recorded for cluster {c.name}",
                                   hint="run `kimictl weights pull --mode control --from DIR` once")
            return load_manifest(inv, token, refresh=True)
        try:
            m = Manifest.from_json(text)
        except InvalidInput as exc:
            raise StateError(f"the cached weights manifest of cluster {c.name} is damaged: {exc.message}",
                             details=exc.details, hint=f"delete {control_dir(c.name) / state.MANIFEST_CACHE}; "
                             "`kimictl weights pull` records it again") from None
    else:
        m = fetch_manifest(c.kimi_model_source, c.kimi_model_id, c.model_revision, c.kimi_model_endpoint, token,
                           timeout=timeout)
    state.write_manifest_cache(c.name, m.to_json())
    return m


# --- control-node lock -----------------------------------------------------------------------------------

@contextlib.contextmanager
def cluster_lock(cluster: str, what: str):
    """One weights run per cluster on this control node; the kernel drops the lock with its holder."""
    path = control_dir(cluster) / "weights.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, who = agent_mod.try_lock(path, holder(what), 0o600)
    if fd is None:
        raise KimictlError(f"another `kimictl weights` run holds cluster {cluster}: {_holder_text(who)}",
                           hint="wait for it to finish")
    try:
        yield
    finally:
        os.close(fd)


def holder(what: str) -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "user": getpass.getuser(), "what": what,
            "since": datetime.now(UTC).isoformat(timespec="seconds")}


def _holder_text(who: dict) -> str:
    return (f"{who.get('what', 'weights pull')} by {who.get('user', '?')}@{who.get('host', '?')} "
            f"(pid {who.get('pid', '?')}, since {who.get('since', '?')})")


# --- one agent per host ------------------------------------------------------------------------------------

def agent_command(python: str, model_dir: str) -> str:
    boot = "import sys,json;exec(compile(json.loads(sys.stdin.buffer.readline()),'kimi_weights_agent','exec'))"
    return f"{python} -c {shlex.quote(boot)} serve --model-dir {shlex.quote(model_dir)}"


class AgentLink:
    """The JSON-lines channel to one host's agent; events go to a shared queue as (host, event)."""

    def __init__(self, host: str, session: Session, python: str, model_dir: str, events: queue.Queue,
                 secrets: list[str]):
        self.host, self.events, self.secrets = host, events, secrets
        transport = session.transport()
        self.server_key = transport.get_remote_server_key()
        self.address = transport.getpeername()[0]   # the host's IP as this machine reached it
        self.chan = transport.open_session()
        self.chan.exec_command(agent_command(python, model_dir))
        self.chan.sendall((json.dumps(AGENT_SRC.read_text()) + "\n").encode())
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        f = self.chan.makefile("rb")
        for line in f:
            try:
                self.events.put((self.host, json.loads(line)))
            except ValueError:
                continue
        err = self.chan.makefile_stderr("rb").read().decode(errors="replace")
        for s in self.secrets:
            err = err.replace(s, "***")
        self.stderr = err.strip().splitlines()[-20:]
        self.events.put((self.host, {"ev": "eof", "rc": self.chan.recv_exit_status()}))

    def send(self, op: dict[str, Any]) -> None:
        self.chan.sendall((json.dumps(op) + "\n").encode())

    def close(self) -> None:
        with contextlib.suppress(OSError, EOFError):
            self.chan.shutdown_write()
        self.chan.close()


def _peer(target: Target) -> dict[str, Any]:
    return {"name": target.name, "address": target.address, "port": target.port, "user": target.user}


def peer_sources(host: str, sources: Any) -> set[str]:
    """The addresses a host's agent says it reaches its peers from (they go into the peer key's from= on every
    host): IP literals, else the host is refused."""
    if sources is None:
        return set()
    if not isinstance(sources, list):
        raise HostError(f"the weights agent reported sources {reported(sources)}, not a list of IP addresses",
                        host=host, step="weights start")
    out = set()
    for s in sources:
        try:
            ip = ipaddress.ip_address(s) if isinstance(s, str) else None
        except ValueError:
            ip = None
        if ip is None or getattr(ip, "scope_id", None) is not None:   # a scope (fe80::1%x) may hold anything
            raise HostError(f"the weights agent reported the source address {reported(s)}, which is not an IP "
                            "address; refusing the host (nothing was installed)", host=host, step="weights start")
        out.add(str(ip))
    return out


def _known_hosts_line(target: Target, key) -> str:
    name = target.address if target.port == 22 else f"[{target.address}]:{target.port}"
    return f"{name} {key.get_name()} {key.get_base64()}\n"


def ssh_command(target: Target) -> list[str]:
    """The OpenSSH client argv that reaches a host the way the inventory says (for rsync -e)."""
    argv = ["ssh", "-p", str(target.port), "-o", "BatchMode=yes", "-o",
            f"StrictHostKeyChecking={'yes' if target.strict else 'accept-new'}", *agent_mod.FAST_CIPHERS]
    for k in target.key_files:
        argv += ["-i", k, "-o", "IdentitiesOnly=yes"]
    if target.known_hosts:
        argv += ["-o", "UserKnownHostsFile=" + " ".join(target.known_hosts)]
    if target.ssh_config:
        argv += ["-F", target.ssh_config]
    return argv


# --- the run -----------------------------------------------------------------------------------------------

class Stager:
    """One `weights pull|verify|status` over the hosts of an inventory."""

    def __init__(self, inv: Inventory, manifest, reporter: Reporter | None = None, *,
                 opts: PullOptions | None = None, warnings: list[str] | None = None):
        self.inv, self.m, self.opts = inv, manifest, opts or PullOptions()
        self.r = reporter or Reporter()
        self.warnings = warnings or []
        self.c = inv.cluster
        self.digest = manifest.digest()
        self.size = {f.path: f.size for f in manifest.files}
        self.order = [f.path for f in manifest.files]
        self.targets = {h.name: target_for(h) for h in inv.hosts}
        self.state_dir = {h.name: h.kimi_state_dir for h in inv.hosts}
        self.events: queue.Queue = queue.Queue()
        self.secrets = [s for s in (self.opts.token,) if s]
        self.reports = {h.name: HostReport(h.name, files=len(self.order)) for h in inv.hosts}
        self.links: dict[str, AgentLink] = {}
        self.run_dir = state.new_run_dir(self.c.name, "weights")
        self.key_comment = f"kimictl-weights:{self.c.name}"
        self.peer_sources: set[str] = set()   # addresses the hosts reach each other from (the key's from=)
        self.prepared = self.cleaned = False
        self.timeline: list[dict[str, Any]] = []   # what moved when: runs/<stamp>-weights/timeline.jsonl

    def _mark(self, what: str, host: str | None = None, **kw: Any) -> None:
        self.timeline.append({"t": round(time.time(), 3), "ev": what, "host": host, **kw})

    def _write_timeline(self) -> None:
        if not self.timeline:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / "timeline.jsonl", "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in self.timeline)

    # --- agents --------------------------------------------------------------------------------------
    def _open(self, sessions: Sessions, mode: str, pull: bool, invalidate: bool = False) -> dict[str, dict]:
        """Start every agent and say hello; the answer is each host's state."""
        for name, err in sessions.errors().items():
            rep = self.reports[name]
            rep.state, rep.error = "unreachable", str(err)
        for name, s in sessions.sessions.items():
            if isinstance(s, SSHError):
                continue
            try:
                self.links[name] = AgentLink(name, s, self.c.kimi_python, self.c.kimi_model_dir, self.events,
                                             self.secrets)
            except Exception as exc:  # paramiko channel errors
                self.reports[name].state, self.reports[name].error = "unreachable", f"cannot start the agent: {exc}"
        manifest = json.loads(self.m.to_json())
        peers = [t.address for t in self.targets.values()] if pull and len(self.targets) > 1 else []
        for name, link in self.links.items():
            link.send({"op": "hello", "manifest": manifest, "digest": self.digest, "mode": mode, "pull": pull,
                       "invalidate": invalidate, "holder": holder("weights pull"), "peers": peers,
                       "key_comment": self.key_comment, "key_dir": f"{self.state_dir[name]}/weights"})
        states: dict[str, dict] = {}
        while len(states) < len(self.links):
            host, ev = self._next(60.0)
            if ev["ev"] == "state":
                states[host] = ev
                self.peer_sources.update(peer_sources(host, ev.get("sources")))
                self._peer_key_seen(host, ev.get("peer_key"))
            elif ev["ev"] in ("locked", "error", "eof"):
                self._abort_on(host, ev, "start")
        return states

    def _next(self, timeout: float) -> tuple[str, dict]:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            raise HostError(f"no word from any host agent for {timeout:.0f}s", step="weights") from None

    def _abort_on(self, host: str, ev: dict, step: str) -> None:
        link = self.links.get(host)
        if ev["ev"] == "locked":
            raise KimictlError(f"host {host}: another weights run holds {self.c.kimi_model_dir}: "
                               f"{_holder_text(ev.get('holder') or {})}", hint="wait for it to finish")
        tail = "\n".join(link.stderr) if link else None
        msg = ev.get("message") or f"the weights agent exited (rc {ev.get('rc')})"
        if ev["ev"] == "eof" and link and not link.stderr and ev.get("rc") == 127:
            msg += f"; is `{self.c.kimi_python}` a python3 on the host (kimi_python)?"
        raise HostError(msg, host=host, step=f"weights {step}", log_tail=tail)

    def _close(self) -> None:
        for link in self.links.values():
            link.close()

    def _completed(self, host: str) -> None:
        rep = self.reports[host]
        rep.state, rep.have, rep.missing, rep.unverified = "complete", len(self.order), [], []

    def _peer_key_seen(self, host: str, key: dict[str, Any] | None) -> None:
        self.reports[host].peer_key = key
        if key and key["state"] == "removed":
            self.r.say(f"weights: {host}: removed the peer key a killed run left behind (it would have expired "
                       f"{key.get('expires') or '(no expiry)'})")

    def _fill(self, host: str, st: dict) -> None:
        rep = self.reports[host]
        rep.have, rep.missing, rep.bad, rep.unverified = len(st["have"]), st["missing"], st["bad"], st["unverified"]
        rep.bytes_read, rep.seconds = st["bytes_read"], st["seconds"]
        rep.state = "complete" if st["complete"] else "incomplete"

    # --- verify and status (read-only but for stamps; verify drops a marker that lies) ---------------
    def check(self, action: str) -> WeightsResult:
        t0 = time.monotonic()
        mode = {"status": "stat", "verify": "full" if self.opts.full else "stamps"}[action]
        with Sessions(self.inv, accept_new_keys=self.opts.accept_new_host_keys) as sessions:
            try:
                states = self._open(sessions, mode, pull=False, invalidate=action == "verify")
            finally:
                self._close()
        for host, st in states.items():
            self._fill(host, st)
        return WeightsResult(action, self.c.name, self.digest, self.m.total_bytes, list(self.reports.values()),
                             time.monotonic() - t0, self.warnings)

    # --- pull ----------------------------------------------------------------------------------------
    def pull(self) -> WeightsResult:
        t0 = time.monotonic()
        self._mark("start")
        with cluster_lock(self.c.name, "weights pull"), \
                Sessions(self.inv, accept_new_keys=self.opts.accept_new_host_keys) as sessions:
            if sessions.errors():
                name, err = next(iter(sessions.errors().items()))
                raise HostError(f"cannot reach every host: {err}", host=name, step="weights connect")
            try:
                shared = self.opts.mode == "shared"
                states = self._open(sessions, "full" if self.opts.full else "stamps", pull=not shared)
                self._mark("hello")
                for host, st in states.items():
                    self._fill(host, st)
                todo = [h for h, st in states.items() if not st["complete"]]
                if not todo:
                    self.r.say(f"weights: all {len(states)} host(s) hold the verified checkpoint; nothing to do")
                elif shared:
                    self._shared(states)
                else:
                    self._gather(states)
            finally:
                self._close()
                if self.prepared:
                    self._cleanup()
                self._mark("end")
                self._write_timeline()
        return WeightsResult("pull", self.c.name, self.digest, self.m.total_bytes, list(self.reports.values()),
                             time.monotonic() - t0, self.warnings, changed=self.prepared)

    def _shared(self, states: dict[str, dict]) -> None:
        short = {h: st for h, st in states.items() if st["missing"] or st["bad"]}
        if short:
            h, st = next(iter(short.items()))
            raise HostError(f"shared mode only verifies: {len(st['missing'])} file(s) missing and {len(st['bad'])} "
                            f"corrupt under {self.c.kimi_model_dir}", host=h, step="weights verify",
                            details=[*st["missing"][:5], *st["bad"][:5]])
        self._finish(list(states))

    # --- prepare / clean up the peer key (Ansible applies; kimictl computed it) ------------------------
    def _playbook(self, phase: str, extra: dict[str, Any]) -> None:
        from kimictl.ansible import build_run_spec, close_control_masters, run_playbook

        hosts = [h.name for h in self.inv.hosts]
        spec = build_run_spec(self.run_dir, "weights.yml", Path(self.inv.path),
                              {"kimi": {"phase": phase, "state_dir_of": self.state_dir, "cluster": self.c.name,
                                        **extra}},
                              ident=f"weights-{phase}", hosts=hosts, limit=hosts,
                              host_key_args=ansible_host_key_args(self.inv, self.opts.accept_new_host_keys))
        try:
            res = run_playbook(spec)
        finally:
            close_control_masters(self.run_dir)
        if not res.ok:
            f = res.failures[0] if res.failures else None
            raise HostError(f"playbook weights.yml ({phase}) failed", host=f.host if f else None,
                            step=f.task if f else phase, log_tail=f.message if f else None,
                            hint=f"ansible artifacts: {res.artifacts}")

    def _prepare(self) -> None:
        """The run's peer key on every host (playbooks/weights.yml); runs while the hub pulls go on."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.run_dir.parent.glob("*-weights/peer_key*"):   # left by a run that was killed
            stale.unlink(missing_ok=True)
        key = self.run_dir / "peer_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", self.key_comment, "-f", str(key)],
                       check=True, capture_output=True)
        known = "".join(_known_hosts_line(self.targets[h], ln.server_key) for h, ln in self.links.items())
        src, private, public = AGENT_SRC.read_text(), key.read_text(), key.with_suffix(".pub").read_text().strip()
        for p in (key, key.with_suffix(".pub")):
            p.unlink()
        payload = {h: {"agent_src": src, "peer_key": private, "known_hosts": known, "model_dir": self.c.kimi_model_dir,
                       "key_dir": f"{sd}/weights", "key_comment": self.key_comment,
                       "authorized_line": self.authorized_line(sd, public)}
                   for h, sd in self.state_dir.items()}
        installer = ("import sys,json;d=json.loads(sys.stdin.read());g={'__name__':'kimi_weights_agent'};"
                     "exec(compile(d['agent_src'],'kimi_weights_agent','exec'),g);g['install_peer_key'](d)")
        # the private key reaches the hosts on the task's stdin (no_log); run_playbook removes its extravars file
        self._playbook("prepare", {"python": self.c.kimi_python, "installer": installer, "payload": payload})

    def authorized_line(self, state_dir: str, public: str) -> str:
        """The peer key's authorized_keys line (the host adds expiry-time when it installs it): no pty, forwarding
        or user rc (restrict), only from the cluster's hosts, only the forced command (agent.parse_peer_command)."""
        sources = sorted(self.peer_sources | {link.address for link in self.links.values()})
        command = (f"{self.c.kimi_python} -I -S {state_dir}/weights/kimi_weights_agent.py rsync-serve "
                   f"{self.c.kimi_model_dir} {state_dir}/logs/weights-peer.log")
        line = f'restrict,from="{",".join(sources)}",command="{command}" {public}'
        if why := agent_mod.authorized_line_problem(line, self.key_comment):   # the host checks it again
            raise KimictlError(f"refusing to install the peer key: {why}")
        return line

    def _prepare_async(self) -> None:
        def run() -> None:
            try:
                self._prepare()
                self.events.put(("@control", {"ev": "prepared"}))
            except KimictlError as exc:
                self.events.put(("@control", {"ev": "prepare-failed", "exc": exc}))
        self.prepared = True   # from here on, cleanup is owed
        threading.Thread(target=run, daemon=True).start()

    def _cleanup(self) -> None:
        """Agents remove the key themselves when every host is complete; otherwise Ansible does it."""
        if self.cleaned:
            return
        try:
            self._playbook("cleanup", {})
        except KimictlError as exc:
            self.r.say(f"weights: could not remove the peer key everywhere ({exc.message}); "
                       "the next pull replaces it")

    # --- the all-gather --------------------------------------------------------------------------------
    def _gather(self, states: dict[str, dict]) -> None:
        """Carry out what the scheduler (schedule.py) decides, feeding it what the agents report."""
        hosts = list(states)
        control = self.opts.mode == "control"
        sched = Schedule(self.size, {h: st["have"] for h, st in states.items()}, streams=self.opts.streams,
                         control=control)
        missing_everywhere = [p for p in self.order if not any(p in st["have"] for st in states.values())]
        inflight_bytes: dict[tuple[str, str], int] = {}
        marked: dict[tuple[str, str], float] = {}   # (host, path) -> when its progress went into the timeline
        done_bytes = {h: sum(self.size[p] for p in st["have"]) for h, st in states.items()}
        completed = {h for h, st in states.items() if st["complete"]}   # left untouched
        failed: set[str] = set()
        peers_ready = False
        self.r.start({h: self.m.total_bytes for h in hosts})
        for h in hosts:
            self.r.progress(h, done_bytes[h])
        self.r.say(f"weights: {len(missing_everywhere)} file(s) from "
                   f"{'this machine' if control else 'the hub'}, then peer to peer across {len(hosts)} host(s)")
        if len(hosts) > 1:
            self._prepare_async()

        self._dispatch(sched, completed)
        while len(completed | failed) < len(hosts):
            host, ev = self._next(STALL_S)
            kind = ev["ev"]
            if host in failed:
                continue
            if kind == "progress":
                if self._progressed(sched, host, ev, inflight_bytes, marked, done_bytes):
                    self._dispatch(sched, completed)
                continue
            if kind == "received":
                sched.received(host, ev["path"])
            elif kind == "done":
                self._landed(sched, host, ev, inflight_bytes, done_bytes)
            elif kind == "fail":
                if not self._transfer_failed(sched, host, ev, inflight_bytes):
                    continue
            elif kind == "complete":
                self._mark("complete", host)
                completed.add(host)
                self._completed(host)
            elif kind == "prepared":
                self._mark("prepared")
                peers_ready = True
                sched.peers_ready()
            elif kind == "prepare-failed":
                raise ev["exc"]
            elif kind == "locked":
                self._abort_on(host, ev, "transfer")
            elif kind in ("error", "eof"):
                self._host_failed(host, ev)
                failed.add(host)
                sched.host_failed(host)
            self._dispatch(sched, completed)
        if self.prepared and not failed:
            self._agents_cleanup(peers_ready)

    def _dispatch(self, sched: Schedule, completed: set[str]) -> None:
        """Start the transfers the scheduler decides on now; finish the hosts that hold everything."""
        for t in sched.next():
            if t.src == HUB:
                self._hub(t.dest, list(t.paths), t.lane)
                continue
            self._mark("fetch", t.dest, src=t.src, paths=list(t.paths))
            if t.src == CONTROL:
                threading.Thread(target=self._push, args=(t.dest, t.paths[0]), daemon=True).start()
            else:
                kd = f"{self.state_dir[t.dest]}/weights"
                self.links[t.dest].send({"op": "fetch", "paths": list(t.paths), "peer": _peer(self.targets[t.src]),
                                         "key": f"{kd}/peer_key", "known_hosts": f"{kd}/known_hosts"})
        for h in sched.finishing():
            if h not in completed:
                self.links[h].send({"op": "finish"})

    def _progressed(self, sched: Schedule, host: str, ev: dict, inflight_bytes: dict[tuple[str, str], int],
                    marked: dict[tuple[str, str], float], done_bytes: dict[str, int]) -> bool:
        """Bytes of a file reached host: the timeline (now and then) and the bar; True when a slot was freed."""
        inflight_bytes[(host, ev["path"])] = int(ev["bytes"])
        if time.monotonic() - marked.get((host, ev["path"]), 0.0) >= TIMELINE_PROGRESS_S:
            marked[(host, ev["path"])] = time.monotonic()
            self._mark("progress", host, path=ev["path"], bytes=int(ev["bytes"]))
        self.r.progress(host, done_bytes[host] + sum(v for (h, _), v in inflight_bytes.items() if h == host))
        return sched.progress(host, ev["path"], int(ev["bytes"]))

    def _landed(self, sched: Schedule, host: str, ev: dict, inflight_bytes: dict[tuple[str, str], int],
                done_bytes: dict[str, int]) -> None:
        """A file is verified in place on host."""
        p = ev["path"]
        self._mark("done", host, path=p, via=ev["via"], bytes=self.size[p])
        sched.landed(host, p)
        inflight_bytes.pop((host, p), None)
        done_bytes[host] += self.size[p]
        via = ev["via"]
        self.reports[host].received[via] = self.reports[host].received.get(via, 0) + self.size[p]
        self.r.progress(host, done_bytes[host])

    def _transfer_failed(self, sched: Schedule, host: str, ev: dict,
                         inflight_bytes: dict[tuple[str, str], int]) -> int:
        """A transfer into host failed: how often so far (0: its source failed and was given up on already).

        Raises:
            HostError: the file failed MAX_TRIES times.
        """
        p = ev["path"]
        inflight_bytes.pop((host, p), None)
        n = sched.failed(host, p)
        if not n:
            return 0
        self.r.say(f"weights: {host}: {p} from {ev['via']} failed (try {n}/{MAX_TRIES}): "
                   f"{ev['error'][-300:]}")
        if n >= MAX_TRIES:
            raise HostError(f"{p} could not be staged after {n} tries: {ev['error'][-500:]}", host=host,
                            step=f"weights from {ev['via']}")
        return n

    def _host_failed(self, host: str, ev: dict) -> None:
        """A host's agent died or gave up mid-run: the others go on without it; its report says why."""
        link = self.links.get(host)
        msg = ev.get("message") or f"the weights agent exited (rc {ev.get('rc')})"
        tail = link.stderr[-5:] if link else []
        self._mark("failed", host, message=msg)
        rep = self.reports[host]
        rep.state = "failed"
        rep.error = f"weights transfer: {msg}" + (f"; agent log: {' | '.join(tail)}" if tail else "")
        self.r.say(f"weights: {host} failed ({msg}); its files go to the others from elsewhere")

    def _agents_cleanup(self, prepared: bool) -> None:
        """Each agent takes the run's key off its host (after the prepare run ended, so nothing comes back)."""
        while not prepared:
            host, ev = self._next(STALL_S)
            if ev["ev"] == "prepare-failed":
                return   # the playbook cleanup runs
            prepared = ev["ev"] == "prepared"
        for h, link in self.links.items():
            link.send({"op": "cleanup", "key_comment": self.key_comment,
                       "key_dir": f"{self.state_dir[h]}/weights"})
        left = set(self.links)
        while left:
            host, ev = self._next(60.0)
            if ev["ev"] == "cleaned":
                left.discard(host)
            elif ev["ev"] in ("error", "eof"):
                return
        self.cleaned = True

    def _hub(self, host: str, files: list[str], lane: int) -> None:
        c = self.c
        self._mark("hub", host, paths=list(files), lane=lane)
        self.links[host].send({"op": "hub", "files": files, "lane": lane, "source": c.kimi_model_source,
                               "model_id": c.kimi_model_id, "revision": self.m.revision,
                               "endpoint": c.kimi_model_endpoint, "token": self.opts.token})

    def _push(self, host: str, path: str) -> None:
        """Control mode: rsync one file from this machine into the host's staging area, then adopt it."""
        t = self.targets[host]
        dest = f"{self.c.kimi_model_dir}/{agent_mod.STAGING}/push/{path}"
        addr = f"[{t.address}]" if ":" in t.address else t.address
        assert self.opts.source_dir is not None
        cmd = ["rsync", "--mkpath", "--partial", "--partial-dir=.kimi-partial", "--progress", "--timeout=60",
               "-e", shlex.join(ssh_command(t)), str(self.opts.source_dir / path), f"{t.user}@{addr}:{dest}"]
        rc, tail = agent_mod.run_rsync(cmd, lambda _p, n: self.events.put((host, {"ev": "progress", "path": path,
                                                                                  "bytes": n})))
        if rc != 0:
            self.events.put((host, {"ev": "fail", "path": path, "via": "control",
                                    "error": f"rsync to {host} exited {rc}: {tail}"}))
            return
        self.links[host].send({"op": "adopt", "path": path})

    def _finish(self, hosts: list[str]) -> None:
        for h in hosts:
            self.links[h].send({"op": "finish"})
        left = set(hosts)
        while left:
            host, ev = self._next(STALL_S)
            if ev["ev"] == "complete":
                left.discard(host)
                self._completed(host)
            elif ev["ev"] in ("error", "eof"):
                self._abort_on(host, ev, "finish")


# --- entry points ------------------------------------------------------------------------------------------

def _holds_a_file(d: Path) -> bool:
    try:
        return any(p.is_file() for p in d.rglob("*"))
    except OSError as exc:
        raise InvalidInput(f"--from {d}: cannot read it: {exc.strerror or exc}") from None


def validate_opts(inv: Inventory, opts: PullOptions) -> None:
    """The pull's flags, checked before the lease and any host (exit 2 naming the flag)."""
    if opts.mode not in MODES:
        raise InvalidInput(f"--mode {opts.mode}: expected one of {', '.join(MODES)}")
    if opts.streams < 1 or opts.streams > 32:
        raise InvalidInput(f"--streams {opts.streams}: expected 1..32")
    if opts.mode == "control" and opts.source_dir is None:
        raise InvalidInput("--mode control needs --from DIR: the checkpoint on this machine to push from")
    if opts.source_dir is not None and not opts.source_dir.is_dir():
        raise InvalidInput(f"--from {opts.source_dir}: not a directory")
    if opts.source_dir is not None and not _holds_a_file(opts.source_dir):
        raise InvalidInput(f"--from {opts.source_dir}: holds no files, so it is no copy of the checkpoint",
                           hint="give the directory holding the checkpoint's config.json and *.safetensors")
    if inv.cluster.kimi_model_source == "local" and opts.mode == "sharded" and opts.source_dir is None:
        raise InvalidInput("kimi_model_source is local: there is no hub to pull from",
                           hint="use --mode control --from DIR, or --mode shared to verify a shared path")


def pull(inv: Inventory, opts: PullOptions, reporter: Reporter | None = None, manifest=None) -> WeightsResult:
    """Stage the checkpoint on every host of inv; `manifest` saves a second listing when the caller has one."""
    from kimictl.weights.manifest import checkpoint_warnings, fetch_small

    validate_opts(inv, opts)
    if opts.source_dir is not None and opts.mode == "sharded":
        opts.mode = "control"
    r = reporter or Reporter()
    if manifest is None:
        r.say(f"weights: reading the file list of {inv.cluster.kimi_model_id} "
              f"({'local copy' if opts.source_dir else inv.cluster.kimi_model_source})")
    m = manifest or load_manifest(inv, opts.token, opts.source_dir)
    c = inv.cluster
    if opts.source_dir is not None:
        def read_small(path: str) -> bytes:
            return (opts.source_dir / path).read_bytes()
    elif c.kimi_model_source == "local":
        read_small = None
    else:
        cache = control_dir(c.name) / "weights-small" / m.digest()[:16]   # never a stale index of another copy
        for old in cache.parent.glob("*") if cache.parent.is_dir() else []:
            if old != cache:
                shutil.rmtree(old, ignore_errors=True)

        def read_small(path: str) -> bytes:
            return fetch_small(c.kimi_model_source, c.kimi_model_id, c.model_revision, c.kimi_model_endpoint,
                               opts.token, path, cache)
    try:
        warnings = checkpoint_warnings(m, read_small)
    except KimictlError as exc:
        warnings = [f"could not read the checkpoint's index/quant description: {exc.message}"]
    for w in warnings:
        r.say(f"warning: {w}")
    r.say(f"weights: {len(m.files)} files, {m.total_bytes / 2**30:.2f} GiB, manifest {m.digest()[:12]}")
    return Stager(inv, m, r, opts=opts, warnings=warnings).pull()


def check(inv: Inventory, action: str, opts: PullOptions, reporter: Reporter | None = None) -> WeightsResult:
    m = load_manifest(inv, opts.token, refresh=False)
    return Stager(inv, m, reporter, opts=opts).check(action)
