#!/usr/bin/python3 -IS
"""Test double of Huawei `npu-smi`: reads the sandbox host state in $KIMI_SIM_DIR (stdlib only).

A real npu-smi is a native binary; this one is a Python start-up. `npu-smi info` (what preflight and status
call on every host) is answered first from `$KIMI_SIM_DIR/fast/npu-smi` when it can be: a file the sandbox
renders with this module's own `info_table` (`write_fast_state`, called next to hccn_tool's), holding the exact
host.json/faults.json bytes it was rendered from. It is used only while both files still hold those bytes and
no NPU is claimed (claims change the table), and before `json` (and the `re` it pulls in) is even imported.
"""

import os
import sys

SIM_DIR_DEFAULT = "/var/lib/kimi-sim"
FAST_FILE = "npu-smi"        # in $KIMI_SIM_DIR/fast
FAST_VERSION = b"1"
WIDE = "+" + "-" * 96 + "+"
THIN = "+" + "-" * 27 + "+" + "-" * 15 + "+" + "-" * 52 + "+"
THICK = "+" + "=" * 27 + "+" + "=" * 15 + "+" + "=" * 52 + "+"
IDLE_HBM_MB = 3318
ENGINE_HBM_FRACTION = 0.9   # what vLLM's default gpu_memory_utilization takes


class UsageError(Exception):
    """A bad command line or NPU id: printed, exit code 255 like the real tool's parameter errors."""


def sim_dir():
    return os.environ.get("KIMI_SIM_DIR") or SIM_DIR_DEFAULT


def load_json(name, default):
    import json

    try:
        with open(os.path.join(sim_dir(), name)) as f:
            return json.load(f)
    except FileNotFoundError:
        return default
    except ValueError:
        return default


def load_host():
    host = load_json("host.json", None)
    if host is None:
        raise SystemExit(f"npu-smi: dcmi model initialized failed, because the device is used. ret is -8020 "
                         f"(no simulator state in {sim_dir()}/host.json)")
    return host


def pid_alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def live_claims(host):
    """{logical npu id: pid} for claims whose process still runs; stale claims are ignored."""
    out = {}
    cdir = os.path.join(sim_dir(), "claims")
    for npu in range(host["npus"]):
        try:
            with open(os.path.join(cdir, f"npu{npu}")) as f:
                pid = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if pid_alive(pid):
            out[npu] = pid
    return out


