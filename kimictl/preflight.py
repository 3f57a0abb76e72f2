"""Preflight: live read-only checks on every host over SSH, judged against the plan (ids in data/checks.yml)."""

from __future__ import annotations

import json
import re
import shlex
import time
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel

from kimictl import ascend
from kimictl.errors import InvalidInput, KimictlError, did_you_mean
from kimictl.facts import VersionProfile, check_specs, engine_profile, hardware_catalogue, version_profile
from kimictl.inventory import Host, Inventory
from kimictl.plan import Plan
from kimictl.render import render_template
from kimictl.router_kinds import router_kind
from kimictl.ssh import Session, Sessions, SSHError
from kimictl.state import cached_manifest_bytes

CLOCK_SKEW_MAX_S = 2.0
DISK_HEADROOM = 1.05
LISTING_TIMEOUT_S = 10.0   # a hub that does not answer by then: judge disk room against the estimate (and say why)
MIN_HOST_MEMORY_GIB = 64


def checkpoint_bytes(inv: Inventory) -> tuple[int, str | None]:
    """(bytes, None): the recorded manifest, else the hub's listing (read-only, cached); else (model facts' bytes,
    why the listing is not known), which RES-001 says next to the estimate."""
    need, _ = cached_manifest_bytes(inv.cluster.name)
    if need is not None:
        return need, None
    if inv.cluster.kimi_model_source == "local":
        return _estimate(inv), "kimi_model_source is local and no weights pull recorded a manifest"
    from kimictl.weights.stage import load_manifest, read_token

    try:
        m = load_manifest(inv, read_token(inv.cluster.kimi_model_source, None), timeout=LISTING_TIMEOUT_S)
    except Exception as exc:   # whatever it is, preflight goes on against the estimate and says why
        why = exc.message if isinstance(exc, KimictlError) else f"{type(exc).__name__}: {exc}"
        return _estimate(inv), f"the hub listing could not be read: {why[:300]}"
    return m.total_bytes, None


def _estimate(inv: Inventory) -> int:
    return engine_profile(inv.cluster.kimi_engine_profile).facts(inv.cluster.kimi_model_id).total_bytes


class CheckResult(BaseModel):
    id: str
    severity: Literal["error", "warning", "info"]
    host: str
    status: Literal["pass", "fail", "skip"]
    title: str
    message: str
    fix: str = ""


class PreflightReport(BaseModel):
    cluster: str
    topology: str
    results: list[CheckResult]
    seconds: float

    @property
    def failed_errors(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "fail" and r.severity == "error"]

    @property
    def ok(self) -> bool:
        return not self.failed_errors

    def summary(self) -> dict:
        def count(status: str, sev: str | None = None) -> int:
            return sum(1 for r in self.results if r.status == status and (sev is None or r.severity == sev))

        return {"ok": self.ok, "hosts": len({r.host for r in self.results if r.host != "*"}),
                "checks": len(self.results), "passed": count("pass"), "errors": count("fail", "error"),
                "warnings": count("fail", "warning"), "skipped": count("skip"), "seconds": round(self.seconds, 2)}

    def to_json(self) -> dict:
        return {"schema_version": 1, "cluster": self.cluster, "topology": self.topology,
                "summary": self.summary(), "results": [r.model_dump() for r in self.results]}


@dataclass
class Probe:
    """Sections of one host's probe output: name -> (text, rc)."""

    sections: dict[str, tuple[str, int]] = field(default_factory=dict)
    t_sent: float = 0.0
    t_back: float = 0.0

    def text(self, name: str) -> str:
        return self.sections.get(name, ("", 127))[0]

    def rc(self, name: str) -> int:
        return self.sections.get(name, ("", 127))[1]


_SECTION = re.compile(r"^@@kimi begin (\S+)\n(.*?)\n?@@kimi end \1 (\d+)$", re.S | re.M)


def parse_sections(out: str) -> dict[str, tuple[str, int]]:
    return {m.group(1): (m.group(2), int(m.group(3))) for m in _SECTION.finditer(out)}


def check_skip_ids(skip: set[str]) -> None:
    """--skip-check names checks of data/checks.yml (exit 2 before any host is contacted)."""
    known = check_specs()
    for cid in sorted(skip):
        if cid not in known:
            raise InvalidInput(f"--skip-check {cid!r} is no preflight check{did_you_mean(cid, known)}",
                               hint="`kimictl preflight --output json` lists every check id")


