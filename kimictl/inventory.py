"""Inventory: read an Ansible YAML inventory, merge group/host vars like Ansible, validate kimi_* keys."""

from __future__ import annotations

import ipaddress
import re
import shlex
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from kimictl.errors import InvalidInput, InventoryError, did_you_mean, reported
from kimictl.facts import hardware_catalogue, system_dirs
from kimictl.secret_file import ENV_KEY, ENV_KEY_RULE, read_secret_file
from kimictl.yamlsrc import LineMap, load_yaml, yaml_type_hint

# --- safe value shapes: nothing a shell or YAML could misread -------------------------------------------
# Every pattern is applied with fullmatch: `$` alone would also accept a trailing newline.

_HOSTNAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62})")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS = re.compile(rf"(?=.{{1,253}}\Z){_LABEL}(?:\.{_LABEL})*")
_NIC = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,14}")
_PATH = re.compile(r"/[A-Za-z0-9._/+@-]*")
_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,99}")
_CLUSTER = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_URL = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+(?::\d+)?(?:/[A-Za-z0-9._~/%+-]*)?")
_COMMAND = re.compile(r"[A-Za-z0-9._/+@-]+(?: [A-Za-z0-9._/+@=-]+)*")
# An image repository as docker spells it, without tag or digest: [registry[:port]/]path (lower-case components).
_REPO_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE_REPO = re.compile(rf"(?=.{{1,255}}\Z)(?:{_LABEL}(?:\.{_LABEL})*(?::\d{{1,5}})?/)?{_REPO_PART}(?:/{_REPO_PART})*")


def _matches(pattern: re.Pattern[str], what: str):
    def check(v: str) -> str:
        if not pattern.fullmatch(v):
            raise ValueError(f"{v!r} is not a valid {what}")
        return v

    return check


_PORT_IN = re.compile(r"^(?:https?://)?(?:\[[^\]]*\]|[^/:]*):([^/]*)(?:/|$)")


def _port_ok(v: str) -> str:
    """A URL's or registry's :port, when it has one, is a TCP port."""
    m = _PORT_IN.match(v)
    port = m.group(1) if m else ""
    if m and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"{v!r}: port {port if port.isdigit() else repr(port)} is not a TCP port (1-65535)")
    return v


def _no_dotdot(v: str) -> str:
    if ".." in v.split("/"):
        raise ValueError(f"{v!r} must not contain a '..' component")
    return v


_PATH_MAX, _NAME_MAX = 4096, 255   # Linux's limits (limits.h): a longer path fails every open() on the host


def _abs_path(v: str) -> str:
    if not v.startswith("/"):
        raise ValueError(f"{v!r} must be an absolute path")
    if not _PATH.fullmatch(v):
        raise ValueError(f"{v!r} has characters outside [A-Za-z0-9._/+@-]")
    parts = v.split("/")
    if ".." in parts or "." in parts:
        raise ValueError(f"{v!r} must not contain '.' or '..' components")
    if len(v) >= _PATH_MAX or any(len(p) > _NAME_MAX for p in parts):
        raise ValueError(f"{v[:60]!r}... is longer than Linux allows (a path under {_PATH_MAX} bytes, each name at "
                         f"most {_NAME_MAX})")
    return v.rstrip("/") or "/"


def _not_root(v: str) -> str:
    if v == "/":
        raise ValueError("'/' would let any request read any file on the host; use a dedicated directory")
    return v


def _not_system_dir(v: str) -> str:
    why = system_dirs().why_refused(v)
    if why:
        raise ValueError(f"{why}; give kimictl a directory of its own (e.g. /var/lib/kimi, /data/models/<name>)")
    return v


_IPV4_ONLY = ("kimictl supports IPv4 only (engine and proxy URLs, HCCL_IF_IP, the DP master address and peer "
              "transfers are built from it); give the host's IPv4 address")


