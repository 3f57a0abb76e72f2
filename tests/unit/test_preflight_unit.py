"""Preflight pieces that need no hosts: section framing, ping-mesh planning, SSH options, the probe script."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from prerequisites import not_applicable

from kimictl.inventory import load_inventory
from kimictl.plan import make_plan
from kimictl.preflight import _ping_plan, _planned_peers, parse_sections
from kimictl.render import render_template
from kimictl.ssh import _common_args, target_for
from kimictl.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]


def test_parse_sections_keeps_output_and_rc() -> None:
    out = "@@kimi begin a\nline1\nline2\n\n@@kimi end a 0\n@@kimi begin b\n\n@@kimi end b 3\n"
    assert parse_sections(out) == {"a": ("line1\nline2\n", 0), "b": ("", 3)}


def _a3_inventory(tmp_path: Path, n: int) -> Path:
    hosts = "\n".join(f"    h{i:02d}: {{ansible_host: 10.0.0.{i}, kimi_hardware: atlas-800-a3}}"
                      for i in range(1, n + 1))
    (tmp_path / "inv.yml").write_text(
        "all:\n  vars:\n    kimi_cluster: c\n    kimi_model_dir: /m\n    kimi_nic: eth0\n  hosts:\n" + hosts + "\n")
    return tmp_path / "inv.yml"


def _check_mesh(plan, ips: dict[str, list[str]], pings: dict[str, list[dict]]) -> None:
    peers = _planned_peers(plan)
    covered = {h: set() for h in peers}
    pairs = set()
    for host, plist in pings.items():
        for p in plist:
            assert p["peer"] in peers[host] and p["address"] == ips[p["peer"]][p["peer_npu"]]
            assert p["npu"] == p["peer_npu"]                    # NPU k <-> NPU k on same-size hosts
            covered[host].add(p["npu"])
            covered[p["peer"]].add(p["peer_npu"])
            pairs.add(frozenset((host, p["peer"])))
    for host, ps in peers.items():
        if ps:
            assert covered[host] == set(range(len(ips[host]))), host     # every NPU is in some ping
        assert all(frozenset((host, b)) in pairs for b in ps), host      # every planned pair is tested
    # an NPU pair is pinged from one end only (the echo tests the path both ways)
    ends = [frozenset(((h, p["npu"]), (p["peer"], p["peer_npu"]))) for h, pl in pings.items() for p in pl]
    assert len(ends) == len(set(ends))


def test_ping_plan_covers_every_npu_and_planned_pair() -> None:
    plan = make_plan(load_inventory(ROOT / "inventories/a2-pd.yml"), load_topology("a2-pd"))
    ips = {h: [f"10.9.{n}.{i}" for i in range(8)] for n, h in enumerate(plan.host_roles)}
    pings = _ping_plan(plan, ips)
    _check_mesh(plan, ips, pings)
    # a2-node-01 shares prefill-0 with a2-node-02 and pairs with both decode hosts.
    assert _planned_peers(plan)["a2-node-01"] == {"a2-node-02", "a2-node-03", "a2-node-04"}


@pytest.mark.parametrize("n", [2, 8, 16])
def test_ping_plan_work_per_host_does_not_grow_with_the_cluster(tmp_path: Path, n: int) -> None:
    plan = make_plan(load_inventory(_a3_inventory(tmp_path, n)), load_topology("a3-pd"))
    ips = {h: [f"10.{n}.{i}.{d}" for d in range(16)] for i, h in enumerate(plan.host_roles)}
    pings = _ping_plan(plan, ips)
    _check_mesh(plan, ips, pings)
    # 16 NPUs a host, two NPUs per ping: 8 pings a host at any size, spread evenly
    assert sum(len(p) for p in pings.values()) == 8 * n
    assert {len(p) for p in pings.values()} == {8}


def test_ping_plan_skips_npus_without_ips() -> None:
    plan = make_plan(load_inventory(ROOT / "inventories/a2-pd.yml"), load_topology("a2-pd"))
    ips = {h: [f"10.9.{n}.{i}" if i != 3 else None for i in range(8)] for n, h in enumerate(plan.host_roles)}
    ips["a2-node-04"] = []
    pings = _ping_plan(plan, ips)
    assert pings["a2-node-04"] == []
    assert all(p["peer"] != "a2-node-04" and 3 not in (p["npu"], p["peer_npu"]) for pl in pings.values() for p in pl)
    assert {p["peer"] for pl in pings.values() for p in pl} == {"a2-node-01", "a2-node-02", "a2-node-03"}


def test_ping_plan_skips_hosts_without_peers() -> None:
    plan = make_plan(load_inventory(ROOT / "inventories/a3-colocated.yml"), load_topology("a3-colocated"))
    assert _ping_plan(plan, {"a3-node-01": ["10.0.0.1"] * 16}) == {"a3-node-01": []}


def test_ssh_options_from_ansible_args(tmp_path: Path) -> None:
    args = _common_args("-o UserKnownHostsFile=/s/known_hosts -o StrictHostKeyChecking=yes -i /s/key -oPort=2201")
    assert args["known_hosts"] == ["/s/known_hosts"] and args["strict"] is True
    assert args["keys"] == ["/s/key"] and args["port"] == 2201
    inv_text = (ROOT / "inventories/a3-colocated.yml").read_text().replace(
        "kimi_hardware: atlas-800-a3}", "kimi_hardware: atlas-800-a3, ansible_port: 2222, ansible_user: ops, "
        "ansible_ssh_common_args: '-o StrictHostKeyChecking=no'}")
    (tmp_path / "i.yml").write_text(inv_text)
    t = target_for(load_inventory(tmp_path / "i.yml").hosts[0])
    assert (t.port, t.user, t.strict) == (2222, "ops", False)


# The probe script itself, run here against stand-ins for the Ascend tools: the builtin replacements for
# cat/ls/grep/command -v must frame the same sections, and a planned port that listens must bring in ss and ps.
STUB_HCCN = """#!/bin/sh
case "$*" in
  *"address 10.9.9.9") echo "3 packets transmitted, 0 received, 100.00% packet loss"; exit 1 ;;
  *address*) echo "3 packets transmitted, 3 received, 0.00% packet loss" ;;
  *-link*) echo "link status: UP" ;;
  *) echo "hccn_tool $*" ;;
