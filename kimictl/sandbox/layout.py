"""Pure description of a sandbox: hardware profiles, names, addresses and the files each fake host gets."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_DIR = Path("/var/tmp/kimictl-sandbox")
NAME_PREFIX = "ks"          # every netns/link we create starts with ks<slot>
MAX_SLOTS = 16              # sandboxes that may run side by side (one control /24 + device /16 each)
MAX_HOSTS = 32
SIM_DIR = "/var/lib/kimi-sim"
MODEL_DIR = "/var/lib/kimi/models/Kimi-K2.5-W4A8"
MODELS_PARENT = "/var/lib/kimi/models"
ENGINE_COMMAND = "/opt/kimi-sim/bin/vllm"
VLLM_ASCEND_TREE = "/opt/vllm-ascend"   # where hosts have vllm-ascend's source tree (its P/D proxy script)
NPU_SMI_PATH = "/usr/local/bin/npu-smi"
NPU_EXPORTER_PORT = 8082    # Ascend NPU-Exporter's default -port (Ascend/ascend-npu-exporter cmd/npu-exporter/main.go)
ASCEND_ROOT = "/usr/local/Ascend"
HCCN_TOOL_PATH = f"{ASCEND_ROOT}/driver/tools/hccn_tool"
CONTROL_NIC = "eth0"        # host interface on the control bridge (kimi_nic)
DEVICE_NIC = "eth1"         # host interface on the device-network bridge (all NPU device IPs)
DEVICE_NETMASK = "255.255.0.0"

DRIVER_VERSION = "25.2.1"
FIRMWARE_VERSION = "7.7.0.6.236"
CANN_VERSION = "9.1.0"
NPU_SMI_VERSION = "25.2.1"


@dataclass(frozen=True)
class HardwareProfile:
    """What one Atlas server model looks like to the tool doubles."""

    name: str
    npus: int               # logical NPUs (dies): what ASCEND_RT_VISIBLE_DEVICES counts
    chips_per_npu: int      # dies per npu-smi "NPU" row group
    chip_name: str          # npu-smi Name column
    npu_name: str           # `-t board -c` NPU Name (A3 only)
    product_name: str
    pci_device_id: str
    bus_ids: tuple[str, ...]
    hbm_mb: int = 65536
    ping_flag: str = "-ping"


HARDWARE: dict[str, HardwareProfile] = {
    "atlas-800-a2": HardwareProfile(
        name="atlas-800-a2", npus=8, chips_per_npu=1, chip_name="910B3", npu_name="",
        product_name="IT21HMDC_Bin5", pci_device_id="0xD802",
        bus_ids=("C1", "C2", "81", "82", "01", "02", "41", "42"), ping_flag="-ping"),
    "atlas-800-a3": HardwareProfile(
        name="atlas-800-a3", npus=16, chips_per_npu=2, chip_name="Ascend910", npu_name="9392",
        product_name="IT22HMDA_2_S", pci_device_id="0xD803",
        bus_ids=("9D", "9F", "99", "9B", "95", "97", "91", "93", "8D", "8F", "89", "8B", "85", "87", "81", "83"),
        ping_flag="-hccs_ping"),
}


def host_name(index: int) -> str:
    """atlas-01, atlas-02, ... (1-based)."""
    return f"atlas-{index:02d}"


def host_index(name: str) -> int | None:
    """Inverse of host_name; None if the name is not a sandbox host name."""
    if not name.startswith("atlas-") or not name[6:].isdigit():
        return None
    return int(name[6:])


@dataclass(frozen=True)
class Names:
    """Kernel object names and subnets for one sandbox slot (so two sandboxes can run at once)."""

    slot: int

    @property
    def prefix(self) -> str:
        return f"{NAME_PREFIX}{self.slot}"

    @property
    def control_bridge(self) -> str:
        return f"{self.prefix}brc"

    @property
    def device_bridge(self) -> str:
        return f"{self.prefix}brd"

    def netns(self, index: int) -> str:
        return f"{self.prefix}-{host_name(index)}"

    def veth_control(self, index: int) -> str:
        return f"{self.prefix}h{index}c"

    def veth_device(self, index: int) -> str:
        return f"{self.prefix}h{index}d"

    @property
    def controller_ip(self) -> str:
        return f"10.200.{self.slot}.1"

    def host_ip(self, index: int, mode: str) -> str:
        if mode == "netns":
            return f"10.200.{self.slot}.{10 + index}"
        return f"127.10.{self.slot}.{index}"

    def ssh_port(self, index: int, mode: str) -> int:
        return 22 if mode == "netns" else 22000 + self.slot * 100 + index

    def device_ips(self, index: int, npus: int, mode: str) -> list[str]:
        # netns: one /16 per slot on the device bridge; loopback: 127.20+slot.x.y, always local
        first = 201 + self.slot if mode == "netns" else 20 + self.slot
        net = "10" if mode == "netns" else "127"
        return [f"{net}.{first}.{index}.{d + 1}" for d in range(npus)]

    def device_subnet(self, index: int) -> str:
        """The /24 holding one host's device IPs (what cut-route blackholes)."""
        return f"10.{201 + self.slot}.{index}.0/24"