class _Judge:
    """Collects results; each check id comes with its severity, title and fix from the table."""

    def __init__(self, skip: set[str]):
        self.specs = check_specs()
        self.results: list[CheckResult] = []
        self.skip = skip

    def add(self, cid: str, host: str, ok: bool | None, message: str) -> None:
        spec = self.specs[cid]
        status = "skip" if ok is None or cid in self.skip else ("pass" if ok else "fail")
        if cid in self.skip:
            message = f"skipped by --skip-check ({message})"
        self.results.append(CheckResult(id=cid, severity=spec.severity, host=host, status=status, title=spec.title,
                                        message=message, fix="" if status != "fail" else spec.fix))


def _managed_pgids(p: Probe) -> set[int]:
    """Process groups of engines kimictl's supervisor runs (their NPUs and ports are ours, not foreign)."""
    out: set[int] = set()
    for line in p.text("supervised").splitlines():
        try:
            st = json.loads(line)
        except ValueError:
            continue
        if st.get("child_pid"):
            out.add(int(st["child_pid"]))
    return out


def _listeners(p: Probe) -> dict[int, list[int]]:
    """port -> pids listening (ss -Htlnp)."""
    out: dict[int, list[int]] = {}
    for line in p.text("listen").splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        m = re.search(r":(\d+)$", parts[3])
        if not m:
            continue
        out.setdefault(int(m.group(1)), []).extend(int(x) for x in re.findall(r"pid=(\d+)", line))
    return out


def _pgid(p: Probe, pid: int) -> int | None:
    for line in p.text("ps").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == str(pid):
            return int(parts[1])
    return None


def driver_checks(j: _Judge, host: str, drv: str, ver: VersionProfile) -> None:
    """VER-001 fails below kimictl's floor; VER-006 warns below the HDK upstream validates the release with."""
    j.add("VER-001", host, bool(drv) and ascend.version_tuple(drv) >= ascend.version_tuple(ver.compat.driver_min),
          f"driver {drv or 'not found'}; vllm-ascend {ver.version} needs >= {ver.compat.driver_min}")
    floor = ver.compat.driver_validated
    j.add("VER-006", host, None if not (drv and floor) else ascend.version_tuple(drv) >= ascend.version_tuple(floor),
          f"driver {drv or 'not found'}; vllm-ascend {ver.upstream or ver.version} is validated with "
          f"HDK {floor}" if floor else f"no validated HDK recorded for vllm-ascend {ver.version}")


SSHD_FLOOR = (7, 7)   # the weights peer key's authorized_keys line uses expiry-time (OpenSSH 7.7)


def tools_checks(j: _Judge, inv: Inventory, host: str, p: Probe) -> None:
    """RT-004: python3 at the host Python floor (and kimi_python), rsync, and an OpenSSH sshd of 7.7 or later."""
    from kimictl import HOST_PYTHON_FLOOR

    floor = ".".join(map(str, HOST_PYTHON_FLOOR))
    bad, seen = [], []
    for i, argv in enumerate(host_pythons(inv)):
        name, out = " ".join(argv), p.text(f"python-{i}").strip()
        if p.rc(f"python-{i}") != 0 or not re.fullmatch(r"\d+\.\d+\.\d+", out):
            bad.append(f"{name}: {out.splitlines()[-1] if out else 'not found'}")
        elif tuple(map(int, out.split(".")[:2])) < HOST_PYTHON_FLOOR:
            bad.append(f"{name} is {out}, kimictl's host-side code needs {floor} or later")
        else:
            seen.append(f"{name} {out}")
    if p.rc("rsync") != 0:
        bad.append("rsync not found on PATH")
    m = re.search(r"OpenSSH_(\d+)\.(\d+)", p.text("sshd"))
    if not m:
        bad.append(f"sshd is not OpenSSH ({p.text('sshd') or 'no banner'}); the weights peer key needs OpenSSH's "
                   "restrict and expiry-time")
    elif (int(m.group(1)), int(m.group(2))) < SSHD_FLOOR:
        bad.append(f"sshd OpenSSH {m.group(1)}.{m.group(2)} is older than 7.7 (the weights peer key's expiry-time)")
    if not bad:
        seen += [f"rsync {p.text('rsync').strip()}", f"sshd OpenSSH {m.group(1)}.{m.group(2)}"]
    j.add("RT-004", host, not bad, "; ".join(bad) or ", ".join(seen))


