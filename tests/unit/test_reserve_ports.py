"""kimictl/remote/reserve_ports.py: adds the plan's ports to ip_local_reserved_ports (never removes), persists the
union, reports a host that refuses; and what kimictl hands it per host."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prerequisites import require_or_skip

from kimictl.remote import reserve_ports as rp

SCRIPT = Path(rp.__file__)
# Hosts run it with their own python3: KIMICTL_HOST_PYTHON=/path/python3.9 checks another one (scripts/test.sh).
HOST_PY = os.environ.get("KIMICTL_HOST_PYTHON") or sys.executable


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HOST_PY, str(SCRIPT), *args], capture_output=True, text=True, timeout=30, check=False)


@pytest.mark.parametrize(("text", "ranges"), [
    ("", []), ("\n", []), ("7100", [(7100, 7100)]), ("36000-36015,7100\n", [(36000, 36015), (7100, 7100)]),
])
def test_parse_reads_the_kernels_spelling(text: str, ranges: list) -> None:
    assert rp.parse(text) == ranges


@pytest.mark.parametrize("bad", ["x", "7100-", "0", "70000", "36015-36000", "1-2-3"])
def test_parse_names_a_bad_item(bad: str) -> None:
    with pytest.raises(ValueError, match="not a port"):
        rp.parse(bad)


def test_merge_joins_overlapping_and_adjacent_ranges() -> None:
    assert rp.merge([(36008, 36015), (7100, 7100), (36000, 36007), (7101, 7101), (8000, 8000), (36010, 36020)]) == [
        (7100, 7101), (8000, 8000), (36000, 36020)]
    assert rp.spell([(7100, 7101), (8000, 8000)]) == "7100-7101,8000"


def test_adds_to_what_is_reserved_and_persists_the_union(tmp_path: Path) -> None:
    proc, conf = tmp_path / "ip_local_reserved_ports", tmp_path / "sysctl.d" / "90-kimictl-reserved-ports.conf"
    proc.write_text("9000-9010,36010\n")   # someone else's reservations stay
    res = run("7100,36000-36015", "--persist", str(conf), "--proc", str(proc))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {"changed": True, "reserved": "7100,9000-9010,36000-36015"}
    assert proc.read_text() == "7100,9000-9010,36000-36015\n"
    assert "net.ipv4.ip_local_reserved_ports = 7100,9000-9010,36000-36015\n" in conf.read_text()
    assert conf.stat().st_mode & 0o777 == 0o644
    again = run("7100,36000-36015", "--persist", str(conf), "--proc", str(proc))
    assert json.loads(again.stdout) == {"changed": False, "reserved": "7100,9000-9010,36000-36015"}
    conf.unlink()   # reserved at runtime, file gone (a host rebuilt from an image): written again, reported changed
    assert json.loads(run("7100", "--persist", str(conf), "--proc", str(proc)).stdout)["changed"] is True
    assert conf.is_file()


@pytest.mark.parametrize("err", [errno.EACCES, errno.EPERM, errno.EROFS])
def test_a_host_that_refuses_the_write_is_reported_not_failed(tmp_path: Path, monkeypatch, err: int) -> None:
    proc, conf = tmp_path / "ip_local_reserved_ports", tmp_path / "90-kimictl-reserved-ports.conf"
    proc.write_text("\n")

    def fake_open(path, mode="r", **kw):
        if "w" in mode:
            raise OSError(err, os.strerror(err), str(path))
        return open(path, mode, **kw)

    monkeypatch.setattr(rp, "open", fake_open, raising=False)
    doc = rp.reserve([(7100, 7100)], str(proc), str(conf))
    assert doc["changed"] is False and doc["skipped"].startswith(f"cannot write {proc}: ")
    assert not conf.exists()


@pytest.mark.parametrize("args", [["7100,x"], ["7100", "--proc", "/nonexistent/ip_local_reserved_ports"]])
def test_bad_input_or_a_missing_setting_fails_with_one_line(args: list[str]) -> None:
    res = run(*args)
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.startswith("reserve_ports: ") and len(res.stderr.splitlines()) == 1


def test_a_reserved_port_is_never_a_source_port(tmp_path: Path) -> None:
    """The kernel behaviour the script relies on, in a network namespace of its own when this machine allows one:
    with every ephemeral port but one reserved, connections (to three listeners) all leave from that one."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "-n", "true"], capture_output=True, check=False).returncode != 0:
        require_or_skip("needs root and network namespaces")
    code = (
        "import socket, subprocess, sys, json\n"
        "subprocess.run(['ip', 'link', 'set', 'lo', 'up'], check=True)\n"
        "lo, hi = map(int, open('/proc/sys/net/ipv4/ip_local_port_range').read().split())\n"
        f"r = subprocess.run([sys.argv[1], {str(SCRIPT)!r}, f'{{lo}}-{{hi - 1}}'], capture_output=True, text=True)\n"
        "conns = []\n"
        "for port in (5001, 5002, 5003):  # fixed: a listener on port 0 would take the one port left\n"
        "    srv = socket.socket(); srv.bind(('127.0.0.1', port)); srv.listen(1)\n"
        "    conns.append(socket.create_connection(srv.getsockname()))\n"
        "ports = {c.getsockname()[1] for c in conns}\n"
        "print(json.dumps({'script': r.stdout, 'err': r.stderr, 'ports': sorted(ports), 'hi': hi}))\n")
    res = subprocess.run(["unshare", "-n", sys.executable, "-c", code, HOST_PY], capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert json.loads(doc["script"] or "null") == {"changed": True, "reserved": f"32768-{doc['hi'] - 1}"}, doc
    assert doc["ports"] == [doc["hi"]]


def test_kimictl_hands_each_host_its_planned_ports(tmp_path: Path) -> None:
    from kimictl.hostops import HostOps
    from kimictl.pipeline import prepare

    inv_path = Path(__file__).resolve().parents[2] / "inventories" / "a3-pd.yml"
    prep = prepare(inv_path, "a3-pd")
    inv, plan = prep.inventory, prep.plan
    ops = HostOps(inv, plan.served_model_name, tmp_path, say=lambda _m: None)
    extra = ops._reserve_vars(plan)
    assert Path(extra["reserve_script"]) == SCRIPT
    assert sorted(extra["reserve_ports"]) == sorted(plan.host_roles)
    for host, spelled in extra["reserve_ports"].items():
        reserved = rp.parse(spelled)
        for use in (u for u in plan.ports if u.host == host):
            assert any(a <= use.first and use.last <= b for a, b in reserved), (host, use)
    proxy = plan.proxy
    assert proxy is not None and any(a <= proxy.port <= b for a, b in rp.parse(extra["reserve_ports"][proxy.host]))
    off = tmp_path / "off.yml"
    off.write_text(inv_path.read_text().replace("  vars:\n", "  vars:\n    kimi_reserve_ports: false\n", 1))
    prep = prepare(off, "a3-pd")
    inv_off, plan_off = prep.inventory, prep.plan
    assert HostOps(inv_off, plan_off.served_model_name, tmp_path, say=lambda _m: None)._reserve_vars(plan_off) == {
        "reserve_ports": {}}