@dataclass
class HostSpec:
    """One fake host as planned by `up`."""

    index: int
    name: str
    ip: str
    port: int
    device_ips: list[str]
    netns: str | None
    dir: Path
    sim_dir: Path            # host-side path of the host's KIMI_SIM_DIR
    root: Path               # loopback mode: where the "/" files of the host live
    state_dir: str | None = None
    extra: dict = field(default_factory=dict)


def plan_hosts(n: int, hardware: str, mode: str, slot: int, directory: Path) -> list[HostSpec]:
    """Names, addresses and per-host directories of an n-host sandbox."""
    prof = HARDWARE[hardware]
    names = Names(slot)
    out = []
    for i in range(1, n + 1):
        hname = host_name(i)
        hd = directory / "hosts" / hname
        out.append(HostSpec(
            index=i, name=hname, ip=names.host_ip(i, mode), port=names.ssh_port(i, mode),
            device_ips=names.device_ips(i, prof.npus, mode),
            netns=names.netns(i) if mode == "netns" else None, dir=hd, sim_dir=hd / "sim", root=hd / "root",
            state_dir=str(hd / "state") if mode == "loopback" else None))
    return out


def host_json(host: HostSpec, hardware: str, *, ascend_root: str = ASCEND_ROOT,
              load_gib_per_s: float = 20.0) -> dict:
    """The simulator's host.json (format documented in docs/sandbox.md)."""
    prof = HARDWARE[hardware]
    return {
        "hostname": host.name,
        "hardware": hardware,
        "npus": prof.npus,
        "chips_per_npu": prof.chips_per_npu,
        "chip_name": prof.chip_name,
        "npu_name": prof.npu_name,
        "product_name": prof.product_name,
        "pci_device_id": prof.pci_device_id,
        "bus_ids": [f"0000:{b}:00.0" for b in prof.bus_ids],
        "hbm_mb": prof.hbm_mb,
        "device_ips": host.device_ips,
        "device_netmask": DEVICE_NETMASK,
        "driver_version": DRIVER_VERSION,
        "firmware_version": FIRMWARE_VERSION,
        "cann_version": CANN_VERSION,
        "npu_smi_version": NPU_SMI_VERSION,
        "ascend_root": ascend_root,
        "load_gib_per_s": load_gib_per_s,
        "host_index": host.index,
    }


def gateway_for(device_ip: str) -> str:
    """A per-/16 gateway address written to hccn.conf (never configured anywhere)."""
    net = ipaddress.ip_network(f"{device_ip}/{DEVICE_NETMASK}", strict=False)
    return str(net.network_address + 1)


def driver_version_info(version: str = DRIVER_VERSION) -> str:
    return "\n".join([
        f"Version={version}",
        "ascendhal_version=7.35.23",
        "aicpu_version=1.0",
        "tdt_version=1.0",
        "log_version=1.0",
        "prof_version=2.0",
        "dvppkernels_version=1.1",
        "tsfw_version=1.0",
        "Innerversion=V100R001C23SPC001B201",
        "compatible_version=[V100R001C30],[V100R001C13],[V100R001C15],[V100R001C17],[V100R001C18],[V100R001C23]",
        "compatible_version_fw=[7.0.0,7.7.99]",
        f"package_version={version}",
        "",
    ])


def firmware_version_info(version: str = FIRMWARE_VERSION, driver: str = DRIVER_VERSION) -> str:
    return "\n".join([
        f"Version={version}",
        "firmware_version=1.0",
        f"package_version={driver}",
        "compatible_version_drv=[23.0.0,23.0.0.],[24.0,24.0.],[24.1,24.1.],[25.0,25.0.],[25.2,25.2.]",
        "",
    ])


def toolkit_install_info(arch: str, version: str = CANN_VERSION) -> str:
    return "\n".join([
        "package_name=Ascend-cann-toolkit",
        f"version={version}",
        "innerversion=V100R001C25SPC001B201",
        "compatible_version=[V100R001C15],[V100R001C18],[V100R001C19],[V100R001C20],[V100R001C21],[V100R001C23]",
        f"arch={arch}",
        "os=linux",
        f"path=/usr/local/Ascend/ascend-toolkit/{version}/{arch}-linux",
        "",
    ])


ASCEND_INSTALL_INFO = "\n".join([
    "UserName=HwHiAiUser",
    "UserGroup=HwHiAiUser",
    "Driver_Install_Type=full",
    "Driver_Install_Path_Param=/usr/local/Ascend",
    "Driver_Install_For_All=yes",
    "Driver_Install_Mode=normal",
    "Firmware_Install_Type=full",
    "Firmware_Install_Path_Param=/usr/local/Ascend",
    "",
])


def hccn_conf(device_ips: list[str]) -> str:
    """/etc/hccn.conf: key_<phyid>=value lines, as hccn_tool persists them."""
    lines = []
    for d, ip in enumerate(device_ips):
        gw = gateway_for(ip)
        lines += [f"address_{d}={ip}", f"netmask_{d}={DEVICE_NETMASK}", f"netdetect_{d}={gw}",
                  f"gateway_{d}={gw}", f"send_arp_status_{d}=1", f"tls_enable_{d}=0"]
    return "\n".join(lines) + "\n"


def etc_hosts(hosts: list[HostSpec], controller_ip: str | None) -> str:
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost"]
    if controller_ip:
        lines.append(f"{controller_ip}\tcontroller")
    lines += [f"{h.ip}\t{h.name}" for h in hosts]
    return "\n".join(lines) + "\n"