def proc_name(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() or "python3"
    except OSError:
        return "python3"


def driver_version(host):
    """Software Version: what the installed driver's version.info says (driver-mismatch rewrites it)."""
    path = os.path.join(host.get("ascend_root", "/usr/local/Ascend"), "driver", "version.info")
    vals = {}
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.strip().partition("=")
                vals[k] = v
    except OSError:
        pass
    return vals.get("package_version") or vals.get("Version") or host.get("driver_version", "")


def health(host, faults, npu):
    return "Critical" if npu in faults.get("npu_unhealthy", []) else "OK"


def hbm_used(host, claims, npu):
    if npu in claims:
        return int(host["hbm_mb"] * ENGINE_HBM_FRACTION)
    return IDLE_HBM_MB + (npu * 37) % 120


def cell(text, width):
    return f" {text}".ljust(width)


def usage_pair(used, total):
    return f"{used:<5}/ {total}"


def row(a, b, c):
    return "|" + cell(a, 27) + "|" + cell(b, 15) + "|" + cell(c, 52) + "|"


def wide_row(text):
    return "|" + cell(text, 96) + "|"


def info_table(host, faults, claims=None):
    a3 = host["chips_per_npu"] > 1
    claims = live_claims(host) if claims is None else claims
    ver = host.get("npu_smi_version", "25.2.1")
    out = [WIDE, wide_row(f"npu-smi {ver}".ljust(33) + f"Version: {ver}"), THIN,
           row("NPU   Name", "Health", "Power(W)    Temp(C)           Hugepages-Usage(page)"),
           row("Chip  Phy-ID" if a3 else "Chip", "Bus-Id", "AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)"),
           THICK]
    per = host["chips_per_npu"]
    for card in range(host["npus"] // per):
        for chip in range(per):
            npu = card * per + chip
            busy = npu in claims
            power = "-" if chip > 0 else f"{(178.7 if a3 else 101.8) + (40.0 if busy else 0.0) + card * 1.3:.1f}"
            temp = 36 + (card + chip) % 5 + (8 if busy else 0)
            line3 = f"{power:<12}{temp:<18}{usage_pair(0, 0)}"
            out.append(row(f"{card:<6}{host['chip_name']}", health(host, faults, npu), line3))
            first = f"{chip:<6}{npu}" if a3 else f"{chip}"
            aicore = 35 if busy else 0
            line4 = f"{aicore:<12}{usage_pair(0, 0):<18}{usage_pair(hbm_used(host, claims, npu), host['hbm_mb'])}"
            out.append(row(first, host["bus_ids"][npu], line4))
            out.append(THICK if chip == per - 1 else WIDE)
    out += [THIN, row("NPU     Chip", "Process id", "Process name             | Process memory(MB)"), THICK]
    for card in range(host["npus"] // per):
        rows = []
        for chip in range(per):
            npu = card * per + chip
            if npu in claims:
                pid = claims[npu]
                rows.append(row(f"{card:<8}{chip}", str(pid),
                                f"{proc_name(pid):<25}| {hbm_used(host, claims, npu)}"))
        out += rows or [wide_row(f"No running processes found in NPU {card}")]
        out.append(THICK)
    return "\n".join(out)


def kv(key, value):
    return f"\t{key:<31}: {value}"


def info_list(host):
    per = host["chips_per_npu"]
    out = [kv("Total Count", host["npus"] // per), ""]
    for card in range(host["npus"] // per):
        out += [kv("NPU ID", card), kv("Product Name", host["product_name"]),
                kv("Serial Number", f"SIM{host.get('host_index', 0):04d}{card:04d}"), kv("Chip Count", per), ""]
    return "\n".join(out)


def info_map(host):
    per = host["chips_per_npu"]
    a3 = per > 1
    cols = ["NPU ID", "Chip ID", "Chip Logic ID"] + (["Chip Phy-ID"] if a3 else []) + ["Chip Name"]
    out = ["\t" + "".join(f"{c:<31}" for c in cols).rstrip()]
    name = "Ascend" if a3 else f"Ascend {host['chip_name']}"
    for card in range(host["npus"] // per):
        for chip in range(per):
            npu = card * per + chip
            vals = [card, chip, npu] + ([npu] if a3 else []) + [name]
            out.append("\t" + "".join(f"{v!s:<31}" for v in vals).rstrip())
        mcu = [card, per, "-"] + (["-"] if a3 else []) + ["Mcu"]
        out.append("\t" + "".join(f"{v!s:<31}" for v in mcu).rstrip())
    return "\n".join(out)


def check_card(host, card, chip):
    per = host["chips_per_npu"]
    cards = host["npus"] // per
    if card is None:
        raise UsageError("Usage: npu-smi info -t <type> -i <id> [-c <chip_id>]")
    if not 0 <= card < cards:
        raise UsageError(f"The card id {card} is invalid. Please check it by 'npu-smi info -l'.")
    if chip is not None and not 0 <= chip < per:
        raise UsageError(f"The chip id {chip} is invalid. Please check it by 'npu-smi info -m'.")


def board(host, card, chip):
    a3 = host["chips_per_npu"] > 1
    if chip is not None:
        out = [kv("NPU ID", card)]
        if a3:
            out += [kv("NPU Name", host["npu_name"]), kv("Chip ID", chip), kv("Chip Name", host["chip_name"])]
        else:
            out += [kv("Chip ID", chip), kv("Chip Type", "Ascend"), kv("Chip Name", host["chip_name"])]
        return "\n".join([*out, kv("Chip Version", "V1")])
    npu = card * host["chips_per_npu"]
    return "\n".join([
        kv("NPU ID", card), kv("Product Name", host["product_name"]), kv("Model", "NA"),
        kv("Manufacturer", "Huawei"), kv("Serial Number", f"SIM{host.get('host_index', 0):04d}{card:04d}"),
        kv("Software Version", driver_version(host)), kv("Firmware Version", host.get("firmware_version", "")),
        kv("Compatibility", "OK"), kv("Board ID", "0x65"), kv("PCB ID", "A"), kv("BOM ID", "1"),
        kv("PCIe Bus Info", host["bus_ids"][npu]), kv("Slot ID", card), kv("Class ID", "NA"),
        kv("PCI Vendor ID", "0x19E5"), kv("PCI Device ID", host["pci_device_id"]),
        kv("Subsystem Vendor ID", "0x0200"), kv("Subsystem Device ID", "0x0100"),
        kv("Chip Count", host["chips_per_npu"])])


def logical(host, card, chip):
    return card * host["chips_per_npu"] + (chip or 0)


def detail(host, faults, kind, card, chip):
    if kind == "board":
        return board(host, card, chip)
    npu = logical(host, card, chip)
    if kind == "memory":
        used = hbm_used(host, live_claims(host), npu)
        return "\n".join([kv("HBM Capacity(MB)", host["hbm_mb"]), kv("HBM Clock Speed(MHz)", 1600),
                          kv("HBM Temperature(C)", 38), kv("HBM Bandwidth Util(%)", 0),
                          kv("HBM Usage Rate(%)", used * 100 // host["hbm_mb"])])
    if kind == "health":
        bad = health(host, faults, npu) != "OK"
        return "\n".join([kv("Health Status", health(host, faults, npu)),
                          kv("Error Code", "80E01801" if bad else "NA"),
                          kv("Error Information", "node type=HBMC, sensor type=Memory, event state=uncorrectable "
                                                  "ECC error" if bad else "NA")])
    if kind == "spod-info":
        if host["chips_per_npu"] < 2:
            raise UsageError("This device does not support querying spod-info.")
        return "\n".join([kv("SDID", (host.get("host_index", 1) - 1) * host["npus"] + npu),
                          kv("Super Pod Size", 1), kv("Super Pod ID", 0),
                          kv("Server Index", host.get("host_index", 1) - 1), kv("Chip ID", card),
                          kv("Die ID", chip or 0)])
    if kind == "common":
        busy = npu in live_claims(host)
        return "\n".join([kv("NPU ID", card), kv("Chip ID", chip or 0), kv("Memory Usage Rate(%)", 3),
                          kv("HBM Usage Rate(%)", 90 if busy else 5), kv("Aicore Usage Rate(%)", 35 if busy else 0),
                          kv("Temperature", 40), kv("Health Status", health(host, faults, npu))])
    if kind == "power":
        return kv("NPU Real-time Power(W)", f"{101.8 + card:.1f}")
    if kind == "temp":
        return kv("NPU Temperature (C)", 40)
    raise UsageError(f"Usage error: the type '{kind}' is not supported.")


def topo(host):
    """NPU-to-NPU link matrix: every die pair is joined by HCCS on both A2 and A3."""
    n = host["npus"]
    width = 11
    out = [" " * width + "".join(f"{'NPU' + str(j):<{width}}" for j in range(n)) + "CPU Affinity"]
    for i in range(n):
        cells = "".join(f"{'X' if i == j else 'HCCS':<{width}}" for j in range(n))
        lo = (i // 2) * 24 % 192
        out.append(f"{'NPU' + str(i):<{width}}{cells}{lo}-{lo + 23}")
    out += ["", "Legend:", "", "  X    = Self",
            "  SYS  = Path traversing PCIe and NUMA nodes. Nodes are connected through SMP, such as QPI, UPI.",
            "  PHB  = Path traversing PCIe and the PCIe host bridge of a CPU.",
            "  PIX  = Path traversing a single PCIe switch",
            "  PXB  = Path traversing multipul PCIe switches",
            "  HCCS = Connection traversing HCCS.",
            "  NA   = Unknown relationship."]
    return "\n".join(out)


def parse_opts(args):
    opts = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-t", "-i", "-c") and i + 1 < len(args):
            opts[a] = args[i + 1]
            i += 2
        elif a in ("-l", "-m"):
            opts[a] = True
            i += 1
        else:
            raise UsageError(f"Usage error: unknown option '{a}'.")
    for k in ("-i", "-c"):
        if k in opts:
            if not str(opts[k]).isdigit():
                raise UsageError(f"Usage error: the value of '{k}' must be a number.")
            opts[k] = int(opts[k])
    return opts


def _read_raw(path):
    """A file's bytes; b"" when it is missing (which the double reads as absent, like an empty file)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


def fast_state(host_raw, faults_raw):
    """The fast/npu-smi bytes for these host.json/faults.json bytes, or None when `info` cannot be pre-rendered.

    NUL-terminated records: `v`, `host` and `faults` (the exact bytes), `info` (the stdout of `npu-smi info`
    with no NPU claimed), and last `end`."""
    if b"\0" in host_raw + faults_raw or not (host_raw.isascii() and faults_raw.isascii()):
        return None
    import json

    try:
        host = json.loads(host_raw.decode())
        faults = json.loads(faults_raw.decode()) if faults_raw.strip() else {}
        text = info_table(host, faults, claims={}) + "\n"
    except Exception:   # anything odd: no fast answer, the double decides every call
        return None
    if not text.isascii() or "\0" in text:
        return None
    recs = [(b"v", FAST_VERSION), (b"host", host_raw), (b"faults", faults_raw), (b"info", text.encode()),
            (b"end", b"1")]
    return b"".join(k + b"=" + v + b"\0" for k, v in recs)


def write_fast_state(sim):
    """Render `sim`/fast/npu-smi from the host.json and faults.json now in sim (replaced atomically; removed when
    nothing can be pre-rendered)."""
    sim = str(sim)
    data = fast_state(_read_raw(os.path.join(sim, "host.json")), _read_raw(os.path.join(sim, "faults.json")))
    fast = os.path.join(sim, "fast")
    path = os.path.join(fast, FAST_FILE)
    if data is None:
        if os.path.exists(path):
            os.unlink(path)
        return
    os.makedirs(fast, exist_ok=True)
    tmp = os.path.join(fast, f".{FAST_FILE}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def fast_info():
    """The pre-rendered `npu-smi info` stdout, or None when it may not be what the double would print now."""
    sim = sim_dir()
    try:
        with open(os.path.join(sim, "fast", FAST_FILE), "rb") as f:
            recs = f.read().split(b"\0")
        if os.listdir(os.path.join(sim, "claims")):
            return None   # claimed NPUs show in the table
    except OSError:
        return None
    # v, host, faults, info, end, and the empty tail after the last NUL
    if len(recs) != 6 or recs[5] or recs[4] != b"end=1" or recs[0] != b"v=" + FAST_VERSION:
        return None
    if recs[1] != b"host=" + _read_raw(os.path.join(sim, "host.json")) or not recs[1][5:]:
        return None
    if recs[2] != b"faults=" + _read_raw(os.path.join(sim, "faults.json")):
        return None
    return recs[3][5:].decode() if recs[3].startswith(b"info=") else None


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    if args == ["info"]:
        text = fast_info()
        if text is not None:
            sys.stdout.write(text)
            return 0
    try:
        if not args or args[0] != "info":
            raise UsageError("Usage: npu-smi info [-l | -m | -t <type> -i <id> [-c <chip_id>]]")
        opts = parse_opts(args[1:])
        host = load_host()
        faults = load_json("faults.json", {})
        if opts.get("-l"):
            print(info_list(host))
        elif opts.get("-m"):
            print(info_map(host))
        elif opts.get("-t") == "topo":
            print(topo(host))
        elif "-t" in opts:
            check_card(host, opts.get("-i"), opts.get("-c"))
            print(detail(host, faults, opts["-t"], opts["-i"], opts.get("-c")))
        else:
            print(info_table(host, faults))
    except UsageError as exc:
        print(str(exc))
        return 255
    return 0


if __name__ == "__main__":
    sys.exit(main())
