#!/usr/bin/python3 -IS
"""Test double of Huawei `hccn_tool`: per-NPU device NIC queries and a real ping between device IPs.

This module is the authority on every answer. On the fake hosts `hccn_tool` is a small bash front
(`hccn_tool_front.sh`) that answers the queries `kimictl preflight` makes from `$KIMI_SIM_DIR/fast/npu<N>`,
files this module renders (`write_fast_state`) with its own `run`, and execs this script for everything
else, or whenever a fast file does not embed the current host.json and faults.json byte for byte.
"""

import json
import os
import re
import sys

SIM_DIR_DEFAULT = "/var/lib/kimi-sim"
PING_REPLY = re.compile(r"icmp_seq=(\d+).*time=([0-9.]+) ms")
# fast state (see write_fast_state): queries answered from a file, ping commands the front runs itself
FAST_DIR = "fast"
FAST_VERSION = "2"
FAST_QUERIES = ("-ip", "-vnic", "-link", "-net_health", "-tls", "-netdetect", "-gateway", "-status", "-speed",
                "-lldp")
FAST_PINGS = ("-ping", "-hccs_ping")
STRICT_CIDR = re.compile(r"([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})(?:/([0-9]{1,2}))?")


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
        import subprocess  # only pings need it

        proc = subprocess.run(["ping", "-n", "-c", str(count), "-i", "0.2", "-w", "2", "-W", "1", "-I", src, dst],
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [(int(m.group(1)) - 1, float(m.group(2))) for m in PING_REPLY.finditer(proc.stdout)]


def ping_source(host, faults, dev):
    """(source device IP, whether link-down blocks every ping from dev)."""
    return host["device_ips"][dev], dev in faults.get("link_down", [])


def ping(host, faults, dev, dst, out=None):
    count = 3
    print(f"device {dev} PING {dst}", file=out)
    src, down = ping_source(host, faults, dev)
    # link-down and loopback-mode cut routes are decided here; in netns mode the kernel decides the rest
    blocked = down or any(in_subnet(dst, c) for c in faults.get("cut_routes", []))
    replies = [] if blocked else run_ping(src, dst, count)
    for seq, ms in replies:
        print(f"recv seq={seq},time={ms:.6f}ms", file=out)
    got = len(replies)
    loss = 100.0 * (count - got) / count
    print(f"{count} packets transmitted, {got} received, {loss:.2f}% packet loss", file=out)
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


def answer(args, host, faults, out=None, do_ping=ping):
    """Print what `hccn_tool ARGS` prints to out (default stdout); raise ToolError for a failing call."""
    dev, cmd, rest = parse(args)
    if host is None:
        raise ToolError(f"hccn_tool: dsmi init failed (no simulator state in {sim_dir()}/host.json)")
    if not 0 <= dev < host["npus"]:
        raise ToolError(f"logic id [{dev}] is invalid, the device id should be in [0, {host['npus'] - 1}].")
    if "-g" not in rest:
        raise ToolError(f"Only get (-g) is supported by this simulated hccn_tool for {cmd}.")
    ip = host["device_ips"][dev]
    down = dev in faults.get("link_down", [])
    a3 = host.get("chips_per_npu", 1) > 1
    if cmd == "-ip":
        print(f"ipaddr:{ip}\nnetmask:{host.get('device_netmask', '255.255.0.0')}", file=out)
    elif cmd == "-link":
        print(f"link status: {'DOWN' if down else 'UP'}", file=out)
    elif cmd == "-net_health":
        print(f"net health status: {'Fault' if down else 'Success'}", file=out)
    elif cmd == "-lldp":
        if down:
            raise ToolError("lldp info is not available, the link is down.")
        print(lldp(host, dev), file=out)
    elif cmd == "-tls":
        print(f"dev_id:{dev}, tls switch[0](0:disable, 1:enable), tls preconfigured[1](0:non-preset, 1:preset), "
              "tls alarm time threshold[60]days", file=out)
    elif cmd == "-netdetect":
        print(f"netdetect address: {gateway(ip)}", file=out)
    elif cmd == "-gateway":
        print(f"default gateway:{gateway(ip)}, Iface:eth{dev}", file=out)
    elif cmd == "-status":
        print(f"Settings for eth{dev}:\n\tLink detected: {'no' if down else 'yes'}", file=out)
    elif cmd == "-speed":
        print("speed: 200000 Mb/s" if not down else "speed: Unknown", file=out)
    elif cmd == "-vnic" and a3:
        print(f"vnic ipaddr:{ip}\nvnic netmask:{host.get('device_netmask', '255.255.0.0')}", file=out)
    elif cmd in FAST_PINGS and not (cmd == "-hccs_ping" and not a3):
        if "address" not in rest or rest.index("address") + 1 >= len(rest):
            raise ToolError(f"Usage: hccn_tool -i <device_id> {cmd} -g address <ip>")
        do_ping(host, faults, dev, rest[rest.index("address") + 1], out)
    else:
        raise ToolError(f"Unsupported command [{cmd}] on this device ({host.get('chip_name', '')}).")


def run(args, host, faults, out=None, do_ping=ping):
    """Exit code of `hccn_tool ARGS`; its stdout goes to out."""
    try:
        answer(args, host, faults, out, do_ping)
    except ToolError as exc:
        if str(exc):
            print(str(exc), file=out)
        return 1
    return 0


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    return run(args, load_json("host.json", None), load_json("faults.json", {}))


# ---- fast state for the bash front ----------------------------------------------------------------
class _PingReached(Exception):
    """The probe in fast_state: `answer` would ping for this command."""


def _probe_ping(host, faults, dev, dst, out):
    raise _PingReached


def _parse_json(raw, default):
    """What load_json returns for a file holding raw bytes (b"" for a missing file)."""
    try:
        return json.loads(raw.decode("ascii")) if raw else default
    except ValueError:   # UnicodeDecodeError is a ValueError
        return default


def cut_pairs(cidrs):
    """cut_routes as (network & mask, mask) integer pairs, or None unless every entry is a plain a.b.c.d[/n]."""
    if not isinstance(cidrs, list):
        return None
    pairs = []
    for c in cidrs:
        m = STRICT_CIDR.fullmatch(c) if isinstance(c, str) and c.isascii() else None
        if m is None or any(int(o) > 255 for o in m.groups()[:4]) or int(m.group(5) or 32) > 32:
            return None
        net = int.from_bytes(bytes(int(o) for o in m.groups()[:4]), "big")
        mask = (0xFFFFFFFF << (32 - int(m.group(5) or 32))) & 0xFFFFFFFF
        pairs.append((net & mask, mask))
    return pairs


def fast_state(host_raw, faults_raw):
    """{npu: file bytes} for the bash front, rendered by `run` itself from these host.json/faults.json bytes.

    A file is NUL-terminated `key=value` records: `v` (format), `host` and `faults` (the exact bytes the
    answers were rendered from: the front uses the file only while both files still hold them), `q<cmd>`
    (`<exit code>:<stdout>` of `hccn_tool -i N <cmd> -g`), and, when the front may run pings itself,
    `p<cmd>` for each ping command that reaches `ping`, `src`, `down` (1: link-down) and `cut`
    (`net mask` integer pairs of cut_routes), and last `end`. Queries whose answer cannot be rendered exactly are
    left out.
    """
    if not (host_raw.isascii() and faults_raw.isascii()) or b"\0" in host_raw + faults_raw:
        return {}   # the double reads text in the locale's encoding, the front compares bytes: keep to ASCII
    host, faults = _parse_json(host_raw, None), _parse_json(faults_raw, {})
    try:
        npus = range(host["npus"])
    except Exception:   # anything odd: no fast state, every call goes to the Python double
        return {}
    files = {}
    for dev in npus:
        recs = [("v", FAST_VERSION.encode()), ("host", host_raw), ("faults", faults_raw)]
        for cmd in FAST_QUERIES:
            buf = _Buffer()
            try:
                rc = run(["-i", str(dev), cmd, "-g"], host, faults, buf, _probe_ping)
            except Exception:   # e.g. a KeyError traceback: leave it to the Python double
                continue
            if buf.text.isascii() and "\0" not in buf.text:
                recs.append(("q" + cmd, f"{rc}:{buf.text}".encode()))
        pings = []
        for cmd in FAST_PINGS:
            try:
                answer(["-i", str(dev), cmd, "-g", "address", "0.0.0.0"], host, faults, _Buffer(), _probe_ping)
            except _PingReached:
                pings.append(cmd)
            except Exception:   # not a ping on this device: the Python double answers
                pass
        try:
            src, down = ping_source(host, faults, dev)
            cut = cut_pairs(faults.get("cut_routes", []))
        except Exception:   # no ping answers from the front
            src, cut = None, None
        if pings and cut is not None and isinstance(src, str) and re.fullmatch(r"[0-9A-Za-z.:_-]+", src):
            recs += [("p" + cmd, b"1") for cmd in pings]
            recs += [("src", src.encode()), ("down", b"1" if down else b"0"),
                     ("cut", " ".join(f"{n} {m}" for n, m in cut).encode())]
        recs.append(("end", b"1"))   # last: the front uses only a file that is complete
        files[dev] = b"".join(k.encode() + b"=" + v + b"\0" for k, v in recs)
    return files


class _Buffer:
    """A minimal text sink for print(file=...)."""

    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s
        return len(s)

    def flush(self):
        pass


def _read_raw(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def write_fast_state(sim):
    """Render `sim`/fast/npu<N> from the host.json and faults.json now in sim (each file replaced atomically)."""
    sim = str(sim)
    files = fast_state(_read_raw(os.path.join(sim, "host.json")), _read_raw(os.path.join(sim, "faults.json")))
    fast = os.path.join(sim, FAST_DIR)
    os.makedirs(fast, exist_ok=True)
    for dev, data in files.items():
        path = os.path.join(fast, f"npu{dev}")
        tmp = os.path.join(fast, f".npu{dev}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    for name in os.listdir(fast):
        if name.startswith("npu") and name[3:].isdigit() and int(name[3:]) not in files:
            os.unlink(os.path.join(fast, name))
    _npu_smi().write_fast_state(sim)   # the same moment is right for npu-smi's pre-rendered `info`


def _npu_smi():
    """The npu-smi double next to this file (the sandbox calls write_fast_state from kimictl, not on hosts)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "npu_smi.py")
    spec = importlib.util.spec_from_file_location("_kimictl_npu_smi_double", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def front_script(python_double):
    """The bash front installed as `hccn_tool`; it execs python_double (an absolute path) for the rare paths."""
    import shlex

    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "hccn_tool_front.sh")) as f:
        body = f.read()
    return body.replace("py=@HCCN_TOOL_PY@", "py=" + shlex.quote(str(python_double)), 1)


if __name__ == "__main__":
    sys.exit(main())
