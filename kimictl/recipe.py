"""Import an upstream vllm-ascend multi-node recipe (its CI's external-DP P/D config) as a kimictl topology.

A recipe (vllm-ascend `tests/e2e/*/multi_node/external_dp/config/*.yaml`) names the model, `num_nodes` hosts of
`npu_per_node` NPUs, which node indices prefill and decode (`routing.groups`), each node's DP/TP slice and DP master
(`config[]`), and each node's env and `vllm serve` arguments (`templates[]`) with `${...}` placeholders its harness
fills per rank. Nodes that share a `dp_address` form one instance. The topology keeps what kimictl renders the same
way, maps switches by name whatever their spelling, leaves out what kimictl computes or deliberately does
differently (data/deviations.yml) and lists what it could not map.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from kimictl.errors import InvalidInput, reported
from kimictl.facts import (
    Hardware,
    ModelFacts,
    VersionProfile,
    deviations,
    find_model,
    hardware_catalogue,
    spells_config_key,
    switch_rules,
    switch_spellings,
    version_profile,
)
from kimictl.topology import SERVE_TYPES, Ports, Topology
from kimictl.yamlsrc import load_yaml

ROLES = {"prefiller": "prefill", "decoder": "decode"}
_NODE_IP = re.compile(r"^\$\{NODE_(\d+)_IP\}$")
_PLACEHOLDER = re.compile(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?")
# Flags kimictl computes per engine, and the harness placeholder each recipe gives them.
COMPUTED_FLAGS = {
    "--port": {"$SERVER_PORT", "${PORT}"},
    "--data-parallel-size": {"${DP_SIZE}"},
    "--data-parallel-rank": {"${DP_RANK}"},
    "--data-parallel-address": {"${DP_ADDRESS}"},
    "--data-parallel-rpc-port": {"${DP_RPC_PORT}"},
    "--tensor-parallel-size": {"${TP_SIZE}"},
}
COMPUTED_ENV = {"ASCEND_RT_VISIBLE_DEVICES", "HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME",
                "TP_SOCKET_IFNAME", "VLLM_HOST_IP"}
ENV_DEVIATIONS = {"VLLM_USE_MODELSCOPE": "model-path", "VLLM_SERVER_DEV_MODE": "dev-mode",
                  "SERVER_PORT": "harness-env", "LOCAL_IP": "harness-env", "NIC_NAME": "harness-env",
                  "MASTER_IP": "harness-env"}
FLAG_DEVIATIONS = {"--allowed-local-media-path": "media-path", "--served-model-name": "served-model-name"}
IGNORED_KEYS = {"test_name": "the CI case name (kept in the description)",
                "benchmarks": "CI performance and accuracy cases, not a deployment setting",
                "dp_load_balancing": "external: kimictl's P/D launch is external DP anyway"}


class RecipeError(InvalidInput):
    """The recipe cannot be read or has no kimictl equivalent."""


class Unmapped(BaseModel):
    model_config = ConfigDict(frozen=True)

    where: str
    what: str
    why: str


class Applied(BaseModel):
    """A deviation that applies to this recipe, with what it changes here."""

    model_config = ConfigDict(frozen=True)

    id: str
    what: str
    reason: str
    detail: str


class ImportResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    source: str
    test_name: str
    model_id: str
    known_model: bool
    hardware: str
    hosts: int
    version: str
    topology: dict[str, Any]
    deviations: list[Applied]
    unmapped: list[Unmapped]

    def yaml(self) -> str:
        """The topology as a YAML file with a header saying where it came from."""
        head = [f"# Imported by `kimictl topology import` from {Path(self.source).name} ({self.test_name}),",
                f"# for vllm-ascend {self.version}. Inventory: {self.hosts} {self.hardware} host(s), "
                f"kimi_model_id: {self.model_id}.",
                "# kimictl's deliberate deviations from the recipe (kimictl/data/deviations.yml):"]
        head += [f"#   {d.id}: {d.detail}" for d in self.deviations]
        if self.unmapped:
            head.append("# Not mapped:")
            head += [f"#   {u.where}: {u.what} ({u.why})" for u in self.unmapped]
        body = yaml.safe_dump(self.topology, sort_keys=False, default_flow_style=None, width=120)
        return "\n".join(head) + "\n" + body


class _Collect:
    def __init__(self) -> None:
        self.applied: dict[str, list[str]] = {}
        self.unmapped: list[Unmapped] = []

    def deviate(self, dev: str, detail: str) -> None:
        details = self.applied.setdefault(dev, [])
        if detail not in details:
            details.append(detail)

    def miss(self, where: str, what: str, why: str) -> None:
        item = Unmapped(where=where, what=what, why=why)
        if item not in self.unmapped:
            self.unmapped.append(item)


def load_recipe(path: Path) -> dict[str, Any]:
    doc = load_yaml(path, "recipe")   # a regular file, size-capped, aliases bounded, errors at file:line
    if not isinstance(doc, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping")
    if "deployment" in doc and "templates" not in doc:
        raise RecipeError(f"{path}: an internal-DP (mixed) recipe; kimictl imports the external-DP P/D recipes of "
                          "vllm-ascend's tests/e2e/*/multi_node/external_dp/config/")
    missing = [k for k in ("model", "num_nodes", "npu_per_node", "routing", "config", "templates") if k not in doc]
    if missing:
        raise RecipeError(f"{path}: not a vllm-ascend multi-node recipe (missing {', '.join(missing)})",
                          hint="recipes live in vllm-ascend's tests/e2e/*/multi_node/external_dp/config/")
    return doc


def _env_switch(key: str, value: str) -> tuple[str, bool] | None:
    """(switch, on) for an env spelling of a switch (VLLM_ASCEND_ENABLE_MLAPO=1), else None."""
    for name, sp in switch_spellings():
        if sp.env == key:
            if value == str(sp.value):
                return name, True
            if value in ("0", str(sp.off_value)):
                return name, False
    return None


def _config_switch(path: str, value: Any) -> tuple[str, bool] | None:
    """(switch, on) for an additional-config spelling, top-level or under scheduler_config, else None."""
    for name, sp in switch_spellings():
        if spells_config_key(sp, path):
            if value == sp.value and type(value) is type(sp.value):
                return name, True
            if value == sp.off_value and type(value) is type(sp.off_value):
                return name, False
    return None


def _args(items: list[Any], where: str) -> list[tuple[str, str | None]]:
    """`--flag value` / `--flag` pairs of a server_cmd_template."""
    out: list[tuple[str, str | None]] = []
    items = [str(i) for i in items]
    i = 0
    while i < len(items):
        flag = items[i]
        if not flag.startswith("--"):
            raise RecipeError(f"{where}: '{flag}' is not a flag (a value without its flag?)")
        value = items[i + 1] if i + 1 < len(items) and not items[i + 1].startswith("--") else None
        out.append((flag, value))
        i += 2 if value is not None else 1
    return out


def _json(value: str | None, where: str) -> dict[str, Any]:
    """The JSON object a server_cmd_template flag holds (--kv-transfer-config, --speculative-config, ...)."""
    try:
        doc = json.loads(value or "{}")
    except json.JSONDecodeError as exc:
        raise RecipeError(f"{where}: not JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(doc, dict):
        raise RecipeError(f"{where}: {reported(doc)} is not a JSON object")
    return doc


def _whole(value: Any, where: str) -> int:
    """A count, size, port or index of the recipe: an integer (YAML may quote it)."""
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.isascii()
                                                                    and value.strip().isdigit())):
        raise RecipeError(f"{where}: {reported(value)} is not a whole number")
    return int(value)


def _port(value: Any, where: str, field: str | None = None) -> int:
    """A port of the recipe: a whole number 1-65535, and within the range of kimictl's `ports.<field>` if given."""
    port = _whole(value, where)
    if not 1 <= port <= 65535:
        raise RecipeError(f"{where}: {port} is not a port (1-65535)")
    if field is not None:
        meta = Ports.model_fields[field].metadata
        lo = next(m.ge for m in meta if hasattr(m, "ge"))
        hi = next(m.le for m in meta if hasattr(m, "le"))
        if not lo <= port <= hi:
            raise RecipeError(f"{where}: {port} is outside {lo}-{hi}, the range of the topology's ports.{field}")
    return port