def _one_host(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    """Refuse addresses that name no single host: 0.0.0.0 (every address of the control node), multicast and
    the broadcast address."""
    if ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
        kind = "the unspecified" if ip.is_unspecified else "a multicast" if ip.is_multicast else "the broadcast"
        raise ValueError(f"{str(ip)!r} is {kind} address, not one host's; give the host's own address")


def _address(v: str) -> str:
    try:
        ip = ipaddress.ip_address(v)
    except ValueError:
        if not _DNS.fullmatch(v):
            raise ValueError(f"{v!r} is neither an IP address nor a DNS name") from None
        if all(label.isdigit() for label in v.split(".")):   # 10.0.0.256, or 10.0.0.010 (ssh reads it as octal)
            raise ValueError(f"{v!r} is not a valid IPv4 address (each part 0-255, no leading zeros)") from None
        return v
    if ip.version == 6:
        raise ValueError(f"{v!r} is an IPv6 address; {_IPV4_ONLY} or a DNS name")
    _one_host(ip)
    return v


def _ipv4(why: str):
    def check(v: str) -> str:
        try:
            ip = ipaddress.ip_address(v)
        except ValueError:
            raise ValueError(f"{v!r} is not an IP address") from None
        if ip.version == 6:
            raise ValueError(f"{v!r} is an IPv6 address; {why}")
        _one_host(ip)
        return str(ip)

    return check


def _nic(v: str) -> str:
    """A Linux interface name (IFNAMSIZ: at most 15 characters, no '/', no blank, not '.' or '..'), not an address."""
    try:
        ipaddress.ip_address(v)
    except ValueError:
        pass
    else:
        raise ValueError(f"{v!r} is an IP address; give the name of the interface that carries it (e.g. eth0)")
    if not _NIC.fullmatch(v):   # starts with a letter or digit: never '.' or '..'; no '/', no blank
        raise ValueError(f"{v!r} is not a valid network interface name (at most 15 characters: letters, digits, "
                         "'.', '_', '-')")
    return v


def _hardware(v: str) -> str:
    known = hardware_catalogue()
    if v not in known:
        raise ValueError(f"'{v}' is not a known hardware; expected one of {', '.join(known)}{did_you_mean(v, known)}")
    return v


def _known_version(v: str) -> str:
    from kimictl.facts import version_profile

    try:
        version_profile(v)
    except InventoryError as exc:  # pragma: no cover - version_profile raises InvalidInput
        raise ValueError(exc.message) from None
    except Exception as exc:
        raise ValueError(str(getattr(exc, "message", exc)).removeprefix("kimi_vllm_ascend_version: ")) from None
    return v


def _command(v: str) -> str:
    if v.startswith("-"):
        raise ValueError(f"{v!r} starts with '-': an option, not the command to run (a path or a program name)")
    if not _COMMAND.fullmatch(v):
        raise ValueError(f"{v!r} must be a command path with optional plain arguments")
    return v


ClusterName = Annotated[str, AfterValidator(_matches(_CLUSTER, "cluster name ([a-z0-9][a-z0-9-]{0,62})"))]
AbsPath = Annotated[str, AfterValidator(_abs_path)]
KimiDir = Annotated[str, AfterValidator(_abs_path), AfterValidator(_not_system_dir)]  # state, model dirs on hosts
MediaDir = Annotated[str, AfterValidator(_abs_path), AfterValidator(_not_root), AfterValidator(_not_system_dir)]
ModelId = Annotated[str, AfterValidator(_matches(_MODEL_ID, "model id (owner/name)"))]
Revision = Annotated[str, AfterValidator(_matches(_REVISION, "revision")), AfterValidator(_no_dotdot)]
Url = Annotated[str, AfterValidator(_matches(_URL, "http(s) URL")), AfterValidator(_port_ok)]
Nic = Annotated[str, AfterValidator(_nic)]
Address = Annotated[str, AfterValidator(_address)]
HardwareName = Annotated[str, AfterValidator(_hardware)]
Command = Annotated[str, AfterValidator(_command)]
ImageRepo = Annotated[str, AfterValidator(_matches(
    _IMAGE_REPO, "image repository ([registry[:port]/]path, lower case, no :tag - the version profile names it)")),
                     AfterValidator(_port_ok)]
DeviceIp = Annotated[str, AfterValidator(_ipv4("NPU device IPs are IPv4 (hccn_tool -ip)"))]


# --- the key table: every kimi_* key, where it may be set ----------------------------------------------


@dataclass(frozen=True)
class Key:
    scope: Literal["cluster", "host", "both"]
    help: str


KEYS: dict[str, Key] = {
    "kimi_cluster": Key("cluster", "cluster name, [a-z0-9][a-z0-9-]{0,62} (required)"),
    "kimi_model_dir": Key("cluster", "absolute checkpoint path on every host (required)"),
    "kimi_model_source": Key("cluster", "modelscope (default), huggingface or local"),
    "kimi_model_id": Key("cluster", "hub model id, default Eco-Tech/Kimi-K2.5-W4A8; also picks the model facts "
                                    "(K2.5, K2.6, K2.7 W4A8: kimictl/data/models/)"),
    "kimi_model_endpoint": Key("cluster", "hub base URL (mirror or the sandbox's fake hub)"),
    "kimi_model_revision": Key("cluster", "hub revision, default master (ModelScope) / main (HF)"),
    "kimi_vllm_ascend_version": Key("cluster", "vllm-ascend version profile (0.23.0.post1, 0.30.0rc2, ...), default "
                                               "the newest final release"),
    "kimi_runtime": Key("cluster", "container (default) or host"),
    "kimi_image_repo": Key("cluster", "engine image repository (a registry mirror), e.g. registry.example.internal/"
                                      "ascend/vllm-ascend; the tag stays the version profile's (plus -a3 on A3)"),
    "kimi_proxy_host": Key("cluster", "inventory host that runs the P/D proxy, default the first prefill host"),
    "kimi_monitor_host": Key("cluster", "inventory host that runs Prometheus (`kimictl observe up`), default the "
                                        "proxy host"),
    "kimi_api_key_file": Key("cluster", "file on the control node (mode 0600) holding the key clients must send "
                                        "to the proxy (Authorization: Bearer); unset: no key"),
    "kimi_proxy_admin_key_file": Key("cluster", "file on the control node (mode 0600) holding the proxy's admin key "
                                                "(drain, re-add); unset: the cluster's own (read back from the "
                                                "proxy host, made on the first deploy)"),
    "kimi_engine_api_key_file": Key("cluster", "P/D: file on the control node (mode 0600) holding the key engines "
                                               "require (needs kimi_api_key_file); unset: the cluster's own"),
    "kimi_draft_model_dir": Key("cluster", "draft checkpoint path (eagle3 or dflash, per the topology); setting it "
                                           "enables speculative decoding"),
    "kimi_media_dir": Key("cluster", "directory engines may read local media from (--allowed-local-media-path)"),
    "kimi_python": Key("cluster", "python3 on the hosts that has modelscope/huggingface_hub, for weights pulls"),
    "kimi_engine_profile": Key("cluster", "engine profile: ascend (default) or cpu-smoke (vLLM CPU build, tiny "
                                          "checkpoint; the sandbox's real-engine lane)"),
    "kimi_kv_connector": Key("cluster", "P/D KV connector of the engine profile: cpu-smoke has nixl (default) and "
                                        "mooncake; ascend takes none (the version profile's MooncakeConnectorV1)"),
    "kimi_reserve_ports": Key("cluster", "true (default): keep the plan's fixed ports out of the kernel's ephemeral "
                                         "range (net.ipv4.ip_local_reserved_ports); false: leave the hosts' sysctls"),
    "kimi_nic": Key("both", "NIC for HCCL/GLOO/TP sockets (required on every host, directly or via all.vars)"),
    "kimi_state_dir": Key("both", "kimictl state directory on the host, default /var/lib/kimi"),
    "kimi_engine_command": Key("both", "engine command replacing `vllm` (e.g. a simulator), default vllm"),
    "kimi_router_command": Key("both", "P/D router command on the proxy host, default vllm-router (pip package)"),
    "kimi_proxy_script": Key("both", "proxy.router vllm-ascend-proxy on kimi_runtime host: path of vllm-ascend's "
                                     "examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py on the "
                                     "proxy host (container runtime: the image's copy)"),
    "kimi_proxy_python": Key("both", "python3 command on the proxy host that has fastapi, httpx and uvicorn, for "
                                     "kimi_proxy_script; default python3"),
    "kimi_hardware": Key("host", "atlas-800-a2 or atlas-800-a3 (required)"),
    "kimi_role": Key("host", "prefill or decode: pins the host to a role"),
    "kimi_device_ips": Key("host", "NPU device IPs, one per NPU"),
    "kimi_host_ip": Key("host", "business IP for HCCL/vLLM when ansible_host is a DNS name"),
}


class ClusterSettings(BaseModel):
    """Cluster-wide settings from all.vars."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    kimi_cluster: ClusterName
    kimi_model_dir: KimiDir
    kimi_model_source: Literal["modelscope", "huggingface", "local"] = "modelscope"
    kimi_model_id: ModelId = "Eco-Tech/Kimi-K2.5-W4A8"
    kimi_model_endpoint: Url | None = None
    kimi_model_revision: Revision | None = None
    kimi_vllm_ascend_version: Annotated[str, AfterValidator(_known_version)] | None = None
    kimi_runtime: Literal["container", "host"] = "container"
    kimi_image_repo: ImageRepo | None = None
    kimi_proxy_host: str | None = None
    kimi_monitor_host: str | None = None
    kimi_api_key_file: AbsPath | None = None
    kimi_proxy_admin_key_file: AbsPath | None = None
    kimi_engine_api_key_file: AbsPath | None = None
    kimi_draft_model_dir: KimiDir | None = None
    kimi_media_dir: MediaDir = "/var/lib/kimi/media"
    kimi_python: Command = "python3"
    kimi_engine_profile: Literal["ascend", "cpu-smoke"] = "ascend"  # kimictl/data/engines/<name>.yml
    kimi_kv_connector: str | None = None  # one of the engine profile's kv_connectors (default: its first)
    kimi_reserve_ports: bool = True  # playbooks/tasks/reserve_ports.yml

    @field_validator("kimi_kv_connector")
    @classmethod
    def _profile_connector(cls, v: str | None, info: ValidationInfo) -> str | None:
        from kimictl.facts import engine_profile

        try:
            engine_profile(info.data.get("kimi_engine_profile")).connector(v)
        except InvalidInput as exc:
            raise ValueError(exc.message.removeprefix("kimi_kv_connector: ")) from None
        return v

    @property
    def name(self) -> str:
        return self.kimi_cluster

    @property
    def model_revision(self) -> str:
        if self.kimi_model_revision:
            return self.kimi_model_revision
        return "main" if self.kimi_model_source == "huggingface" else "master"


class Host(BaseModel):
    """One inventory host with its merged kimi_* settings."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str
    ansible_host: Address
    kimi_hardware: HardwareName
    kimi_nic: Nic
    kimi_role: Literal["prefill", "decode"] | None = None
    kimi_device_ips: list[DeviceIp] | None = None
    kimi_host_ip: Annotated[str, AfterValidator(_ipv4(_IPV4_ONLY))] | None = None
    kimi_state_dir: KimiDir = "/var/lib/kimi"
    kimi_engine_command: Command | None = None
    kimi_router_command: Command | None = None
    kimi_proxy_script: AbsPath | None = None
    kimi_proxy_python: Command = "python3"
    ansible_vars: dict[str, Any] = Field(default_factory=dict, exclude=True)

    @property
    def ip(self) -> str:
        """Business IP: HCCL_IF_IP, VLLM_HOST_IP, the DP master address."""
        return self.kimi_host_ip or self.ansible_host

    @property
    def hardware(self):
        return hardware_catalogue()[self.kimi_hardware]


class Inventory(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: str
    cluster: ClusterSettings
    hosts: list[Host]

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def limited(self, names: list[str] | None, flag: str = "--limit") -> Inventory:
        """The inventory restricted to `names` (the --limit option, or `flag` naming another)."""
        if not names:
            return self
        known = {h.name for h in self.hosts}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise InventoryError(
                f"{flag} names hosts not in {self.path}: "
                + ", ".join(n if n.strip() == n and n else repr(n) for n in unknown)
                + "".join(did_you_mean(n, known) for n in unknown[:1])
            )
        return self.model_copy(update={"hosts": [h for h in self.hosts if h.name in names]})


# --- loading --------------------------------------------------------------------------------------------


@dataclass
class _Origin:
    line: int
    where: str  # "all.vars", "group prefill", "host h1"


@dataclass
class _Group:
    line: int
    parents: set[str] = field(default_factory=set)
    vars: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, _Origin] = field(default_factory=dict)
    priority: int = 1  # ansible_group_priority


class _Collector:
    """Walks the group tree and merges vars with Ansible's precedence: a host's groups ordered by depth, then
    ansible_group_priority, then name (each later one wins; ansible.inventory.helpers.sort_groups), host vars last.
    all.vars are the lowest and are applied separately."""

    def __init__(self, path: Path):
        self.path = path
        self.errors: list[str] = []
        self.all_vars: dict[str, Any] = {}
        self.all_origin: dict[str, _Origin] = {}
        self.host_order: list[str] = []
        self.host_line: dict[str, int] = {}
        self.groups: dict[str, _Group] = {}
        self.host_groups: dict[str, set[str]] = {}  # the groups a host is listed in (not all)
        self.host_vars: dict[str, tuple[dict[str, Any], dict[str, _Origin]]] = {}
        self._depth: dict[str, int] = {"all": 0}

    def err(self, line: int, msg: str) -> None:
        self.errors.append(f"{self.path}:{line}: {msg}")

    def walk(self, name: str, group: Any, line: int, parent: str | None) -> None:
        g = self.groups.setdefault(name, _Group(line))
        if parent is not None:
            g.parents.add(parent)
        if group is None:
            return
        if not isinstance(group, LineMap):
            self.err(line, f"group '{name}' must be a mapping with hosts/vars/children, got {type(group).__name__}")
            return
        for key in group:
            if key not in ("hosts", "vars", "children"):
                self.err(group.line_of(key), f"group '{name}': unknown section '{key}' (expected hosts, vars, children)"
                         + did_you_mean(key, ("hosts", "vars", "children")))
        self._group_vars(name, g, self._section(name, group, "vars", "a mapping"))
        hosts = self._section(name, group, "hosts", "a mapping of host names")
        for host, hvars in hosts.items():
            if not self.typed_name(hosts, host, f"group '{name}': host name"):
                self._group_host(name, host, hvars, hosts.line_of(host))
        children = self._section(name, group, "children", "a mapping of groups")
        for child, cgroup in children.items():
            if self.typed_name(children, child, f"group '{name}': children: group name"):
                continue
            if child == "all":   # Ansible refuses it too: every group is already under all
                self.err(children.line_of(child), f"group '{name}': 'all' cannot be a child group (it holds them all)")
                continue
            self.walk(child, cgroup, children.line_of(child), name)

    def typed_name(self, section: LineMap, key: str, what: str) -> bool:
        """True (and reported) when YAML read the host or group name `key` as another type (`~:`, `yes:`, `1:`):
        it names no host or group Ansible would call by that text."""
        if key not in section.typed_keys:
            return False
        self.err(section.line_of(key), f"{what} {key!r} is not text" + yaml_type_hint(section.typed_keys[key]))
        return True

    def _section(self, name: str, group: LineMap, key: str, what: str) -> LineMap:
        """One of a group's hosts/vars/children mappings (empty when absent, or reported and empty when not a
        mapping)."""
        section = group.get(key) or LineMap()
        if not isinstance(section, LineMap):
            self.err(group.line_of(key), f"group '{name}': {key} must be {what}")
            return LineMap()
        return section

    def _group_vars(self, name: str, g: _Group, vars_: LineMap) -> None:
        where = "all.vars" if name == "all" else f"group {name}"
        for k, v in vars_.items():
            if k in ("hosts", "children", "vars"):
                self.err(vars_.line_of(k), f"{where}: '{k}' is a section of the group, not a variable: move it out of "
                                           "vars, one level up")
                continue
            if not self._var_name_ok(vars_, k, where):
                continue
            if k == "ansible_group_priority":  # Ansible keeps it as the group's priority, not as a variable
                if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, str) and v.strip().isdigit())):
                    self.err(vars_.line_of(k), f"{where}: ansible_group_priority must be an integer, got {v!r}")
                else:
                    g.priority = int(v)
                continue
            g.vars[k] = v
            g.origins[k] = _Origin(vars_.line_of(k), where)
        if name == "all":
            self.all_vars, self.all_origin = g.vars, g.origins

    def _var_name_ok(self, where_map: LineMap, k: str, where: str) -> bool:
        """A variable name Ansible accepts: an ASCII identifier (a look-alike letter makes another, unknown key)."""
        if _VAR_NAME.fullmatch(k):
            return True
        self.err(where_map.line_of(k), f"{where}: {k!r} is not a variable name (ASCII letters, digits and '_')"
                                       + did_you_mean(k, KEYS))
        return False

    def _group_host(self, name: str, host: str, hvars: Any, hline: int) -> None:
        """One entry of group `name`'s hosts: register the host and merge the variables given there."""
        if not _HOSTNAME.fullmatch(host):
            self.err(hline, f"host name {host!r} is not safe: use letters, digits, '.', '_' and '-' (max 63)")
            return
        if host not in self.host_line:
            self.host_order.append(host)
            self.host_line[host] = hline
            self.host_groups[host] = set()
            self.host_vars[host] = ({}, {})
        if name != "all":
            self.host_groups[host].add(name)
        if hvars is None:
            return
        if not isinstance(hvars, LineMap):
            self.err(hline, f"host {host}: variables must be a mapping, got {type(hvars).__name__}")
            return
        hv, ho = self.host_vars[host]
        for k, v in hvars.items():
            if not self._var_name_ok(hvars, k, f"host {host}"):
                continue
            hv[k] = v
            ho[k] = _Origin(hvars.line_of(k), f"host {host}")

    def check_groups(self) -> None:
        """A group that is its own ancestor is an error in Ansible too; report it once per cycle."""
        for name in self.groups:
            self.depth(name, ())

    def depth(self, name: str, path: tuple[str, ...]) -> int:
        """Ansible's group depth: the longest parent chain up to all (a group without parents is under all)."""
        if name in self._depth:
            return self._depth[name]
        if name in path:
            cycle = [*path[path.index(name):], name]
            self.err(self.groups[name].line, f"group '{name}' is its own ancestor ({' -> '.join(reversed(cycle))})")
            self._depth.update({n: 1 for n in cycle})
            return 1
        parents = self.groups[name].parents or {"all"}
        d = 1 + max(self.depth(p, (*path, name)) for p in parents)
        self._depth.setdefault(name, d)
        return self._depth[name]

    def _ancestors(self, name: str, out: set[str]) -> None:
        if name == "all" or name in out:
            return
        out.add(name)
        for p in self.groups[name].parents:
            self._ancestors(p, out)

    def merged(self, host: str) -> tuple[dict[str, Any], dict[str, _Origin]]:
        names: set[str] = set()
        for g in self.host_groups[host]:
            self._ancestors(g, names)
        values: dict[str, Any] = {}
        origins: dict[str, _Origin] = {}
        for n in sorted(names, key=lambda n: (self.depth(n, ()), self.groups[n].priority, n)):
            values.update(self.groups[n].vars)
            origins.update(self.groups[n].origins)
        hv, ho = self.host_vars[host]
        values.update(hv)
        origins.update(ho)
        return values, origins


