"""Sandbox naming, addressing, host.json, version files and the client files it writes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kimictl.errors import InvalidInput
from kimictl.inventory import KEYS
from kimictl.sandbox import client, layout
from kimictl.sandbox.cluster import boot_script, sshd_config, validate_dir

ALLOWED_KIMI_KEYS = set(KEYS)  # the inventory validator's key table


def test_interface_names_fit_the_kernel_limit():
    for slot in range(layout.MAX_SLOTS):
        n = layout.Names(slot)
        for name in (n.control_bridge, n.device_bridge, n.veth_control(layout.MAX_HOSTS),
                     n.veth_device(layout.MAX_HOSTS)):
            assert len(name) <= 15, name


def test_addresses_are_distinct_across_hosts_and_slots():
    seen: set[str] = set()
    for slot in (0, 1):
        for mode in ("netns", "loopback"):
            for h in layout.plan_hosts(16, "atlas-800-a3", mode, slot, Path("/x")):
                for ip in [h.ip, *h.device_ips]:
                    assert ip not in seen
                    seen.add(ip)
    netns = layout.plan_hosts(2, "atlas-800-a3", "netns", 0, Path("/x"))
    assert netns[0].ip == "10.200.0.11" and netns[0].port == 22
    assert netns[1].device_ips[0] == "10.201.2.1" and len(netns[1].device_ips) == 16
    assert layout.Names(0).device_subnet(2) == "10.201.2.0/24"
    loop = layout.plan_hosts(2, "atlas-800-a2", "loopback", 0, Path("/x"))
    assert all(h.ip.startswith("127.") and h.port != 22 and len(h.device_ips) == 8 for h in loop)
    assert loop[0].state_dir == "/x/hosts/atlas-01/state"


@pytest.mark.parametrize(("hw", "npus", "chip"), [("atlas-800-a3", 16, "Ascend910"), ("atlas-800-a2", 8, "910B3")])
def test_host_json_has_the_documented_keys(hw, npus, chip):
    h = layout.plan_hosts(1, hw, "netns", 0, Path("/x"))[0]
    doc = layout.host_json(h, hw)
    for key in ("hostname", "hardware", "npus", "chip_name", "hbm_mb", "device_ips", "driver_version",
                "firmware_version", "cann_version", "load_gib_per_s"):
        assert key in doc
    assert (doc["hardware"], doc["npus"], doc["chip_name"], doc["hbm_mb"]) == (hw, npus, chip, 65536)
    assert len(doc["device_ips"]) == len(doc["bus_ids"]) == npus


def test_version_files_are_key_value_lines():
    drv = dict(line.split("=", 1) for line in layout.driver_version_info("24.1.rc2.2").splitlines())
    assert drv["Version"] == drv["package_version"] == "24.1.rc2.2"
    fw = dict(line.split("=", 1) for line in layout.firmware_version_info().splitlines())
    assert fw["Version"] == layout.FIRMWARE_VERSION
    tk = dict(line.split("=", 1) for line in layout.toolkit_install_info("aarch64").splitlines())
    assert tk["package_name"] == "Ascend-cann-toolkit" and tk["arch"] == "aarch64"
    assert tk["path"] == f"/usr/local/Ascend/ascend-toolkit/{layout.CANN_VERSION}/aarch64-linux"
    assert "Driver_Install_Path_Param=/usr/local/Ascend" in layout.ASCEND_INSTALL_INFO.splitlines()


def test_hccn_conf_has_one_block_per_device():
    ips = layout.plan_hosts(1, "atlas-800-a3", "netns", 0, Path("/x"))[0].device_ips
    conf = dict(line.split("=", 1) for line in layout.hccn_conf(ips).splitlines())
    assert conf["address_0"] == "10.201.1.1" and conf["address_15"] == "10.201.1.16"
    assert conf["netmask_7"] == "255.255.0.0" and conf["gateway_3"] == "10.201.0.1"
    assert "address_16" not in conf


@pytest.mark.parametrize("mode", ["netns", "loopback"])
def test_inventory_uses_only_contract_keys_and_ansible_accepts_it(tmp_path, mode):
    hosts = layout.plan_hosts(2, "atlas-800-a3", mode, 0, tmp_path)
    doc = client.inventory(hosts, "atlas-800-a3", tmp_path, mode=mode, cluster="sandbox")
    all_vars = doc["all"]["vars"]
    assert all_vars["kimi_model_source"] == "local" and all_vars["kimi_runtime"] == "host"
    assert "StrictHostKeyChecking=yes" in all_vars["ansible_ssh_common_args"]
    assert f"UserKnownHostsFile={tmp_path}/known_hosts" in all_vars["ansible_ssh_common_args"]
    keys = set(all_vars)
    for hv in doc["all"]["hosts"].values():
        keys |= set(hv)
        assert len(hv["kimi_device_ips"]) == 16
        assert ("ansible_port" in hv) == ("kimi_state_dir" in hv) == (mode == "loopback")
    assert {k for k in keys if k.startswith("kimi_")} <= ALLOWED_KIMI_KEYS
    inv = tmp_path / "inventory.yml"
    inv.write_text(client.inventory_yaml(doc))
    assert yaml.safe_load(inv.read_text()) == doc
    ansible_inventory = Path(sys.executable).with_name("ansible-inventory")
    proc = subprocess.run([str(ansible_inventory), "-i", str(inv), "--list"], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert "atlas-02" in proc.stdout


def test_ssh_config_and_known_hosts(tmp_path):
    hosts = layout.plan_hosts(2, "atlas-800-a2", "loopback", 0, tmp_path)
    text = client.ssh_config(hosts, tmp_path)
    assert "Host atlas-02\n  HostName 127.10.0.2\n  Port 22002" in text
    assert "StrictHostKeyChecking yes" in text and f"ControlPath {client.control_dir(tmp_path)}/%h-%p" in text
    assert client.known_hosts_line(hosts[0], "ssh-ed25519 AAAA atlas-01\n") == "[127.10.0.1]:22001 ssh-ed25519 AAAA\n"
    netns = layout.plan_hosts(1, "atlas-800-a2", "netns", 0, tmp_path)[0]
    assert client.known_hosts_line(netns, "ssh-ed25519 AAAA c") == "10.200.0.11 ssh-ed25519 AAAA\n"


def test_control_sockets_fit_in_sun_path():
    assert client.control_dir(Path("/var/tmp/kimictl-sandbox")) == Path("/var/tmp/kimictl-sandbox/cp")
    long_dir = Path("/tmp/pytest-of-root/pytest-40/test_up_with_faults_and_more0/sandbox")
    cp = client.control_dir(long_dir)
    assert cp != long_dir / "cp" and cp == client.control_dir(long_dir)
    assert len(f"{cp}/127.10.7.32-22732.7mpqDupG483iCE5W") < 108


def test_boot_script_mounts_private_dirs_and_execs_sshd(tmp_path):
    h = layout.plan_hosts(1, "atlas-800-a3", "netns", 0, tmp_path)[0]
    script = boot_script(h, tmp_path, "netns")
    for d in ("/var/lib", "/opt", "/usr/local", "/etc"):
        assert f"lowerdir={d}," in script
    assert "hostname atlas-01" in script and "/tmp" not in script.replace(str(tmp_path), "")
    assert script.rstrip().splitlines()[-1].startswith("exec /usr/sbin/sshd -D")
    # the site's npu-exporter (the double) starts once the host's own /usr/local is mounted, on the host's IP
    lines = script.splitlines()
    exporter = next(i for i, line in enumerate(lines) if "npu-exporter" in line)
    assert exporter > next(i for i, line in enumerate(lines) if "lowerdir=/usr/local," in line)
    assert f"/usr/local/bin/npu-exporter -ip={h.ip} -port=8082 " in lines[exporter] and lines[exporter].endswith("&")
    loop = layout.plan_hosts(1, "atlas-800-a3", "loopback", 0, tmp_path)[0]
    assert "mount -t" not in boot_script(loop, tmp_path, "loopback")
    cfg = sshd_config(loop, tmp_path, {"KIMI_SIM_DIR": str(loop.sim_dir)})
    assert "PasswordAuthentication no" in cfg and f"SetEnv KIMI_SIM_DIR={loop.sim_dir}" in cfg
    assert "ListenAddress 127.10.0.1:22001" in cfg


def test_boot_script_carries_a_floor_python_under_root_past_the_hosts_fresh_root(tmp_path):
    """pyenv's 3.9 lives under /root, which the host covers with a fresh tmpfs: it is carried past it read-only to
    the same path (libpython is found by its install path); /usr/local/bin/python3 points at it."""
    h = layout.plan_hosts(1, "atlas-800-a3", "netns", 0, tmp_path)[0]
    py = {"path": "/root/.pyenv/versions/3.9.18/bin/python3.9", "version": "3.9.18",
          "prefix": "/root/.pyenv/versions/3.9.18"}
    lines = boot_script(h, tmp_path, "netns", py).splitlines()
    order = [next(i for i, ln in enumerate(lines) if ln.startswith(x)) for x in (
        "mount -t overlay overlay -o 'lowerdir=/usr/local,",
        "mount --bind '/root/.pyenv/versions/3.9.18' /run/kimi-python", "mount -o remount,bind,ro /run/kimi-python",
        "mount -t tmpfs -o mode=700,size=256m tmpfs /root", "mkdir -p '/root/.pyenv/versions/3.9.18'",
        "mount --move /run/kimi-python '/root/.pyenv/versions/3.9.18'", "chmod 711 /root", "exec /usr/sbin/sshd")]
    assert order == sorted(order)  # traversable: observe up runs the exporters, python3 among them, unprivileged
    for visible in (None, {**py, "prefix": "/usr"}):   # nothing to carry
        assert "/run/kimi-python" not in boot_script(h, tmp_path, "netns", visible)
        assert "chmod 711 /root" not in boot_script(h, tmp_path, "netns", visible)


@pytest.mark.parametrize("bad", ["/etc/sb", "/var/lib/kimi-sb", "/opt", "/usr/local/sb", "/root/sb"])
def test_sandbox_dir_must_not_be_under_a_private_mount(bad):
    with pytest.raises(InvalidInput, match="mounts over"):
        validate_dir(Path(bad))
    assert validate_dir(Path("/var/tmp/sb")) == Path("/var/tmp/sb")
