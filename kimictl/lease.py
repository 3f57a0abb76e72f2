"""The cluster lease: one command that changes hosts at a time, whichever control node runs it.

The lease is an exclusive `flock` on `<kimi_state_dir>/lease.lock` of the cluster's lock host (the inventory host
whose name sorts first, whatever `--limit` says), held by kimictl/remote/lease.py in an SSH session for the whole
command. It disappears by itself with its holder: a control node that exits, is killed or loses its runner closes
the channel (sshd closes the script's stdin; the script exits; the kernel drops the flock), and one that is cut
off or stopped stops sending heartbeats (the script exits after TTL seconds without one). Nothing is left to
clean up, so there is nothing to break: a lease whose lock host is gone went with that host (docs/operate.md).

Commands that change hosts (deploy, rollout, rollback, stop, start, weights pull, observe up) hold it through
`held(...)`; heal takes it per action through `try_hold(...)` and skips an action while another command holds it;
`status` shows it through `peek_on(...)`. Read-only commands never take it.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import shlex
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from kimictl import remote
from kimictl.errors import HostError, InvalidInput, reported
from kimictl.inventory import Host, Inventory
from kimictl.ssh import Session, SSHError, target_for

TTL = 60.0   # seconds the lock host keeps a lease whose holder sends nothing (a heartbeat goes every TTL / 4)
CONNECT_TIMEOUT = 15.0
DOCS = "docs/operate.md#the-cluster-lease"
# The remote script comes as the first stdin line (a JSON string); the rest of stdin is the holder's lifeline.
BOOT = "import sys,json;exec(compile(json.loads(sys.stdin.buffer.readline()),'kimi_lease','exec'))"


def lock_host(inv: Inventory) -> Host:
    """The host that keeps the lease: the inventory host whose name sorts first (not the order of the file, so two
    copies of an inventory agree; pass the whole inventory, never a --limit of it)."""
    return min(inv.hosts, key=lambda h: h.name)


def lease_command(python: str, mode: str, args: dict[str, Any]) -> str:
    return f"{python} -c {shlex.quote(BOOT)} {mode} {shlex.quote(json.dumps(args))}"


def script_line() -> bytes:
    return (json.dumps(remote.script("lease.py")) + "\n").encode()


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) the lease, as its record on the lock host says; fields a host reports are checked."""

    hostname: str = "?"
    user: str = "?"
    pid: int | None = None
    command: str = "?"
    since: str = "?"

    @classmethod
    def of(cls, doc: Any) -> Holder:
        doc = doc if isinstance(doc, dict) else {}

        def text(key: str) -> str:
            v = doc.get(key)
            return v[:200] if isinstance(v, str) and v.isprintable() and v else "?"

        pid = doc.get("pid")
        return cls(text("hostname"), text("user"), pid if type(pid) is int else None, text("command"), text("since"))

    @classmethod
    def me(cls, command: str) -> Holder:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):   # a CI container's uid without a passwd entry
            user = f"uid {os.getuid()}"
        return cls(socket.gethostname(), user, os.getpid(), command, datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))

    def to_json(self) -> dict[str, Any]:
        return {"hostname": self.hostname, "user": self.user, "pid": self.pid, "command": self.command,
                "since": self.since}

    def text(self) -> str:
        return (f"`{self.command}` of {self.user}@{self.hostname} (pid {self.pid if self.pid is not None else '?'}, "
                f"since {self.since})")


class LeaseHeld(InvalidInput):
    """Another command holds the cluster lease: nothing was changed (exit 2)."""

    def __init__(self, cluster: str, lock: str, holder: Holder, wait: float):
        waited = f" (still held after --wait {wait:g}s)" if wait > 0 else ""
        super().__init__(f"cluster {cluster} is leased to {holder.text()}{waited}; nothing was changed",
                         details=[f"the lease lives on {lock}, the cluster's lock host"],
                         hint=f"wait for it to finish, or pass --wait SECONDS to queue behind it ({DOCS})")
        self.holder = holder


