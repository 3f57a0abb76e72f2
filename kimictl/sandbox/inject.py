"""Fault injection into a running sandbox (kimictl/sandbox/faults.py parses the specs): each fault made real on the
fake hosts, in their network or in the faults.json files the doubles and the engine simulator read."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from pathlib import Path

from kimictl.errors import HostError, InvalidInput, KimictlError
from kimictl.sandbox import layout, system
from kimictl.sandbox.cluster import HostState, Sandbox, SandboxState, write_file
from kimictl.sandbox.doubles import hccn_tool
from kimictl.sandbox.faults import Fault, apply_to_doc, fault_hosts, parse_fault
from kimictl.sandbox.layout import HARDWARE, HostSpec, Names

SINGLE_VALUED = ("driver-mismatch", "small-disk", "slow-link", "kv-pressure")

# port-taken: a listener that dies with its launcher (PDEATHSIG) so killing the launcher frees the port
LISTENER = """
import ctypes, signal, socket, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[2], int(sys.argv[1])))
s.listen(16)
signal.pause()
"""


class Injector:
    """Injects faults into (and clears them from) the sandbox `sb` runs, and records them in its state."""

    def __init__(self, sb: Sandbox):
        self.sb = sb

    def parse(self, spec: str) -> Fault:
        """Check a SPEC's syntax first (exit 2 even without a sandbox), then its hosts and NPU ids."""
        parse_fault(spec)
        state = self.sb.require()
        return parse_fault(spec, [h.name for h in state.hosts], HARDWARE[state.hardware].npus)

    def apply(self, fault: Fault) -> list[str]:
        """Inject (or clear) one fault so the doubles, the network and ssh really show it.

        Returns:
            The fault specs active afterwards.
        """
        state = self.sb.require()
        if fault.kind == "clear":
            self._clear(state, fault.host)
        elif fault.spec not in state.faults:
            self._inject(state, fault)
            state.faults.append(fault.spec)
        self.sb.save(state)
        self._write_faults_json(state)
        return list(state.faults)

    def _host(self, state: SandboxState, name: str) -> tuple[HostSpec, HostState]:
        for h, hs in zip(self.sb.specs(state), state.hosts, strict=True):
            if h.name == name:
                return h, hs
        raise InvalidInput(f"no such sandbox host '{name}'")

    def _is_down(self, state: SandboxState, name: str) -> bool:
        return f"host-down:{name}" in state.faults

    def _need_up(self, state: SandboxState, name: str, kind: str) -> None:
        if self._is_down(state, name):
            raise HostError(f"cannot inject {kind}: the host is down (host-down fault)", host=name,
                            hint=f"clear it first: kimictl sandbox fault clear:{name}")

    def _need_netns(self, state: SandboxState, kind: str) -> None:
        if state.mode != "netns":
            raise KimictlError(f"{kind} needs netns mode; this sandbox runs in loopback mode")

    def _inject(self, state: SandboxState, f: Fault) -> None:
        h, hs = self._host(state, f.host)
        netns = state.mode == "netns"
        if f.kind in ("small-disk", "slow-link"):
            self._need_netns(state, f.kind)
        if f.kind in ("small-disk", "port-taken"):
            self._need_up(state, f.host, f.kind)
        if f.kind in SINGLE_VALUED:   # a new size/rate/version replaces the old one
            for old in [x for x in state.faults if x.startswith(f"{f.kind}:{f.host}:")]:
                state.faults.remove(old)
        self.sb.log(f"injecting {f.spec}")
        if f.kind == "link-down" and netns:
            system.run(["ip", "-n", str(h.netns), "addr", "del", f"{h.device_ips[int(f.arg or 0)]}/16", "dev",
                        layout.DEVICE_NIC], check=False)
        elif f.kind == "driver-mismatch":
            self._write_host_file(state, h, hs, f"{layout.ASCEND_ROOT}/driver/version.info",
                                  layout.driver_version_info(str(f.arg)))
        elif f.kind == "small-disk":
            self._clear_small_disk(hs)
            self._host_exec(hs, ["sh", "-c", f"mkdir -p {layout.MODELS_PARENT} && mount -t tmpfs -o "
                                 f"size={f.arg},mode=755 kimi-small-disk {layout.MODELS_PARENT}"])
        elif f.kind == "host-down":
            self.sb.stop_listeners(hs)
            self.sb.stop_host(hs, state.mode)
        elif f.kind == "slow-link":
            tbf = ["root", "tbf", "rate", str(f.arg), "burst", "64kb", "latency", "100ms"]
            system.run(["tc", "qdisc", "replace", "dev", Names(state.slot).veth_control(h.index), *tbf])
            system.run(["ip", "netns", "exec", str(h.netns), "tc", "qdisc", "replace", "dev",
                        layout.CONTROL_NIC, *tbf])
        elif f.kind == "cut-route" and netns:
            peer, _ = self._host(state, str(f.arg))
            names = Names(state.slot)
            for a, b in ((h, peer), (peer, h)):
                system.run(["ip", "-n", str(a.netns), "route", "replace", "blackhole", names.device_subnet(b.index)])
        elif f.kind == "port-taken":
            self._take_port(state, hs, int(f.arg or 0))
        elif f.kind == "engine-crash":
            state.spare_tags[h.name] = self._running_tags(state, h)
        elif f.kind == "engine-hang-now":
            state.hang_since[f.spec] = time.time()
        elif f.kind in ("npu-unhealthy", "engine-crash", "engine-hang", "kv-pressure"):
            pass   # faults.json only: the doubles and the engine simulator read it on every call

    def _clear(self, state: SandboxState, target: str) -> None:
        gone = [s for s in state.faults if target == "all" or target in fault_hosts(s)]
        # restart downed hosts first so the other undo steps can reach them
        gone.sort(key=lambda s: not s.startswith("host-down:"))
        for spec in gone:
            self.sb.log(f"clearing {spec}")
            self._undo(state, parse_fault(spec))
            state.faults.remove(spec)
            if spec.startswith("engine-crash:"):
                state.spare_tags.pop(parse_fault(spec).host, None)
            state.hang_since.pop(spec, None)

    def _undo(self, state: SandboxState, f: Fault) -> None:
        h, hs = self._host(state, f.host)
        names = Names(state.slot)
        if f.kind == "host-down":
            self.sb.launch_host(h, hs, state)
            self.sb.save(state)
            self.sb.wait_host_ready(h, hs)
        elif f.kind == "link-down" and state.mode == "netns":
            ip = h.device_ips[int(f.arg or 0)]
            system.run(["ip", "-n", str(h.netns), "addr", "replace", f"{ip}/16", "dev", layout.DEVICE_NIC],
                       check=False)
            # peers cached a FAILED neighbour entry while the address was gone; forget it
            for other in self.sb.specs(state):
                if other.name != h.name:
                    system.run(["ip", "-n", str(other.netns), "neigh", "flush", "to", ip], check=False)
        elif f.kind == "driver-mismatch":
            self._write_host_file(state, h, hs, f"{layout.ASCEND_ROOT}/driver/version.info",
                                  layout.driver_version_info())
        elif f.kind == "small-disk":
            if not self._is_down(state, h.name):
                self._clear_small_disk(hs)
        elif f.kind == "slow-link":
            system.run(["tc", "qdisc", "del", "dev", names.veth_control(h.index), "root"], check=False)
            system.run(["ip", "netns", "exec", str(h.netns), "tc", "qdisc", "del", "dev", layout.CONTROL_NIC,
                        "root"], check=False)
        elif f.kind == "cut-route" and state.mode == "netns":
            peer, _ = self._host(state, str(f.arg))
            for a, b in ((h, peer), (peer, h)):
                system.run(["ip", "-n", str(a.netns), "route", "del", "blackhole", names.device_subnet(b.index)],
                           check=False)
        elif f.kind == "port-taken":
            pid_started = hs.listeners.pop(str(f.arg), None)
            if pid_started and system.alive(*pid_started):
                system.kill(pid_started[0])
                system.wait_dead([pid_started[0]], 2.0)

    def _sshd_pid(self, hs: HostState) -> int:
        kids = system.children(hs.launcher_pid or 0) if system.alive(hs.launcher_pid, hs.launcher_started) else []
        if not kids:
            raise HostError("host is not running", host=hs.name)
        return kids[0]

    def _host_exec(self, hs: HostState, argv: list[str], input: str | None = None) -> None:
        """Run argv inside the host's namespaces (mounts, pids, network) via nsenter."""
        pid = self._sshd_pid(hs)
        system.run(["nsenter", "-t", str(pid), "--net", "--mount", "--uts", "--pid", "--", *argv], input=input)

    def _write_host_file(self, state: SandboxState, h: HostSpec, hs: HostState, path: str, text: str) -> None:
        """Write a file at its path on the host: through its mount ns, or into the overlay upper dir if down."""
        if state.mode == "loopback":
            write_file(h.root / path.lstrip("/"), text)
        elif self._is_down(state, h.name) or not system.alive(hs.launcher_pid, hs.launcher_started):
            # no mount namespace uses the overlay now, so its upper dir may be edited directly
            write_file(h.dir / "ovl/usr_local/upper" / Path(path).relative_to("/usr/local"), text)
        else:
            self._host_exec(hs, ["sh", "-c", f'cat > "{path}.tmp" && mv "{path}.tmp" "{path}"'], input=text)

    def _clear_small_disk(self, hs: HostState) -> None:
        self._host_exec(hs, ["sh", "-c", f"while mountpoint -q {layout.MODELS_PARENT}; do "
                                         f"umount {layout.MODELS_PARENT} || exit 1; done"])

    def _take_port(self, state: SandboxState, hs: HostState, port: int) -> None:
        bind_ip = "0.0.0.0" if state.mode == "netns" else hs.ip
        if state.mode == "netns":
            argv = ["nsenter", "-t", str(self._sshd_pid(hs)), "--net", "--mount", "--uts", "--pid", "--",
                    "/usr/bin/python3", "-c", LISTENER, str(port), bind_ip]
        else:
            argv = ["/usr/bin/python3", "-c", LISTENER, str(port), bind_ip]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + 5
        while not system.port_open(hs.ip, port, 0.2):
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode(errors="replace") if proc.poll() is not None and proc.stderr else ""
                proc.kill()
                raise HostError(f"could not listen on port {port}", host=hs.name, step="port-taken",
                                log_tail=err[-800:] or None)
            time.sleep(0.05)
        if proc.stderr:
            proc.stderr.close()
        hs.listeners[str(port)] = (proc.pid, system.start_time(proc.pid) or "")

    def _running_tags(self, state: SandboxState, h: HostSpec) -> list[str]:
        """Release tags of the processes kimictl's supervisor runs on h (its state files)."""
        run = (h.dir / "ovl/var_lib/upper/kimi/run") if state.mode == "netns" else \
            Path(h.state_dir or h.dir / "state") / "run"
        tags = []
        for path in sorted(run.glob("*.json")) if run.is_dir() else []:
            with contextlib.suppress(OSError, ValueError):
                st = json.loads(path.read_text())
                if st.get("state") in ("running", "starting", "backoff") and st.get("tag"):
                    tags.append(st["tag"])
        return tags

    def _write_faults_json(self, state: SandboxState) -> None:
        specs = self.sb.specs(state)
        by_name = {h.name: h for h in specs}
        for h in specs:
            doc: dict = {}
            for spec in state.faults:
                f = parse_fault(spec)
                if f.kind == "cut-route":
                    # netns: the kernel drops the traffic (blackhole routes); loopback: the doubles must
                    if state.mode == "loopback" and h.name in (f.host, f.arg):
                        peer = by_name[str(f.arg) if f.host == h.name else f.host]
                        subnet = ".".join(peer.device_ips[0].split(".")[:3]) + ".0/24"
                        doc = apply_to_doc(doc, Fault("cut-route", h.name, peer.name), peer_subnet=subnet)
                elif f.host == h.name:
                    doc = apply_to_doc(doc, f, since=state.hang_since.get(spec))
            if "engine_crash_at_start" in doc and state.spare_tags.get(h.name):
                doc["engine_crash_spare_tags"] = state.spare_tags[h.name]
            write_file(h.sim_dir / "faults.json", json.dumps(doc, indent=2) + "\n")
            hccn_tool.write_fast_state(h.sim_dir)
