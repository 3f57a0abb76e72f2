"""Ascend output parsers against the output shapes of real npu-smi / hccn_tool (Atlas 800 A2 and A3 hosts)."""

from __future__ import annotations

from pathlib import Path

from kimictl import ascend

DATA = Path(__file__).parent / "data"

# Real A2 layout from the reference (910B3, npu-smi 24.1.rc1): 5-digit HBM use has no space before '/'.
A2_REAL = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 24.1.rc1.b030            Version: 24.1.rc1.b030                                        |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 101.8       43                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3318 / 65536         |
+===========================+===============+====================================================+
| 1     910B3               | Warning       | 99.1        41                0    / 0             |
| 0                         | 0000:C2:00.0  | 0           0    / 0          58626/ 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| No running processes found in NPU 0                                                            |
+===========================+===============+====================================================+
| 1       0                 | 4242          | python3                  | 55000                   |
+===========================+===============+====================================================+
"""


def test_parse_real_a2_table() -> None:
    info = ascend.parse_npu_smi_info(A2_REAL)
    assert info.version == "24.1.rc1.b030"
    assert [(n.logical_id, n.name, n.health, n.hbm_used_mb, n.hbm_total_mb) for n in info.npus] == [
        (0, "910B3", "OK", 3318, 65536), (1, "910B3", "Warning", 58626, 65536)]
    assert info.processes == [(1, 4242, "python3", 55000)]


def test_parse_a3_dies_use_phy_id() -> None:
    info = ascend.parse_npu_smi_info((DATA / "npu_smi_a3_claimed.txt").read_text())
    assert len(info.npus) == 16
    assert [n.logical_id for n in info.npus] == list(range(16))
    assert {(n.npu_id, n.chip) for n in info.npus if n.logical_id == 3} == {(1, 1)}
    assert all(n.name == "Ascend910" and n.hbm_total_mb == 65536 for n in info.npus)
    assert [p[0] for p in info.processes] == [3]


def test_parse_a2_double() -> None:
    info = ascend.parse_npu_smi_info((DATA / "npu_smi_a2_claimed.txt").read_text())
    assert len(info.npus) == 8 and {n.name for n in info.npus} == {"910B3"}
    assert [p[0] for p in info.processes] == [3]


def test_hccn_and_version_parsers() -> None:
    assert ascend.parse_device_ip("ipaddr:10.86.1.80\nnetmask:255.255.255.0\n") == "10.86.1.80"
    assert ascend.parse_device_ip("Get ipconf failed, because no ip was preset there!") is None
    assert ascend.parse_link("link status: UP") == "UP" and ascend.parse_link("link status: DOWN") == "DOWN"
    assert ascend.parse_net_health("net health status: Success") == "Success"
    assert ascend.parse_tls("dev_id:0, tls switch[1](0:disable, 1:enable), tls preconfigured[1]") == "1"
    assert ascend.parse_ping("device 3 PING 29.1.137.205\nrecv seq=0,time=1.4ms\n"
                             "3 packets transmitted, 3 received, 0.00% packet loss") == (3, 3)
    assert ascend.parse_ping("3 packets transmitted, 0 received, 100.00% packet loss") == (3, 0)
    vi = "Version=24.1.rc2.2\nascendhal_version=7.35.23\npackage_version=24.1.rc2.2\n"
    assert ascend.version_of(vi) == "24.1.rc2.2" and ascend.version_of("Version=24.1.rc1\n") == "24.1.rc1"
    assert ascend.cann_version("package_name=Ascend-cann-toolkit\nversion=8.2.RC1\n") == "8.2.RC1"


def test_version_order() -> None:
    vt = ascend.version_tuple
    assert vt("25.2.1") > vt("25.0.0") > vt("24.1.rc2.2") > vt("24.1.rc1") and vt("23.0.rc3") < vt("24.1.0")