def _host_checks(j: _Judge, inv: Inventory, plan: Plan, h: Host, p: Probe, need_bytes: int,
                 estimate: str | None) -> None:
    hw = hardware_catalogue()[h.kimi_hardware]
    ver = version_profile(plan.vllm_ascend_version)
    planned = sorted({d for e in plan.engines_on(h.name) for d in e.devices})
    info = ascend.parse_npu_smi_info(p.text("npu-smi"))
    managed = _managed_pgids(p)

    # hardware
    if p.rc("npu-smi") != 0:
        j.add("HW-001", h.name, False, f"npu-smi info failed (rc {p.rc('npu-smi')}): {p.text('npu-smi')[-200:]}")
    else:
        j.add("HW-001", h.name, len(info.npus) == hw.npus,
              f"npu-smi shows {len(info.npus)} NPUs; {hw.name} has {hw.npus}")
    names = sorted({n.name for n in info.npus})
    j.add("HW-002", h.name, bool(names) and set(names) <= set(hw.npu_smi_names),
          f"chip name {', '.join(names) or 'none'}; {hw.name} shows {'/'.join(hw.npu_smi_names)}")
    by_id = {n.logical_id: n for n in info.npus}
    sick = [f"NPU {i} health {by_id[i].health}" if i in by_id else f"NPU {i} missing" for i in planned
            if i not in by_id or by_id[i].health != "OK"]
    j.add("HW-003", h.name, not sick, "; ".join(sick) or f"NPUs {planned[0]}-{planned[-1]} OK" if planned else
          "no NPUs planned on this host")
    small = [f"NPU {n.logical_id}: {n.hbm_total_mb} MB" for n in info.npus if n.hbm_total_mb < hw.hbm_mib]
    j.add("HW-004", h.name, not small if info.npus else None,
          f"{'; '.join(small)} ({', '.join(names)}); the plan assumes {hw.hbm_mib} MB per NPU" if small else
          f"at least {hw.hbm_mib} MB HBM per NPU")
    foreign = [f"NPU {npu} held by pid {pid} ({name})" for npu, pid, name, _ in info.processes
               if npu in planned and _pgid(p, pid) not in managed and pid not in managed]
    j.add("HW-005", h.name, not foreign, "; ".join(foreign) or "no foreign process on planned NPUs")

    # versions
    driver_checks(j, h.name, ascend.version_of(p.text("driver")), ver)
    fw = ascend.version_of(p.text("firmware"))
    j.add("VER-002", h.name, bool(fw), f"firmware {fw or 'not found'}")
    if inv.cluster.kimi_runtime == "host":
        cann = ascend.cann_version(p.text("cann"))
        j.add("VER-003", h.name, cann in ver.compat.cann,
              f"CANN {cann or 'not found'}; vllm-ascend {ver.version} needs {', '.join(ver.compat.cann)}")
        eng = p.text("engine").strip()
        j.add("RT-001", h.name, p.rc("engine") == 0, f"engine command: {eng or 'not found on PATH'}")
        if _proxy_check(inv, plan, h):
            out = p.text("proxy").strip()
            j.add("RT-003", h.name, p.rc("proxy") == 0,
                  f"{h.kimi_proxy_script} runs on python {out}" if p.rc("proxy") == 0 else
                  f"{h.kimi_proxy_script} with {h.kimi_proxy_python}: {out.splitlines()[-1] if out else 'failed'}")
    else:
        j.add("VER-003", h.name, None, "container runtime: CANN comes with the image")
        j.add("VER-005", h.name, p.rc("image") == 0,
              f"image {plan.image} " + ("present" if p.rc("image") == 0 else "not present"))
        j.add("RT-001", h.name, p.rc("docker") == 0,
              f"docker server {p.text('docker').strip()}" if p.rc("docker") == 0 else "docker not usable")

    tools_checks(j, inv, h.name, p)

    # network
    down = [f"NPU {i} link {ascend.parse_link(p.text(f'link-{i}'))}" for i in planned
            if ascend.parse_link(p.text(f"link-{i}")) != "UP"]
    j.add("NET-001", h.name, not down, "; ".join(down) or "all planned NPU links UP")
    bad = [f"NPU {i} net health {ascend.parse_net_health(p.text(f'health-{i}'))}" for i in planned
           if ascend.parse_net_health(p.text(f"health-{i}")).lower() != "success"]
    j.add("NET-002", h.name, not bad, "; ".join(bad) or "net health Success on planned NPUs")
    if h.kimi_device_ips:
        seen = {i: ascend.parse_device_ip(p.text(f"ip-{i}")) for i in range(hw.npus)}
        diff = [f"NPU {i}: host has {seen[i]}, inventory says {ip}" for i, ip in enumerate(h.kimi_device_ips)
                if seen.get(i) != ip]
        j.add("NET-004", h.name, not diff, "; ".join(diff) or "device IPs match kimi_device_ips")
    else:
        j.add("NET-004", h.name, None, "kimi_device_ips not set in the inventory")
    nic = p.text("nic")
    j.add("NET-006", h.name, p.rc("nic") == 0 and f"inet {h.ip}/" in nic,
          f"{h.kimi_nic} carries {h.ip}" if f"inet {h.ip}/" in nic else
          f"{h.kimi_nic}: " + (nic.strip()[:160] or "no such interface or no IPv4 address"))

    # resources
    df = p.text("df").splitlines()
    free = int(df[-1].split()[3]) if p.rc("df") == 0 and len(df) >= 2 else 0
    model_lines = p.text("model").splitlines() if p.rc("model") == 0 else []
    present = int(model_lines[0].split()[0]) if model_lines and model_lines[0].split()[0].isdigit() else 0
    names = set(model_lines[1:])
    has_ckpt = "config.json" in names and any(n.endswith(".safetensors") for n in names)
    if p.rc("complete") == 0:
        j.add("RES-001", h.name, True, f"checkpoint staged and verified at {inv.cluster.kimi_model_dir}")
    elif inv.cluster.kimi_model_source == "local":
        j.add("RES-001", h.name, has_ckpt,
              f"local checkpoint at {inv.cluster.kimi_model_dir}: {present / 2**30:.2f} GiB" if has_ckpt else
              f"kimi_model_source is local but {inv.cluster.kimi_model_dir} holds no checkpoint "
              "(config.json and *.safetensors)")
    else:
        need = max(0, int(need_bytes * DISK_HEADROOM) - present)
        label = "checkpoint" if estimate is None else f"checkpoint (estimate from model facts; {estimate})"
        j.add("RES-001", h.name, free >= need,
              f"{free / 2**30:.1f} GiB free at {inv.cluster.kimi_model_dir}; the {label} of "
              f"{need_bytes / 2**30:.1f} GiB (+5%) needs "
              f"{need / 2**30:.1f} GiB more")
    mem = ascend.parse_kv(p.text("meminfo"))
    total_gib = int(re.sub(r"\D", "", mem.get("MemTotal", "0")) or 0) / 2**20
    j.add("RES-002", h.name, total_gib >= MIN_HOST_MEMORY_GIB, f"{total_gib:.0f} GiB host memory")
    listening = _listeners(p)
    taken = []
    for use in (u for u in plan.ports if u.host == h.name):
        for port in range(use.first, use.last + 1):
            owners = [pid for pid in listening.get(port, []) if _pgid(p, pid) not in managed]
            if port in listening and (owners or not listening[port]):
                taken.append(f"port {port} ({use.what}) in use" + (f" by pid {owners[0]}" if owners else ""))
                break
    j.add("RES-003", h.name, not taken, "; ".join(taken) or
          f"{sum(u.last - u.first + 1 for u in plan.ports if u.host == h.name)} planned ports free")


