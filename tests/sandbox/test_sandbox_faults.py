"""Each fault knob makes the doubles, the network or ssh really say otherwise, and clear undoes it."""

from __future__ import annotations

import json
import re
import socket
import subprocess

import pytest

pytestmark = pytest.mark.sandbox
HCCN = "/usr/local/Ascend/driver/tools/hccn_tool"


def health_column(table: str) -> list[str]:
    body = table.split("| NPU     Chip", maxsplit=1)[0]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in body.splitlines() if ln.startswith("| ")]
    return [r[1] for r in rows[3:][0::2]]


def test_npu_unhealthy(a3):
    a3.fault("npu-unhealthy:atlas-01:3")
    health = health_column(a3.ssh("atlas-01", "npu-smi info").stdout)
    assert health[3] == "Critical" and health.count("OK") == 15
    r = a3.ssh("atlas-01", "npu-smi info -t health -i 1 -c 1")
    assert re.search(r"Health Status\s+: Critical", r.stdout)
    assert health_column(a3.ssh("atlas-02", "npu-smi info").stdout).count("OK") == 16
    a3.fault("clear:atlas-01")
    assert health_column(a3.ssh("atlas-01", "npu-smi info").stdout).count("OK") == 16


def test_link_down(a3):
    a3.fault("link-down:atlas-02:5")
    r = a3.ssh("atlas-02", f"{HCCN} -i 5 -link -g; {HCCN} -i 5 -net_health -g; {HCCN} -i 4 -link -g")
    assert r.stdout.splitlines() == ["link status: DOWN", "net health status: Fault", "link status: UP"]
    # `fault` re-rendered the fast state: the bash front answers itself, without the Python double
    r = a3.ssh("atlas-02", f"bash -px {HCCN} -i 5 -link -g")
    assert r.stdout == "link status: DOWN\n" and "+ exec " not in r.stderr, r.stderr[-400:]
    # the die's device IP is really gone: peers cannot reach it
    r = a3.ssh("atlas-01", f"{HCCN} -i 0 -hccs_ping -g address {a3.device_ip('atlas-02', 5)}")
    assert r.returncode != 0
    a3.fault("clear:atlas-02")
    r = a3.ssh("atlas-01", f"{HCCN} -i 0 -hccs_ping -g address {a3.device_ip('atlas-02', 5)}")
    assert r.returncode == 0, r.stdout
    r = a3.ssh("atlas-02", f"bash -px {HCCN} -i 5 -link -g")   # and `clear` did too
    assert r.stdout == "link status: UP\n" and "+ exec " not in r.stderr, r.stderr[-400:]


def test_link_down_of_the_first_npu_takes_only_its_own_device_ip(a3):
    # NPU 0's address is the primary one of the device subnet: removing it must not take the others with it
    a3.fault("link-down:atlas-02:0")
    held = a3.nsenter("atlas-02", ["ip", "-o", "-4", "addr", "show", "dev", "eth1"]).stdout
    assert {f"{a3.device_ip('atlas-02', n)}/16" for n in range(1, 16)} <= set(held.split())
    assert f"{a3.device_ip('atlas-02', 0)}/16" not in held.split()
    a3.fault("clear:atlas-02")
    held = a3.nsenter("atlas-02", ["ip", "-o", "-4", "addr", "show", "dev", "eth1"]).stdout
    assert {f"{a3.device_ip('atlas-02', n)}/16" for n in range(16)} <= set(held.split())


def test_cut_route_really_cuts_the_device_network(a3):
    target = a3.device_ip("atlas-02", 0)
    assert a3.ssh("atlas-01", f"{HCCN} -i 0 -hccs_ping -g address {target}").returncode == 0
    a3.fault("cut-route:atlas-01:atlas-02")
    r = a3.ssh("atlas-01", f"{HCCN} -i 0 -hccs_ping -g address {target}")
    assert r.returncode != 0 and "3 packets transmitted, 0 received, 100.00% packet loss" in r.stdout
    # enforced by the kernel, not by the double: a plain ping fails too, both ways
    assert a3.nsenter("atlas-01", ["ping", "-c", "1", "-W", "1", "-I", a3.device_ip("atlas-01", 0),
                                   target]).returncode != 0
    assert a3.nsenter("atlas-02", ["ping", "-c", "1", "-W", "1", "-I", target,
                                   a3.device_ip("atlas-01", 3)]).returncode != 0
    faults = json.loads(a3.ssh("atlas-01", "cat /var/lib/kimi-sim/faults.json").stdout)
    assert "cut_routes" not in faults
    a3.fault("clear:atlas-02")   # clearing either end removes the cut
    assert a3.ssh("atlas-01", f"{HCCN} -i 0 -hccs_ping -g address {target}").returncode == 0


def test_driver_mismatch(a3):
    a3.fault("driver-mismatch:atlas-01:24.0.rc1")
    r = a3.ssh("atlas-01", "grep -E '^(Version|package_version)=' /usr/local/Ascend/driver/version.info; "
                           "npu-smi info -t board -i 0")
    assert "Version=24.0.rc1" in r.stdout and "package_version=24.0.rc1" in r.stdout
    assert re.search(r"Software Version\s+: 24.0.rc1", r.stdout)
    assert "24.0.rc1" not in a3.ssh("atlas-02", "cat /usr/local/Ascend/driver/version.info").stdout
    a3.fault("clear:all")
    assert "24.0.rc1" not in a3.ssh("atlas-01", "cat /usr/local/Ascend/driver/version.info").stdout


