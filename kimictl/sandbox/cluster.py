"""Bring a simulated Atlas cluster up and down: namespaces, sshd per host, doubles, client files (faults are
injected by kimictl/sandbox/inject.py)."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from kimictl.ansible import make_private_dir
from kimictl.errors import HostError, InvalidInput, KimictlError
from kimictl.sandbox import client, layout, system
from kimictl.sandbox.doubles import hccn_tool
from kimictl.sandbox.faults import Fault, fault_hosts, parse_fault
from kimictl.sandbox.layout import HARDWARE, HostSpec, Names

Log = Callable[[str], None]
SLOTS_DIR = Path("/var/tmp/kimictl-sandbox.slots")
SLOT_GRACE_S = 120
CLUSTER_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
# the fake hosts mount over these, so the sandbox directory must not live below them
FORBIDDEN_DIR_PARENTS = ("/var/lib", "/opt", "/usr/local", "/etc", "/run", "/root", "/proc", "/sys", "/dev")
PRIVATE_DIRS = ("/var/lib", "/opt", "/usr/local", "/etc")
READY_TIMEOUT = 20.0
PKG_DIR = Path(__file__).resolve().parent


DEFAULT_CHECKPOINT_BYTES = 64 * 2**20
CHECKPOINT_SHARDS = 8


def _quiet(_msg: str) -> None:
    """Default progress sink."""


class HostState(BaseModel):
    """Runtime state of one fake host."""

    name: str
    index: int
    ip: str
    port: int
    device_ips: list[str]
    netns: str | None = None
    state_dir: str | None = None
    launcher_pid: int | None = None
    launcher_started: str | None = None
    listeners: dict[str, tuple[int, str]] = Field(default_factory=dict)   # port-taken: port -> (pid, start)


class SandboxState(BaseModel):
    """D/sandbox.json: everything `down`, `status` and `fault` need."""

    schema_version: int = 1
    status: Literal["creating", "up"]
    mode: Literal["netns", "loopback"]
    cluster: str
    hardware: str
    slot: int
    dir: str
    created: float
    hosts: list[HostState]
    faults: list[str] = Field(default_factory=list)
    # engine-crash spares the releases running when it was injected: it models a bad *new* release
    spare_tags: dict[str, list[str]] = Field(default_factory=dict)
    # engine-hang-now hangs the engines running when it was injected (spec -> epoch seconds); a restart cures them
    hang_since: dict[str, float] = Field(default_factory=dict)
    hub_url: str | None = None
    hub_pid: int | None = None
    hub_started: str | None = None
    # what `python3` is on the hosts (/usr/local/bin/python3, first on PATH): the host Python floor's interpreter
    # when this machine has one ({path, version, prefix}), else None (this machine's python3)
    host_python: dict[str, str] | None = None


@dataclass
class UpResult:
    """What `up` did."""

    state: SandboxState
    already_up: bool
    seconds: float
    inventory: Path


def write_file(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    tmp.replace(path)


def _install_script(src: Path, dst: Path) -> None:
    """Copy a stdlib-only Python script as an executable run by the hosts' /usr/bin/python3."""
    body = src.read_text()
    if body.startswith("#!"):
        body = body.split("\n", 1)[1] if "\n" in body else ""
    write_file(dst, "#!/usr/bin/python3\n" + body, 0o755)


def _install_hccn_tool(tools: Path, tools_on_host: str) -> None:
    """hccn_tool: the bash front (answers preflight's queries from KIMI_SIM_DIR/fast) and the Python double."""
    _install_script(PKG_DIR / "doubles" / "hccn_tool.py", tools / "hccn_tool.py")
    write_file(tools / "hccn_tool", hccn_tool.front_script(f"{tools_on_host}/hccn_tool.py"), 0o755)


def validate_dir(directory: Path) -> Path:
    """Absolute sandbox dir, not under a path the fake hosts mount over."""
    d = directory.expanduser().absolute()
    for parent in FORBIDDEN_DIR_PARENTS:
        if str(d) == parent or str(d).startswith(parent + "/"):
            raise InvalidInput(f"--dir {d} is under {parent}, which every fake host mounts over",
                               hint="use a directory such as /var/tmp/kimictl-sandbox")
    return d


def _check_up(n: int, hardware: str, cluster: str, mode: str | None, faults: list[str],
              inject: Callable[[Fault], object] | None) -> list[Fault]:
    """Sandbox.up's arguments, checked before anything changes; the fault specs parsed against its hosts."""
    if not 1 <= n <= layout.MAX_HOSTS:
        raise InvalidInput(f"--hosts {n} is out of range; expected 1..{layout.MAX_HOSTS}")
    if hardware not in HARDWARE:
        raise InvalidInput(f"invalid --hardware '{hardware}'; expected one of {', '.join(HARDWARE)}")
    if not CLUSTER_NAME.fullmatch(cluster):
        raise InvalidInput(f"invalid --name {cluster!r}; expected [a-z0-9][a-z0-9-]{{0,62}}")
    if mode not in (None, "netns", "loopback"):
        raise InvalidInput(f"invalid mode '{mode}'; expected netns or loopback")
    names = [layout.host_name(i) for i in range(1, n + 1)]
    parsed = [parse_fault(s, names, HARDWARE[hardware].npus) for s in faults]
    if parsed and inject is None:
        raise ValueError("Sandbox.up: faults need `inject` (kimictl.sandbox.inject.Injector(sandbox).apply)")
    return parsed