def _check_key_names(c: _Collector, values: dict[str, Any], origins: dict[str, _Origin], at_all: bool) -> None:
    for key in values:
        if not key.startswith("kimi_"):
            continue
        o = origins[key]
        spec = KEYS.get(key)
        if spec is None:
            c.err(o.line, f"{o.where}: unknown key '{key}'{did_you_mean(key, KEYS)}")
        elif spec.scope == "cluster" and not at_all:
            c.err(o.line, f"{o.where}: '{key}' is cluster-wide; set it under all.vars")


def _pydantic_errors(c: _Collector, exc: ValidationError, values: dict, origins: dict[str, _Origin],
                     fallback_line: int, where: str) -> None:
    for e in exc.errors():
        loc = e["loc"]
        key = str(loc[0]) if loc else ""
        o = origins.get(key)
        line = o.line if o else fallback_line
        value = values.get(key)
        if e["type"] == "missing":
            c.err(line, f"{where}: '{key}' is required ({KEYS[key].help if key in KEYS else 'required'})")
            continue
        field = ".".join(str(p) for p in loc)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] in ("string_type", "literal_error", "list_type") and not isinstance(value, str):
            msg += yaml_type_hint(value if len(loc) == 1 else _dig(value, loc[1:]))
        c.err(line, f"{where}: {field}: {msg}")