def test_small_disk(a3):
    a3.fault("small-disk:atlas-02:64M")
    r = a3.ssh("atlas-02", "df -B1M --output=size,target /var/lib/kimi/models | tail -1")
    size, target = r.stdout.split()
    assert target == "/var/lib/kimi/models" and int(size) == 64
    r = a3.ssh("atlas-02", "dd if=/dev/zero of=/var/lib/kimi/models/big bs=1M count=80")
    assert r.returncode != 0 and "No space left" in r.stderr   # the limit is real
    a3.fault("small-disk:atlas-02:32M")   # a new size replaces the old mount and spec
    r = a3.ssh("atlas-02", "df -B1M --output=size /var/lib/kimi/models | tail -1")
    assert int(r.stdout) == 32
    assert [f for f in a3.state["faults"] if f.startswith("small-disk")] == ["small-disk:atlas-02:32M"]
    a3.fault("clear:atlas-02")
    r = a3.ssh("atlas-02", "df --output=target /var/lib/kimi/models | tail -1")
    assert r.stdout.strip() == "/var/lib"


def test_host_down_kills_everything_and_clear_boots_it_again(a3, cli):
    pid = a3.ssh("atlas-02", "setsid sleep 600 >/dev/null 2>&1 < /dev/null & echo $!").stdout.strip()
    ns = a3.host("atlas-02")["netns"]
    before = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=True).stdout.split()
    assert len(before) >= 2, pid
    a3.fault("host-down:atlas-02")
    r = a3.ssh("atlas-02", "true", timeout=30)
    assert r.returncode == 255 and "Connection refused" in r.stderr
    assert subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                          check=True).stdout.split() == []
    r = cli("status", "--dir", str(a3.dir), "--output", "json", check=False)
    assert r.returncode == 3
    assert [h["state"] for h in json.loads(r.stdout)["hosts"]] == ["up", "down"]
    a3.fault("clear:atlas-02")
    r = a3.ssh("atlas-02", "hostname; pgrep -x sleep || echo none")
    assert r.stdout.split() == ["atlas-02", "none"]


def test_slow_link_shapes_the_control_link(a3):
    a3.fault("slow-link:atlas-01:200mbit")
    inside = a3.nsenter("atlas-01", ["tc", "qdisc", "show", "dev", "eth0"]).stdout
    assert "tbf" in inside and "200Mbit" in inside
    a3.fault("slow-link:atlas-01:1gbit")   # replaces the old rate
    assert "1Gbit" in a3.nsenter("atlas-01", ["tc", "qdisc", "show", "dev", "eth0"]).stdout
    assert [f for f in a3.state["faults"] if f.startswith("slow-link")] == ["slow-link:atlas-01:1gbit"]
    a3.fault("clear:atlas-01")
    assert "tbf" not in a3.nsenter("atlas-01", ["tc", "qdisc", "show", "dev", "eth0"]).stdout


def test_port_taken(a3):
    ip = a3.host("atlas-01")["ip"]
    a3.fault("port-taken:atlas-01:8000")
    with socket.create_connection((ip, 8000), timeout=2):
        pass
    r = a3.ssh("atlas-01", "python3 -c 'import socket; socket.socket().bind((\"0.0.0.0\", 8000))'")
    assert r.returncode != 0 and "Address already in use" in r.stderr
    a3.fault("clear:atlas-01")
    with pytest.raises(OSError):
        socket.create_connection((ip, 8000), timeout=2)


def test_engine_faults_reach_faults_json(a3):
    a3.fault("engine-crash:atlas-02:decode", "engine-hang:atlas-02")
    doc = json.loads(a3.ssh("atlas-02", "cat /var/lib/kimi-sim/faults.json").stdout)
    assert doc["engine_crash_at_start"] == ["decode"] and doc["engine_hang_in_load"] == ["*"]
    assert json.loads(a3.ssh("atlas-01", "cat /var/lib/kimi-sim/faults.json").stdout) == {}


def test_bad_fault_spec_exits_2_and_changes_nothing(a3):
    r = a3.fault("npu-unhealthy:atlas-01:3", "link-down:atlas-09:1", check=False)
    assert r.returncode == 2 and "'atlas-09'" in r.stderr and "Traceback" not in r.stderr
    assert a3.state["faults"] == []


def test_up_with_faults(tmp_path, cli):
    d = tmp_path / "sb"
    cli("up", "--hosts", "1", "--hardware", "atlas-800-a2", "--dir", str(d), "--fault", "npu-unhealthy:atlas-01:7",
        "--fault", "engine-crash:atlas-01")
    try:
        r = cli("status", "--dir", str(d), "--output", "json")
        assert json.loads(r.stdout)["faults"] == ["npu-unhealthy:atlas-01:7", "engine-crash:atlas-01:*"]
        table = subprocess.run(["ssh", "-F", str(d / "ssh_config"), "atlas-01", "npu-smi info"],
                               capture_output=True, text=True, check=True).stdout
        assert health_column(table) == ["OK"] * 7 + ["Critical"]
    finally:
        cli("down", "--dir", str(d))