def _planned_peers(plan: Plan) -> dict[str, set[str]]:
    """Per host: the hosts it must reach over the device network (same DP group, or the other side of a P/D pair)."""
    peers: dict[str, set[str]] = {h: set() for h in plan.host_roles}
    for inst in plan.instances:
        for a in inst.hosts:
            peers[a].update(b for b in inst.hosts if b != a)
    if plan.mode == "pd":
        pre = [h for h, r in plan.host_roles.items() if r == "prefill"]
        dec = [h for h, r in plan.host_roles.items() if r == "decode"]
        for a in pre:
            peers[a].update(dec)
        for b in dec:
            peers[b].update(pre)
    return peers


def _ping_plan(plan: Plan, device_ips: dict[str, list[str | None]]) -> dict[str, list[dict]]:
    """Per host: the device pings it runs, {npu, address, peer, peer_npu} each (NPU `npu` pings `address`, the
    device IP of NPU `peer_npu` on `peer`).

    A ping tests the path between two NPUs both ways (the echo and its reply cross it), so it counts for both
    hosts and the mesh is a set of NPU pairs, not directed pings: every NPU with a known device IP on a host with
    planned peers is in at least one pair, every planned host pair has at least one, NPU k is paired with NPU k
    where the peer has it, and each pair is pinged by whichever end has fewer pings so far. That is about half
    the pings of pinging from both ends, and the same on every host whatever the cluster size."""
    peers = _planned_peers(plan)
    local = {h: [i for i, ip in enumerate(device_ips.get(h) or []) if ip] for h in peers}
    rank = {h: n for n, h in enumerate(peers)}
    covered: dict[str, set[int]] = {h: set() for h in peers}
    pairs: dict[frozenset[str], int] = {}
    out: dict[str, list[dict]] = {h: [] for h in peers}

    def target(k: int, b: str) -> int:
        if k in local[b]:
            return k
        free = [x for x in local[b] if x not in covered[b]]
        return free[0] if free else local[b][k % len(local[b])]

    def add(a: str, k: int, b: str, kb: int) -> None:
        if len(out[b]) < len(out[a]):
            a, k, b, kb = b, kb, a, k
        ips = device_ips[b]
        out[a].append({"npu": k, "address": ips[kb], "peer": b, "peer_npu": kb})
        covered[a].add(k)
        covered[b].add(kb)
        key = frozenset((a, b))
        pairs[key] = pairs.get(key, 0) + 1

    def free(a: str, k: int) -> list[str]:
        return [b for b in peers[a] if k in local[b] and k not in covered[b]]

    # NPU index by NPU index, a greedy matching between hosts that still need NPU k covered: each host pairs
    # with the free peer it shares the fewest pings with (hosts with the fewest free peers choose first)
    for k in sorted({k for h in peers for k in local[h]}):
        todo = [a for a in peers if k in local[a] and any(local[b] for b in peers[a])]
        for a in sorted(todo, key=lambda a: (len(free(a, k)), rank[a])):
            if k in covered[a]:
                continue
            cands = free(a, k) or [b for b in peers[a] if local[b]]
            b = min(cands, key=lambda b: (pairs.get(frozenset((a, b)), 0), rank[b]))
            add(a, k, b, target(k, b))
    for a in peers:
        for b in sorted(peers[a], key=rank.__getitem__):
            if local[a] and local[b] and not pairs.get(frozenset((a, b))):
                k = next((x for x in local[a] if x in local[b]), local[a][0])
                add(a, k, b, target(k, b))
    return out


