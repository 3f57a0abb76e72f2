#!/usr/bin/python3 -IS
"""Test double of Huawei `hccn_tool`: per-NPU device NIC queries and a real ping between device IPs."""

import json
import os
import re
import sys

SIM_DIR_DEFAULT = "/var/lib/kimi-sim"
PING_REPLY = re.compile(r"icmp_seq=(\d+).*time=([0-9.]+) ms")


class ToolError(Exception):
    """Printed as the real tool would and exits non-zero."""


def sim_dir():
    return os.environ.get("KIMI_SIM_DIR") or SIM_DIR_DEFAULT


def load_json(name, default):
    try:
        with open(os.path.join(sim_dir(), name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def gateway(ip):
    a, b = ip.split(".")[:2]
    return f"{a}.{b}.0.1"


def in_subnet(ip, cidr):
    net, _, bits = cidr.partition("/")
    bits = int(bits or 32)
    to_int = lambda s: int.from_bytes(bytes(int(p) for p in s.split(".")), "big")  # noqa: E731
    mask = (0xFFFFFFFF << (32 - bits)) & 0xFFFFFFFF
    try:
        return to_int(ip) & mask == to_int(net) & mask
    except ValueError:
        return False


def run_ping(src, dst, count=3):
    """[(seq, ms)] of the replies that came back, from the real network (ping -I src)."""
    try:
        import subprocess  # only pings need it; every other call stays cheap (probes run it 64 times a host)

        proc = subprocess.run(["ping", "-n", "-c", str(count), "-i", "0.2", "-w", "2", "-W", "1", "-I", src, dst],
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [(int(m.group(1)) - 1, float(m.group(2))) for m in PING_REPLY.finditer(proc.stdout)]


def ping(host, faults, dev, dst):
    count = 3
    print(f"device {dev} PING {dst}")
    src = host["device_ips"][dev]
    # link-down and loopback-mode cut routes are decided here; in netns mode the kernel decides the rest
    blocked = dev in faults.get("link_down", []) or any(in_subnet(dst, c) for c in faults.get("cut_routes", []))
    replies = [] if blocked else run_ping(src, dst, count)
    for seq, ms in replies:
        print(f"recv seq={seq},time={ms:.6f}ms")
    got = len(replies)
    loss = 100.0 * (count - got) / count
    print(f"{count} packets transmitted, {got} received, {loss:.2f}% packet loss")
    if got == 0:
        raise ToolError("")


def lldp(host, dev):
    idx = host.get("host_index", 1)
    return "\n".join([
        "Chassis ID TLV", f"\tMAC: 38:7a:cc:{idx:02x}:00:01",
        "Port ID TLV", f"\tIfname: 200GE1/0/{idx * 16 + dev}",
        "Time to Live TLV", "\t121",
        "Port Description TLV", f"\tto-{host['hostname']}-npu{dev}",
        "System Name TLV", "\tsandbox-leaf-01",
        "System Description TLV", "\tHuawei Versatile Routing Platform Software",
        "\tVRP (R) software, Version 8.210 (CE9860 V200R021C10SPC600)",
        "System Capabilities TLV", "\tEnabled capabilities: Bridge, Router",
        "Management Address TLV", "\tIPv4: 10.0.0.254",
        "End of LLDPDU TLV",
    ])


def parse(args):
    if len(args) < 3 or args[0] != "-i":
        raise ToolError("Usage: hccn_tool -i <device_id> -<command> -g [options]")
    if not args[1].isdigit():
        raise ToolError(f"Invalid device id [{args[1]}], please input a number.")
    return int(args[1]), args[2], args[3:]


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    try:
        dev, cmd, rest = parse(args)
        host = load_json("host.json", None)
        if host is None:
            raise ToolError(f"hccn_tool: dsmi init failed (no simulator state in {sim_dir()}/host.json)")
        faults = load_json("faults.json", {})
        if not 0 <= dev < host["npus"]:
            raise ToolError(f"logic id [{dev}] is invalid, the device id should be in [0, {host['npus'] - 1}].")
        if "-g" not in rest:
            raise ToolError(f"Only get (-g) is supported by this simulated hccn_tool for {cmd}.")
        ip = host["device_ips"][dev]
        down = dev in faults.get("link_down", [])
        a3 = host.get("chips_per_npu", 1) > 1
        if cmd == "-ip":
            print(f"ipaddr:{ip}\nnetmask:{host.get('device_netmask', '255.255.0.0')}")
        elif cmd == "-link":
            print(f"link status: {'DOWN' if down else 'UP'}")
        elif cmd == "-net_health":
            print(f"net health status: {'Fault' if down else 'Success'}")
        elif cmd == "-lldp":
            if down:
                raise ToolError("lldp info is not available, the link is down.")
            print(lldp(host, dev))
        elif cmd == "-tls":
            print(f"dev_id:{dev}, tls switch[0](0:disable, 1:enable), tls preconfigured[1](0:non-preset, 1:preset), "
                  "tls alarm time threshold[60]days")
        elif cmd == "-netdetect":
            print(f"netdetect address: {gateway(ip)}")
        elif cmd == "-gateway":
            print(f"default gateway:{gateway(ip)}, Iface:eth{dev}")
        elif cmd == "-status":
            print(f"Settings for eth{dev}:\n\tLink detected: {'no' if down else 'yes'}")
        elif cmd == "-speed":
            print("speed: 200000 Mb/s" if not down else "speed: Unknown")
        elif cmd == "-vnic" and a3:
            print(f"vnic ipaddr:{ip}\nvnic netmask:{host.get('device_netmask', '255.255.0.0')}")
        elif cmd in ("-ping", "-hccs_ping") and not (cmd == "-hccs_ping" and not a3):
            if "address" not in rest or rest.index("address") + 1 >= len(rest):
                raise ToolError(f"Usage: hccn_tool -i <device_id> {cmd} -g address <ip>")
            ping(host, faults, dev, rest[rest.index("address") + 1])
        else:
            raise ToolError(f"Unsupported command [{cmd}] on this device ({host.get('chip_name', '')}).")
    except ToolError as exc:
        if str(exc):
            print(str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
