"""Session fixtures: simulated Atlas clusters brought up once, always torn down, plus host helpers."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from prerequisites import require_or_skip

from kimictl.sandbox import system


def _cli_prefix() -> list[str]:
    from kimictl.cli import main

    if any(g.name == "sandbox" for g in main.app.registered_groups):
        return [sys.executable, "-m", "kimictl", "sandbox"]
    # until the lead registers the group, drive the sub-app directly (same code path)
    return [sys.executable, "-c", "import sys; from kimictl.cli.sandbox import app; sys.exit(app())"]


def sandbox_cli(*args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run `kimictl sandbox ARGS` in a subprocess (as a user would)."""
    proc = subprocess.run([*_cli_prefix(), *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"kimictl sandbox {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@dataclass
class SandboxHandle:
    """A running sandbox and ways to run things on its hosts."""

    dir: Path

    @property
    def state(self) -> dict:
        return json.loads((self.dir / "sandbox.json").read_text())

    @property
    def hosts(self) -> list[str]:
        return [h["name"] for h in self.state["hosts"]]

    @property
    def cluster(self) -> str:
        return self.state["cluster"]

    @property
    def inventory(self) -> Path:
        return self.dir / "inventory.yml"

    def host(self, name: str) -> dict:
        return next(h for h in self.state["hosts"] if h["name"] == name)

    def device_ip(self, name: str, npu: int) -> str:
        return self.host(name)["device_ips"][npu]

    def ssh(self, name: str, command: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a shell command on a host over real ssh with the generated ssh_config."""
        return subprocess.run(["ssh", "-F", str(self.dir / "ssh_config"), name, command], capture_output=True,
                              text=True, timeout=timeout, check=False)

    def sshd_pid(self, name: str) -> int:
        kids = system.children(self.host(name)["launcher_pid"])
        assert kids, f"{name} is not running"
        return kids[0]

    def nsenter(self, name: str, argv: list[str]) -> subprocess.CompletedProcess:
        """Run argv inside a host's namespaces without ssh (for assertions)."""
        return subprocess.run(["nsenter", "-t", str(self.sshd_pid(name)), "--net", "--mount", "--uts", "--pid",
                               "--", *argv], capture_output=True, text=True, timeout=60, check=False)

    def fault(self, *specs: str, check: bool = True) -> subprocess.CompletedProcess:
        return sandbox_cli("fault", *specs, "--dir", str(self.dir), check=check)


def leftovers(directory: Path, slot: int) -> list[str]:
    """Namespaces, links, mounts and processes of a sandbox that still exist."""
    prefix = f"ks{slot}"
    out = [f"netns {n}" for n in system.netns_list() if n.startswith(prefix + "-")]
    out += [f"link {ln}" for ln in system.links() if ln.startswith(prefix)]
    out += [f"mount {ln}" for ln in Path("/proc/mounts").read_text().splitlines() if str(directory) in ln]
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) != os.getpid() and system.alive(int(p)):
            argv = system.cmdline(int(p))
            if any(str(directory) in a for a in argv):
                out.append(f"process {p}: {' '.join(argv)[:120]}")
    return out


@functools.cache
def _namespaces() -> tuple[bool, str]:
    return system.namespaces_usable()


def _require_namespaces() -> None:
    ok, why = _namespaces()
    if not ok:
        require_or_skip(f"sandbox tests need root and namespaces: {why}")


@pytest.fixture(autouse=True)
def _skip_without_namespaces(request):
    if request.node.get_closest_marker("sandbox"):
        _require_namespaces()


def _bring_up(directory: Path, *args: str, name: str | None = None):
    """Each sandbox is its own cluster (default: named after its directory): kimictl's control-node state (current
    release, history) is per cluster name, and the session shares one state dir."""
    _require_namespaces()
    name = name or re.sub(r"[^a-z0-9-]", "-", directory.name.lower()).strip("-")[:63]
    sandbox_cli("up", *args, "--name", name, "--dir", str(directory))
    handle = SandboxHandle(directory)
    try:
        yield handle
    finally:
        sandbox_cli("down", "--dir", str(directory), check=False)


@pytest.fixture(scope="session")
def sandbox_a3(tmp_path_factory):
    """Two Atlas 800 A3 hosts (16 dies each), up for the whole session, under `sandbox up`'s default name: the
    operators' guide and test_sandbox_hosts run `kimictl sandbox up` on it again, which must find it already up."""
    yield from _bring_up(tmp_path_factory.mktemp("sb-a3"), "--hosts", "2", "--hardware", "atlas-800-a3",
                         name="sandbox")


@pytest.fixture(scope="session")
def sandbox_a2(tmp_path_factory):
    """Two Atlas 800 A2 hosts (8 x 910B3 each), up for the whole session."""
    yield from _bring_up(tmp_path_factory.mktemp("sb-a2"), "--hosts", "2", "--hardware", "atlas-800-a2")


@pytest.fixture(scope="session")
def cli():
    """`cli("status", "--dir", D)` runs `kimictl sandbox status --dir D` in a subprocess."""
    return sandbox_cli


@pytest.fixture(scope="session")
def find_leftovers():
    """`find_leftovers(dir, slot)` lists what of a sandbox still exists."""
    return leftovers


@pytest.fixture
def a3(sandbox_a3):
    """The shared A3 sandbox, with every fault cleared after the test."""
    yield sandbox_a3
    sandbox_a3.fault("clear:all")


@pytest.fixture(scope="session", autouse=True)
def _control_state_dir(tmp_path_factory):
    """kimictl's control-node state (releases, runs) goes to a temp dir, never the user's home."""
    old = os.environ.get("KIMICTL_STATE_DIR")
    os.environ["KIMICTL_STATE_DIR"] = str(tmp_path_factory.mktemp("kimictl-state"))
    yield
    if old is None:
        os.environ.pop("KIMICTL_STATE_DIR", None)
    else:
        os.environ["KIMICTL_STATE_DIR"] = old


def kimictl(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `kimictl ARGS` in a subprocess, as a user or CI would (`env` added to this process's environment)."""
    return subprocess.run([sys.executable, "-m", "kimictl", *args], capture_output=True, text=True,
                          timeout=timeout, check=False, env={**os.environ, **(env or {})})


class ArgvWatch:
    """`with ArgvWatch(secret) as w: ...`: samples the argv of every process on the machine (sandbox hosts' too:
    their PID namespaces are children of ours) until the block ends; `w.hits` are the command lines that held a
    needle."""

    def __init__(self, *needles: str):
        self.needles = [n.encode() for n in needles]
        self.hits: list[str] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if any(n in argv for n in self.needles):
                    self.hits.append(argv.replace(b"\0", b" ").decode(errors="replace"))
            self.samples += 1
            self._stop.wait(0.05)

    def __enter__(self) -> ArgvWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="session")
def sandbox_a3_4(tmp_path_factory):
    """Four Atlas 800 A3 hosts: a3-pd plans 2P2D, so every role keeps a live instance while another restarts."""
    yield from _bring_up(tmp_path_factory.mktemp("sb-a3x4"), "--hosts", "4", "--hardware", "atlas-800-a3")