def _ping_checks(j: _Judge, reachable: list[str], pings: dict[str, list[dict]],
                 ran: dict[str, dict[str, tuple[str, int]] | SSHError | None],
                 device_ips: dict[str, list[str | None]]) -> None:
    """NET-005 per reachable host, from every ping with that host at either end that its initiator ran."""
    count: dict[str, int] = {h: 0 for h in reachable}
    peers: dict[str, set[str]] = {h: set() for h in reachable}
    failed: dict[str, list[str]] = {h: [] for h in reachable}
    for a, plist in pings.items():
        got = ran.get(a)
        if not isinstance(got, dict):
            continue   # the initiator is unreachable, or its pings did not run (reported on it below)
        for n, p in enumerate(plist):
            text, rc = got.get(f"ping-{n}", ("", 127))
            ok = rc == 0 and ascend.parse_ping(text)[1] > 0
            b, src = p["peer"], device_ips[a][p["npu"]]   # a planned this ping from its own known IP
            for host, other, msg in (
                    (a, b, f"NPU {p['npu']} -> {b} NPU {p['peer_npu']} {p['address']} unreachable"),
                    (b, a, f"NPU {p['peer_npu']} <- {a} NPU {p['npu']} {src} unreachable")):
                if host in count:
                    count[host] += 1
                    peers[host].add(other)
                    if not ok:
                        failed[host].append(msg)
    for h in reachable:
        got = ran.get(h)
        if isinstance(got, SSHError):
            j.add("NET-005", h, False, f"ping mesh did not run: {got}")
        elif not count[h]:
            j.add("NET-005", h, None, "no planned peers with known device IPs")
        else:
            j.add("NET-005", h, not failed[h], "; ".join(failed[h]) or
                  f"{count[h]} device pings with {len(peers[h])} peer host(s) answered")