esac
"""


TOOL_DIRS = "/usr/local/bin:/usr/local/sbin:/usr/local/Ascend/driver/tools"   # first on the probe's PATH


SMI_IDLE = "npu-smi stand-in\n| NPU Chip | Process id | Process name |\n| No running processes found in NPU 0 |"
SMI_BUSY = "npu-smi stand-in\n| NPU Chip | Process id | Process name |\n| 0       0 | 4242 | python3 |"


def _probe_run(tmp_path: Path, smi: str = SMI_IDLE, **over) -> dict[str, tuple[str, int]]:
    if any(shutil.which(t, path=TOOL_DIRS) for t in ("npu-smi", "hccn_tool")):
        not_applicable("real Ascend tools on this machine would shadow the stand-ins")
    bins = tmp_path / "bin"
    bins.mkdir(parents=True)
    (bins / "hccn_tool").write_text(STUB_HCCN)
    (bins / "npu-smi").write_text(f"#!/bin/sh\ncat <<'EOF'\n{smi}\nEOF\n")
    for f in bins.iterdir():
        f.chmod(0o755)
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model-00001.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "state" / "run").mkdir(parents=True)
    (tmp_path / "state" / "run" / "a.json").write_text('{"child_pid": 1}\n')
    ctx = dict(host="h1", npus=range(3), health_npus=[1], device_ip_query="-ip", model_dir=str(model),
               state_dir=str(tmp_path / "state"), nic="lo", runtime="host", image="img", ports=[1],
               engine_command="sh", pings=[{"npu": 0, "address": "10.9.9.8"}, {"npu": 2, "address": "10.9.9.9"}],
               ping_flag="-ping", pythons=[["python3"]], proxy_check=None)
    ctx.update(over)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        if over.get("ports") == "listening":
            ctx["ports"] = [s.getsockname()[1]]
        script = render_template("preflight_probe.sh.j2", **ctx)
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=False,
                             env={"PATH": f"{bins}:/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 0 and out.stderr == "", out.stderr
    return parse_sections(out.stdout)


def test_probe_script_frames_every_section(tmp_path: Path) -> None:
    sec = _probe_run(tmp_path)
    assert float(sec["time"][0]) > 1e9
    assert sec["npu-smi"] == (SMI_IDLE, 0)
    assert [k for k in sec if k.startswith(("link-", "health-"))] == ["link-1", "health-1"]   # planned NPUs only
    assert sec["link-1"] == ("link status: UP", 0) and sec["ip-2"] == ("hccn_tool -i 2 -ip -g", 0)
    assert sorted(k for k in sec if k.startswith(("tls-", "ip-"))) == [f"{q}-{i}" for q in ("ip", "tls")
                                                                        for i in range(3)]
    assert sec["driver"][1] == 1 and sec["complete"][1] == 1          # no such files here
    du, *names = sec["model"][0].splitlines()
    assert sec["model"][1] == 0 and int(du.split()[0]) >= 1000 and names == ["config.json", "model-00001.safetensors"]
    assert sec["df"][1] == 0 and sec["df"][0].splitlines()[0].startswith("Filesystem")
    assert "MemTotal:" in sec["meminfo"][0] and sec["meminfo"][0].count("\n") == 2
    assert sec["supervised"] == ('{"child_pid": 1}\n', 0)
    assert sec["engine"] == (shutil.which("sh", path=TOOL_DIRS + ":/usr/sbin:/usr/bin:/sbin:/bin"), 0)
    assert sec["listen"] == ("", 0) and sec["ps"] == ("", 0)         # no planned port listens, no NPU process
    assert sec["ping-0"][1] == 0 and "3 received" in sec["ping-0"][0]
    assert sec["ping-1"][1] == 1 and "0 received" in sec["ping-1"][0]


def test_probe_script_names_owners_only_when_needed(tmp_path: Path) -> None:
    sec = _probe_run(tmp_path, ports="listening", engine_command="/nonexistent/vllm", pings=[])
    assert sec["listen"][1] == 0 and "LISTEN" in sec["listen"][0] and "127.0.0.1:" in sec["listen"][0]
    assert sec["ps"][1] == 0 and str(os.getpid()) in sec["ps"][0].split()
    assert sec["engine"] == ("", 1) and not [k for k in sec if k.startswith("ping-")]
    # a process on an NPU: ps names its group (HW-005), ss is still not needed
    sec = _probe_run(tmp_path / "busy", smi=SMI_BUSY)
    assert sec["npu-smi"] == (SMI_BUSY, 0) and sec["listen"] == ("", 0)
    assert sec["ps"][1] == 0 and str(os.getpid()) in sec["ps"][0].split()



def test_ssh_prefers_aes_gcm_and_keeps_every_other_cipher() -> None:
    import paramiko

    from kimictl.ssh import PREFERRED_CIPHERS, _transport

    a, b = socket.socketpair()
    with a, b:
        t = _transport(a)
        got = t.get_security_options().ciphers
        assert got[:2] == PREFERRED_CIPHERS and sorted(got) == sorted(paramiko.Transport._preferred_ciphers)
        t.close()


def test_lazy_sessions_connect_in_each_and_keep_the_error(tmp_path: Path) -> None:
    from kimictl.ssh import Sessions, SSHError

    with socket.socket() as s:   # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        inv_text = (ROOT / "inventories/a3-colocated.yml").read_text().replace(
            "kimi_hardware: atlas-800-a3}", f"kimi_hardware: atlas-800-a3, ansible_port: {port}}}")
        inv_text = re.sub(r"ansible_host: [0-9.]+", "ansible_host: 127.0.0.1", inv_text)
        (tmp_path / "i.yml").write_text(inv_text)
        inv = load_inventory(tmp_path / "i.yml")
        with Sessions(inv, timeout=2, lazy=True) as sessions:
            assert sessions.errors() == {}   # nothing tried yet
            got = sessions.each(lambda name, sess: "ran")
    (name,) = got
    assert isinstance(got[name], SSHError) and "cannot reach 127.0.0.1" in str(got[name])
    assert sessions.errors() == {name: got[name]}


@pytest.mark.parametrize(("driver", "ver001", "ver006"), [
    ("25.2.1", "pass", "fail"),      # kimictl's floor met, below the HDK upstream validates 0.23 with
    ("26.0.rc1", "pass", "pass"),    # HDK 26.0.RC1 (version.info spells it lower-case)
    ("26.0.1", "pass", "pass"),
    ("24.1.rc2", "fail", "fail"),
    ("", "fail", "skip"),
])
def test_driver_floor_and_validated_hdk(driver: str, ver001: str, ver006: str) -> None:
    from kimictl.facts import version_profile
    from kimictl.preflight import _Judge, driver_checks

    j = _Judge(set())
    driver_checks(j, "h1", driver, version_profile("0.23.0.post1"))
    got = {r.id: r for r in j.results}
    assert (got["VER-001"].status, got["VER-006"].status) == (ver001, ver006)
    assert got["VER-006"].severity == "warning"
    if ver006 == "fail":
        assert "validated with HDK 26.0.RC1" in got["VER-006"].message and got["VER-006"].fix


def test_res001_says_why_it_judges_disk_room_against_the_estimate(tmp_path: Path, monkeypatch) -> None:
    """A hub listing that cannot be read does not stop preflight, but RES-001 says why it used the estimate."""
    from kimictl.facts import model_facts
    from kimictl.preflight import Probe, _host_checks, _Judge, checkpoint_bytes
    from kimictl.sandbox.fakehub import FakeHub

    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path / "state"))
    for name in ("MODELSCOPE_API_TOKEN", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "w-00001-of-00001.safetensors").write_bytes(b"w" * 5000)
    inv_file = _a3_inventory(tmp_path, 2)
    with FakeHub({"Eco-Tech/Kimi-K2.5-W4A8": ckpt}, token="tok-needed") as hub:
        inv_file.write_text(inv_file.read_text().replace("    kimi_nic: eth0\n", "    kimi_nic: eth0\n"
                                                         f"    kimi_model_endpoint: {hub.url}\n"))
        inv = load_inventory(inv_file)
        need, why = checkpoint_bytes(inv)
    assert need == model_facts().total_bytes
    assert why and why.startswith("the hub listing could not be read: ") and "token is missing" in why
    plan = make_plan(inv, load_topology("a3-pd"))
    j = _Judge(set())
    df = "Filesystem 1B-blocks Used Available Use% Mounted\n/dev/x 1 1 1099511627776 1% /var\n"
    _host_checks(j, inv, plan, inv.hosts[0], Probe({"df": (df, 0), "model": ("0\n", 0)}), need, why)
    (res,) = [r for r in j.results if r.id == "RES-001"]
    assert "estimate from model facts; the hub listing could not be read:" in res.message and "token" in res.message
    with FakeHub({"Eco-Tech/Kimi-K2.5-W4A8": ckpt}) as hub:   # readable: the exact size, nothing to explain
        inv_file.write_text(re.sub(r"kimi_model_endpoint: \S+", f"kimi_model_endpoint: {hub.url}",
                                   inv_file.read_text()))
        assert checkpoint_bytes(load_inventory(inv_file)) == (5002, None)


def test_hub_clients_are_core_dependencies() -> None:
    """`weights pull` and `deploy` need them on every real cluster: not an optional extra."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {re.split(r"[<>=!~ ;\[]", d)[0].lower() for d in project["dependencies"]}
    assert {"modelscope", "huggingface-hub"} <= core
    extras = project.get("optional-dependencies", {}).values()
    assert not any("modelscope" in d or "huggingface" in d for extra in extras for d in extra)


def test_probe_checks_the_upstream_proxy_script_and_its_modules_on_the_proxy_host(tmp_path: Path) -> None:
    """RT-003 (vllm-ascend-proxy, kimi_runtime host): the script the inventory names exists and the python that
    runs it imports fastapi, httpx and uvicorn; either missing fails with the reason."""
    import yaml

    from kimictl.inventory import load_inventory
    from kimictl.plan import make_plan
    from kimictl.preflight import _proxy_check
    from kimictl.topology import load_topology

    script = tmp_path / "load_balance_proxy_server_example.py"
    doc = yaml.safe_load((Path(__file__).parents[2] / "inventories" / "a3-pd.yml").read_text())
    doc["all"]["vars"].update(kimi_runtime="host", kimi_proxy_script=str(script), kimi_proxy_python=sys.executable)
    (tmp_path / "inv.yml").write_text(yaml.safe_dump(doc))
    inv = load_inventory(tmp_path / "inv.yml")
    plan = make_plan(inv, load_topology("a3-pd"))
    proxy_host, other = inv.host("a3-node-01"), inv.host("a3-node-02")
    assert _proxy_check(inv, plan, other) is None
    check = _proxy_check(inv, plan, proxy_host)
    assert check[0] == sys.executable and check[-1] == str(script)
    sec = _probe_run(tmp_path / "a", proxy_check=check)
    assert sec["proxy"][1] != 0 and f"no such file: {script}" in sec["proxy"][0]
    script.write_text("# the upstream proxy\n")
    sec = _probe_run(tmp_path / "b", proxy_check=check)
    assert sec["proxy"] == (sys.version.split()[0], 0)  # this venv has the test extra's fastapi, httpx, uvicorn
    no_modules = ["/usr/bin/env", "-i", "/usr/bin/python3", "-I", *check[1:]]
    sec = _probe_run(tmp_path / "c", proxy_check=no_modules)
    assert sec["proxy"][1] != 0 and "ModuleNotFoundError" in sec["proxy"][0]
    assert "proxy" not in _probe_run(tmp_path / "d")  # no check asked, no section


@pytest.mark.parametrize(("chip", "hbm", "hw002", "hw004"), [
    ("910B3", 65536, "pass", "pass"),
    ("910B1", 65536, "pass", "pass"),      # Atlas 800T/800I A2 ship several 910B bins: all are atlas-800-a2
    ("910B2", 65536, "pass", "pass"),
    ("910B4", 32768, "pass", "fail"),      # ... but the 32 GB one cannot hold what the plan puts on an NPU
    ("Ascend910", 65536, "fail", "pass"),  # an A3 die named in an A2 inventory
])
def test_a2_chip_bins_pass_hw002_and_hw004_catches_a_smaller_hbm(chip: str, hbm: int, hw002: str, hw004: str) -> None:
    from kimictl.preflight import Probe, _host_checks, _Judge

    inv = load_inventory(ROOT / "inventories/a2-pd.yml")
    plan = make_plan(inv, load_topology("a2-pd"))
    smi = (Path(__file__).parent / "data" / "npu_smi_a2_claimed.txt").read_text()
    smi = smi.replace("910B3    ", f"{chip:<9}").replace("/ 65536", f"/ {hbm}")
    j = _Judge(set())
    _host_checks(j, inv, plan, inv.hosts[0], Probe({"npu-smi": (smi, 0)}), 1, None)
    got = {r.id: r for r in j.results}
    assert (got["HW-002"].status, got["HW-004"].status) == (hw002, hw004), (got["HW-002"], got["HW-004"])
    assert got["HW-004"].severity == "error"
    if hw004 == "fail":
        assert got["HW-004"].message.startswith(f"NPU 0: {hbm} MB; NPU 1: {hbm} MB")
        assert f"({chip}); the plan assumes 65536 MB per NPU" in got["HW-004"].message
    if hw002 == "fail":
        assert got["HW-002"].message == f"chip name {chip}; atlas-800-a2 shows 910B1/910B2/910B2C/910B3/910B4"


def test_probe_reads_the_host_pythons_and_rsync(tmp_path: Path) -> None:
    sec = _probe_run(tmp_path / "a", pythons=[[sys.executable], ["/nonexistent/python3"]])
    assert sec["python-0"] == (".".join(map(str, sys.version_info[:3])), 0)
    assert sec["python-1"][1] != 0
    rsync = shutil.which("rsync", path="/usr/bin:/bin")
    assert sec["rsync"] == ((rsync, 0) if rsync else ("", 1))


@pytest.mark.parametrize(("sections", "status", "says"), [
    ({"python-0": ("3.9.18", 0), "rsync": ("/usr/bin/rsync", 0), "sshd": ("SSH-2.0-OpenSSH_8.8", 0)}, "pass",
     "python3 3.9.18, rsync /usr/bin/rsync, sshd OpenSSH 8.8"),
    ({"python-0": ("3.7.9", 0), "rsync": ("/usr/bin/rsync", 0), "sshd": ("SSH-2.0-OpenSSH_8.8", 0)}, "fail",
     "python3 is 3.7.9, kimictl's host-side code needs 3.9 or later"),
    ({"python-0": ("bash: python3: command not found", 127), "rsync": ("/usr/bin/rsync", 0),
      "sshd": ("SSH-2.0-OpenSSH_8.8", 0)}, "fail", "python3: bash: python3: command not found"),
    ({"python-0": ("3.11.2", 0), "rsync": ("", 1), "sshd": ("SSH-2.0-OpenSSH_9.2p1 Debian-2", 0)}, "fail",
     "rsync not found on PATH"),
    ({"python-0": ("3.11.2", 0), "rsync": ("/usr/bin/rsync", 0), "sshd": ("SSH-2.0-OpenSSH_7.4", 0)}, "fail",
     "sshd OpenSSH 7.4 is older than 7.7"),
    ({"python-0": ("3.11.2", 0), "rsync": ("/usr/bin/rsync", 0), "sshd": ("SSH-2.0-dropbear_2022.83", 0)}, "fail",
     "sshd is not OpenSSH (SSH-2.0-dropbear_2022.83)"),
])
def test_rt004_host_tools(tmp_path: Path, sections: dict, status: str, says: str) -> None:
    """RT-004: what kimictl's own host-side code needs on every host, checked before anything runs there."""
    from kimictl.preflight import Probe, _Judge, tools_checks

    inv = load_inventory(_a3_inventory(tmp_path, 2))
    j = _Judge(set())
    tools_checks(j, inv, "h1", Probe(sections))
    (r,) = j.results
    assert (r.id, r.status) == ("RT-004", status) and says in r.message
    assert status == "pass" or "docs/operators.md#t-rt-004" in r.fix


@pytest.mark.parametrize(("key", "value", "why"), [
    ("ansible_ssh_common_args", "-o 'UserKnownHostsFile=/x", "No closing quotation"),
    ("ansible_ssh_extra_args", "-p twenty-two", "invalid literal"),
    ("ansible_port", "ssh", "not a port number"),
])
def test_ssh_arguments_nobody_can_read_name_the_host_and_key(key: str, value: str, why: str) -> None:
    """Preflight, logs and every probe build their SSH target here: a bad value is bad input, not a traceback."""
    from kimictl.errors import InvalidInput

    host = load_inventory(ROOT / "inventories" / "a3-pd.yml").hosts[0]
    host = host.model_copy(update={"ansible_vars": {**host.ansible_vars, key: value}})
    with pytest.raises(InvalidInput, match=f"host {host.name}: (ansible_port|{key}).*{why}"):
        target_for(host)