def _tcp_port(v: Any) -> bool:
    """ansible_port as Ansible takes it: a number, or a string of digits."""
    if isinstance(v, str) and v.isascii() and v.isdigit():
        v = int(v)
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 65535


def _dig(value: Any, loc: tuple) -> Any:
    for p in loc:
        try:
            value = value[p]
        except (KeyError, IndexError, TypeError):
            return value
    return value


def load_inventory(path: Path | str) -> Inventory:
    """Read and validate an inventory; raise InventoryError listing every problem with file:line."""
    path = Path(path)
    doc = load_yaml(path, "inventory")
    _refuse_vars_dirs(path)
    c = _Collector(path)
    if not isinstance(doc, LineMap) or not doc:
        raise InventoryError(f"{path}: an inventory is a YAML mapping of groups, starting with 'all:'")
    for name, group in doc.items():
        if not c.typed_name(doc, name, "group name"):
            c.walk(name, group, doc.line_of(name), None)
    c.check_groups()
    if not c.host_order:
        c.err(1, "no hosts: list them under all.hosts (or a child group's hosts)")
        raise InventoryError(f"invalid inventory {path}", details=c.errors)

    _check_key_names(c, c.all_vars, c.all_origin, at_all=True)
    cluster_values = {k: v for k, v in c.all_vars.items() if KEYS.get(k, Key("host", "")).scope == "cluster"}
    cluster: ClusterSettings | None = None
    try:
        cluster = ClusterSettings(**cluster_values)
    except ValidationError as exc:
        _pydantic_errors(c, exc, cluster_values, c.all_origin, doc.line_of("all"), "all.vars")

    hosts: list[Host] = []
    for name in c.host_order:
        values, origins = c.merged(name)
        _check_key_names(c, {k: v for k, v in values.items() if origins[k].where != "all.vars"}, origins, False)
        for k, v in c.all_vars.items():  # all.vars is the lowest precedence for every host
            if not k.startswith("kimi_") or KEYS.get(k, Key("cluster", "")).scope in ("both", "host"):
                values.setdefault(k, v)
                origins.setdefault(k, c.all_origin[k])
        fields = {k: v for k, v in values.items() if k in KEYS and KEYS[k].scope in ("host", "both")}
        fields["ansible_host"] = values.get("ansible_host", name)
        origins.setdefault("ansible_host", _Origin(c.host_line[name], f"host {name}"))
        extra = {k: v for k, v in values.items() if not k.startswith("kimi_")}
        port = extra.get("ansible_port")
        if port is not None and not _tcp_port(port):
            c.err(origins["ansible_port"].line, f"host {name}: ansible_port: {port!r} is not a TCP port (1-65535)"
                  + yaml_type_hint(port if isinstance(port, bool) else ""))
        try:
            hosts.append(Host(name=name, ansible_vars=extra, **fields))
        except ValidationError as exc:
            _pydantic_errors(c, exc, fields, origins, c.host_line[name], f"host {name}")

    if cluster is not None and hosts:
        _cross_checks(c, cluster, hosts)
    if c.errors:
        raise InventoryError(f"invalid inventory {path} ({len(c.errors)} problem(s))", details=c.errors)
    assert cluster is not None
    return Inventory(path=str(path), cluster=cluster, hosts=hosts)