def _probe_script(inv: Inventory, plan: Plan, h: Host, pings: list[dict]) -> str:
    hw = hardware_catalogue()[h.kimi_hardware]
    return render_template(
        "preflight_probe.sh.j2", host=h.name, npus=range(hw.npus), device_ip_query=hw.device_ip_query,
        health_npus=sorted({d for e in plan.engines_on(h.name) for d in e.devices}),
        ports=sorted({port for u in plan.ports if u.host == h.name for port in range(u.first, u.last + 1)}),
        model_dir=inv.cluster.kimi_model_dir, state_dir=h.kimi_state_dir, nic=h.kimi_nic,
        runtime=inv.cluster.kimi_runtime, image=plan.image, pings=pings, ping_flag=hw.device_ping,
        engine_command=(h.kimi_engine_command or "vllm").split()[0],  # the program, not its arguments
        pythons=host_pythons(inv), proxy_check=_proxy_check(inv, plan, h))


def host_pythons(inv: Inventory) -> list[list[str]]:
    """The interpreters kimictl's host-side code runs under: `python3` (supervisor, proxy front), and the weights
    agent's kimi_python when it names another one."""
    return [["python3"]] + ([shlex.split(inv.cluster.kimi_python)] if inv.cluster.kimi_python != "python3" else [])


def _proxy_check(inv: Inventory, plan: Plan, h: Host) -> list[str] | None:
    """The proxy host's check of the upstream P/D proxy it runs on kimi_runtime host: the script is there and the
    python that runs it imports what the script imports. None where there is nothing to check."""
    if not plan.proxy or plan.proxy.host != h.name or inv.cluster.kimi_runtime != "host":
        return None
    kind = router_kind(plan.proxy.router)
    if not kind.script or not h.kimi_proxy_script:
        return None
    code = ("import os, sys; f = sys.argv[1]; os.path.isfile(f) or sys.exit('no such file: ' + f); "
            f"import {', '.join(kind.python_modules)}; print(sys.version.split()[0])")
    return [*shlex.split(h.kimi_proxy_python), "-c", code, h.kimi_proxy_script]


