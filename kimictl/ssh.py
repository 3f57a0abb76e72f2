"""Fast read-only SSH probes with paramiko: one connection per host, TCP_NODELAY, strict host keys, in parallel.

Host keys are checked against known_hosts as OpenSSH reads them (kimictl/known_hosts.py), and the same files and
policy go to the Ansible stage (`ansible_host_key_args`)."""

from __future__ import annotations

import functools
import logging
import os
import shlex
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kimictl import known_hosts as hostkeys
from kimictl.errors import InvalidInput
from kimictl.inventory import Host, Inventory, ssh_config_option, ssh_options

T = TypeVar("T")

# paramiko logs a failed handshake (a bad banner, a reset) with its traceback through `logging`; with no handler
# configured Python prints that to stderr. Each host's failure is reported as one SSHError line instead.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

# AEAD ciphers first: one AES-GCM pass per packet (in OpenSSL) instead of AES-CTR plus an HMAC that paramiko
# verifies in Python; measured ~25% less control-node CPU per connection. Every OpenSSH since 6.2 offers
# them; paramiko's own list follows, so any server still negotiates.
PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")


def _first(preferred: tuple[str, ...], have: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(c for c in preferred if c in have) + tuple(c for c in have if c not in preferred)


def _transport(sock: Any, key_types: tuple[str, ...] = (), **kwargs: Any) -> Any:
    """key_types: the host key algorithms known_hosts holds for this host, asked for first (as OpenSSH does)."""
    import paramiko

    t = paramiko.Transport(sock, **kwargs)
    opts = t.get_security_options()
    opts.ciphers = _first(PREFERRED_CIPHERS, tuple(opts.ciphers))
    if key_types:
        opts.key_types = _first(key_types, tuple(opts.key_types))
    return t


@dataclass(frozen=True)
class Target:
    """How to reach one inventory host, read from its ansible_* variables."""

    name: str
    address: str
    port: int = 22
    user: str = "root"
    key_files: tuple[str, ...] = ()
    known_hosts: tuple[str, ...] = ()
    strict: bool = True
    ssh_config: str | None = None
    global_known_hosts: tuple[str, ...] = hostkeys.GLOBAL_FILES

    @property
    def host_key_name(self) -> str:
        """How known_hosts names this host: `address`, or `[address]:port` off port 22."""
        return hostkeys.host_name(self.address, self.port)


def _common_args(args: str) -> dict[str, Any]:
    """The few OpenSSH options kimictl honours from ansible_ssh_common_args / ansible_ssh_extra_args (read as
    `kimictl validate` checks them: inventory.ssh_options)."""
    out: dict[str, Any] = {"known_hosts": [], "keys": []}
    for w, val in ssh_options(args or ""):
        if not val:
            continue
        if w == "-i":
            out["keys"].append(val)
        elif w == "-F":
            out["ssh_config"] = val
        elif w == "-p":
            out["port"] = int(val)
        else:
            k, v = ssh_config_option(val)
            k = k.lower()
            if not v:
                continue
            if k == "userknownhostsfile":
                out["known_hosts"] += v.split()
            elif k == "globalknownhostsfile":
                out["global_known_hosts"] = tuple(v.split())
            elif k == "stricthostkeychecking":
                out["strict"] = v.strip().lower() not in ("no", "off", "accept-new")
            elif k == "port":
                out["port"] = int(v)
            elif k == "identityfile":
                out["keys"].append(v)
            elif k == "user":
                out["user"] = v
    return out


def _host_args(host: Host) -> dict[str, Any]:
    """_common_args of the host's ansible_ssh_common_args and ansible_ssh_extra_args; exit 2 naming the host and
    the key when one cannot be read (an unbalanced quote, a port that is no number)."""
    out: dict[str, Any] = {"known_hosts": [], "keys": []}
    for key in ("ansible_ssh_common_args", "ansible_ssh_extra_args"):
        try:
            got = _common_args(str(host.ansible_vars.get(key, "")))
        except ValueError as exc:
            raise InvalidInput(f"host {host.name}: {key}: {exc}",
                               hint="write it as ssh's command line would take it (quotes balanced)") from None
        out["known_hosts"] += got.pop("known_hosts")
        out["keys"] += got.pop("keys")
        out.update(got)
    port = host.ansible_vars.get("ansible_port", out.get("port", 22))
    try:
        out["port"] = int(port)
    except (TypeError, ValueError):
        raise InvalidInput(f"host {host.name}: ansible_port {port!r} is not a port number") from None
    return out


def target_for(host: Host) -> Target:
    v = host.ansible_vars
    extra = _host_args(host)
    keys = [v["ansible_ssh_private_key_file"]] if v.get("ansible_ssh_private_key_file") else []
    keys += extra["keys"]
    known = extra["known_hosts"] or ["~/.ssh/known_hosts", "~/.ssh/known_hosts2"]   # OpenSSH's default
    return Target(
        name=host.name,
        address=host.ansible_host,
        port=extra["port"],
        user=str(v.get("ansible_user", extra.get("user", "root"))),
        key_files=tuple(os.path.expanduser(k) for k in keys),
        known_hosts=tuple(os.path.expanduser(k) for k in known),
        strict=extra.get("strict", True),
        ssh_config=extra.get("ssh_config"),
        global_known_hosts=tuple(os.path.expanduser(k)
                                 for k in extra.get("global_known_hosts", hostkeys.GLOBAL_FILES)),
    )


def ansible_host_key_args(inv: Inventory, accept_new: bool) -> str:
    """OpenSSH options that give the Ansible stage the known_hosts files and policy kimictl's own connections use.
    They go first on ssh's command line (ANSIBLE_SSH_ARGS), where OpenSSH takes the first value of each option."""
    targets = [target_for(h) for h in inv.hosts]
    args = []
    files = {t.known_hosts for t in targets}
    if len(files) == 1:   # per-host files differ: each host's own ansible_ssh_common_args say them
        args += ["-o", shlex.quote("UserKnownHostsFile=" + " ".join(files.pop()))]
    if accept_new:
        args += ["-o", "StrictHostKeyChecking=accept-new"]
    return " ".join(args)


@dataclass
class RunResult:
    rc: int
    stdout: str
    stderr: str
    seconds: float


class SSHError(Exception):
    """The host could not be reached or refused us; message says which and why."""


@dataclass
class _KnownHostsPolicy:
    """paramiko's host key hook: no key is loaded into paramiko, so it asks here for every connection (before
    authenticating) and kimictl/known_hosts.py decides."""

    target: Target
    accept_new: bool

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        t = self.target
        hostkeys.check(t.name, hostname, key.get_name(), key.get_base64(), t.known_hosts, t.global_known_hosts,
                       accept_new=self.accept_new)


def _known_key_types(target: Target) -> tuple[str, ...]:
    out: list[str] = []
    for e in hostkeys.load(target.known_hosts + target.global_known_hosts):
        if not e.marker and e.matches(target.host_key_name):
            out += ["rsa-sha2-512", "rsa-sha2-256", "ssh-rsa"] if e.key_type == "ssh-rsa" else [e.key_type]
    return tuple(dict.fromkeys(out))


@dataclass
class Session:
    target: Target
    timeout: float = 10.0
    accept_new_keys: bool = False
    _client: Any = field(default=None, repr=False)

    def connect(self) -> Session:
        import paramiko

        t = self.target
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(_KnownHostsPolicy(t, self.accept_new_keys or not t.strict))
        try:
            sock = socket.create_connection((t.address, t.port), timeout=self.timeout)
            # Without TCP_NODELAY every small exec round trip waits on Nagle + delayed ACK (~40 ms).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client.connect(t.address, port=t.port, username=t.user, key_filename=list(t.key_files) or None,
                           sock=sock, timeout=self.timeout, banner_timeout=self.timeout,
                           auth_timeout=self.timeout, allow_agent=not t.key_files, look_for_keys=not t.key_files,
                           transport_factory=functools.partial(_transport, key_types=_known_key_types(t)))
        except hostkeys.HostKeyError as exc:
            client.close()
            raise SSHError(str(exc)) from None
        except (paramiko.SSHException, EOFError) as exc:
            client.close()
            why = str(exc) or "the connection closed"
            raise SSHError(f"ssh to {t.user}@{t.address}:{t.port} failed: {why}") from None
        except OSError as exc:
            client.close()
            if exc.filename is not None:  # a key file (ansible_ssh_private_key_file, -i) that cannot be read
                raise SSHError(f"ssh to {t.user}@{t.address}:{t.port} failed: cannot read {exc.filename}: "
                               f"{exc.strerror or exc}") from None
            raise SSHError(f"cannot reach {t.address}:{t.port}: {exc.strerror or exc}") from None
        self._client = client
        return self

    def run(self, command: str, timeout: float | None = None, stdin: str | None = None) -> RunResult:
        import paramiko  # loaded by connect() already

        t0 = time.monotonic()
        chan_timeout = timeout or self.timeout
        try:
            stdin_f, stdout_f, stderr_f = self._client.exec_command(command, timeout=chan_timeout)
            if stdin is not None:
                stdin_f.write(stdin)
                stdin_f.channel.shutdown_write()
            out = stdout_f.read().decode(errors="replace")
            err = stderr_f.read().decode(errors="replace")
            rc = stdout_f.channel.recv_exit_status()
        except TimeoutError:
            raise SSHError(f"{self.target.name}: command timed out after {chan_timeout:.0f}s") from None
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise SSHError(f"{self.target.name}: the SSH connection failed during a command: "
                           f"{str(exc) or type(exc).__name__}") from None
        return RunResult(rc, out, err, time.monotonic() - t0)

    def transport(self):
        """The connection's paramiko Transport, for long-lived channels (the weights agents)."""
        return self._client.get_transport()

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class Sessions:
    """One open session per reachable host; unreachable hosts keep their SSHError. Close with `with`.

    `lazy=True` connects each host inside the first `each` call instead of up front, so a host's work starts
    as soon as its own connection is up rather than after the slowest host's handshake; `sessions` and
    `errors()` are complete only after that first `each`."""

    def __init__(self, inv: Inventory, *, timeout: float = 10.0, accept_new_keys: bool = False,
                 lazy: bool = False):
        self.hosts = list(inv.hosts)
        self.timeout = timeout

        def open_one(host: Host) -> Session | SSHError:
            try:
                return Session(target_for(host), timeout=timeout, accept_new_keys=accept_new_keys).connect()
            except SSHError as exc:
                return exc

        self._pool = ThreadPoolExecutor(max_workers=max(1, min(64, len(self.hosts))))
        if lazy:
            self.sessions: dict[str, Session | SSHError] = {
                h.name: Session(target_for(h), timeout=timeout, accept_new_keys=accept_new_keys)
                for h in self.hosts}
        else:
            self.sessions = dict(zip([h.name for h in self.hosts], self._pool.map(open_one, self.hosts),
                                     strict=True))

    def errors(self) -> dict[str, SSHError]:
        return {k: v for k, v in self.sessions.items() if isinstance(v, SSHError)}

    def each(self, fn: Callable[[str, Session], T]) -> dict[str, T | SSHError]:
        """Run fn(host, session) on every reachable host in parallel; failures become that host's SSHError."""

        def one(item: tuple[str, Session | SSHError]) -> T | SSHError:
            name, s = item
            if isinstance(s, SSHError):
                return s
            if s._client is None:   # lazy: connect here, in this host's own thread
                try:
                    s.connect()
                except SSHError as exc:
                    self.sessions[name] = exc
                    return exc
            try:
                return fn(name, s)
            except SSHError as exc:
                return exc

        items = list(self.sessions.items())
        return dict(zip([k for k, _ in items], self._pool.map(one, items), strict=True))

    def close(self) -> None:
        for s in self.sessions.values():
            if isinstance(s, Session):
                s.close()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> Sessions:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
