"""up/down lifecycle: teardown leaves nothing, crashes and failed ups are cleaned, loopback fallback works."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kimictl.errors import KimictlError
from kimictl.sandbox import client, system
from kimictl.sandbox.cluster import SLOTS_DIR, Sandbox

pytestmark = pytest.mark.sandbox


@pytest.fixture
def sbdir(tmp_path):
    d = tmp_path / "sb"
    yield d
    Sandbox(d).down()   # safety net if a test failed before its own down


def ssh(d: Path, host: str, cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", "-F", str(d / "ssh_config"), host, cmd], capture_output=True, text=True,
                          timeout=60, check=False)


def test_down_leaves_no_namespace_mount_sshd_or_engine(sbdir, cli, find_leftovers):
    cli("up", "--hosts", "2", "--hardware", "atlas-800-a3", "--dir", str(sbdir), "--fault", "port-taken:atlas-02:9000",
        "--fault", "small-disk:atlas-01:1G", "--fault", "slow-link:atlas-02:100mbit")
    state = json.loads((sbdir / "sandbox.json").read_text())
    slot = state["slot"]
    # an "engine" that holds an NPU, detached from the ssh session, plus a ControlPersist master
    r = ssh(sbdir, "atlas-01", "setsid python3 -c 'import time; time.sleep(900)' >/dev/null 2>&1 < /dev/null & "
                               "echo $! > /var/lib/kimi-sim/claims/npu0")
    assert r.returncode == 0, r.stderr
    host_pids = {n: system.netns_pids(n) for n in system.netns_list() if n.startswith(f"ks{slot}-")}
    assert len(host_pids) == 2 and all(len(p) >= 2 for p in host_pids.values())
    masters = [p for p in map(int, filter(str.isdigit, os.listdir("/proc")))
               if any(str(client.control_dir(sbdir)) in a for a in system.cmdline(p))]
    assert masters, "expected a ControlPersist master"
    listener = state["hosts"][1]["listeners"]["9000"][0]

    r = cli("down", "--dir", str(sbdir))
    assert "sandbox down" in r.stdout
    assert find_leftovers(sbdir, slot) == []
    assert find_leftovers(client.control_dir(sbdir), slot) == []
    every_pid = [p for pids in host_pids.values() for p in pids] + masters + [listener]
    assert [p for p in every_pid if system.alive(p)] == []
    assert not any("sshd" in " ".join(system.cmdline(p)) and str(sbdir) in " ".join(system.cmdline(p))
                   for p in map(int, filter(str.isdigit, os.listdir("/proc"))))
    assert not sbdir.exists() and not (SLOTS_DIR / str(slot)).exists()
    assert not SLOTS_DIR.exists() or any(SLOTS_DIR.iterdir())   # removed once no sandbox is registered
    assert "nothing to tear down" in cli("down", "--dir", str(sbdir)).stdout   # idempotent


@pytest.mark.parametrize("mode", ["netns", "loopback"])
@pytest.mark.parametrize("damage", ["deleted", "corrupt"])
def test_down_after_a_crash_without_state_file(sbdir, cli, find_leftovers, mode, damage):
    cli("up", "--hosts", "2", "--hardware", "atlas-800-a2", "--dir", str(sbdir), "--mode", mode)
    slot = json.loads((sbdir / "sandbox.json").read_text())["slot"]
    # the state is lost; the slot record, name prefix and command lines remain
    if damage == "deleted":
        (sbdir / "sandbox.json").unlink()
    else:
        (sbdir / "sandbox.json").write_text("{not json")
    assert find_leftovers(sbdir, slot)
    r = cli("down", "--dir", str(sbdir))
    assert "Traceback" not in r.stderr
    assert find_leftovers(sbdir, slot) == []
    assert not sbdir.exists()


def test_up_replaces_a_sandbox_whose_hosts_died(sbdir, cli, find_leftovers):
    cli("up", "--hosts", "1", "--hardware", "atlas-800-a2", "--dir", str(sbdir))
    launcher = json.loads((sbdir / "sandbox.json").read_text())["hosts"][0]["launcher_pid"]
    os.kill(launcher, signal.SIGKILL)   # unshare --kill-child takes the host with it
    system.wait_dead([launcher], 5)
    r = cli("up", "--hosts", "1", "--hardware", "atlas-800-a2", "--dir", str(sbdir))
    assert "already up" not in r.stdout
    assert ssh(sbdir, "atlas-01", "hostname").stdout.strip() == "atlas-01"
    cli("down", "--dir", str(sbdir))


def test_failed_up_removes_what_it_made(sbdir, monkeypatch, find_leftovers):
    seen = {}

    def boom(self, state, hosts):
        seen["slot"] = state.slot
        assert all(system.alive(h.launcher_pid) for h in state.hosts)   # hosts were really started
        raise KimictlError("simulated failure after the hosts started")

    monkeypatch.setattr(Sandbox, "_wait_ready", boom)
    with pytest.raises(KimictlError, match="simulated failure"):
        Sandbox(sbdir).up(2, "atlas-800-a3")
    assert find_leftovers(sbdir, seen["slot"]) == []
    assert not sbdir.exists() and not (SLOTS_DIR / str(seen["slot"])).exists()


def test_loopback_fallback(sbdir, cli, find_leftovers):
    r = cli("up", "--hosts", "2", "--hardware", "atlas-800-a3", "--dir", str(sbdir), "--mode", "loopback")
    assert "loopback mode" in r.stdout
    inv = (sbdir / "inventory.yml").read_text()
    assert "ansible_port:" in inv and "kimi_state_dir:" in inv
    r = ssh(sbdir, "atlas-02", "echo $KIMI_SIM_DIR; npu-smi info | grep -c Ascend910; "
                               f"{sbdir}/hosts/atlas-02/root/usr/local/Ascend/driver/tools/hccn_tool -i 1 -ip -g")
    lines = r.stdout.split()
    assert lines[0] == str(sbdir / "hosts/atlas-02/sim") and lines[1] == "16"
    assert lines[2] == f"ipaddr:{json.loads((sbdir / 'sandbox.json').read_text())['hosts'][1]['device_ips'][1]}"
    bindir = Path(sys.executable).parent
    r = subprocess.run([str(bindir / "ansible"), "all", "-i", str(sbdir / "inventory.yml"), "-m", "ping"],
                       capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    # loopback faults: cut-route is enforced by the doubles, small-disk needs namespaces
    hccn = f"{sbdir}/hosts/atlas-01/root/usr/local/Ascend/driver/tools/hccn_tool"
    peer = json.loads((sbdir / "sandbox.json").read_text())["hosts"][1]["device_ips"][0]
    assert ssh(sbdir, "atlas-01", f"{hccn} -i 0 -hccs_ping -g address {peer}").returncode == 0
    cli("fault", "cut-route:atlas-01:atlas-02", "--dir", str(sbdir))
    r = ssh(sbdir, "atlas-01", f"{hccn} -i 0 -hccs_ping -g address {peer}")
    assert r.returncode != 0 and "0 received" in r.stdout
    r = cli("fault", "small-disk:atlas-01", "--dir", str(sbdir), check=False)
    assert r.returncode == 1 and "needs netns mode" in r.stderr
    # a daemon started over ssh is adopted by the host's subreaper and dies with `down`
    pid = ssh(sbdir, "atlas-01", "setsid sleep 600 >/dev/null 2>&1 < /dev/null & echo $!").stdout.strip()
    assert system.alive(int(pid))
    slot = json.loads((sbdir / "sandbox.json").read_text())["slot"]
    cli("down", "--dir", str(sbdir))
    assert not system.alive(int(pid))
    assert find_leftovers(sbdir, slot) == []
    assert not sbdir.exists()
