"""Topology presets and user topology files: roles, DP x TP per instance, env, switches, serve flags."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from kimictl.errors import TopologyError, did_you_mean
from kimictl.facts import DATA_DIR, hardware_catalogue, switch_rules
from kimictl.inventory import ModelId
from kimictl.yamlsrc import LineMap, load_yaml, yaml_type_hint

PRESET_DIR = DATA_DIR / "topologies"
RoleName = Literal["prefill", "decode", "colocated"]
NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"   # a topology's name: it names files, run dirs and metrics labels

# Flags kimictl computes from the plan; a topology setting them would break ranks, ports or the connector.
# `config` reads more flags from a YAML file on the host, where any of these could hide.
RESERVED_FLAGS = {
    "host", "port", "data-parallel-size", "data-parallel-rank", "data-parallel-address",
    "data-parallel-rpc-port", "data-parallel-size-local", "data-parallel-start-rank", "headless",
    "tensor-parallel-size", "kv-transfer-config", "served-model-name", "allowed-local-media-path",
    "speculative-config", "model", "config", "api-key",
}
# Flags that make vLLM print something and exit 0 instead of serving: every engine would restart in a loop.
EXIT_FLAGS = {"help": "its usage", "version": "its version"}
_FLAG = re.compile(r"[a-z0-9][a-z0-9-]*")
_NUMBER = re.compile(r"-(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


# Serve flags kimictl reads for the plan (HBM fit, graph mode); their values must have vLLM's types.
SERVE_TYPES: dict[str, tuple[Any, str]] = {
    "gpu-memory-utilization": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1,
                               "a fraction in (0, 1]"),
    "max-model-len": (_positive_int, "a positive integer (tokens)"),
    "max-num-batched-tokens": (_positive_int, "a positive integer"),
    "max-num-seqs": (_positive_int, "a positive integer"),
    "seed": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32,
             "an integer from 0 to 4294967295 (vLLM seeds numpy with it)"),
    "additional-config": (lambda v: isinstance(v, dict), "a mapping (it is rendered as JSON)"),
    "compilation-config": (lambda v: isinstance(v, dict), "a mapping (it is rendered as JSON)"),
}
# Env values kimictl reads: HCCL_BUFFSIZE sizes the reserve in the HBM fit.
ENV_TYPES = {"HCCL_BUFFSIZE": (lambda v: v.isascii() and v.isdigit() and int(v) > 0,
                               "a positive integer number of MiB")}
# Env kimictl sets itself for each engine (kimictl/render.py engine_env, templates/engine.sh.j2): a topology's value
# would be silently replaced, so it is refused. Name -> what kimictl sets it from.
RESERVED_ENV = {
    "ASCEND_RT_VISIBLE_DEVICES": "the NPUs the plan gives it",
    "HCCL_IF_IP": "each host's business IP (kimi_host_ip or ansible_host)",
    "VLLM_HOST_IP": "each host's business IP (kimi_host_ip or ansible_host)",
    "HCCL_SOCKET_IFNAME": "each host's kimi_nic",
    "GLOO_SOCKET_IFNAME": "each host's kimi_nic",
    "TP_SOCKET_IFNAME": "each host's kimi_nic",
    "VLLM_API_KEY": "the engines' API key it keeps for the cluster (a 0600 file on each host, never in a topology)",
}
_ENV = re.compile(r"[A-Z_][A-Z0-9_]*")
ServeValue = bool | int | float | str | dict[str, Any] | list[Any]


def _check_env_map(v: dict[str, str]) -> dict[str, str]:
    return _check_env(v)


def _check_serve_map(v: dict[str, Any]) -> dict[str, Any]:
    return _check_serve(v)


EnvMap = Annotated[dict[str, str], AfterValidator(_check_env_map)]
ServeMap = Annotated[dict[str, ServeValue], AfterValidator(_check_serve_map)]


class _Strict(BaseModel):
    # strict: a count written as "4", 4.0 or true is an error naming the field, not silently 4 (or 1)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Ports(_Strict):
    http_base: int = Field(7100, ge=1024, le=65000, description="first engine HTTP port on each host")
    rpc: int = Field(12321, ge=1024, le=65535, description="--data-parallel-rpc-port of each DP group")
    kv_base: int | None = Field(None, ge=1024, le=65000,
                                description="first kv_port; default the hardware minimum (A2 28000, A3 36000)")


class FrontLimits(_Strict):
    """What kimictl's proxy front allows its clients (docs/operate.md: the proxy front's limits); proxy keys."""

    max_connections: int = Field(1024, ge=16, le=65536, description="client connections served at once; one more "
                                 "waits up to 2 s for a slot (an idle keep-alive connection gives its own), then 503")
    max_body_mib: int = Field(256, ge=1, le=4096, description="request body limit in MiB (413 over it)")
    header_timeout_s: int = Field(10, ge=1, le=300, description="seconds for a request head from its first byte (408)")
    io_timeout_s: int = Field(30, ge=1, le=3600, description="seconds without a byte of a request body (408), or "
                                                             "without the client taking a byte of its response")
    idle_timeout_s: int = Field(75, ge=1, le=3600, description="seconds a keep-alive connection may wait for its "
                                                               "next request")


RouterKind = Literal["vllm-ascend-proxy", "vllm-router"]  # kimictl/data/routers.yml


class Proxy(FrontLimits):
    router: RouterKind | None = Field(None, description="the P/D router behind kimictl's front (data/routers.yml); "
                                                        "default the engine profile's (ascend: vllm-ascend-proxy)")
    port: int = Field(8000, ge=1024, le=65535)
    policy: Literal["round_robin", "random", "cache_aware", "power_of_two"] | None = Field(
        None, description="vllm-router's --policy (default round_robin); vllm-ascend-proxy schedules by load itself")
    routers: int = Field(2, ge=1, le=4, description="router copies behind the proxy port; with 2 or more a router "
                                                    "restart (re-adding drained workers) never refuses a client")
    router_port_base: int | None = Field(None, ge=1024, le=65000,
                                         description="first loopback port of the routers (a port and a metrics "
                                                     "port each); default the proxy port + 1")


class Role(_Strict):
    nodes: int = Field(1, ge=1, le=64, description="hosts per instance of this role")
    dp: int = Field(ge=1, le=256, description="data-parallel size of one instance")
    tp: int = Field(ge=1, le=16, description="tensor-parallel size")
    env: EnvMap = Field(default_factory=dict)
    switches: dict[str, bool] = Field(default_factory=dict)
    serve: ServeMap = Field(default_factory=dict)

    @field_validator("switches")
    @classmethod
    def _known_switches(cls, v: dict[str, bool]) -> dict[str, bool]:
        known = switch_rules()
        for name in v:
            if name not in known:
                raise ValueError(f"unknown switch '{name}'{did_you_mean(name, known)}; known: {', '.join(known)}")
        return v



class Speculative(_Strict):
    method: Literal["eagle3", "dflash"] = Field(
        "eagle3", description="eagle3 (K2.5's lightseekorg draft) or dflash (the K2.6/K2.7 recipes' z-lab drafter)")
    model_id: ModelId = Field(description="the draft's hub id (owner/name)")
    num_speculative_tokens: dict[RoleName, Annotated[int, Field(ge=1)]]


class Slo(_Strict):
    """Serving targets the monitoring alerts against (unset fields: kimictl/data/observe.yml's slo)."""

    model_config = ConfigDict(allow_inf_nan=False)   # .inf is no target: the alert could never fire

    tpot_ms: float | None = Field(None, gt=0, description="time per output token target, ms, at the quantile")
    ttft_ms: float | None = Field(None, gt=0, description="time to first token target, ms, at the quantile")
    quantile: float | None = Field(None, gt=0, lt=1, description="the quantile the targets hold for, e.g. 0.9")


class Heal(_Strict):
    """How `kimictl heal` judges engines and how often it may act (unset fields: kimictl/data/heal.yml)."""

    model_config = ConfigDict(allow_inf_nan=False)

    hang_deadline_s: float | None = Field(None, gt=0, description="seconds an engine may run requests with no "
                                                                   "token counter moving before it counts as hung")
    max_actions: int | None = Field(None, ge=1, le=100, description="heal actions per slice within window_s; one "
                                                                    "more escalates (exit 1)")
    window_s: float | None = Field(None, gt=0, description="the flap-damping window, seconds")


class Topology(_Strict):
    """A deployment shape: which roles exist, how big each instance is, and how engines are tuned."""

    name: str = Field(pattern=NAME_PATTERN)
    description: str
    hardware: str | None = Field(None, description="required hardware of every host; default: any one kind")
    mode: Literal["pd", "colocated"]
    launch: Literal["external-dp", "internal-dp"] = Field(
        "external-dp", description="external-dp: one `vllm serve` per DP rank; internal-dp: one per host")
    share: dict[Literal["prefill", "decode"], Annotated[int, Field(ge=1, le=64)]] = Field(
        default_factory=lambda: {"prefill": 1, "decode": 1}, description="how spare hosts split between roles")
    ports: Ports = Field(default_factory=Ports)
    engine_bind: Literal["host-ip", "all"] = Field(
        "host-ip", description="where engines listen: the host's business IP (kimi_host_ip or ansible_host), or all "
                               "interfaces (0.0.0.0)")
    proxy: Proxy | None = None
    env: EnvMap = Field(default_factory=dict)
    serve: ServeMap = Field(default_factory=dict)
    roles: dict[RoleName, Role]
    speculative: Speculative | None = None
    slo: Slo | None = Field(None, description="serving targets for `kimictl observe` alerts")
    heal: Heal | None = Field(None, description="`kimictl heal`'s hang deadline and flap damping")
    source: SkipJsonSchema[str] = Field("", exclude=True)   # where kimictl read the file: not a key of it

    @field_validator("hardware")
    @classmethod
    def _hardware(cls, v: str | None) -> str | None:
        if v is not None and v not in hardware_catalogue():
            raise ValueError(f"unknown hardware '{v}'; expected one of {', '.join(hardware_catalogue())}")
        return v

    @field_validator("speculative")
    @classmethod
    def _speculative_roles(cls, v: Speculative | None, info: ValidationInfo) -> Speculative | None:
        roles = info.data.get("roles")
        for role in v.num_speculative_tokens if v and roles else ():
            if role not in roles:
                raise ValueError(f"num_speculative_tokens names role '{role}', which this topology does not have "
                                 f"(roles: {', '.join(roles)}); speculation would never apply")
        return v

    @model_validator(mode="after")
    def _roles_match_mode(self) -> Topology:
        roles = set(self.roles)
        if self.mode == "pd" and roles != {"prefill", "decode"}:
            raise ValueError(f"mode pd needs exactly the roles prefill and decode, got {', '.join(sorted(roles))}")
        if self.mode == "colocated" and roles != {"colocated"}:
            raise ValueError(f"mode colocated needs exactly one role named colocated, got {', '.join(sorted(roles))}")
        if self.mode == "pd" and self.launch != "external-dp":
            raise ValueError("mode pd needs launch external-dp (one vllm serve per DP rank, as vllm-ascend's P/D docs)")
        if self.mode == "pd" and self.proxy is None:
            raise ValueError("mode pd needs a proxy section (the P/D router in front of the engines)")
        if self.mode == "colocated" and self.proxy is not None:
            raise ValueError("proxy: a colocated topology has no P/D router (clients talk to the engines); remove the "
                             "proxy section, or use mode pd")
        return self

    def role_serve(self, role: str) -> dict[str, ServeValue]:
        """Common serve flags overlaid with the role's own (role wins; False removes a common flag)."""
        merged = dict(self.serve)
        merged.update(self.roles[role].serve)  # type: ignore[index]
        return {k: v for k, v in merged.items() if v is not False}


def _check_env(v: dict[str, str]) -> dict[str, str]:
    for k, val in v.items():
        if not _ENV.fullmatch(k):
            raise ValueError(f"env name {k!r} must be upper-case letters, digits and '_' ({_ENV.pattern})")
        if k in RESERVED_ENV:
            raise ValueError(f"env '{k}' is set by kimictl for each engine from {RESERVED_ENV[k]}; remove it from "
                             "the topology")
        if k in ENV_TYPES and not ENV_TYPES[k][0](val):
            raise ValueError(f"env '{k}' is '{val}'; it must be {ENV_TYPES[k][1]}")
    return v


def reserved_why(flag: str) -> str:
    if flag in EXIT_FLAGS:
        return f"makes vLLM print {EXIT_FLAGS[flag]} and exit 0 instead of serving (every engine would restart)"
    if flag == "config":
        return "reads more flags from a file on the host, where reserved ones could hide (set flags under serve)"
    if flag == "api-key":   # on argv it would show in `ps` and logs
        return ("is computed by kimictl from the plan: engines get their key from kimi_api_key_file through an env "
                "file, never on the command line")
    return "is computed by kimictl from the plan"


def _check_serve(v: dict[str, ServeValue]) -> dict[str, ServeValue]:
    for k in v:
        if k.startswith("-"):
            raise ValueError(f"serve flag '{k}': write it without leading dashes")
        if not _FLAG.fullmatch(k):
            raise ValueError(f"serve flag {k!r} must be lower-case words joined by '-'")
        if k in RESERVED_FLAGS or k in EXIT_FLAGS:
            raise ValueError(f"serve flag '{k}' {reserved_why(k)}; remove it from the topology")
        # vLLM's parser (argparse) takes any unambiguous prefix of a flag: --tensor-parallel is --tensor-parallel-size
        abbreviates = sorted(r for r in (*RESERVED_FLAGS, *EXIT_FLAGS) if r.startswith(k))
        if abbreviates:
            raise ValueError(f"serve flag '{k}' abbreviates '{abbreviates[0]}', which {reserved_why(abbreviates[0])}; "
                             "remove it from the topology")
        if "pipeline-parallel-size".startswith(k) and k.startswith("pipeline") and v[k] not in (1, "1"):
            raise ValueError(f"serve flag '{k}': {v[k]!r}: kimictl plans DP x TP instances (NPUs, ports, HBM, KV "
                             "layout); pipeline parallelism is not planned, remove it")
        if isinstance(v[k], str) and _CONTROL.search(v[k]):
            raise ValueError(f"serve flag '{k}' is {v[k]!r}: a line break or other control character in a value "
                             "would split or corrupt the engine's command line")
        if isinstance(v[k], str) and v[k].startswith("-") and not _NUMBER.fullmatch(v[k]):
            raise ValueError(f"serve flag '{k}' is {v[k]!r}: a value starting with '-' would be read as another "
                             "flag")
        check = SERVE_TYPES.get(k)
        if check and v[k] is not False and not check[0](v[k]):
            raise ValueError(f"serve flag '{k}' is {v[k]!r}; it must be {check[1]}")
    return v


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yml"))


def load_topology(name_or_path: str) -> Topology:
    """A preset by name, or a user topology file by path."""
    candidate = Path(name_or_path)
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", name_or_path):
        raise TopologyError(f"--topology {name_or_path}: a URL; kimictl reads a preset name or a local topology file",
                            hint="download the file and give its path")
    if name_or_path in preset_names():
        path = PRESET_DIR / f"{name_or_path}.yml"
    elif candidate.suffix in (".yml", ".yaml") or "/" in name_or_path:
        path = candidate
        if not os.path.lexists(path):   # said as given: Path() would print ./a3-pd as a3-pd
            preset = candidate.name in preset_names()
            raise TopologyError(f"--topology {name_or_path}: topology not found (no such file)",
                                hint=f"the preset is --topology {candidate.name} (a name, no path)" if preset else
                                "give a preset name (`kimictl topologies`) or the path of a topology YAML")
    else:
        raise TopologyError(
            f"unknown topology '{name_or_path}'{did_you_mean(name_or_path, preset_names())}"
            f"; presets: {', '.join(preset_names())}; or give a path to a topology YAML"
        )
    doc = load_yaml(path, "topology")
    if not isinstance(doc, dict):
        raise TopologyError(f"{path}: a topology is a YAML mapping (see `kimictl schema topology`)")
    if "source" in doc:   # where the file was read from: kimictl's to fill in, not a key of the file
        raise TopologyError(f"invalid topology {path}", details=[f"{path}:{doc.line_of('source')}: source: not a "
                                                                 "topology key (kimictl records where it read the "
                                                                 "file)"])
    try:
        return Topology(**doc, source=str(path))
    except ValidationError as exc:
        details = [_describe(e, doc, path) for e in exc.errors()]
        raise TopologyError(f"invalid topology {path}", details=details) from None


def _describe(err: dict, doc: Any, path: Path) -> str:
    loc = [p for p in err["loc"]]
    node, line = doc, getattr(doc, "line", 0)
    value: Any = doc
    for part in loc:
        if isinstance(node, LineMap) and part in node:
            line = node.line_of(part)
            node = node[part]
            value = node
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
            value = node
        else:
            break
    field = ".".join(str(p) for p in loc) or "(top level)"
    msg = err["msg"].removeprefix("Value error, ")
    if isinstance(node, LineMap):  # point at the offending key inside a validated mapping
        named = [k for k in node if f"'{k}'" in msg]
        if named:
            line = node.line_of(named[0])
    if err["type"] == "missing":
        msg = "required"
    elif err["type"] == "int_type":
        msg = "must be an integer" + _int_hint(value)
    elif err["type"].endswith("_type") or err["type"] == "literal_error":
        msg += yaml_type_hint(value)
    return f"{path}:{line}: {field}: {msg}"


def _int_hint(value: Any) -> str:
    if isinstance(value, bool):
        return f" (YAML read this as the boolean {value}; write a number)"
    if isinstance(value, str):
        quoted = value.strip().lstrip("+-").isdigit()
        return f" (YAML read this as the text {value!r}" + ("; write the number without quotes)" if quoted else ")")
    if isinstance(value, float):
        return f" (got {value!r}; write it without a decimal point)"
    return ""