class Sandbox:
    """One sandbox directory and the kernel objects and processes it owns."""

    def __init__(self, directory: Path, log: Log = _quiet):
        self.dir = validate_dir(directory)
        self.log = log
        self._proxy_src: Path | None = None  # vllm-ascend's P/D proxy for the hosts (set by `up`)
        self._proxy_rel = ""

    # ---- state -------------------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        return self.dir / "sandbox.json"

    def load(self) -> SandboxState | None:
        try:
            return SandboxState.model_validate_json(self.state_path.read_text())
        except FileNotFoundError:
            return None
        except ValueError as exc:
            raise KimictlError(f"unreadable sandbox state {self.state_path}: {exc}",
                               hint="`kimictl sandbox down` removes leftovers by name") from None

    def require(self) -> SandboxState:
        state = self.load()
        if state is None or state.status != "up":
            raise KimictlError(f"no sandbox is up in {self.dir}",
                               hint="start one with `kimictl sandbox up --hosts 2 --hardware atlas-800-a3`")
        return state

    def save(self, state: SandboxState) -> None:
        write_file(self.state_path, state.model_dump_json(indent=2) + "\n")

    def specs(self, state: SandboxState) -> list[HostSpec]:
        return layout.plan_hosts(len(state.hosts), state.hardware, state.mode, state.slot, self.dir)

    # ---- up ----------------------------------------------------------------------------------
    def up(self, n: int, hardware: str, *, cluster: str = "sandbox", faults: list[str] | None = None,
           mode: str | None = None, checkpoint_bytes: int = DEFAULT_CHECKPOINT_BYTES,
           checkpoint_shards: int = CHECKPOINT_SHARDS, inject: Callable[[Fault], object] | None = None) -> UpResult:
        """Bring an n-host sandbox up (or report that an identical one already runs).

        faults: specs checked before anything changes, then given to `inject` (kimictl/sandbox/inject.py's
        Injector(sandbox).apply) once the sandbox is up; a sandbox this call made is torn down if one fails.

        Raises:
            InvalidInput: bad host count, hardware, name or fault spec (nothing was changed).
            KimictlError: the sandbox could not be built; whatever was made is torn down again.
        """
        t0 = time.monotonic()
        parsed = _check_up(n, hardware, cluster, mode, faults or [], inject)
        old = self.load()
        if old is not None:
            same = (old.status == "up" and len(old.hosts) == n and old.hardware == hardware
                    and old.cluster == cluster and (mode is None or mode == old.mode))
            if same and self._all_running(old):
                self.log(f"sandbox in {self.dir} is already up ({n} x {hardware}, {old.mode} mode)")
                for f in parsed:
                    inject(f)
                return UpResult(self.load() or old, True, time.monotonic() - t0, self.dir / "inventory.yml")
            if old.status == "up" and not same:
                raise InvalidInput(
                    f"a different sandbox is up in {self.dir} ({len(old.hosts)} x {old.hardware}, "
                    f"name {old.cluster})", hint=f"run `kimictl sandbox down --dir {self.dir}` first")
            self.log(f"cleaning up a broken sandbox in {self.dir}")
            self.down()

        system.ensure_packages(self.log)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._proxy_src = self._upstream_proxy()
        if mode in (None, "netns"):
            ok, why = system.namespaces_usable(self.dir / ".probe")
            if not ok and mode == "netns":
                raise KimictlError(f"netns mode is not possible here: {why}")
            if not ok:
                self.log(f"network namespaces are not usable ({why}); "
                         "falling back to loopback mode: one sshd per host on 127.10.x.y ports")
            mode = "netns" if ok else "loopback"
        slot = self._claim_slot()
        hosts = layout.plan_hosts(n, hardware, mode, slot, self.dir)
        state = SandboxState(
            status="creating", mode=mode, cluster=cluster, hardware=hardware, slot=slot, dir=str(self.dir),
            created=time.time(), host_python=_floor_python_info(),
            hosts=[HostState(name=h.name, index=h.index, ip=h.ip, port=h.port, device_ips=h.device_ips,
                             netns=h.netns, state_dir=h.state_dir) for h in hosts])
        self.save(state)   # written first so `down` can find leftovers if we crash midway
        try:
            self.log(f"creating {n} x {hardware} hosts ({mode} mode) in {self.dir}")
            self._client_key()
            # loopback hosts share one filesystem, so there is nothing to stage per host
            ckpt = (self._checkpoint(checkpoint_bytes, checkpoint_shards) if checkpoint_bytes and mode == "netns"
                    else None)
            with ThreadPoolExecutor(max_workers=min(16, n)) as pool:
                list(pool.map(lambda h: self._prepare_host(h, state), hosts))
            if mode == "loopback":   # hosts share the filesystem: one engine command for all
                self._install_engine(self.dir / "bin" / "vllm", warn=True)
                if self._proxy_src:
                    _copy_file(self._proxy_src, self.dir / "vllm-ascend" / self._proxy_rel)
            if mode == "netns":
                write_file(self.dir / "etc_hosts", layout.etc_hosts(hosts, Names(slot).controller_ip))
                self._create_network(state, hosts)
            if ckpt is not None:
                self._start_hub(state, ckpt)
            for h, hs in zip(hosts, state.hosts, strict=True):
                self.launch_host(h, hs, state)
            self.save(state)
            self._write_client_files(state, hosts)
            self._wait_ready(state, hosts)
            state.status = "up"
            self.save(state)
            for f in parsed:
                inject(f)
        except BaseException:
            self.log("up failed; removing what was created")
            try:
                self.down()
            except KimictlError as exc:
                self.log(f"cleanup after the failed up also failed: {exc.message}")
            raise
        return UpResult(self.load() or state, False, time.monotonic() - t0, self.dir / "inventory.yml")

    def _all_running(self, state: SandboxState) -> bool:
        down = {parse_fault(s).host for s in state.faults if s.startswith("host-down:")}
        return all(h.name in down or system.alive(h.launcher_pid, h.launcher_started) for h in state.hosts)

    def _claim_slot(self) -> int:
        """A slot (subnets + name prefix) no other sandbox or leftover uses; recorded in SLOTS_DIR."""
        try:
            SLOTS_DIR.mkdir(parents=True, exist_ok=True)
            if os.geteuid() == 0:
                SLOTS_DIR.chmod(0o1777)   # like /tmp: a non-root loopback sandbox may register too
        except OSError as exc:
            raise KimictlError(f"cannot use the sandbox slot registry {SLOTS_DIR}: {exc.strerror}") from None
        taken = [*system.netns_list(), *system.links()] if os.geteuid() == 0 else []
        for s in range(layout.MAX_SLOTS):
            rec = SLOTS_DIR / str(s)
            if rec.exists():
                owner = Path(rec.read_text().strip() or "/nonexistent")
                # ours from a crash, or its owner is gone (a young record may belong to an `up` in progress)
                if owner == self.dir or (not (owner / "sandbox.json").exists()
                                         and time.time() - rec.stat().st_mtime > SLOT_GRACE_S):
                    rec.unlink(missing_ok=True)
                else:
                    continue
            prefix = Names(s).prefix
            if any(t.startswith((prefix + "-", prefix + "b", prefix + "h")) for t in taken):
                continue
            if os.geteuid() != 0 and system.port_open(Names(s).host_ip(1, "loopback"),
                                                      Names(s).ssh_port(1, "loopback"), 0.2):
                continue   # without root we cannot list links: a busy ssh port means the slot is used
            try:
                fd = _create_exclusive(rec)
            except FileExistsError:
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(self.dir) + "\n")
            return s
        raise KimictlError(f"all {layout.MAX_SLOTS} sandbox slots are in use",
                           details=[f"{p}: {p.read_text().strip()}" for p in sorted(SLOTS_DIR.iterdir())],
                           hint="tear one down with `kimictl sandbox down --dir DIR`")

    def _client_key(self) -> None:
        key = self.dir / "id_ed25519"
        if not key.exists():
            system.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "kimictl-sandbox", "-f", str(key)])
        shutil.copyfile(key.with_suffix(".pub"), self.dir / "authorized_keys")
        make_private_dir(client.control_dir(self.dir))

    def _checkpoint(self, size: int, shards: int) -> Path:
        """A small Kimi-shaped W4A8 checkpoint, generated once per sandbox dir (deterministic)."""
        from kimictl.sandbox.checkpoint import generate_checkpoint

        dest = self.dir / "checkpoint"
        stamp = self.dir / "checkpoint.json"
        want = {"bytes": size, "shards": shards}
        if not (stamp.exists() and json.loads(stamp.read_text()).get("spec") == want):
            self.log(f"generating a {size / 2**20:.0f} MiB Kimi-shaped checkpoint in {dest}")
            files = generate_checkpoint(dest, total_bytes=size, num_shards=shards)
            write_file(stamp, json.dumps({"spec": want, "files": files}, indent=1) + "\n")
        return dest

    def _start_hub(self, state: SandboxState, checkpoint: Path) -> None:
        """The fake model hub on the control bridge, serving the generated checkpoint (docs/fakehub.md)."""
        ip = Names(state.slot).controller_ip
        url_file = self.dir / "hub.url"
        url_file.unlink(missing_ok=True)
        with open(url_file, "wb") as out, open(self.dir / "hub.log", "ab") as err:
            proc = subprocess.Popen([sys.executable, "-m", "kimictl.sandbox.fakehub", "--repo",
                                     f"{client.MODEL_ID}={checkpoint}", "--host", ip, "--port", "0",
                                     "--log-file", str(self.dir / "hub.log")],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                                    env={**os.environ, "PYTHONPATH": str(PKG_DIR.parent.parent)})
        state.hub_pid, state.hub_started = proc.pid, system.start_time(proc.pid)
        self.save(state)
        deadline = time.monotonic() + READY_TIMEOUT
        while not url_file.read_text().strip():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise KimictlError("the fake model hub did not start",
                                   details=(self.dir / "hub.log").read_text(errors="replace").splitlines()[-5:])
            time.sleep(0.05)
        state.hub_url = url_file.read_text().strip()

    def _prepare_host(self, h: HostSpec, state: SandboxState) -> None:
        """Host keys, sshd config, boot script and the files the doubles and tools read."""
        if h.dir.exists():
            shutil.rmtree(h.dir)
        h.dir.mkdir(parents=True)
        system.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", h.name, "-f",
                    str(h.dir / "ssh_host_ed25519_key")])
        netns = state.mode == "netns"
        # where "/usr/local", "/etc", "/opt", "/var/lib" of this host are written before it boots
        if netns:
            roots = {d: h.dir / "ovl" / d.strip("/").replace("/", "_") / "upper" for d in PRIVATE_DIRS}
            for d in PRIVATE_DIRS:
                (roots[d].parent / "work").mkdir(parents=True)
                roots[d].mkdir(parents=True)
            ascend_root = layout.ASCEND_ROOT
        else:
            roots = {d: h.root / d.strip("/") for d in PRIVATE_DIRS}
            ascend_root = str(roots["/usr/local"] / "Ascend")
        usr_local, etc = roots["/usr/local"], roots["/etc"]
        sim = h.sim_dir
        (sim / "claims").mkdir(parents=True)
        write_file(sim / "host.json", json.dumps(layout.host_json(h, state.hardware, ascend_root=ascend_root),
                                             indent=2) + "\n")
        write_file(sim / "faults.json", "{}\n")
        hccn_tool.write_fast_state(sim)   # what the hccn_tool front answers from (after every faults.json write)
        if netns:
            (roots["/var/lib"] / "kimi-sim").mkdir()
            (roots["/var/lib"] / "kimi" / "models").mkdir(parents=True)
        else:
            Path(h.state_dir or h.dir / "state").mkdir(parents=True, exist_ok=True)
        _install_script(PKG_DIR / "doubles" / "npu_smi.py", usr_local / "bin" / "npu-smi")
        _install_script(PKG_DIR / "doubles" / "npu_exporter.py", usr_local / "bin" / "npu-exporter")
        _install_hccn_tool(usr_local / "Ascend/driver/tools", f"{ascend_root}/driver/tools")
        write_file(usr_local / "Ascend/driver/version.info", layout.driver_version_info())
        write_file(usr_local / "Ascend/firmware/version.info", layout.firmware_version_info())
        arch = platform.machine() or "x86_64"
        tk = usr_local / "Ascend/ascend-toolkit"
        write_file(tk / layout.CANN_VERSION / f"{arch}-linux" / "ascend_toolkit_install.info",
               layout.toolkit_install_info(arch))
        (tk / "latest").symlink_to(layout.CANN_VERSION)
        write_file(tk / "set_env.sh", "export ASCEND_TOOLKIT_HOME=/usr/local/Ascend/ascend-toolkit/latest\n"
                                  "export ASCEND_HOME_PATH=$ASCEND_TOOLKIT_HOME\n")
        write_file(etc / "ascend_install.info", layout.ASCEND_INSTALL_INFO)
        write_file(etc / "hccn.conf", layout.hccn_conf(h.device_ips))
        if netns:
            self._install_engine(roots["/opt"] / "kimi-sim/bin/vllm", warn=h.index == 1)
            if self._proxy_src:
                tree = Path(layout.VLLM_ASCEND_TREE).relative_to("/opt")
                _copy_file(self._proxy_src, roots["/opt"] / tree / self._proxy_rel)
        if state.host_python:   # `python3` (PATH: /usr/local/bin comes first) is the host Python floor's
            (usr_local / "bin" / "python3").symlink_to(state.host_python["path"])
        env = {} if netns else {"KIMI_SIM_DIR": str(sim),
                                "PATH": f"{usr_local / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:"
                                        "/sbin:/bin"}
        write_file(h.dir / "sshd_config", sshd_config(h, self.dir, env))
        write_file(h.dir / "boot.sh", boot_script(h, self.dir, state.mode, state.host_python), 0o755)

    def _upstream_proxy(self) -> Path | None:
        """vllm-ascend's P/D proxy from the sdist of the default version profile (fetched once, sha256-checked,
        cached); the hosts get it where a vllm-ascend source tree would put it. None, with a warning, when it cannot
        be had (then only proxy.router vllm-router can be deployed here)."""
        from kimictl.facts import version_profile
        from kimictl.router_kinds import router_kind
        from kimictl.upstream import UpstreamMismatch, UpstreamUnavailable, release_of, upstream_file

        kind = router_kind("vllm-ascend-proxy")
        self._proxy_rel = str(kind.script)
        release = release_of(version_profile(None).image_tag)
        why = None
        if client.proxy_python() is None:
            why = f"this venv lacks {', '.join(kind.python_modules)} (pip install -e '.[test]')"
        else:
            try:
                return upstream_file(release, self._proxy_rel)
            except (UpstreamUnavailable, UpstreamMismatch) as exc:
                why = exc.message
        self.log(f"warning: vllm-ascend {release}'s P/D proxy cannot run here ({why}); the inventory gets no "
                 "kimi_proxy_script, so only proxy.router vllm-router can be deployed")
        return None

    def _install_engine(self, dst: Path, *, warn: bool) -> None:
        engine = PKG_DIR / "engine_sim.py"
        if engine.exists():
            _install_script(engine, dst)
        elif warn:
            self.log(f"warning: {engine} does not exist yet; the engine command is not installed")

    def _create_network(self, state: SandboxState, hosts: list[HostSpec]) -> None:
        names = Names(state.slot)
        batch = [f"link add {names.control_bridge} type bridge",
                 f"addr add {names.controller_ip}/24 dev {names.control_bridge}",
                 f"link set {names.control_bridge} up",
                 f"link add {names.device_bridge} type bridge",
                 f"link set {names.device_bridge} up"]
        for h in hosts:
            vc, vd = names.veth_control(h.index), names.veth_device(h.index)
            batch += [f"netns add {h.netns}",
                      f"link add {vc} type veth peer name {layout.CONTROL_NIC} netns {h.netns}",
                      f"link set {vc} master {names.control_bridge} up",
                      f"link add {vd} type veth peer name {layout.DEVICE_NIC} netns {h.netns}",
                      f"link set {vd} master {names.device_bridge} up"]
        system.run(["ip", "-batch", "-"], input="\n".join(batch) + "\n")
        for h in hosts:
            inner = ["link set lo up", f"addr add {h.ip}/24 dev {layout.CONTROL_NIC}",
                     f"link set {layout.CONTROL_NIC} up",
                     *(f"addr add {ip}/16 dev {layout.DEVICE_NIC}" for ip in h.device_ips),
                     f"link set {layout.DEVICE_NIC} up"]
            system.run(["ip", "-n", str(h.netns), "-batch", "-"], input="\n".join(inner) + "\n")
            # link-down removes one device IP; without this, removing the first (primary) one takes every
            # other device IP of the subnet with it
            system.run(["ip", "netns", "exec", str(h.netns), "sh", "-c",
                        f"echo 1 > /proc/sys/net/ipv4/conf/{layout.DEVICE_NIC}/promote_secondaries"])

    def launch_host(self, h: HostSpec, hs: HostState, state: SandboxState) -> None:
        """Start the host: sshd becomes PID 1 of fresh namespaces (netns) or runs under a subreaper."""
        if state.mode == "netns":
            # `ip netns exec` and unshare exec, so the pid is unshare's; --kill-child ties sshd to it
            argv = ["ip", "netns", "exec", str(h.netns), "unshare", "--mount", "--uts", "--pid", "--fork",
                    "--kill-child", "--mount-proc", "--propagation", "private", str(h.dir / "boot.sh")]
        else:
            if os.geteuid() == 0:
                Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)   # root sshd's hard-coded privsep dir
            argv = ["/usr/bin/python3", str(PKG_DIR / "subreaper.py"), str(h.dir / "boot.sh")]
        with open(h.dir / "sshd.log", "ab") as logf:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        hs.launcher_pid = proc.pid
        hs.launcher_started = system.start_time(proc.pid)
        hs.listeners = {}

    def _write_client_files(self, state: SandboxState, hosts: list[HostSpec]) -> None:
        kh = "".join(client.known_hosts_line(h, (h.dir / "ssh_host_ed25519_key.pub").read_text()) for h in hosts)
        write_file(self.dir / "known_hosts", kh)
        write_file(self.dir / "ssh_config", client.ssh_config(hosts, self.dir, user=_login_user()))
        if state.mode == "netns":
            model_dir, engine = layout.MODEL_DIR, layout.ENGINE_COMMAND
        else:
            # loopback hosts share one filesystem: keep everything inside the sandbox dir
            model_dir = str(self.dir / "shared/models/Kimi-K2.5-W4A8")
            engine = str(self.dir / "bin" / "vllm")
        script = None
        if self._proxy_src:
            script = str(Path(layout.VLLM_ASCEND_TREE if state.mode == "netns" else self.dir / "vllm-ascend")
                         / self._proxy_rel)
        # Ansible runs its modules on the hosts' python3 too (netns: it is at /usr/local/bin/python3 on every host)
        python = "/usr/local/bin/python3" if state.host_python and state.mode == "netns" else "/usr/bin/python3"
        inv = client.inventory(hosts, state.hardware, self.dir, mode=state.mode, cluster=state.cluster,
                               model_dir=model_dir, engine_command=engine, user=_login_user(),
                               hub_url=state.hub_url, python=python, proxy_script=script)
        write_file(self.dir / "inventory.yml", client.inventory_yaml(inv))

    def _wait_ready(self, state: SandboxState, hosts: list[HostSpec]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        pending = {h.name: (h, hs) for h, hs in zip(hosts, state.hosts, strict=True)}
        while pending:
            for name, (h, hs) in list(pending.items()):
                if system.ssh_banner(h.ip, h.port, 0.5):
                    del pending[name]
                elif not system.alive(hs.launcher_pid, hs.launcher_started):
                    raise HostError("sshd exited during boot", host=name, step="boot", log_tail=_tail(h))
            if pending and time.monotonic() > deadline:
                name, (h, _) = next(iter(pending.items()))
                raise HostError(f"sshd did not answer on {h.ip}:{h.port} within {READY_TIMEOUT:.0f}s",
                                host=name, step="boot", log_tail=_tail(h))
            if pending:
                time.sleep(0.05)

    def wait_host_ready(self, h: HostSpec, hs: HostState) -> None:
        """Wait for one restarted host's sshd."""
        deadline = time.monotonic() + READY_TIMEOUT
        while not system.ssh_banner(h.ip, h.port, 0.5):
            if not system.alive(hs.launcher_pid, hs.launcher_started):
                raise HostError("sshd exited during restart", host=h.name, step="boot", log_tail=_tail(h))
            if time.monotonic() > deadline:
                raise HostError("sshd did not come back", host=h.name, step="boot", log_tail=_tail(h))
            time.sleep(0.05)

    # ---- down --------------------------------------------------------------------------------
    def down(self) -> list[str]:
        """Remove every process, namespace, link, mount and file this sandbox made; safe to repeat."""
        try:
            state = self.load()
        except KimictlError as exc:
            self.log(f"{exc.message}; removing leftovers by name")
            state = None
        slot = state.slot if state else self._slot_from_registry()
        removed: list[str] = []
        self._close_masters(removed)
        if state:
            for hs in state.hosts:
                self.stop_listeners(hs)
            stopped = [hs for hs in state.hosts if self.stop_host(hs, state.mode, wait=False)]
            for p in system.wait_dead([hs.launcher_pid or 0 for hs in stopped], 5.0):
                system.kill(p, signal.SIGKILL)
            system.wait_dead([hs.launcher_pid or 0 for hs in stopped], 2.0)
            removed += [f"host {hs.name}" for hs in stopped]
        if state and state.hub_pid and system.alive(state.hub_pid, state.hub_started):
            system.kill(state.hub_pid)
            if system.wait_dead([state.hub_pid], 3.0):
                system.kill(state.hub_pid, signal.SIGKILL)
            removed.append("fake model hub")
        removed += self._stop_strays()
        if slot is not None and os.geteuid() == 0:
            removed += self._remove_kernel_objects(slot)
        for mp in system.mounts_under(self.dir):
            system.run(["umount", "-l", mp], check=False)
            removed.append(f"mount {mp}")
        for name in ("hosts", "cp", "bin", "shared", "checkpoint", "vllm-ascend"):
            shutil.rmtree(self.dir / name, ignore_errors=True)
        shutil.rmtree(client.control_dir(self.dir), ignore_errors=True)
        for name in ("inventory.yml", "ssh_config", "known_hosts", "id_ed25519", "id_ed25519.pub",
                     "authorized_keys", "etc_hosts", "sandbox.json", "checkpoint.json", "hub.url", "hub.log"):
            (self.dir / name).unlink(missing_ok=True)
        if slot is not None:
            rec = SLOTS_DIR / str(slot)
            if rec.exists() and rec.read_text().strip() == str(self.dir):
                rec.unlink()
        with contextlib.suppress(OSError):   # only when no other sandbox is registered
            SLOTS_DIR.rmdir()
        if self.dir.exists() and not any(self.dir.iterdir()):
            self.dir.rmdir()
        return removed

    def _stop_strays(self) -> list[str]:
        """Safety net without state: launchers and sshds whose command line names this sandbox's host dirs, and
        the fake hub serving this sandbox's checkpoint."""
        marker = f"{self.dir}/hosts/"
        hub_repo = f"={self.dir / 'checkpoint'}"
        found = []
        for p in (int(x) for x in os.listdir("/proc") if x.isdigit()):
            argv = system.cmdline(p)
            if p == os.getpid() or not argv or not system.alive(p):
                continue
            prog = Path(argv[0]).name
            if "kimictl.sandbox.fakehub" in argv and any(a.endswith(hub_repo) for a in argv):
                found.append((p, "fake hub", argv))
                continue
            if not any(marker in a for a in argv):
                continue
            if prog in ("unshare", "sshd") or (prog.startswith("python") and
                                               any(a.endswith("subreaper.py") for a in argv)):
                found.append((p, prog, argv))
        for p, prog, _ in found:
            # unshare: --kill-child takes the host's PID 1 with it; sshd/subreaper clean up on TERM
            system.kill(p, signal.SIGKILL if prog == "unshare" else signal.SIGTERM)
        pids = [p for p, _, _ in found]
        for p in system.wait_dead(pids, 3.0):
            system.kill(p, signal.SIGKILL)
        return [f"stray process {p} ({prog})" for p, prog, _ in found]

    def _slot_from_registry(self) -> int | None:
        if not SLOTS_DIR.is_dir():
            return None
        for rec in SLOTS_DIR.iterdir():
            if rec.name.isdigit() and rec.read_text().strip() == str(self.dir):
                return int(rec.name)
        return None

    def _close_masters(self, removed: list[str]) -> None:
        """ControlPersist masters (ssh -F ssh_config, ansible) outlive their sessions: stop them."""
        cp = client.control_dir(self.dir)
        if cp.is_dir():
            for sock in cp.iterdir():
                system.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "sandbox"], check=False, timeout=10)
        marker = str(cp) + "/"
        masters = [int(p) for p in os.listdir("/proc") if p.isdigit()
                   and (argv := system.cmdline(int(p))) and Path(argv[0]).name == "ssh"
                   and any(marker in a for a in argv)]
        for p in masters:
            system.kill(p)
        system.wait_dead(masters, 2.0)
        if masters:
            removed.append(f"{len(masters)} ssh control master(s)")

    def stop_host(self, hs: HostState, mode: str, *, wait: bool = True) -> bool:
        """Stop one host; netns: TERM its sshd (PID 1 there), so the kernel kills the rest of the host."""
        lp = hs.launcher_pid
        if not system.alive(lp, hs.launcher_started):
            return False
        assert lp is not None
        if mode == "netns":
            # unshare ignores TERM while it waits; its child is the host's PID 1. A running sshd gets a
            # clean TERM; a host still in boot.sh (PID 1 ignores TERM) goes with unshare (--kill-child).
            kids = [k for k in system.children(lp) if "sshd" in " ".join(system.cmdline(k))]
            for k in kids:
                system.kill(k)
            if not kids:
                system.kill(lp, signal.SIGKILL)
        else:
            system.kill(lp)
        if wait:
            for p in system.wait_dead([lp], 5.0):
                system.kill(p, signal.SIGKILL)
            system.wait_dead([lp], 2.0)
        return True

    def stop_listeners(self, hs: HostState) -> None:
        for pid, started in hs.listeners.values():
            if system.alive(pid, started):
                system.kill(pid)
                system.wait_dead([pid], 2.0)
        hs.listeners = {}

    def _remove_kernel_objects(self, slot: int) -> list[str]:
        names = Names(slot)
        removed = []
        for ns in system.netns_list():
            if ns.startswith(names.prefix + "-"):
                pids = system.netns_pids(ns)
                for p in pids:
                    system.kill(p, signal.SIGKILL)
                system.wait_dead(pids, 3.0)
                system.run(["ip", "netns", "del", ns], check=False)
                removed.append(f"netns {ns}")
        for link in system.links():
            if link in (names.control_bridge, names.device_bridge) or re.fullmatch(rf"{names.prefix}h\d+[cd]", link):
                system.run(["ip", "link", "del", link], check=False)
                removed.append(f"link {link}")
        return removed

    # ---- status ------------------------------------------------------------------------------
    def status(self) -> dict:
        """JSON-able report: sandbox state and, per host, whether its sshd answers."""
        state = self.load()
        if state is None:
            return {"schema_version": 1, "dir": str(self.dir), "state": "absent", "hosts": []}
        hosts = []
        for hs in state.hosts:
            running = system.alive(hs.launcher_pid, hs.launcher_started)
            answers = running and system.ssh_banner(hs.ip, hs.port, 1.0)
            hosts.append({"name": hs.name, "ip": hs.ip, "port": hs.port, "netns": hs.netns,
                          "launcher_pid": hs.launcher_pid, "state": "up" if answers else "down",
                          "device_ips": hs.device_ips, "state_dir": hs.state_dir,
                          "faults": [s for s in state.faults if fault_hosts(s) & {hs.name}]})
        ups = sum(h["state"] == "up" for h in hosts)
        overall = ("creating" if state.status == "creating" else
                   "up" if ups == len(hosts) else "down" if ups == 0 else "degraded")
        return {"schema_version": 1, "dir": str(self.dir), "state": overall, "mode": state.mode,
                "cluster": state.cluster, "hardware": state.hardware, "slot": state.slot,
                "host_python": state.host_python,   # None: the hosts run this machine's python3
                "inventory": str(self.dir / "inventory.yml"), "ssh_config": str(self.dir / "ssh_config"),
                "hosts": hosts, "faults": list(state.faults),
                "hub": {"url": state.hub_url, "state": "up" if system.alive(state.hub_pid, state.hub_started)
                        else "down"} if state.hub_pid else None}


