"""A healthy sandbox: hosts, doubles at their real paths, device network, ansible access."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prerequisites import require_or_skip

pytestmark = pytest.mark.sandbox
HCCN = "/usr/local/Ascend/driver/tools/hccn_tool"


def npu_rows(table: str) -> list[list[str]]:
    body = table.split("| NPU     Chip", maxsplit=1)[0]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in body.splitlines() if ln.startswith("| ")]
    return rows[3:]


def test_a3_npu_smi_shows_16_healthy_910c_dies(sandbox_a3):
    r = sandbox_a3.ssh("atlas-01", "npu-smi info")
    assert r.returncode == 0, r.stderr
    rows = npu_rows(r.stdout)
    firsts, seconds = rows[0::2], rows[1::2]
    assert len(firsts) == 16
    assert all(f[0].split()[1] == "Ascend910" and f[1] == "OK" for f in firsts)
    assert [s[0].split()[1] for s in seconds] == [str(i) for i in range(16)]   # Phy-ID 0..15
    assert "Chip  Phy-ID" in r.stdout


def test_a2_npu_smi_shows_8_910b3(sandbox_a2):
    r = sandbox_a2.ssh("atlas-02", "npu-smi info")
    assert r.returncode == 0, r.stderr
    firsts = npu_rows(r.stdout)[0::2]
    assert [f[0].split() for f in firsts] == [[str(i), "910B3"] for i in range(8)]
    assert all(f[1] == "OK" for f in firsts)


def test_hccn_tool_reports_the_inventory_device_ips_and_link_up(sandbox_a3):
    r = sandbox_a3.ssh("atlas-02", f"for i in 0 15; do {HCCN} -i $i -ip -g; {HCCN} -i $i -link -g; done")
    assert r.returncode == 0, r.stderr
    ips = re.findall(r"ipaddr:(\d+\.\d+\.\d+\.\d+)", r.stdout)
    assert ips == [sandbox_a3.device_ip("atlas-02", 0), sandbox_a3.device_ip("atlas-02", 15)]
    assert r.stdout.count("link status: UP") == 2
    # the device IPs are real addresses on the host's second interface
    addrs = sandbox_a3.nsenter("atlas-02", ["ip", "-o", "-4", "addr", "show", "dev", "eth1"]).stdout
    assert all(ip in addrs for ip in sandbox_a3.host("atlas-02")["device_ips"])


@pytest.mark.parametrize("fixture", ["sandbox_a3", "sandbox_a2"])
def test_hccn_tool_front_answers_preflight_without_python(request, fixture):
    """The calls preflight makes are answered by the bash front from KIMI_SIM_DIR/fast, not the Python double."""
    sb = request.getfixturevalue(fixture)
    a3 = fixture == "sandbox_a3"
    ip_query, ping = ("-vnic", "-hccs_ping") if a3 else ("-ip", "-ping")
    peer = sb.device_ip("atlas-02", 1)
    calls = [f"-i {n} {q} -g" for n in (0, 7) for q in ("-link", "-net_health", "-tls", ip_query)]
    cmd = "; ".join(f"bash -px {HCCN} {c}" for c in [*calls, f"-i 0 {ping} -g address {peer}"])
    r = sb.ssh("atlas-01", cmd)
    # the front never hands over to the Python double (a top-level `exec`; `++ exec ping` is its own ping)
    assert r.returncode == 0 and not re.search(r"^\+ exec ", r.stderr, re.M), r.stderr[-400:]
    assert r.stdout.count("link status: UP") == 2 and r.stdout.count("net health status: Success") == 2
    assert f"device 0 PING {peer}" in r.stdout and "3 packets transmitted, 3 received, 0.00% packet loss" in r.stdout
    # the Python double is still there, and answers the rest (the same way as before)
    r = sb.ssh("atlas-01", f"{HCCN} -i 0 -lldp -g -x; {HCCN} -i 99 -link -g")
    assert "System Name TLV" in r.stdout and "logic id [99] is invalid" in r.stdout


def test_hccs_ping_between_hosts_travels_the_device_network(sandbox_a3):
    target = sandbox_a3.device_ip("atlas-02", 7)
    r = sandbox_a3.ssh("atlas-01", f"{HCCN} -i 3 -hccs_ping -g address {target}")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"device 3 PING {target}"
    assert re.fullmatch(r"recv seq=0,time=[0-9.]+ms", lines[1])
    assert lines[-1] == "3 packets transmitted, 3 received, 0.00% packet loss"
    r = sandbox_a3.ssh("atlas-01", f"{HCCN} -i 3 -hccs_ping -g address 10.201.99.1")   # nobody has it
    assert r.returncode != 0 and "0 received, 100.00% packet loss" in r.stdout


def test_a2_ping_between_hosts(sandbox_a2):
    target = sandbox_a2.device_ip("atlas-01", 2)
    r = sandbox_a2.ssh("atlas-02", f"{HCCN} -i 0 -ping -g address {target}")
    assert r.returncode == 0 and "3 received" in r.stdout


def test_version_files_and_etc_files_are_per_host(sandbox_a3):
    cmd = ("cat /usr/local/Ascend/driver/version.info /usr/local/Ascend/firmware/version.info "
           "/usr/local/Ascend/ascend-toolkit/latest/$(uname -m)-linux/ascend_toolkit_install.info "
           "/etc/ascend_install.info; grep address_0= /etc/hccn.conf; hostname")
    r = sandbox_a3.ssh("atlas-02", cmd)
    assert r.returncode == 0, r.stderr
    assert "package_version=" in r.stdout and "package_name=Ascend-cann-toolkit" in r.stdout
    assert "Driver_Install_Path_Param=/usr/local/Ascend" in r.stdout
    assert f"address_0={sandbox_a3.device_ip('atlas-02', 0)}" in r.stdout
    assert r.stdout.strip().endswith("atlas-02")
    assert not Path("/etc/hccn.conf").exists() and not Path("/etc/ascend_install.info").exists()


def test_private_var_lib_opt_usr_local_and_shared_tmp(sandbox_a3, tmp_path):
    marker = f"/tmp/kimictl-sb-test-{tmp_path.name}"
    r = sandbox_a3.ssh("atlas-01", f"echo one > /var/lib/kimi/probe && echo one > /opt/probe && "
                                   f"echo one > /usr/local/probe && echo shared > {marker}")
    assert r.returncode == 0, r.stderr
    r = sandbox_a3.ssh("atlas-02", f"ls /var/lib/kimi/probe /opt/probe /usr/local/probe; cat {marker}")
    assert r.stdout.strip() == "shared" and r.stderr.count("No such file") == 3
    assert not Path("/opt/probe").exists() and not Path("/usr/local/probe").exists()
    Path(marker).unlink()
    sandbox_a3.ssh("atlas-01", "rm -f /var/lib/kimi/probe /opt/probe /usr/local/probe")


def test_each_host_sees_only_its_own_processes(sandbox_a3):
    r = sandbox_a3.ssh("atlas-01", "cat /proc/1/cmdline | tr '\\0' ' '")
    assert "sshd" in r.stdout and "atlas-01/sshd_config" in r.stdout


def test_engine_simulator_is_installed(sandbox_a3):
    r = sandbox_a3.ssh("atlas-01", "head -1 /opt/kimi-sim/bin/vllm && test -x /opt/kimi-sim/bin/vllm")
    assert r.returncode == 0 and r.stdout.strip() == "#!/usr/bin/python3"
    # it runs on the host's bare /usr/bin/python3 (no venv there): a bad model dir is its own error
    r = sandbox_a3.ssh("atlas-01", "/opt/kimi-sim/bin/vllm serve /nonexistent-model-dir")
    assert r.returncode != 0 and "nonexistent-model-dir" in r.stdout + r.stderr
    assert "ModuleNotFoundError" not in r.stderr and "ImportError" not in r.stderr


def test_live_claims_show_in_npu_smi(sandbox_a3):
    r = sandbox_a3.ssh("atlas-01", "setsid sleep 300 >/dev/null 2>&1 < /dev/null & echo $! > "
                                   "/var/lib/kimi-sim/claims/npu4; echo $!")
    pid = r.stdout.strip()
    try:
        table = sandbox_a3.ssh("atlas-01", "npu-smi info").stdout
        row = next(ln for ln in table.split("| NPU     Chip")[1].splitlines() if f"| {pid} " in ln)
        assert row.split("|")[1].split() == ["2", "0"] and "sleep" in row
        assert re.search(r"\d{5}/ 65536", npu_rows(table)[9][2])   # die 4's HBM line
    finally:
        sandbox_a3.ssh("atlas-01", f"kill {pid}; rm -f /var/lib/kimi-sim/claims/npu4")
    assert "No running processes found in NPU 2" in sandbox_a3.ssh("atlas-01", "npu-smi info").stdout


def test_ansible_inventory_and_ping(sandbox_a3):
    bindir = Path(sys.executable).parent
    r = subprocess.run([str(bindir / "ansible-inventory"), "-i", str(sandbox_a3.inventory), "--list"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(bindir / "ansible"), "all", "-i", str(sandbox_a3.inventory), "-m", "ping"],
                       capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("SUCCESS") == 2


def test_strict_host_key_checking_is_on(sandbox_a3, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    r = subprocess.run(["ssh", "-F", str(sandbox_a3.dir / "ssh_config"), "-o", f"UserKnownHostsFile={empty}",
                        "-o", "ControlMaster=no", "-o", "ControlPath=none", "atlas-01", "true"],
                       capture_output=True, text=True, check=False, timeout=30)
    assert r.returncode == 255 and "Host key verification failed" in r.stderr


def test_up_again_is_a_noop_and_other_shapes_are_refused(sandbox_a3, cli):
    before = [h["launcher_pid"] for h in sandbox_a3.state["hosts"]]
    r = cli("up", "--hosts", "2", "--hardware", "atlas-800-a3", "--dir", str(sandbox_a3.dir))
    assert "already up" in r.stdout
    assert [h["launcher_pid"] for h in sandbox_a3.state["hosts"]] == before
    r = cli("up", "--hosts", "3", "--hardware", "atlas-800-a3", "--dir", str(sandbox_a3.dir), check=False)
    assert r.returncode == 2 and "different sandbox is up" in r.stderr


def test_status_json(sandbox_a3, cli):
    r = cli("status", "--dir", str(sandbox_a3.dir), "--output", "json")
    doc = json.loads(r.stdout)
    assert doc["state"] == "up" and doc["mode"] == "netns" and doc["hardware"] == "atlas-800-a3"
    assert [h["state"] for h in doc["hosts"]] == ["up", "up"]


def test_hosts_run_the_host_python_floor_as_python3(sandbox_a3, cli):
    """openEuler 22.03 hosts run Python 3.9: the sandbox's hosts do too when this machine has one, as the `python3`
    kimictl's host code, its scripts and Ansible's modules run on, with the stdlib working."""
    from kimictl import HOST_PYTHON_FLOOR
    from kimictl.sandbox.system import floor_python

    doc = json.loads(cli("status", "--dir", str(sandbox_a3.dir), "--output", "json").stdout)
    if floor_python() is None:
        assert doc["host_python"] is None
        require_or_skip("no interpreter of the host Python floor on this machine")
    version = doc["host_python"]["version"]
    assert version.startswith(".".join(map(str, HOST_PYTHON_FLOOR)) + ".")
    r = sandbox_a3.ssh("atlas-01", "python3 -c 'import sys, ssl, sqlite3, asyncio; print(sys.version.split()[0])'")
    assert r.returncode == 0 and r.stdout.split() == [version], r.stderr
    prefix = doc["host_python"]["prefix"]
    if prefix.startswith("/root/"):   # carried past the host's fresh /root, read-only
        r = sandbox_a3.ssh("atlas-01", f"touch {prefix}/kimictl-probe")
        assert r.returncode != 0 and "Read-only file system" in r.stderr
    bindir = Path(sys.executable).parent
    r = subprocess.run([str(bindir / "ansible"), "all", "-i", str(sandbox_a3.inventory), "-m",
                        "ansible.builtin.setup", "-a", "filter=ansible_python_version"], capture_output=True,
                       text=True, check=False, timeout=120)
    assert r.returncode == 0 and r.stdout.count(f'"ansible_python_version": "{version}"') == 2, r.stdout + r.stderr
    assert f"hosts' python3: {version}" in cli("status", "--dir", str(sandbox_a3.dir)).stdout
