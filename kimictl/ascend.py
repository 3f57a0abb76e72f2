"""Parsers for Ascend tool output (npu-smi, hccn_tool, version files); split on '|' and 'key : value', not columns."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_IP = re.compile(r"ipaddr\s*:\s*(\d+\.\d+\.\d+\.\d+)")
_HBM = re.compile(r"(\d+)\s*/\s*(\d+)\s*$")


@dataclass
class Npu:
    """One logical NPU (a die on A3): ASCEND_RT_VISIBLE_DEVICES numbering."""

    logical_id: int
    npu_id: int
    chip: int
    name: str
    health: str
    hbm_used_mb: int
    hbm_total_mb: int


@dataclass
class NpuSmiInfo:
    version: str = ""
    npus: list[Npu] = field(default_factory=list)
    processes: list[tuple[int, int, str, int]] = field(default_factory=list)  # (logical id, pid, name, MB)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_npu_smi_info(text: str) -> NpuSmiInfo:
    """`npu-smi info`: the NPU table (2 lines per chip) and the process table."""
    info = NpuSmiInfo()
    lines = text.splitlines()
    m = re.search(r"npu-smi\s+(\S+)", text)
    info.version = m.group(1) if m else ""
    in_proc = False
    has_phy = "Phy-ID" in text
    pending: tuple[int, str, str] | None = None
    for line in lines:
        if not line.startswith("|"):
            continue
        cells = _cells(line)
        if "Process id" in line:
            in_proc = True
            continue
        if in_proc:
            if len(cells) >= 4 and cells[1].isdigit():
                ids = cells[0].split()
                npu, chip = int(ids[0]), int(ids[1]) if len(ids) > 1 else 0
                logical = npu * 2 + chip if has_phy else npu
                mb = int(re.sub(r"\D", "", cells[3]) or 0)
                info.processes.append((logical, int(cells[1]), cells[2], mb))
            continue
        if len(cells) < 3 or not cells[0] or cells[0].startswith(("NPU", "Chip")):
            continue
        first = cells[0].split()
        if not first[0].isdigit():
            continue
        if pending is None and len(first) >= 2 and not first[1].isdigit():
            pending = (int(first[0]), first[1], cells[1].split()[0] if cells[1] else "")
            continue
        if pending is not None:
            npu_id, name, health = pending
            pending = None
            chip = int(first[0])
            logical = int(first[1]) if has_phy and len(first) > 1 else npu_id
            hbm = _HBM.search(cells[-1])
            used, total = (int(hbm.group(1)), int(hbm.group(2))) if hbm else (0, 0)
            info.npus.append(Npu(logical, npu_id, chip, name, health, used, total))
    return info


def parse_kv(text: str, sep: str = ":") -> dict[str, str]:
    """`key : value` (npu-smi -t/-l) or `key=value` (version.info) lines; first occurrence wins."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if sep not in line:
            continue
        k, v = line.split(sep, 1)
        out.setdefault(k.strip(), v.strip())
    return out


def version_of(version_info: str) -> str:
    """Driver/firmware version.info: package_version, else Version."""
    kv = parse_kv(version_info, "=")
    return kv.get("package_version") or kv.get("Version") or ""


def cann_version(install_info: str) -> str:
    return parse_kv(install_info, "=").get("version", "")


def parse_device_ip(text: str) -> str | None:
    m = _IP.search(text)
    return m.group(1) if m else None


def parse_link(text: str) -> str:
    m = re.search(r"link status\s*:\s*(\w+)", text, re.I)
    return m.group(1).upper() if m else "UNKNOWN"


def parse_net_health(text: str) -> str:
    m = re.search(r"net health status\s*:\s*(\w+)", text, re.I)
    return m.group(1) if m else "Unknown"


def parse_tls(text: str) -> str:
    """The TLS switch value: `tls switch[0](0:disable, 1:enable)` or `switch: 0`."""
    m = re.search(r"tls switch\[(\w+)\]", text, re.I) or re.search(r"switch\s*[:=]\s*(\w+)", text, re.I)
    return m.group(1) if m else "unknown"


def parse_ping(text: str) -> tuple[int, int]:
    """(transmitted, received) from hccn_tool -ping / -hccs_ping."""
    m = re.search(r"(\d+)\s+packets transmitted,\s*(\d+)\s+received", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def version_tuple(v: str) -> tuple:
    """Compare driver/CANN versions like 25.5.1, 24.1.rc2.2, 8.2.RC1: numbers numerically, rc below final."""
    out: list = []
    for part in re.split(r"[.\-]", v.lower()):
        if part.isdigit():
            out.append((1, int(part)))
        elif part.startswith("rc") and part[2:].isdigit():
            out.append((0, int(part[2:])))
        elif part:
            out.append((0, 0))
    return tuple(out)
