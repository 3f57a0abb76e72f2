"""Output shapes of the npu-smi and hccn_tool doubles (those of real Atlas 800 A2/A3 hosts), without root."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from kimictl.sandbox import layout
from kimictl.sandbox.doubles import hccn_tool, npu_smi

DOUBLES = Path(npu_smi.__file__).parent


def make_sim(tmp_path: Path, hardware: str, faults: dict | None = None) -> Path:
    h = layout.plan_hosts(2, hardware, "netns", 0, tmp_path)[0]
    sim = tmp_path / "sim"
    (sim / "claims").mkdir(parents=True)
    ascend = tmp_path / "Ascend"
    (ascend / "driver").mkdir(parents=True)
    (ascend / "driver/version.info").write_text(layout.driver_version_info())
    (sim / "host.json").write_text(json.dumps(layout.host_json(h, hardware, ascend_root=str(ascend))))
    (sim / "faults.json").write_text(json.dumps(faults or {}))
    return sim


@pytest.fixture
def sim(tmp_path, monkeypatch, request):
    hardware, faults = getattr(request, "param", ("atlas-800-a3", {}))
    d = make_sim(tmp_path, hardware, faults)
    monkeypatch.setenv("KIMI_SIM_DIR", str(d))
    return d


def run(mod, argv, capsys):
    rc = mod.main(argv)
    return rc, capsys.readouterr().out


def chip_rows(table: str) -> list[list[str]]:
    """Rows of the NPU section split on '|' the way robust parsers do (pairs of lines per chip)."""
    body = table.split("| NPU     Chip", maxsplit=1)[0]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in body.splitlines() if ln.startswith("| ")]
    return rows[3:]   # skip the version line and the two header lines


def hbm(cell: str) -> int:
    m = re.search(r"(\d+)\s*/\s*65536$", cell)
    assert m, cell
    return int(m.group(1))


def test_a3_table_shape(sim, capsys):
    rc, out = run(npu_smi, ["info"], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert all(len(ln) == 98 for ln in lines), {len(ln) for ln in lines}
    assert "| Chip  Phy-ID              | Bus-Id        |" in out
    rows = chip_rows(out)
    assert len(rows) == 32   # 16 dies x 2 lines
    firsts, seconds = rows[0::2], rows[1::2]
    assert [r[0].split() for r in firsts[:3]] == [["0", "Ascend910"], ["0", "Ascend910"], ["1", "Ascend910"]]
    assert all(r[1] == "OK" for r in firsts)
    assert [r[0].split() for r in seconds[:3]] == [["0", "0"], ["1", "1"], ["0", "2"]]
    assert [r[1] for r in seconds[:2]] == ["0000:9D:00.0", "0000:9F:00.0"]
    assert firsts[1][2].split()[0] == "-" and firsts[0][2].split()[0] != "-"   # power on chip 0 only
    assert all(r[2].endswith("/ 65536") for r in seconds)
    assert out.count("No running processes found in NPU") == 8
    # a +---+ line between the two chips of a package, +===+ between packages
    assert lines[8].startswith("+---") and lines[11].startswith("+===")


@pytest.mark.parametrize("sim", [("atlas-800-a2", {})], indirect=True)
def test_a2_table_shape(sim, capsys):
    rc, out = run(npu_smi, ["info"], capsys)
    assert rc == 0
    assert "| Chip                      | Bus-Id        |" in out
    rows = chip_rows(out)
    assert len(rows) == 16
    assert [r[0].split() for r in rows[0::2]] == [[str(i), "910B3"] for i in range(8)]
    assert all(r[0] == "0" for r in rows[1::2])
    assert "3318 / 65536" in out
    assert out.count("No running processes found in NPU") == 8


@pytest.mark.parametrize("sim", [("atlas-800-a3", {"npu_unhealthy": [3]})], indirect=True)
def test_unhealthy_npu(sim, capsys):
    _, out = run(npu_smi, ["info"], capsys)
    health = [r[1] for r in chip_rows(out)[0::2]]
    assert health[3] == "Critical" and health.count("OK") == 15
    _, out = run(npu_smi, ["info", "-t", "health", "-i", "1", "-c", "1"], capsys)
    assert re.search(r"Health Status\s+: Critical", out)
    _, out = run(npu_smi, ["info", "-t", "health", "-i", "1", "-c", "0"], capsys)
    assert re.search(r"Health Status\s+: OK", out)


def test_live_claims_show_in_process_table_and_hbm(sim, capsys):
    (sim / "claims/npu2").write_text(f"{os.getpid()}\n")
    (sim / "claims/npu5").write_text("999999999\n")   # stale: no such process
    _, out = run(npu_smi, ["info"], capsys)
    procs = out.split("| NPU     Chip")[1]
    row = [c.strip() for c in next(ln for ln in procs.splitlines() if str(os.getpid()) in ln).strip("|").split("|")]
    assert row[0].split() == ["1", "0"] and row[1] == str(os.getpid()) and int(row[3]) > 50000
    assert "No running processes found in NPU 1" not in procs
    assert "No running processes found in NPU 2" in procs   # npu5's holder is dead
    seconds = chip_rows(out)[1::2]
    assert hbm(seconds[2][2]) > 50000 and re.search(r"\d{5}/ 65536$", seconds[2][2])
    assert hbm(seconds[5][2]) < 5000


def test_list_map_board(sim, capsys):
    _, out = run(npu_smi, ["info", "-l"], capsys)
    assert re.search(r"Total Count\s+: 8", out) and out.count("Chip Count") == 8
    _, out = run(npu_smi, ["info", "-m"], capsys)
    assert "Chip Phy-ID" in out and len(out.splitlines()) == 1 + 8 * 3
    _, out = run(npu_smi, ["info", "-t", "board", "-i", "0"], capsys)
    kv = dict(re.split(r"\s+:\s", ln.strip(), maxsplit=1) for ln in out.splitlines())
    assert kv["PCI Device ID"] == "0xD803" and kv["Software Version"] == layout.DRIVER_VERSION
    _, out = run(npu_smi, ["info", "-t", "board", "-i", "0", "-c", "1"], capsys)
    kv = dict(re.split(r"\s+:\s", ln.strip(), maxsplit=1) for ln in out.splitlines())
    assert (kv["Chip Name"], kv["NPU Name"]) == ("Ascend910", "9392") and "Chip Type" not in kv
    _, out = run(npu_smi, ["info", "-t", "spod-info", "-i", "1", "-c", "1"], capsys)
    assert re.search(r"SDID\s+: 3", out)
    _, out = run(npu_smi, ["info", "-t", "memory", "-i", "0"], capsys)
    assert re.search(r"HBM Capacity\(MB\)\s+: 65536", out)


def test_topo_matrix(sim, capsys):
    rc, out = run(npu_smi, ["info", "-t", "topo"], capsys)
    lines = out.splitlines()
    assert rc == 0 and lines[0].split()[-2:] == ["CPU", "Affinity"] and lines[0].split()[0] == "NPU0"
    assert lines[1].split()[:3] == ["NPU0", "X", "HCCS"] and len(lines[1].split()) == 18
    assert "Legend:" in out


@pytest.mark.parametrize("sim", [("atlas-800-a2", {})], indirect=True)
def test_a2_board_chip_and_driver_version_from_file(sim, tmp_path, capsys):
    _, out = run(npu_smi, ["info", "-t", "board", "-i", "7", "-c", "0"], capsys)
    assert re.search(r"Chip Type\s+: Ascend", out) and re.search(r"Chip Name\s+: 910B3", out)
    (tmp_path / "Ascend/driver/version.info").write_text(layout.driver_version_info("23.0.rc3"))
    _, out = run(npu_smi, ["info", "-t", "board", "-i", "7"], capsys)
    assert re.search(r"Software Version\s+: 23.0.rc3", out)
    rc, out = run(npu_smi, ["info", "-t", "spod-info", "-i", "0", "-c", "0"], capsys)
    assert rc != 0


@pytest.mark.parametrize("argv", [["info", "-t", "board", "-i", "8"], ["info", "-t", "board", "-i", "0", "-c", "2"],
                                  ["info", "-t", "board", "-i", "x"], ["info", "--bogus"], ["list"]])
def test_npu_smi_errors(sim, capsys, argv):
    rc, out = run(npu_smi, argv, capsys)
    assert rc == 255 and out.strip()


def test_missing_state_is_an_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KIMI_SIM_DIR", str(tmp_path / "nothing"))
    with pytest.raises(SystemExit, match=r"host\.json"):
        npu_smi.main(["info"])
    assert hccn_tool.main(["-i", "0", "-link", "-g"]) == 1


def test_hccn_queries(sim, capsys):
    rc, out = run(hccn_tool, ["-i", "3", "-ip", "-g"], capsys)
    assert rc == 0 and out == "ipaddr:10.201.1.4\nnetmask:255.255.0.0\n"
    assert re.search(r"ipaddr:(\d+\.\d+\.\d+\.\d+)", out)
    assert run(hccn_tool, ["-i", "0", "-link", "-g"], capsys) == (0, "link status: UP\n")
    assert run(hccn_tool, ["-i", "0", "-net_health", "-g"], capsys) == (0, "net health status: Success\n")
    rc, out = run(hccn_tool, ["-i", "0", "-lldp", "-g"], capsys)
    assert rc == 0 and "Ifname:" in out and "System Name TLV" in out
    assert run(hccn_tool, ["-i", "0", "-netdetect", "-g"], capsys)[1] == "netdetect address: 10.201.0.1\n"
    assert "default gateway:10.201.0.1" in run(hccn_tool, ["-i", "0", "-gateway", "-g"], capsys)[1]
    assert "tls switch[0]" in run(hccn_tool, ["-i", "0", "-tls", "-g"], capsys)[1]
    assert run(hccn_tool, ["-i", "15", "-vnic", "-g"], capsys)[1].startswith("vnic ipaddr:10.201.1.16")


@pytest.mark.parametrize("argv", [["-i", "16", "-ip", "-g"], ["-i", "a", "-ip", "-g"], ["-i", "0", "-bogus", "-g"],
                                  ["-link", "-g"], ["-i", "0", "-hccs_ping", "-g"]])
def test_hccn_errors(sim, capsys, argv):
    rc, out = run(hccn_tool, argv, capsys)
    assert rc == 1 and out.strip()


@pytest.mark.parametrize("sim", [("atlas-800-a2", {})], indirect=True)
def test_hccs_ping_is_a3_only(sim, capsys):
    rc, out = run(hccn_tool, ["-i", "0", "-hccs_ping", "-g", "address", "10.201.2.1"], capsys)
    assert rc == 1 and "Unsupported" in out
    rc, _ = run(hccn_tool, ["-i", "0", "-vnic", "-g"], capsys)
    assert rc == 1


@pytest.mark.parametrize("sim", [("atlas-800-a3", {"link_down": [5], "cut_routes": ["10.201.3.0/24"]})],
                         indirect=True)
def test_link_down_and_ping(sim, capsys, monkeypatch):
    calls = []

    def fake_ping(src, dst, count=3):
        calls.append((src, dst))
        return [(0, 0.1), (1, 0.05), (2, 0.05)]

    monkeypatch.setattr(hccn_tool, "run_ping", fake_ping)
    assert run(hccn_tool, ["-i", "5", "-link", "-g"], capsys) == (0, "link status: DOWN\n")
    assert run(hccn_tool, ["-i", "5", "-net_health", "-g"], capsys) == (0, "net health status: Fault\n")
    rc, out = run(hccn_tool, ["-i", "0", "-hccs_ping", "-g", "address", "10.201.2.1"], capsys)
    assert rc == 0 and calls == [("10.201.1.1", "10.201.2.1")]
    assert out.splitlines() == ["device 0 PING 10.201.2.1", "recv seq=0,time=0.100000ms",
                                "recv seq=1,time=0.050000ms", "recv seq=2,time=0.050000ms",
                                "3 packets transmitted, 3 received, 0.00% packet loss"]
    rc, out = run(hccn_tool, ["-i", "5", "-ping", "-g", "address", "10.201.2.1"], capsys)
    assert rc == 1 and out.endswith("3 packets transmitted, 0 received, 100.00% packet loss\n")
    rc, out = run(hccn_tool, ["-i", "0", "-ping", "-g", "address", "10.201.3.7"], capsys)   # cut route
    assert rc == 1 and len(calls) == 1


def test_ping_reports_real_loss(sim, capsys, monkeypatch):
    monkeypatch.setattr(hccn_tool, "run_ping", lambda src, dst, count=3: [(1, 0.2)])
    rc, out = run(hccn_tool, ["-i", "0", "-ping", "-g", "address", "10.201.2.1"], capsys)
    assert rc == 0 and "3 packets transmitted, 1 received, 66.67% packet loss" in out


@pytest.mark.parametrize("name", ["npu_smi.py", "hccn_tool.py"])
def test_doubles_run_on_bare_system_python(sim, name, host_python):
    """The hosts have no venv: the doubles must work under their python3 -I -S (stdlib only)."""
    argv = ["info"] if name == "npu_smi.py" else ["-i", "0", "-link", "-g"]
    proc = subprocess.run([host_python, "-I", "-S", str(DOUBLES / name), *argv], capture_output=True, text=True,
                          env={"KIMI_SIM_DIR": str(sim), "PATH": "/usr/bin:/bin"}, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert (DOUBLES / name).read_text().startswith("#!/usr/bin/python3 -IS\n")