def run_preflight(inv: Inventory, plan: Plan, *, timeout: float = 20.0, accept_new_keys: bool = False,
                  skip: set[str] | None = None) -> PreflightReport:
    """Probe every host in parallel (one SSH connection each) and judge the results against the plan.

    With every host's device IPs in the inventory (kimi_device_ips) the ping mesh is known up front and rides
    in the probe: one round trip per host. Otherwise the probe reads the device IPs and a second round trip
    runs the mesh."""
    t_start = time.monotonic()
    check_skip_ids(skip or set())
    j = _Judge(skip or set())
    need, estimate = checkpoint_bytes(inv)
    device_ips: dict[str, list[str | None]] = {h.name: list(h.kimi_device_ips) for h in inv.hosts
                                               if h.kimi_device_ips}
    one_trip = len(device_ips) == len(inv.hosts)
    pings = _ping_plan(plan, device_ips) if one_trip else {}
    scripts = {h.name: _probe_script(inv, plan, h, pings.get(h.name, [])) for h in inv.hosts}
    probes: dict[str, Probe] = {}
    ran: dict[str, dict[str, tuple[str, int]] | SSHError | None] = {}
    with Sessions(inv, timeout=timeout, accept_new_keys=accept_new_keys, lazy=True) as sessions:

        def probe(name: str, s: Session) -> Probe:
            t0 = time.time()
            res = s.run("bash -c " + shlex.quote(scripts[name]), stdin="", timeout=timeout)
            sections = parse_sections(res.stdout)
            sections["sshd"] = (s.transport().remote_version or "", 0)   # the server's banner: SSH-2.0-OpenSSH_9.2p1
            return Probe(sections, t_sent=t0, t_back=time.time())

        for name, r in sessions.each(probe).items():
            if isinstance(r, SSHError):
                j.add("SSH-001", name, False, str(r))
            else:
                j.add("SSH-001", name, True, f"reachable ({inv.host(name).ansible_host})")
                probes[name] = r
                ran[name] = r.sections

        if not one_trip:
            for name, p in probes.items():
                if name not in device_ips:
                    hw = hardware_catalogue()[inv.host(name).kimi_hardware]
                    device_ips[name] = [ascend.parse_device_ip(p.text(f"ip-{i}")) for i in range(hw.npus)]
            pings = _ping_plan(plan, device_ips)

            def mesh(name: str, s: Session) -> dict[str, tuple[str, int]] | None:
                if name not in probes:
                    return None
                if not pings.get(name):
                    return {}
                hw = hardware_catalogue()[inv.host(name).kimi_hardware]
                script = render_template("preflight_ping.sh.j2", host=name, pings=pings[name], ping_flag=hw.device_ping)
                return parse_sections(s.run("bash -c " + shlex.quote(script), stdin="", timeout=timeout).stdout)

            ran = {name: r for name, r in sessions.each(mesh).items() if name in probes}

    for name, p in probes.items():
        _host_checks(j, inv, plan, inv.host(name), p, need, estimate)
    _ping_checks(j, list(probes), pings, ran, device_ips)
    _cross_checks(j, inv, plan, probes)
    order = {h.name: i for i, h in enumerate(inv.hosts)}
    j.results.sort(key=lambda r: (order.get(r.host, -1), r.id))
    return PreflightReport(cluster=plan.cluster, topology=plan.topology, results=j.results,
                           seconds=time.monotonic() - t_start)


def _cross_checks(j: _Judge, inv: Inventory, plan: Plan, probes: dict[str, Probe]) -> None:
    ver = version_profile(plan.vllm_ascend_version)
    # VER-004: among hosts of a role that meet the driver floor (VER-001 reports the rest), one version.
    for role in sorted(set(plan.host_roles.values())):
        hosts = [h for h, r in plan.host_roles.items() if r == role and h in probes]
        seen: dict[tuple[str, str], list[str]] = {}
        for h in hosts:
            drv = ascend.version_of(probes[h].text("driver"))
            if drv and ascend.version_tuple(drv) < ascend.version_tuple(ver.compat.driver_min):
                continue
            seen.setdefault((drv, ascend.version_of(probes[h].text("firmware"))), []).append(h)
        common = max(seen, key=lambda k: len(seen[k])) if seen else None
        for key, hs in seen.items():
            for h in hs:
                j.add("VER-004", h, key == common,
                      f"driver {key[0]}, firmware {key[1]}" + ("" if key == common else
                                                               f"; most {role} hosts run {common[0]}/{common[1]}"))
    # NET-003: one TLS switch value on every NPU of every host.
    tls = {h: {ascend.parse_tls(p.text(f"tls-{i}")) for i in range(hardware_catalogue()[
        inv.host(h).kimi_hardware].npus)} for h, p in probes.items()}
    values = [v for vs in tls.values() for v in vs]
    common_tls = max(set(values), key=values.count) if values else None
    for h, vs in tls.items():
        j.add("NET-003", h, vs == {common_tls}, f"TLS switch {','.join(sorted(vs))}"
              + ("" if vs == {common_tls} else f"; the cluster mostly uses {common_tls}"))
    # RT-002: clock skew against this control node, allowing for the round trip.
    for h, p in probes.items():
        try:
            remote = float(p.text("time").strip())
        except ValueError:
            j.add("RT-002", h, False, "could not read the host clock")
            continue
        slack = (p.t_back - p.t_sent) + CLOCK_SKEW_MAX_S
        skew = remote - p.t_sent
        j.add("RT-002", h, -CLOCK_SKEW_MAX_S <= skew <= slack,
              f"clock differs from this node by {skew:+.2f}s (bound {CLOCK_SKEW_MAX_S}s)")