def _refuse_vars_dirs(path: Path) -> None:
    """host_vars/ and group_vars/ beside the inventory: Ansible applies them to its hosts and groups, kimictl plans
    from this file alone, so the two would deploy different things. Refused, naming the directory."""
    found = []
    for name in ("host_vars", "group_vars"):
        d = path.parent / name
        try:
            used = d.is_dir() and any(not e.name.startswith(".") for e in d.iterdir())
        except OSError:   # there, but unreadable here: Ansible may still read it
            used = True
        if used:
            found.append(f"{d}: Ansible applies the variables in {name}/ beside the inventory; kimictl reads only "
                         f"{path.name}, so its plan would differ from what Ansible runs")
    if found:
        raise InventoryError(f"invalid inventory {path}", details=found,
                             hint="move those variables into the inventory file (under the host or group) and "
                                  "remove the directory, or keep the inventory in a directory of its own")


def _within(inner: str, outer: str) -> bool:
    a, b = PurePosixPath(inner), PurePosixPath(outer)
    return a == b or b in a.parents


def _dir_overlaps(cluster: ClusterSettings, h: Host) -> list[str]:
    """Directories others may read must not hold the state dir (its secrets/): the peer key reads the model and
    draft dirs, and any request may read files under the media dir."""
    shared = {"kimi_model_dir": cluster.kimi_model_dir, "kimi_draft_model_dir": cluster.kimi_draft_model_dir,
              "kimi_media_dir": cluster.kimi_media_dir}
    return [f"{key} {d} holds kimi_state_dir {h.kimi_state_dir} (its secrets/ would be readable through it)"
            for key, d in shared.items() if d and _within(h.kimi_state_dir, d)]