def _copy_file(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    dst.chmod(0o644)


def _create_exclusive(path: Path) -> int:
    """O_EXCL create; recreate the registry dir if a concurrent `down` just removed it (empty)."""
    for _ in range(3):
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                path.parent.chmod(0o1777)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)


def _floor_python_info() -> dict[str, str] | None:
    """{path, version, prefix} of this machine's host-Python-floor interpreter (system.floor_python), or None."""
    path = system.floor_python()
    if path is None:
        return None
    out = system.run([path, "-I", "-S", "-c", "import sys; print(sys.version.split()[0]); print(sys.prefix)"]).stdout
    version, prefix = out.split()
    return {"path": path, "version": version, "prefix": prefix}


def _login_user() -> str:
    """root normally; a non-root loopback sandbox can only log its own user in."""
    return "root" if os.geteuid() == 0 else getpass.getuser()


def _tail(h: HostSpec, n: int = 15) -> str | None:
    try:
        return "\n".join((h.dir / "sshd.log").read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return None


def sshd_config(h: HostSpec, directory: Path, env: dict[str, str]) -> str:
    """sshd_config of one fake host: key-only root login, its own host key, big session limits."""
    lines = [
        f"ListenAddress {h.ip}:{h.port}",
        f"HostKey {h.dir / 'ssh_host_ed25519_key'}",
        f"PidFile {h.dir / 'sshd.pid'}",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        # the sandbox's login key, then the host's own file (where `weights pull` puts its peer key)
        f"AuthorizedKeysFile {directory / 'authorized_keys'} .ssh/authorized_keys",
        # the sandbox dir may sit under world-writable /tmp, which StrictModes would silently refuse
        "StrictModes no",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "UseDNS no",
        "PrintMotd no",
        "PrintLastLog no",
        # ansible forks + ControlMaster multiplexing open many connections and channels at once
        "MaxStartups 100:30:200",
        "MaxSessions 100",
        "AcceptEnv LANG LC_*",
        "Subsystem sftp /usr/lib/openssh/sftp-server",
        "LogLevel INFO",
    ]
    if env:
        lines.append("SetEnv " + " ".join(f"{k}={v}" for k, v in env.items()))
    return "\n".join(lines) + "\n"


def boot_script(h: HostSpec, directory: Path, mode: str, host_python: dict[str, str] | None = None) -> str:
    """The host's PID 1 until it execs sshd: hostname, private mounts, then sshd in the foreground.

    host_python (netns mode): an install under /root (pyenv's) is carried, read-only, past the host's fresh /root
    to the same path (its libpython is found there).
    """
    lines = ["#!/bin/sh", "set -e"]
    if mode == "netns":
        lines += [f"hostname {h.name}",
                  "mount -t tmpfs -o mode=755,size=64m tmpfs /run",
                  "mkdir -p -m 755 /run/sshd /run/lock"]
        for d in PRIVATE_DIRS:
            ovl = h.dir / "ovl" / d.strip("/").replace("/", "_")
            lines.append(f"mount -t overlay overlay -o 'lowerdir={d},upperdir={ovl}/upper,workdir={ovl}/work' {d}")
        prefix = (host_python or {}).get("prefix", "")
        carry = prefix.startswith("/root/")
        if carry:
            lines += ["mkdir -p /run/kimi-python", f"mount --bind '{prefix}' /run/kimi-python",
                      "mount -o remount,bind,ro /run/kimi-python"]
        lines += ["mount -t tmpfs -o mode=700,size=256m tmpfs /root",
                  f"mount --bind '{directory / 'etc_hosts'}' /etc/hosts",
                  f"mount --bind '{h.sim_dir}' {layout.SIM_DIR}"]
        if carry:
            # 711: the carried python3 runs for the unprivileged monitoring user too (observe up), /root stays unlisted
            lines += [f"mkdir -p '{prefix}'", f"mount --move /run/kimi-python '{prefix}'", "chmod 711 /root"]
    else:
        lines.append(f"mkdir -p '{h.state_dir}'")
    # the site's NPU-Exporter (a double reading the host state), on its default port like a real Atlas host's
    exporter = "/usr/local/bin/npu-exporter" if mode == "netns" else \
        f"KIMI_SIM_DIR='{h.sim_dir}' '{h.root / 'usr/local/bin/npu-exporter'}'"
    lines.append(f"{exporter} -ip={h.ip} -port={layout.NPU_EXPORTER_PORT} -enableHTTP=true "
                 f">>'{h.dir / 'npu-exporter.log'}' 2>&1 </dev/null &")
    lines += [f"/usr/sbin/sshd -t -f '{h.dir / 'sshd_config'}'",
              f"exec /usr/sbin/sshd -D -e -f '{h.dir / 'sshd_config'}'"]
    return "\n".join(lines) + "\n"