class Link(Protocol):
    """A running remote lease script: write its stdin, read its stdout lines, end it."""

    def send(self, data: bytes) -> None: ...

    def readline(self, timeout: float) -> bytes: ...

    def stderr(self) -> str: ...

    def close(self) -> None: ...


class SshLink:
    """The lease script in an SSH session of its own (paramiko): closing it, or this process dying, ends the
    script."""

    def __init__(self, host: Host, command: str, *, timeout: float, accept_new_keys: bool):
        self.session = Session(target_for(host), timeout=timeout, accept_new_keys=accept_new_keys)
        try:
            self.session.connect()
            transport = self.session.transport()
            transport.set_keepalive(15)
            self.chan = transport.open_session(timeout=timeout)
            self.chan.exec_command(command)
        except SSHError as exc:
            self.session.close()
            raise _unavailable(host, str(exc)) from None
        except Exception as exc:   # paramiko's SSHException, a channel that failed to open
            self.session.close()
            raise _unavailable(host, f"the SSH session failed: {str(exc) or type(exc).__name__}") from None
        self.out = self.chan.makefile("rb")

    def send(self, data: bytes) -> None:
        self.chan.sendall(data)

    def readline(self, timeout: float) -> bytes:
        self.chan.settimeout(timeout)
        try:
            return self.out.readline()
        except TimeoutError:
            return b""

    def stderr(self) -> str:
        self.chan.settimeout(1.0)
        try:
            return self.chan.makefile_stderr("rb").read().decode(errors="replace")
        except (OSError, TimeoutError):
            return ""

    def close(self) -> None:
        """End the script (EOF on its stdin) and give it a moment to exit, so the lease is free when this returns
        (a next command right after this one finds it free, not held by a script still on its way out)."""
        with contextlib.suppress(Exception):
            self.chan.shutdown_write()
            deadline = time.monotonic() + 5.0
            while not self.chan.exit_status_ready() and time.monotonic() < deadline:
                time.sleep(0.02)
        with contextlib.suppress(Exception):
            self.chan.close()
        self.session.close()


Opener = Callable[[Host, str], Link]


def _unavailable(host: Host, why: str) -> HostError:
    return HostError(f"cannot take the cluster lease on its lock host {host.name}: {why}", host=host.name,
                     step="lease", hint=f"the lease lives on the host whose name sorts first; if that host is gone "
                                        f"for good, see {DOCS}")