def _checkpoint_dir_overlaps(cluster: ClusterSettings) -> list[tuple[str, str]]:
    """(key, why) for checkpoint dirs that overlap each other or sit under the media dir, which any request may
    read."""
    model, draft, media = cluster.kimi_model_dir, cluster.kimi_draft_model_dir, cluster.kimi_media_dir
    out = [("kimi_media_dir", f"kimi_media_dir {media} holds {key} {d} (any request could read the checkpoint)")
           for key, d in (("kimi_model_dir", model), ("kimi_draft_model_dir", draft)) if d and _within(d, media)]
    if draft and (_within(draft, model) or _within(model, draft)):
        out.append(("kimi_draft_model_dir", f"kimi_draft_model_dir {draft} and kimi_model_dir {model} overlap (each "
                                            "checkpoint is staged and verified in a directory of its own)"))
    return out


def _host_checks(c: _Collector, cluster: ClusterSettings, h: Host, seen_addr: dict[str, str],
                 seen_dev: dict[str, str]) -> None:
    line = c.host_line[h.name]
    for why in _dir_overlaps(cluster, h):
        c.err(line, f"host {h.name}: {why}; give each its own directory")
    # One business IP per host: HCCL_IF_IP, the DP master address and the proxy's endpoints use it.
    for addr in dict.fromkeys((h.ansible_host, h.ip)):
        if addr in seen_addr and seen_addr[addr] != h.name:
            c.err(line, f"host {h.name}: address {addr} is also host {seen_addr[addr]} "
                        "(each host needs its own ansible_host / kimi_host_ip)")
        seen_addr.setdefault(addr, h.name)
    _ssh_var_checks(c, line, h)
    try:
        ipaddress.ip_address(h.ansible_host)
    except ValueError:
        if not h.kimi_host_ip:
            c.err(line, f"host {h.name}: ansible_host '{h.ansible_host}' is a DNS name; set kimi_host_ip to "
                        "its business IP (HCCL_IF_IP and the DP master address need an IP)")
    if h.kimi_device_ips is not None:
        want = h.hardware.npus
        if len(h.kimi_device_ips) != want:
            c.err(line, f"host {h.name}: kimi_device_ips has {len(h.kimi_device_ips)} addresses; "
                        f"{h.kimi_hardware} has {want} NPUs, one device IP each")
        shared: dict[str, list[str]] = {}   # other host -> the device IPs it lists too
        for ip, n in Counter(h.kimi_device_ips).items():
            if n > 1:
                c.err(line, f"host {h.name}: kimi_device_ips lists device IP {ip} "
                            f"{'twice' if n == 2 else f'{n} times'} (one device IP per NPU)")
            if ip in seen_dev:
                shared.setdefault(seen_dev[ip], []).append(ip)
            seen_dev.setdefault(ip, h.name)
        for other, ips in shared.items():
            c.err(line, f"host {h.name}: kimi_device_ips shares {len(ips)} address(es) with host {other}'s "
                        f"kimi_device_ips: device IP {', '.join(ips)} (each NPU needs its own device IP)")