def _typed(flag: str, value: str, where: str) -> Any:
    if flag in SERVE_TYPES and SERVE_TYPES[flag][1].startswith("a mapping"):
        return _json(value, where)
    if flag in SERVE_TYPES:
        try:
            return int(value)
        except ValueError:
            pass
        try:
            return float(value)
        except ValueError:
            raise RecipeError(f"{where}: {value!r} is not a number") from None
    return value


class _Node:
    """One recipe node: its config entry and template, mapped onto a role's settings."""

    def __init__(self, index: int, role: str, cfg: dict[str, Any], template: dict[str, Any]) -> None:
        self.index, self.role, self.cfg, self.template = index, role, cfg, template
        self.env: dict[str, str] = {}
        self.switches: dict[str, bool] = {}
        self.serve: dict[str, Any] = {}
        self.speculative: dict[str, Any] | None = None
        self.kv: dict[str, Any] = {}

    @property
    def where(self) -> str:
        return f"templates[{self.index}]"


def import_recipe(path: Path, version: str | None = None, name: str | None = None) -> ImportResult:
    """Map one recipe onto a topology for vllm-ascend `version` (default: the default profile)."""
    doc = load_recipe(path)
    ver = version_profile(version)
    out = _Collect()
    hw, nodes = _layout(doc, path)
    n = len(nodes)
    _note_top_keys(doc, out)
    instances = _instances(nodes, hw, path)
    ports = _ports(nodes, path)
    read_keys = set(ver.additional_config_keys or [])
    for node in nodes:
        try:
            _map_env(node, ver, out)
            _map_args(node, ver, read_keys, out)
        except RecipeError as exc:   # a node's problem, named by the node's place in the file
            exc.message = f"{path}: {exc.message}"
            raise
    roles, speculative = _roles(nodes, instances, path)
    mid = str(doc["model"])
    model = find_model(mid)
    _note_deviations(out, ver, hw, nodes, mid, model, speculative)
    topo = _topology(path, doc, name, hw, n, instances, ports, roles, speculative)
    devs = deviations()
    return ImportResult(
        source=str(path), test_name=str(doc.get("test_name") or path.stem), model_id=mid,
        known_model=model is not None, hardware=hw.name, hosts=n, version=ver.upstream or ver.version,
        topology=topo, unmapped=out.unmapped,
        deviations=[Applied(id=k, what=devs[k].what, reason=devs[k].reason, detail="; ".join(v))
                    for k, v in out.applied.items()])