class Lease:
    """One hold of the cluster lease. `try_acquire()` returns None once it is ours (or the other holder), `acquire()`
    raises LeaseHeld instead; `release()` (or leaving `with`) gives it back. A heartbeat thread keeps it alive."""

    def __init__(self, inv: Inventory, command: str, *, wait: float = 0.0, accept_new_keys: bool = False,
                 timeout: float = CONNECT_TIMEOUT, ttl: float = TTL, opener: Opener | None = None,
                 on_wait: Callable[[Holder], None] | None = None):
        self.inv, self.command, self.wait, self.ttl = inv, command, wait, ttl
        self.host = lock_host(inv)
        self.timeout = timeout
        self.on_wait = on_wait
        self.opener = opener or (lambda h, cmd: SshLink(h, cmd, timeout=timeout, accept_new_keys=accept_new_keys))
        self.link: Link | None = None
        self.holder: Holder | None = None   # ours, while held
        self._stop = threading.Event()

    def try_acquire(self) -> Holder | None:
        me = Holder.me(self.command)
        args = {"state_dir": self.host.kimi_state_dir, "holder": me.to_json(), "wait": self.wait, "ttl": self.ttl}
        link = self.opener(self.host, lease_command("python3", "hold", args))
        try:
            link.send(script_line())
            self._heartbeat(link)
            doc = self._outcome(link)
        except BaseException:
            self._stop.set()
            link.close()
            raise
        if doc.get("ok") is True:
            self.link, self.holder = link, Holder.of(doc.get("holder"))
            return None
        self._stop.set()
        link.close()
        return Holder.of(doc.get("holder"))

    def _outcome(self, link: Link) -> dict[str, Any]:
        deadline = self.wait + self.timeout + 5.0   # the script answers within --wait (plus its grace)
        while True:
            line = link.readline(deadline)
            if not line:
                why = link.stderr().strip().splitlines()[-3:]
                raise _unavailable(self.host, "the lease script ended without an answer"
                                   + (f": {' / '.join(why)}" if why else ""))
            try:
                doc = json.loads(line)
            except ValueError:
                raise _unavailable(self.host, f"the lease script answered {reported(line)}, not JSON") from None
            if not isinstance(doc, dict):
                raise _unavailable(self.host, f"the lease script answered {reported(doc)}")
            if isinstance(doc.get("error"), str):
                raise _unavailable(self.host, f"the lease script failed: {reported(doc['error'], 300)}")
            if doc.get("waiting") is True:
                if self.on_wait:
                    self.on_wait(Holder.of(doc.get("holder")))
                continue
            return doc

    def _heartbeat(self, link: Link) -> None:
        def beat() -> None:
            while not self._stop.wait(self.ttl / 4):
                try:
                    link.send(b"\n")
                except Exception:   # the channel is gone; the lock host drops the lease by itself
                    return

        threading.Thread(target=beat, name="kimictl-lease", daemon=True).start()

    def acquire(self) -> Lease:
        other = self.try_acquire()
        if other is not None:
            raise LeaseHeld(self.inv.cluster.name, self.host.name, other, self.wait)
        return self

    def release(self) -> None:
        self._stop.set()
        if self.link is not None:
            self.link.close()
            self.link, self.holder = None, None

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def held(inv: Inventory, command: str, *, wait: float = 0.0, accept_new_keys: bool = False,
         on_wait: Callable[[Holder], None] | None = None, opener: Opener | None = None) -> Iterator[Lease]:
    """Hold the cluster lease for a whole command: LeaseHeld (exit 2, naming the holder) when another command holds
    it after `wait` seconds; HostError (exit 1) when the lock host cannot be reached. `inv` is the whole inventory."""
    lease = Lease(inv, command, wait=wait, accept_new_keys=accept_new_keys, on_wait=on_wait, opener=opener)
    with lease:
        yield lease


@dataclass(frozen=True)
class Attempt:
    """What `try_hold` got: `ours` (the lease is held until the `with` ends) or the other `holder`."""

    ours: bool
    holder: Holder


@contextlib.contextmanager
def try_hold(inv: Inventory, command: str, *, accept_new_keys: bool = False,
             opener: Opener | None = None) -> Iterator[Attempt]:
    """For heal's actions: take the lease without waiting, or say who holds it; never raises LeaseHeld.

        with lease.try_hold(inv, "heal: restart decode-0") as got:
            if not got.ours:
                say(f"skipped: {got.holder.text()} holds the cluster lease")
                return
            ...the action...
    """
    lease = Lease(inv, command, accept_new_keys=accept_new_keys, opener=opener)
    other = lease.try_acquire()
    try:
        yield Attempt(other is None, other or lease.holder or Holder.me(command))
    finally:
        lease.release()


def peek_on(session: Any, host: Host, timeout: float) -> dict[str, Any]:
    """The lease as the lock host's peek reports it, over an open ssh.Session: {"state": "free"} or {"state":
    "held", "holder": {...}}; {"state": "unknown", "detail": why} when the answer is not one of those."""
    try:
        res = session.run(lease_command("python3", "peek", {"state_dir": host.kimi_state_dir}), timeout=timeout,
                          stdin=script_line().decode())
    except SSHError as exc:   # the probe's connection failed meanwhile
        return {"state": "unknown", "detail": str(exc)}
    try:
        doc = json.loads(res.stdout)
    except ValueError:
        return {"state": "unknown", "detail": f"the lease peek answered {reported(res.stdout)}"}
    if not isinstance(doc, dict) or doc.get("state") not in ("free", "held"):
        return {"state": "unknown", "detail": f"the lease peek answered {reported(doc)}"}
    if doc["state"] == "free":
        return {"state": "free"}
    return {"state": "held", "holder": Holder.of(doc.get("holder")).to_json()}