_SSH_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._@-]{0,63}")   # what useradd and ssh accept as a login name
_STRICT_VALUES = ("yes", "no", "ask", "accept-new", "off")          # ssh_config(5) StrictHostKeyChecking
SSH_VALUE_FLAGS = ("-o", "-i", "-F", "-p")   # the ssh options kimictl reads (kimictl/ssh.py), each with a value


def ssh_options(args: str) -> list[tuple[str, str | None]]:
    """The options of ansible_ssh_common_args / ansible_ssh_extra_args kimictl reads, in order, as ssh reads them:
    (flag, value) for `-p 22` and `-p22`, `-o Port=22` and `-oPort=22` (likewise -i, -F); value None when the flag
    ends the line. One reading for validation and for kimictl's connections; ValueError when quotes do not balance."""
    words = shlex.split(args)
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(words):
        w = words[i]
        if w in SSH_VALUE_FLAGS:
            out.append((w, words[i + 1] if i + 1 < len(words) else None))
            i += 1
        elif w[:2] in SSH_VALUE_FLAGS:
            out.append((w[:2], w[2:]))
        i += 1
    return out


def ssh_config_option(value: str) -> tuple[str, str]:
    """(keyword, argument) of an `-o` value as ssh_config(5) separates them: `Key=Value`, `Key = Value` or `Key Value`;
    the argument is '' when there is none."""
    key, *rest = re.split(r"\s*=\s*|\s+", value.strip(), maxsplit=1)
    return key, rest[0] if rest else ""


def _user_problem(user: Any, h: Host) -> str | None:
    if not (isinstance(user, str) and _SSH_USER.fullmatch(user)):
        return (f"{reported(user)} is not a login name (letters, digits, '_', '.', '@', '-'; not starting with '-', "
                "which ssh would read as an option)")
    at = user.rpartition("@")[2] if "@" in user else None
    if at is not None and (at in (h.name, h.ansible_host, h.kimi_host_ip) or _is_ip(at)):
        return (f"{reported(user)} names a host after '@': ssh and Ansible take the whole value as the login name "
                "(the host comes from ansible_host); give the user only")
    return None


def _is_ip(v: str) -> bool:
    try:
        ipaddress.ip_address(v)
    except ValueError:
        return False
    return True


def _ssh_option_problem(flag: str, value: str | None, h: Host) -> str | None:
    """Why ssh (and kimictl's connections, which read the same options) cannot use one option, or None."""
    if not value:
        return f"{flag} has no value (ssh refuses to start)"
    if flag == "-p":
        return None if _tcp_port(value) else f"-p {value}: not a TCP port (1-65535)"
    if flag != "-o":
        return None
    key, arg = ssh_config_option(value)
    name = key.lower()
    if not arg:
        return f"-o {value}: the option has no value (write -o {key}=VALUE; ssh refuses to start)"
    if name == "port" and not _tcp_port(arg):
        return f"-o {value}: {arg!r} is not a TCP port (1-65535)"
    if name == "stricthostkeychecking" and arg.lower() not in _STRICT_VALUES:
        return f"StrictHostKeyChecking={arg} is not one of {', '.join(_STRICT_VALUES)} (ssh refuses to connect)"
    if name == "user":
        why = _user_problem(arg, h)
        return f"-o {value}: User {why}" if why else None
    return None


