"""The fault SPEC language of `kimictl sandbox up --fault` / `sandbox fault`, parsed into typed faults."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kimictl.errors import InvalidInput

ROLES = ("prefill", "decode", "colocated", "*")
DEFAULT_DRIVER_MISMATCH = "23.0.rc3"
DEFAULT_SMALL_DISK = "2G"

_SIZE = re.compile(r"[1-9][0-9]*[KMGkmg]?")
_RATE = re.compile(r"[1-9][0-9]*(bit|kbit|mbit|gbit)")
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.\-]{0,40}")

# kind -> (argument names after the host, how many of them are required)
KINDS: dict[str, tuple[tuple[str, ...], int]] = {
    "npu-unhealthy": (("npu",), 1),
    "link-down": (("npu",), 1),
    "driver-mismatch": (("version",), 0),
    "small-disk": (("size",), 0),
    "host-down": ((), 0),
    "slow-link": (("rate",), 1),
    "cut-route": (("peer",), 1),
    "engine-crash": (("role",), 0),
    "engine-hang": (("role",), 0),
    "engine-hang-now": (("role",), 0),
    "port-taken": (("port",), 1),
    "kv-pressure": (("tokens",), 0),
    "clear": ((), 0),
}
DEFAULT_KV_PRESSURE_TOKENS = 4
_NUMBER_KINDS = ("npu-unhealthy", "link-down", "port-taken", "kv-pressure")  # their argument is an int

USAGE = ("npu-unhealthy:HOST:NPU, link-down:HOST:NPU, driver-mismatch:HOST[:VERSION], small-disk:HOST[:SIZE], "
         "host-down:HOST, slow-link:HOST:RATE, cut-route:HOST:HOST, engine-crash:HOST[:ROLE], "
         "engine-hang:HOST[:ROLE], engine-hang-now:HOST[:ROLE], port-taken:HOST:PORT, kv-pressure:HOST[:TOKENS], "
         "clear:HOST|all")


@dataclass(frozen=True)
class Fault:
    """One parsed fault: kind, target host ("all" only for clear) and its argument."""

    kind: str
    host: str
    arg: str | int | None = None

    @property
    def spec(self) -> str:
        return f"{self.kind}:{self.host}" + ("" if self.arg is None else f":{self.arg}")


def _bad(spec: str, part: str, why: str) -> InvalidInput:
    return InvalidInput(f"bad fault spec '{spec}': {why} ('{part}')", hint=f"fault specs: {USAGE}")


def parse_fault(spec: str, hosts: list[str] | None = None, npus: int | None = None) -> Fault:
    """Parse one SPEC; check host names and NPU ids when the sandbox shape is known.

    Raises:
        InvalidInput: naming the bad part of the spec.
    """
    kind, host, raw = _split(spec, hosts)
    if kind in _NUMBER_KINDS:
        return Fault(kind, host, _number(spec, kind, host, raw, npus))
    return Fault(kind, host, _word(spec, kind, host, raw, hosts))


def _split(spec: str, hosts: list[str] | None) -> tuple[str, str, str | None]:
    """KIND, HOST and the argument (None when not given) of a spec with a known kind, a known host and as many
    parts as its kind takes."""
    parts = spec.strip().split(":")
    kind = parts[0]
    if kind not in KINDS:
        raise _bad(spec, kind, f"unknown fault kind; expected one of {', '.join(KINDS)}")
    if len(parts) < 2 or not parts[1]:
        raise _bad(spec, spec, "missing host")
    host, args = parts[1], parts[2:]
    names, required = KINDS[kind]
    if len(args) < required:
        raise _bad(spec, spec, f"{kind} needs {':'.join(n.upper() for n in names)} after the host")
    if len(args) > len(names):
        raise _bad(spec, ":".join(args[len(names):]), f"too many parts for {kind}")
    if host == "all" and kind != "clear":
        raise _bad(spec, host, "'all' is only allowed with clear")
    if hosts is not None and host != "all" and host not in hosts:
        raise _bad(spec, host, f"no such sandbox host; hosts are {', '.join(hosts)}")
    return kind, host, args[0] if args else None


def _number(spec: str, kind: str, host: str, raw: str | None, npus: int | None) -> int:
    """The checked argument of a fault that takes a number (an NPU id, a port, a token count)."""
    if kind in ("npu-unhealthy", "link-down"):
        if not raw or not (raw.isascii() and raw.isdigit()):
            raise _bad(spec, raw or "", "NPU id must be a non-negative integer")
        arg = int(raw)
        if npus is not None and arg >= npus:
            raise _bad(spec, raw, f"NPU id out of range; {host} has NPUs 0..{npus - 1}")
        return arg
    if kind == "port-taken":
        if not raw or not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= 65535:
            raise _bad(spec, raw or "", "PORT must be an integer in 1..65535")
        return int(raw)
    raw = raw or str(DEFAULT_KV_PRESSURE_TOKENS)  # kv-pressure
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= 1_000_000:
        raise _bad(spec, raw, "TOKENS must be an integer in 1..1000000 (generated tokens before the recompute)")
    return int(raw)


def _word(spec: str, kind: str, host: str, raw: str | None, hosts: list[str] | None) -> str | None:
    """The checked argument (default filled in) of any other fault: a rate, a size, a version, a role, a peer."""
    arg = raw
    if kind == "slow-link":
        if not raw or not _RATE.fullmatch(raw):
            raise _bad(spec, raw or "", "RATE must look like 200mbit, 1gbit or 500kbit")
    elif kind == "small-disk":
        arg = raw or DEFAULT_SMALL_DISK
        if not _SIZE.fullmatch(str(arg)):
            raise _bad(spec, str(arg), "SIZE must look like 2G, 500M or 1048576")
    elif kind == "driver-mismatch":
        arg = raw or DEFAULT_DRIVER_MISMATCH
        if not _VERSION.fullmatch(str(arg)):
            raise _bad(spec, str(arg), "VERSION must look like 23.0.rc3")
    elif kind in ("engine-crash", "engine-hang", "engine-hang-now"):
        arg = raw or "*"
        if arg not in ROLES:
            raise _bad(spec, str(arg), f"ROLE must be one of {', '.join(ROLES)}")
    elif kind == "cut-route":
        if not raw:
            raise _bad(spec, "", "cut-route needs a second host")
        if raw == host:
            raise _bad(spec, raw, "cut-route needs two different hosts")
        if hosts is not None and raw not in hosts:
            raise _bad(spec, raw, f"no such sandbox host; hosts are {', '.join(hosts)}")
    return arg


def fault_hosts(spec: str) -> set[str]:
    """The hosts a fault spec touches (both ends of a cut-route)."""
    f = parse_fault(spec)
    return {f.host, str(f.arg)} if f.kind == "cut-route" else {f.host}


def apply_to_doc(doc: dict, fault: Fault, *, peer_subnet: str | None = None, since: float | None = None) -> dict:
    """Return faults.json content for fault.host after adding fault (pure; the doubles read these keys). `since`:
    when engine-hang-now was injected (engines started before it hang; a restarted one does not)."""
    out = {k: (list(v) if isinstance(v, list) else v) for k, v in doc.items()}

    def add(key: str, value: object) -> None:
        vals = out.setdefault(key, [])
        if value not in vals:
            vals.append(value)

    if fault.kind == "npu-unhealthy":
        add("npu_unhealthy", fault.arg)
    elif fault.kind == "link-down":
        add("link_down", fault.arg)
    elif fault.kind == "engine-crash":
        add("engine_crash_at_start", fault.arg)
    elif fault.kind == "engine-hang":
        add("engine_hang_in_load", fault.arg)
    elif fault.kind == "engine-hang-now":
        if since is None:
            raise ValueError("engine-hang-now needs the moment it was injected")
        out["engine_hang_since"] = {**(out.get("engine_hang_since") or {}), str(fault.arg): since}
    elif fault.kind == "cut-route":
        add("cut_routes", peer_subnet or fault.arg)
    elif fault.kind == "port-taken":
        add("port_taken", fault.arg)
    elif fault.kind == "driver-mismatch":
        out["driver_version"] = fault.arg
    elif fault.kind == "small-disk":
        out["small_disk"] = fault.arg
    elif fault.kind == "slow-link":
        out["slow_link"] = fault.arg
    elif fault.kind == "host-down":
        out["host_down"] = True
    elif fault.kind == "kv-pressure":
        out["kv_pressure_tokens"] = fault.arg
    return out
