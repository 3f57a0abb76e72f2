"""Thin wrappers over the Linux tools the sandbox drives (ip, tc, nsenter, apt-get) and /proc."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kimictl.errors import KimictlError

# binary -> Debian package that provides it
REQUIRED_TOOLS = {
    "/usr/sbin/sshd": "openssh-server",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "rsync": "rsync",
    "ip": "iproute2",
    "tc": "iproute2",
    "ping": "iputils-ping",
    "nsenter": "util-linux",
    "unshare": "util-linux",
}


PYENV_ROOTS = ("/root/.pyenv",)   # the CI machines keep their interpreters here; $PYENV_ROOT is searched first


@functools.cache
def floor_python() -> str | None:
    """A CPython of the host Python floor (kimictl.HOST_PYTHON_FLOOR) on this machine, or None: python3.X on PATH,
    else the newest 3.X.* under $PYENV_ROOT or /root/.pyenv. Each candidate must say it is that version."""
    from kimictl import HOST_PYTHON_FLOOR

    want = ".".join(map(str, HOST_PYTHON_FLOOR))
    candidates = [shutil.which(f"python{want}")]
    for root in (os.environ.get("PYENV_ROOT"), *PYENV_ROOTS):
        try:
            found = list((Path(root or "/nonexistent") / "versions").glob(f"{want}.*/bin/python{want}"))
        except OSError:   # /root is not readable for everybody
            found = []
        candidates += sorted(map(str, found), key=lambda p: [int(x) if x.isdigit() else -1
                                                             for x in Path(p).parts[-3].split(".")], reverse=True)
    for c in filter(None, candidates):
        try:
            out = subprocess.run([c, "-I", "-S", "-c", "import sys; print(*sys.version_info[:2], sep='.')"],
                                 capture_output=True, text=True, timeout=10, check=False).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out == want:
            return str(Path(c).resolve())
    return None


class CommandError(KimictlError):
    """A system command the sandbox needs failed."""


def run(argv: Sequence[str], *, input: str | None = None, check: bool = True,
        timeout: float = 60) -> subprocess.CompletedProcess:
    """Run argv; on failure raise CommandError with the command and its stderr."""
    try:
        proc = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except FileNotFoundError as exc:
        raise CommandError(f"command not found: {argv[0]}") from exc
    except subprocess.TimeoutExpired as exc:
        raise CommandError(f"command timed out after {timeout}s: {' '.join(argv)}") from exc
    if check and proc.returncode != 0:
        raise CommandError(f"command failed ({proc.returncode}): {' '.join(argv)}",
                           details=[ln for ln in (proc.stderr or proc.stdout).strip().splitlines()[-5:]])
    return proc


def which(tool: str) -> bool:
    return os.access(tool, os.X_OK) if tool.startswith("/") else shutil.which(tool) is not None


def missing_packages() -> list[str]:
    return sorted({pkg for tool, pkg in REQUIRED_TOOLS.items() if not which(tool)})


def ensure_packages(log: Callable[[str], None]) -> None:
    """Install missing Debian packages with apt-get (root only).

    Raises:
        KimictlError: the packages are missing and cannot be installed.
    """
    pkgs = missing_packages()
    if not pkgs:
        return
    cmd = f"apt-get install -y --no-install-recommends {' '.join(pkgs)}"
    if os.geteuid() != 0 or not which("apt-get"):
        raise KimictlError(f"the sandbox needs these packages: {', '.join(pkgs)}", hint=f"as root run: {cmd}")
    log(f"installing {', '.join(pkgs)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *pkgs]):
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            raise KimictlError(f"could not install {', '.join(pkgs)}", details=proc.stderr.strip().splitlines()[-5:],
                               hint=f"run it by hand: {cmd}")
    if missing_packages():
        raise KimictlError(f"still missing after apt-get: {', '.join(missing_packages())}")


# what a fake host needs, tried in throw-away namespaces: overlay with its upper dir in the sandbox dir
# (fails when that filesystem is itself an overlay) and a bridge (CAP_NET_ADMIN)
_PROBE = """set -e
mkdir -p "$1/u" "$1/w" "$1/m"
mount -t overlay overlay -o "lowerdir=/opt,upperdir=$1/u,workdir=$1/w" "$1/m"
ip link add kimiprobe0 type bridge
"""


def namespaces_usable(probe_dir: Path | None = None) -> tuple[bool, str]:
    """Whether this process may build netns-mode hosts: root, unshare, and (given a dir) overlay + bridge."""
    if os.geteuid() != 0:
        return False, "not running as root"
    argv = ["unshare", "--net", "--mount", "--uts", "--pid", "--fork", "--mount-proc", "--propagation", "private"]
    if probe_dir is None:
        argv.append("true")
    else:
        argv += ["sh", "-c", _PROBE, "sh", str(probe_dir)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"unshare failed: {exc}"
    finally:
        if probe_dir is not None:
            shutil.rmtree(probe_dir, ignore_errors=True)
    if proc.returncode != 0:
        return False, f"unshare/overlay/bridge probe failed: {proc.stderr.strip()[-300:] or proc.returncode}"
    return True, ""


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (index 0 = state), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> str | None:
    st = proc_stat(pid)
    return st[19] if st else None


def alive(pid: int | None, started: str | None = None) -> bool:
    """Running, not a zombie, and (if given) the same process that was started at `started`."""
    if not pid:
        return False
    # reap our own dead children so they do not linger as zombies
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    st = proc_stat(pid)
    if not st or st[0] in ("Z", "X"):
        return False
    return started is None or st[19] == started


def children(pid: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            st = proc_stat(int(p))
            if st and st[1] == str(pid):
                out.append(int(p))
    return out


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def kill(pid: int, sig: int = signal.SIGTERM) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def wait_dead(pids: list[int], timeout: float) -> list[int]:
    """Wait until all pids are gone; return those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [p for p in left if alive(p)]
    return left


def ssh_banner(ip: str, port: int, timeout: float = 1.0) -> bool:
    """True once an sshd answers with its SSH- banner."""
    try:
        with socket.create_connection((ip, port), timeout=timeout) as s:
            s.settimeout(timeout)
            return s.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def port_open(ip: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return True
    except OSError:
        return False


def netns_list() -> list[str]:
    proc = run(["ip", "netns", "list"], check=False)
    return [ln.split()[0] for ln in proc.stdout.splitlines() if ln.strip()]


def links() -> list[str]:
    proc = run(["ip", "-o", "link", "show"], check=False)
    out = []
    for ln in proc.stdout.splitlines():
        parts = ln.split(":", 2)
        if len(parts) > 1:
            out.append(parts[1].strip().split("@")[0])
    return out


def netns_pids(ns: str) -> list[int]:
    proc = run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def mounts_under(path: Path) -> list[str]:
    """Mount points in this mount namespace at or below path (deepest first)."""
    prefix = str(path)
    out = []
    for ln in Path("/proc/mounts").read_text().splitlines():
        mp = ln.split()[1].replace("\\040", " ")
        if mp == prefix or mp.startswith(prefix + "/"):
            out.append(mp)
    return sorted(out, key=len, reverse=True)