def _ssh_var_checks(c: _Collector, line: int, h: Host) -> None:
    """The connection variables ssh, Ansible and kimictl's probes each read: one reading for all three."""
    user = h.ansible_vars.get("ansible_user")
    why = None if user is None else _user_problem(user, h)
    if why:
        c.err(line, f"host {h.name}: ansible_user: {why}")
    for key in ("ansible_ssh_common_args", "ansible_ssh_extra_args"):
        args = h.ansible_vars.get(key)
        if args is None:
            continue
        if not isinstance(args, str):   # Ansible pastes it into ssh's command line as text
            c.err(line, f"host {h.name}: {key}: {reported(args)} is not a string; write the options as on ssh's "
                        "command line, e.g. '-o Port=2222 -i ~/.ssh/id_kimi'")
            continue
        try:
            options = ssh_options(args)
        except ValueError as exc:   # ssh, Ansible and kimictl's probes would each read it differently
            c.err(line, f"host {h.name}: {key}: {exc} (quotes must balance)")
            continue
        for flag, value in options:
            why = _ssh_option_problem(flag, value, h)
            if why:
                c.err(line, f"host {h.name}: {key}: {why}")


def _loopback_checks(c: _Collector, hosts: list[Host]) -> None:
    """Loopback addresses reach only the host itself: never a device IP, and a business IP only in a one-host
    cluster (other hosts, the proxy and the KV connector use it to reach this host). A loopback ansible_host (an
    SSH address: a tunnel, a closed port in tests) becomes the business IP only in a plan (plan.py)."""
    for h in hosts:
        line = c.host_line[h.name]
        if h.kimi_host_ip and ipaddress.ip_address(h.kimi_host_ip).is_loopback and len(hosts) > 1:
            c.err(line, f"host {h.name}: kimi_host_ip {h.kimi_host_ip} is a loopback address; the other hosts "
                        "reach this one at its business IP")
        bad = [ip for ip in h.kimi_device_ips or [] if ipaddress.ip_address(ip).is_loopback]
        if bad:
            c.err(line, f"host {h.name}: kimi_device_ips: {bad[0]} is a loopback address, not an NPU's device IP "
                        "(hccn_tool -i N -ip -g)")


def cross_check_errors(cluster: ClusterSettings, hosts: list[Host], path: Path) -> list[str]:
    """The checks across the inventory's keys and hosts (`_cross_checks`) over settings made some other way (a
    rollout's --set): the problems without file, line or `all.vars:`."""

    class _Errors(_Collector):
        def err(self, line: int, msg: str) -> None:
            self.errors.append(msg.removeprefix("all.vars: "))

    class _Origins(dict):   # lines are not reported (err drops them)
        def __missing__(self, key: str) -> _Origin:
            return _Origin(0, "all.vars")

    c = _Errors(path)
    c.all_origin = _Origins()
    c.host_line = {h.name: 0 for h in hosts}
    _cross_checks(c, cluster, hosts)
    return c.errors


def _key_file_check(c: _Collector, cluster: ClusterSettings, var: str) -> None:
    """A key file of all.vars: read where the commands that use it run (checked by validate and plan too)."""
    f = getattr(cluster, var)
    if not f:
        return
    try:
        key = read_secret_file(Path(f), var)
    except InvalidInput as exc:
        c.err(c.all_origin[var].line, f"all.vars: {exc.message}")
    else:
        if not ENV_KEY.fullmatch(key):  # it reaches env files a shell sources and `docker --env-file` reads
            c.err(c.all_origin[var].line, f"all.vars: {var}: {ENV_KEY_RULE}")


def _cross_checks(c: _Collector, cluster: ClusterSettings, hosts: list[Host]) -> None:
    seen_addr: dict[str, str] = {}
    seen_dev: dict[str, str] = {}
    for h in hosts:
        _host_checks(c, cluster, h, seen_addr, seen_dev)
    _loopback_checks(c, hosts)
    for ip, host in seen_dev.items():   # the device network and the business network must not share an address
        if ip in seen_addr:
            c.err(c.host_line[host], f"host {host}: device IP {ip} is host {seen_addr[ip]}'s business address")
    for key, why in _checkpoint_dir_overlaps(cluster):
        origin = c.all_origin.get(key)
        c.err(origin.line if origin else 1, f"all.vars: {why}; give each its own directory")
    for var in ("kimi_api_key_file", "kimi_proxy_admin_key_file", "kimi_engine_api_key_file"):
        _key_file_check(c, cluster, var)
    if cluster.kimi_engine_api_key_file and not cluster.kimi_api_key_file:
        c.err(c.all_origin["kimi_engine_api_key_file"].line, "all.vars: kimi_engine_api_key_file: engines require a "
                                                             "key only when clients do: set kimi_api_key_file too")
    names = [h.name for h in hosts]
    for key in ("kimi_proxy_host", "kimi_monitor_host"):
        value = getattr(cluster, key)
        if value and value not in names:
            c.err(c.all_origin[key].line,
                  f"all.vars: {key} '{value}' is not an inventory host{did_you_mean(value, names)}")