def _layout(doc: dict[str, Any], path: Path) -> tuple[Hardware, list[_Node]]:
    """The recipe's hosts: the Atlas hardware its npu_per_node means, and its nodes, each with its role."""
    routing = doc["routing"] or {}
    if not isinstance(routing, dict):
        raise RecipeError(f"{path}: routing is {reported(routing)}, not a mapping (type, groups)")
    if routing.get("type") != "disaggregated_prefill":
        raise RecipeError(f"{path}: routing.type is {routing.get('type')!r}; only disaggregated_prefill (P/D) "
                          "recipes map onto a kimictl topology")
    hw = next((h for h in hardware_catalogue().values() if h.npus == doc["npu_per_node"]), None)
    if hw is None:
        raise RecipeError(f"{path}: npu_per_node {doc['npu_per_node']} matches no Atlas host kimictl knows "
                          f"({', '.join(f'{h.name}: {h.npus}' for h in hardware_catalogue().values())})")
    n = _whole(doc["num_nodes"], f"{path}: num_nodes")
    configs, templates = doc["config"], doc["templates"]
    for key, entries in (("config", configs), ("templates", templates)):
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise RecipeError(f"{path}: {key} must be a list of mappings, one per node")
    if len(configs) != n or len(templates) != n:
        raise RecipeError(f"{path}: {len(configs)} config and {len(templates)} templates entries for "
                          f"num_nodes {n}")
    for i, tpl in enumerate(templates):
        if not isinstance(tpl.get("envs") or {}, dict):
            raise RecipeError(f"{path}: templates[{i}].envs is {reported(tpl['envs'])}, not a mapping of "
                              "NAME: value (a list of NAME=VALUE is not what the recipes' harness reads)")
    for i, cfg in enumerate(configs):   # the recipes' harness (external_dp_config.py) requires it too
        if "node_index" in cfg and _whole(cfg["node_index"], f"{path}: config[{i}].node_index") != i:
            raise RecipeError(f"{path}: config[{i}].node_index is {cfg['node_index']}: config entry {i} is node {i} "
                              "(node_index, when given, must equal the entry's position)")
    groups = routing.get("groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(idx, list) for idx in groups.values()):
        raise RecipeError(f"{path}: routing.groups must map prefiller and decoder to lists of node indices")
    role_of = {_whole(i, f"{path}: routing.groups.{g}"): ROLES[g] for g, idx in groups.items() if g in ROLES
               for i in idx}
    for g in groups:
        if g not in ROLES:
            raise RecipeError(f"{path}: routing.groups.{g}: kimictl knows the groups prefiller and decoder")
    if sorted(role_of) != list(range(n)) or set(role_of.values()) != {"prefill", "decode"}:
        raise RecipeError(f"{path}: routing.groups must give every node index 0..{n - 1} a role, "
                          "with at least one prefiller and one decoder")
    return hw, [_Node(i, role_of[i], configs[i], templates[i]) for i in range(n)]


def _note_top_keys(doc: dict[str, Any], out: _Collect) -> None:
    """Top-level recipe keys kimictl ignores or does not read."""
    for key in doc:
        if key in IGNORED_KEYS:
            if key != "test_name":
                out.miss(key, "ignored", IGNORED_KEYS[key])
        elif key not in ("model", "num_nodes", "npu_per_node", "routing", "config", "templates") \
                and not key.startswith("env_"):
            out.miss(key, "not read", "kimictl has no equivalent")


def _roles(nodes: list[_Node], instances: dict[str, dict[str, int]],
           path: Path) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The topology's roles (from each role's nodes, which must agree) and its speculative section."""
    roles: dict[str, dict[str, Any]] = {}
    speculative: dict[str, Any] = {}
    for role in ("prefill", "decode"):
        members = [nd for nd in nodes if nd.role == role]
        first = members[0]
        for other in members[1:]:
            for attr in ("env", "switches", "serve", "speculative"):
                if getattr(other, attr) != getattr(first, attr):
                    raise RecipeError(f"{path}: {first.where} and {other.where} (both {role}) differ in {attr}; "
                                      "kimictl gives every instance of a role the same settings")
        shape = instances[role]
        roles[role] = {"nodes": shape["nodes"], "dp": shape["dp"], "tp": shape["tp"], "env": dict(first.env),
                       "switches": dict(first.switches), "serve": dict(first.serve)}
        if first.speculative:
            _add_draft(speculative, role, first.speculative, path)
        _check_kv_shapes(first, instances, path)
    return roles, speculative


def _add_draft(speculative: dict[str, Any], role: str, spec: dict[str, Any], path: Path) -> None:
    """Merge one role's --speculative-config into the topology's single draft."""
    if speculative and (speculative["method"], speculative["model_id"]) != (spec["method"], spec["model"]):
        raise RecipeError(f"{path}: prefill and decode use different drafts; kimictl has one per topology")
    speculative.setdefault("method", spec["method"])
    speculative.setdefault("model_id", spec["model"])
    speculative.setdefault("num_speculative_tokens", {})[role] = spec["num_speculative_tokens"]


def _check_kv_shapes(node: _Node, instances: dict[str, dict[str, int]], path: Path) -> None:
    """A node's kv_connector_extra_config shapes must be the instances' shapes."""
    for kv_key in ("prefill", "decode"):
        want = {"dp_size": instances[kv_key]["dp"], "tp_size": instances[kv_key]["tp"]}
        got = node.kv.get(kv_key)
        if got is not None and got != want:
            raise RecipeError(f"{path}: {node.where} kv_connector_extra_config.{kv_key} is {got}; the "
                              f"{kv_key} instances are DP{want['dp_size']}xTP{want['tp_size']}")


def _note_deviations(out: _Collect, ver: VersionProfile, hw: Hardware, nodes: list[_Node], mid: str,
                     model: ModelFacts | None, speculative: dict[str, Any]) -> None:
    """The deviations every import applies (with this recipe's details), and what is never mapped."""
    out.deviate("model-path", f"engines load kimi_model_dir; set kimi_model_id: {mid} for `kimictl weights`")
    out.deviate("served-model-name", f"kimictl --served-model-name {model.served_model_name if model else 'kimi-k2.5'}")
    out.deviate("media-path", "kimictl --allowed-local-media-path kimi_media_dir (default /var/lib/kimi/media)")
    out.deviate("api-key", "clients send kimi_api_key_file's key to kimictl's proxy front (when set)")
    out.deviate("kv-port", f"kv_port ranges from {hw.kv_port_min} (per instance)")
    out.deviate("engine-id", "engine_id is the instance name (prefill-0, ..., decode-0)")
    timeouts = {k: ver.env[k] for k in ("HCCL_EXEC_TIMEOUT", "HCCL_CONNECT_TIMEOUT") if k in ver.env}
    if any(k not in (nd.template.get("envs") or {}) for nd in nodes for k in timeouts):
        out.deviate("hccl-timeouts", ", ".join(f"{k}={v}" for k, v in timeouts.items()) + " on every engine")
    out.deviate("host-ip", "VLLM_HOST_IP=<host IP> on every engine")
    out.deviate("engine-bind", "engines listen on --host <host IP>, not 0.0.0.0")
    if ver.env_prepend:
        out.deviate("mooncake-lib-path", "LD_LIBRARY_PATH prepended: " + ", ".join(ver.env_prepend.values()))
    if ver.preload:
        out.deviate("jemalloc", "LD_PRELOAD " + ", ".join(ver.preload) + " when present")
    if any(nd.cfg.get("dp_size") == 1 for nd in nodes):
        out.deviate("dp-rank-at-dp1", "no --data-parallel-rank for the DP-size-1 instances")
    if speculative:
        out.deviate("draft-path", f"the draft loads from kimi_draft_model_dir ({speculative['model_id']} staged "
                                  "there); speculative decoding is on only when it is set")
    out.miss("routing", "the CI proxy (load_balance_proxy_server_example.py on node 0, port 1999)",
             "kimictl runs the same proxy (proxy.router vllm-ascend-proxy, the default) as copies behind its proxy "
             "front on port 8000 of the proxy host")
    if not model:
        out.miss("model", mid, "no kimictl model facts; the plan estimates HBM with Kimi K2.5 W4A8's numbers")


def _topology(path: Path, doc: dict[str, Any], name: str | None, hw: Hardware, n: int,
              instances: dict[str, dict[str, int]], ports: dict[str, int], roles: dict[str, dict[str, Any]],
              speculative: dict[str, Any]) -> dict[str, Any]:
    """The topology document (settings both roles share lifted to the top level), checked by Topology."""
    common_env = _common(roles, "env")
    common_serve = _common(roles, "serve")
    topo: dict[str, Any] = {
        "name": name or _name(path),
        "description": f"Imported from vllm-ascend recipe {doc.get('test_name') or path.stem} "
                       f"({n} {hw.name} hosts)",
        "hardware": hw.name,
        "mode": "pd",
        "launch": "external-dp",
        "share": {"prefill": instances["prefill"]["count"], "decode": instances["decode"]["count"]},
        "ports": ports,
        "proxy": {"port": 8000},
    }
    if common_env:
        topo["env"] = common_env
    topo["serve"] = common_serve
    topo["roles"] = roles
    for role in roles.values():
        for key in ("env", "switches", "serve"):
            if not role[key]:
                del role[key]
    if speculative:
        topo["speculative"] = speculative
    try:
        Topology(**topo, source=str(path))
    except ValidationError as exc:
        raise RecipeError(f"{path}: the imported topology is not valid",
                          details=[f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]) from None
    return topo


def _name(path: Path) -> str:
    stem = re.sub(r"[^a-z0-9._-]+", "-", path.stem.lower()).strip("-._")
    return (stem or "imported")[:63]


def _common(roles: dict[str, dict[str, Any]], key: str) -> dict[str, Any]:
    """Entries equal in both roles move to the topology level."""
    p, d = roles["prefill"][key], roles["decode"][key]
    common = {k: v for k, v in p.items() if k in d and d[k] == v}
    for k in common:
        del p[k], d[k]
    return common


def _cfg(nd: _Node, key: str, default: int, path: Path) -> int:
    return _whole(nd.cfg.get(key, default), f"{path}: config[{nd.index}].{key}")


def _instances(nodes: list[_Node], hw: Hardware, path: Path) -> dict[str, dict[str, int]]:
    """Per role: hosts per instance, DP and TP of one instance, and how many instances (from dp_address)."""
    shapes: dict[str, dict[str, int]] = {}
    for role in ("prefill", "decode"):
        groups: dict[int, list[_Node]] = {}
        for nd in (x for x in nodes if x.role == role):
            for key in ("cp_size", "sp_size", "pp_size"):
                if _cfg(nd, key, 1, path) != 1:
                    raise RecipeError(f"{path}: config[{nd.index}].{key} is {nd.cfg[key]}; kimictl plans DP x TP only")
            for key in ("dp_size", "dp_size_local", "tp_size"):
                if _cfg(nd, key, 1, path) < 1:
                    raise RecipeError(f"{path}: config[{nd.index}].{key} is {nd.cfg[key]}: a parallel size is at "
                                      "least 1")
            addr = str(nd.cfg.get("dp_address", ""))
            m = _NODE_IP.match(addr)
            master = int(m.group(1)) if m else (nd.index if addr in ("${LOCAL_IP}", "") else None)
            if master is None:
                raise RecipeError(f"{path}: config[{nd.index}].dp_address {addr!r}: kimictl needs ${{NODE_<i>_IP}}")
            groups.setdefault(master, []).append(nd)
        shape = None
        for master, members in groups.items():
            members.sort(key=lambda x: _cfg(x, "dp_rank_start", 0, path))
            if members[0].index != master:
                raise RecipeError(f"{path}: the DP master of nodes {[x.index for x in members]} is node {master}, "
                                  "which does not hold rank 0; kimictl makes an instance's first host its master")
            m0 = members[0]
            dp, tp = _cfg(m0, "dp_size", 1, path), _cfg(m0, "tp_size", 1, path)
            local = _cfg(m0, "dp_size_local", 1, path)
            if local * tp > hw.npus:
                raise RecipeError(f"{path}: config[{m0.index}] runs dp_size_local {local} x tp_size {tp} = "
                                  f"{local * tp} NPUs on one node; npu_per_node is {hw.npus}")
            for k, nd in enumerate(members):
                if (_cfg(nd, "dp_size", 1, path), _cfg(nd, "tp_size", 1, path), _cfg(nd, "dp_size_local", 1, path),
                        _cfg(nd, "dp_rank_start", 0, path)) != (dp, tp, local, k * local):
                    raise RecipeError(f"{path}: config[{nd.index}] does not continue instance {master}'s ranks "
                                      f"(kimictl splits DP{dp} evenly: {local} ranks per host, in host order)")
            if local * len(members) != dp:
                raise RecipeError(f"{path}: the instance mastered by node {master} covers {local * len(members)} of "
                                  f"its {dp} DP ranks")
            this = {"nodes": len(members), "dp": dp, "tp": tp}
            if shape is not None and this != shape:
                raise RecipeError(f"{path}: {role} instances differ in shape ({shape} vs {this}); kimictl gives "
                                  "every instance of a role the same shape")
            shape = this
        assert shape is not None
        # kimictl puts a role's hosts into instances in host order: instance members must be consecutive.
        order = [x.index for x in nodes if x.role == role]
        if [x.index for m in sorted(groups) for x in groups[m]] != order:
            raise RecipeError(f"{path}: the {role} instances interleave hosts; kimictl fills instances in host order")
        shapes[role] = {**shape, "count": len(groups)}
    return shapes


def _ports(nodes: list[_Node], path: Path) -> dict[str, int]:
    def port(nd: _Node, key: str, default: int, field: str) -> int:
        return _port(nd.cfg.get(key, default), f"{path}: config[{nd.index}].{key}", field)

    http = {port(nd, "port_start", 7100, "http_base") for nd in nodes}
    rpc = {port(nd, "dp_rpc_port", 12321, "rpc") for nd in nodes}
    if len(http) != 1 or len(rpc) != 1:
        raise RecipeError(f"{path}: port_start {sorted(http)} and dp_rpc_port {sorted(rpc)} differ between nodes; "
                          "kimictl uses one of each for the whole deployment")
    return {"http_base": http.pop(), "rpc": rpc.pop()}


def _map_env(node: _Node, ver: VersionProfile, out: _Collect) -> None:
    rules = switch_rules()
    for key, raw in (node.template.get("envs") or {}).items():
        value = str(raw)
        where = f"{node.where}.envs.{key}"
        if key in ENV_DEVIATIONS:
            out.deviate(ENV_DEVIATIONS[key], f"{key} not rendered")
            continue
        if key in COMPUTED_ENV:
            continue
        if _PLACEHOLDER.search(value):
            out.miss(where, value, "a CI harness placeholder kimictl has no value for")
            continue
        switch = _env_switch(key, value)
        if switch:
            _set_switch(node, *switch, f"env {key}={value}", rules, out)
            continue
        if key in ver.removed_env:
            out.miss(where, f"{key}={value}", ver.removed_env[key])
            continue
        if ver.env.get(key) == value:
            continue  # the version profile sets it already
        node.env[key] = value


def _set_switch(node: _Node, name: str, on: bool, spelled: str, rules, out: _Collect) -> None:
    if node.role not in rules[name].roles:
        out.deviate("switch-not-for-role", f"{spelled} on {node.role} not rendered (vllm-ascend ignores it there)")
        return
    out.deviate("switch-spelling", f"{spelled} -> switch {name}: {str(on).lower()}")
    node.switches[name] = on


def _map_args(node: _Node, ver: VersionProfile, read_keys: set[str], out: _Collect) -> None:
    rules = switch_rules()
    args = _args(node.template.get("server_cmd_template") or [], f"{node.where}.server_cmd_template")
    seen: set[str] = set()
    for flag, value in args:
        where = f"{node.where}: {flag}"
        if flag in seen:
            out.miss(where, "given twice", "kimictl keeps the last one")
        seen.add(flag)
        if flag == "--host":
            if value != "0.0.0.0":
                out.miss(where, str(value), "kimictl's engines listen on 0.0.0.0")
            continue
        if flag in COMPUTED_FLAGS:
            if value not in COMPUTED_FLAGS[flag]:
                out.miss(where, str(value), "kimictl computes it from the plan")
            continue
        if flag in FLAG_DEVIATIONS:
            out.deviate(FLAG_DEVIATIONS[flag], f"recipe {flag} {value}")
            continue
        if value is not None and _PLACEHOLDER.search(value):
            out.miss(where, value, "a CI harness placeholder kimictl has no value for")
            continue
        if flag in ("--headless", "--data-parallel-start-rank", "--data-parallel-size-local"):
            out.miss(where, str(value), "internal-DP flags; P/D instances run external DP here")
            continue
        if flag == "--api-key":
            out.miss(where, "(a key)", "secrets never go on an argv; set kimi_api_key_file (checked at kimictl's "
                                       "proxy front)")
            continue
        if flag == "--kv-transfer-config":
            _map_kv(node, _json(value, where), ver, out)
            continue
        if flag == "--speculative-config":
            spec = _json(value, where)
            extra = sorted(set(spec) - {"method", "model", "num_speculative_tokens"})
            if extra:
                out.miss(where, ", ".join(extra), "kimictl renders method, model and num_speculative_tokens only")
            if spec.get("method") not in ("eagle3", "dflash"):
                out.miss(where, f"method {spec.get('method')}", "kimictl knows eagle3 and dflash")
                continue
            missing = [k for k in ("model", "num_speculative_tokens") if k not in spec]
            if missing:
                raise RecipeError(f"{where}: no {' and no '.join(missing)}")
            node.speculative = {k: spec[k] for k in ("method", "model", "num_speculative_tokens")}
            continue
        if flag == "--additional-config":
            _map_additional(node, _json(value, where), read_keys, ver, rules, out)
            continue
        key = flag[2:]
        node.serve[key] = True if value is None else _typed(key, value, where)


def _map_additional(node: _Node, extra: dict[str, Any], read_keys: set[str], ver: VersionProfile, rules,
                    out: _Collect) -> None:
    raw: dict[str, Any] = {}
    for key, value in extra.items():
        items = [(f"{key}.{k}", v) for k, v in value.items()] if key == "scheduler_config" and \
            isinstance(value, dict) else [(key, value)]
        for path, v in items:
            switch = _config_switch(path, v)
            if switch:
                _set_switch(node, *switch, f"additional-config {path}={json.dumps(v)}", rules, out)
            elif read_keys and key not in read_keys:
                out.deviate("unread-additional-config", f"{path} not rendered (vllm-ascend {ver.version} does "
                                                        "not read it)")
            elif path != key:
                raw.setdefault(key, {})[path.split(".", 1)[1]] = v
            else:
                raw[key] = v
    if raw:
        node.serve["additional-config"] = raw


def _map_kv(node: _Node, kv: dict[str, Any], ver: VersionProfile, out: _Collect) -> None:
    where = f"{node.where}: --kv-transfer-config"
    if kv.get("kv_connector") != ver.kv_connector:
        raise RecipeError(f"{where}: kv_connector {kv.get('kv_connector')!r}; kimictl renders {ver.kv_connector}")
    want = "kv_producer" if node.role == "prefill" else "kv_consumer"
    if kv.get("kv_role") != want:
        raise RecipeError(f"{where}: kv_role {kv.get('kv_role')!r} on a {node.role} node (expected {want})")
    if "kv_port" in kv:   # kimictl gives each instance its own (a deviation), but a value that is no port is a typo
        _port(kv["kv_port"], f"{where}: kv_port")
    for key in sorted(set(kv) - {"kv_connector", "kv_role", "kv_port", "engine_id", "kv_connector_extra_config"}):
        out.miss(where, f"{key}={json.dumps(kv[key])}", "kimictl renders the registered connector name only"
                 if key == "kv_connector_module_path" else "kimictl has no setting for it")
    extra = dict(kv.get("kv_connector_extra_config") or {})
    if extra.pop("use_ascend_direct", None) is not None:
        out.deviate("use-ascend-direct", "kv_connector_extra_config.use_ascend_direct not rendered")
    node.kv = {k: extra.pop(k) for k in ("prefill", "decode") if k in extra}
    for key in sorted(extra):
        out.miss(where, f"kv_connector_extra_config.{key}", "kimictl renders the prefill/decode sizes only")
