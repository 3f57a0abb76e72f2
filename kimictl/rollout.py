"""Rollout: change a running P/D deployment slice by slice - one DP group (instance) at a time, drained from the
proxy, restarted on the new release, health + pair-smoke gated, re-added - with a canary first and an automatic
rollback of the touched slices to the last good release when a gate fails.

The pure parts (--set parsing, slicing, P/D compatibility, ordering) take no hosts and are unit-tested; the
`Rollout` class drives the hosts through `EngineOps` (the deploy's playbooks and readiness) and the routers
through their admin HTTP API (`RouterAdmin`)."""

from __future__ import annotations

import difflib
import getpass
import hashlib
import json
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kimictl import health
from kimictl.deploy import (
    LIVE_STATES,
    ROLLBACK_READY_TIMEOUT_S,
    STOP_GRACE_S,
    DeployOptions,
    EngineOps,
    HostObservation,
    Proc,
    desired_procs,
    observe,
    process_tag,
)
from kimictl.errors import HostError, InvalidInput, InventoryError, KimictlError, TopologyError
from kimictl.inventory import KEYS, ClusterSettings, Inventory
from kimictl.render import Rendered, write_rendered
from kimictl.secret_file import proxy_admin_key
from kimictl.state import control_dir
from kimictl.topology import Ports, Proxy, Role, Speculative, Topology

ROLLOUT_SCHEMA_VERSION = 1
ROLES = ("prefill", "decode", "colocated")
# Flags whose values shape the KV cache a prefill engine hands to a decode engine: both sides must agree.
KV_SHAPE_FLAGS = ("block-size", "kv-cache-dtype", "quantization")
# What a drained endpoint may still hold: requests running or queued, and (simulator) KV waiting to be pulled.
BUSY_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "kimi_sim:kv_transfer_held_requests")
# Counters that move whenever the endpoint serves anything: a change means a request arrived meanwhile.
ACTIVITY_COUNTERS = ("vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                     "kimi_sim:kv_transfer_sent_requests_total", "kimi_sim:kv_transfer_failed_requests_total")
# vllm-router's answer when its static P/D mode is asked to add a worker at runtime.
STATIC_PD_ROUTER_MARK = "add_prefill_server or add_decode_server"


# --- --set: K=V over the topology (and cluster-wide inventory keys) -----------------------------------------


@dataclass(frozen=True)
class Setting:
    """One `--set KEY=VALUE`: where it lands and the parsed value (None deletes the key)."""

    raw: str
    key: str
    target: str  # topology | inventory
    path: tuple[str, ...]
    value: Any


# Topology fields that are free-form maps (any key), nested models (fixed keys) and scalars.
_TOPO_MAPS = {"env", "serve", "switches", "share"}
_TOPO_MODELS: dict[str, type] = {"ports": Ports, "proxy": Proxy, "speculative": Speculative}
_ROLE_FIELDS = [f for f in Role.model_fields]
_TOPO_FIELDS = [f for f in Topology.model_fields if f != "source"]
_NOT_SETTABLE_INVENTORY = {"kimi_cluster": "renaming the cluster is not a change of the running deployment"}


def _dym(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _bad(item: str, why: str) -> InvalidInput:
    return InvalidInput(f"--set {item}: {why}",
                        hint="keys are topology paths (decode.serve.max-num-seqs=32, prefill.env.NAME=1, "
                             "decode.tp=4, serve.seed=7, proxy.policy=random) or cluster-wide inventory keys "
                             "(kimi_vllm_ascend_version=0.18.0); see `kimictl schema topology`")


def _value(text: str, *, as_string: bool) -> Any:
    """YAML scalar/flow value (`32`, `true`, `0.9`, `{a: 1}`, `null`); env values and inventory keys stay text."""
    import yaml

    if text.strip() in ("null", "~"):
        return None
    if as_string:
        return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_set(item: str, topo: Topology) -> Setting:
    """Parse and locate one K=V; an unknown key is an error naming the key, with a did-you-mean."""
    key, sep, raw_value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise _bad(item, "expected KEY=VALUE")
    if raw_value == "":
        raise _bad(item, "empty value (write KEY=null to remove a key)")
    if key.startswith("kimi_"):
        spec = KEYS.get(key)
        if spec is None:
            raise _bad(item, f"unknown inventory key '{key}'{_dym(key, list(KEYS))}")
        if spec.scope != "cluster":
            raise _bad(item, f"'{key}' is a per-host inventory key; --set changes cluster-wide (all.vars) keys only")
        if key in _NOT_SETTABLE_INVENTORY:
            raise _bad(item, f"'{key}' cannot be rolled out: {_NOT_SETTABLE_INVENTORY[key]}")
        return Setting(item, key, "inventory", (key,), _value(raw_value, as_string=True))
    parts = key.split(".")
    if any(not p for p in parts):
        raise _bad(item, f"'{key}' has an empty path component")
    if parts[0] in ROLES:  # shorthand: decode.serve.X == roles.decode.serve.X
        parts = ["roles", *parts]
    head = parts[0]
    if head not in _TOPO_FIELDS:
        raise _bad(item, f"unknown topology key '{head}'{_dym(head, [*_TOPO_FIELDS, *ROLES])}; "
                         f"top-level keys: {', '.join(_TOPO_FIELDS)}, or a role ({', '.join(topo.roles)})")
    if head == "source":
        raise _bad(item, "'source' is not a topology setting")
    as_string = False
    if head == "roles":
        if len(parts) < 3:
            raise _bad(item, f"'{key}' names a whole role; set one of its keys ({', '.join(_ROLE_FIELDS)})")
        role = parts[1]
        if role not in topo.roles:
            raise _bad(item, f"topology {topo.name} has no role '{role}'{_dym(role, list(topo.roles))}; "
                             f"roles: {', '.join(topo.roles)}")
        fld = parts[2]
        if fld not in _ROLE_FIELDS:
            raise _bad(item, f"unknown key '{fld}' of role {role}{_dym(fld, _ROLE_FIELDS)}; "
                             f"role keys: {', '.join(_ROLE_FIELDS)}")
        _check_depth(item, parts[2:], fld in _TOPO_MAPS)
        as_string = fld == "env"
    elif head in _TOPO_MAPS:
        _check_depth(item, parts, True)
        as_string = head == "env"
    elif head in _TOPO_MODELS:
        model = _TOPO_MODELS[head]
        names = list(model.model_fields)
        if len(parts) == 1:
            raise _bad(item, f"'{head}' is a section; set one of its keys ({', '.join(names)})")
        if parts[1] not in names:
            raise _bad(item, f"unknown key '{parts[1]}' of {head}{_dym(parts[1], names)}; keys: {', '.join(names)}")
        nested_map = head == "speculative" and parts[1] == "num_speculative_tokens"
        _check_depth(item, parts[1:], nested_map)
    else:
        _check_depth(item, parts, False)
    if parts[-2] == "serve":
        _check_serve_flag(item, parts[-1], topo)
    return Setting(item, key, "topology", tuple(parts), _value(raw_value, as_string=as_string))


def _check_serve_flag(item: str, flag: str, topo: Topology) -> None:
    """A serve flag the topology does not set yet but that is one typo away from one it sets is a mistake."""
    known = set(topo.serve) | {f for r in topo.roles.values() for f in r.serve}
    if flag.startswith("-"):
        raise _bad(item, f"serve flag '{flag}': write it without leading dashes")
    if flag not in known:
        close = difflib.get_close_matches(flag, sorted(known), n=1, cutoff=0.85)
        if close:
            raise _bad(item, f"serve flag '{flag}' is not set by topology {topo.name} (did you mean '{close[0]}'?)")


def _check_depth(item: str, tail: list[str], is_map: bool) -> None:
    want = 2 if is_map else 1
    if len(tail) != want:
        what = f"'{tail[0]}' is a map: name one entry, e.g. {tail[0]}.NAME=VALUE" if is_map else \
            f"'{tail[0]}' takes a value, not a sub-key"
        if is_map and len(tail) == 1:
            raise _bad(item, what)
        raise _bad(item, what if len(tail) > want else f"'{'.'.join(tail)}' is incomplete")


def parse_sets(items: list[str], topo: Topology) -> list[Setting]:
    out: list[Setting] = []
    seen: dict[tuple[str, ...], str] = {}
    for item in items:
        s = parse_set(item, topo)
        if s.path in seen:
            raise _bad(item, f"'{s.key}' is already set by --set {seen[s.path]}")
        seen[s.path] = item
        out.append(s)
    return out


def apply_sets(topo: Topology, inv: Inventory, sets: list[Setting]) -> tuple[Topology, Inventory]:
    """The topology and inventory with the settings applied, validated like files on disk (exit 2 on error)."""
    from pydantic import ValidationError

    new_topo, new_inv = topo, inv
    topo_sets = [s for s in sets if s.target == "topology"]
    if topo_sets:
        doc = topo.model_dump(mode="json", exclude={"source"})
        for s in topo_sets:
            node = doc
            for part in s.path[:-1]:
                if node.get(part) is None:
                    node[part] = {}
                node = node[part]
            if s.value is None and s.path[-1] in node and len(s.path) > 1 and s.path[-2] in (
                    *_TOPO_MAPS, "num_speculative_tokens"):
                del node[s.path[-1]]
            else:
                node[s.path[-1]] = s.value
        try:
            new_topo = Topology(**doc, source=topo.source)
        except ValidationError as exc:
            raise TopologyError(f"--set makes topology {topo.name} invalid",
                                details=[_blame(e, topo_sets) for e in exc.errors()]) from None
    inv_sets = [s for s in sets if s.target == "inventory"]
    if inv_sets:
        values = inv.cluster.model_dump(exclude_unset=True)
        for s in inv_sets:
            if s.value is None:
                values.pop(s.key, None)
            else:
                values[s.key] = s.value
        try:
            cluster = ClusterSettings(**values)
        except ValidationError as exc:
            raise InventoryError("--set makes the inventory invalid",
                                 details=[_blame(e, inv_sets) for e in exc.errors()]) from None
        new_inv = inv.model_copy(update={"cluster": cluster})
    return new_topo, new_inv


def _blame(err: dict, sets: list[Setting]) -> str:
    loc = tuple(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    hits = [s for s in sets if s.path[:len(loc)] == loc or loc[:len(s.path)] == s.path
            or (loc and loc == s.path[:-1] and f"'{s.path[-1]}'" in msg)]
    where = ", ".join(f"--set {s.raw}" for s in hits) or ".".join(loc) or "(topology)"
    return f"{where}: {msg}"


def effective_topology_yaml(topo: Topology) -> str:
    """The topology with --set applied, as a file `kimictl deploy/rollout --topology` accepts."""
    import yaml

    return yaml.safe_dump(topo.model_dump(mode="json", exclude={"source"}), sort_keys=False)


# --- slices and what changes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    engine: str
    host: str
    ip: str
    port: int
    role: str

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"


@dataclass(frozen=True)
class Slice:
    """One DP group (instance): the unit that restarts together (its ranks share a DP master and a kv_port)."""

    name: str
    role: str
    hosts: tuple[str, ...]
    engines: tuple[str, ...]
    endpoints: tuple[Endpoint, ...]


def slices_of(rendered: Rendered) -> dict[str, Slice]:
    """Every instance of the plan as a slice, in plan order."""
    out: dict[str, Slice] = {}
    for inst in rendered.plan.instances:
        engines = [e for e in rendered.engines if e.instance == inst.name]
        out[inst.name] = Slice(inst.name, inst.role, tuple(inst.hosts), tuple(e.id for e in engines),
                               tuple(Endpoint(e.id, e.host, e.host_ip, e.port, e.role)
                                     for e in engines if e.serves_http))
    return out


@dataclass
class Analysis:
    touched: list[Slice]
    unchanged: list[Slice]
    changed_engines: dict[str, list[str]]  # slice -> engine ids whose files differ
    proxy_changed: bool
    changed_hosts: dict[str, tuple[str | None, str]]  # host -> (old release, new release)
    problems: list[str]  # reasons a rolling change is impossible (the rollout is refused)


def _engine_layout(rendered: Rendered) -> dict[str, tuple]:
    return {e.id: (e.instance, e.host, e.port, tuple(e.devices), e.serves_http, tuple(e.dp_ranks))
            for e in rendered.engines}


def analyze(old: Rendered, new: Rendered) -> Analysis:
    """Which slices the new render changes against the deployed one, and whether slice-wise is possible at all."""
    problems: list[str] = []
    old_l, new_l = _engine_layout(old), _engine_layout(new)
    if old.plan.mode != new.plan.mode:
        problems.append(f"mode changes from {old.plan.mode} to {new.plan.mode}")
    old_inst = {i.name: tuple(i.hosts) for i in old.plan.instances}
    new_inst = {i.name: tuple(i.hosts) for i in new.plan.instances}
    if old_inst != new_inst:
        gone = sorted(set(old_inst) - set(new_inst))
        added = sorted(set(new_inst) - set(old_inst))
        moved = sorted(n for n in set(old_inst) & set(new_inst) if old_inst[n] != new_inst[n])
        problems.append("the instance layout changes (" + "; ".join(
            p for p in (f"removed {', '.join(gone)}" if gone else "", f"added {', '.join(added)}" if added else "",
                        f"moved {', '.join(moved)}" if moved else "") if p) + ")")
    if old_l != new_l and old_inst == new_inst:
        diff = sorted(set(old_l) ^ set(new_l)) or sorted(k for k in old_l if old_l[k] != new_l.get(k))
        problems.append("engines change shape (ids, ports, NPUs or DP ranks): " + ", ".join(diff[:6]))
    if (old.proxy is None) != (new.proxy is None) or (
            old.proxy and new.proxy and (old.proxy.host_name, old.proxy.port) != (new.proxy.host_name,
                                                                                  new.proxy.port)):
        problems.append("the proxy moves (host or port): clients would have to follow it")
    new_slices = slices_of(new)
    changed: dict[str, list[str]] = {}
    for e in new.engines:
        if e.id in old_l and e.host in old.files and \
                process_tag(old.files[e.host], e.id) != process_tag(new.files[e.host], e.id):
            changed.setdefault(e.instance, []).append(e.id)
    proxy_changed = bool(old.proxy and new.proxy and old.proxy.host_name in old.files and
                         process_tag(old.files[old.proxy.host_name], "proxy")
                         != process_tag(new.files[new.proxy.host_name], "proxy"))
    hosts = {h: (old.releases.get(h), r) for h, r in new.releases.items() if old.releases.get(h) != r}
    touched = [s for n, s in new_slices.items() if n in changed]
    unchanged = [s for n, s in new_slices.items() if n not in changed]
    return Analysis(touched, unchanged, changed, proxy_changed, hosts, problems)


# --- P/D compatibility of mixed states ----------------------------------------------------------------------


@dataclass(frozen=True)
class PdSide:
    """What one engine brings to a P/D pair."""

    engine: str
    release: str  # "old" | "new"
    role: str
    tp: int
    dp: int
    connector: str | None
    extra: dict[str, Any]
    version: str
    hardware: str
    model: str
    served: str
    kv_shape: tuple[tuple[str, Any], ...]


def _flags(argv: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, item in enumerate(argv):
        if item.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[item[2:]] = nxt if nxt is not None and not nxt.startswith("--") else True
    return out


def pd_side(rendered: Rendered, engine_id: str, release: str) -> PdSide:
    e = next(x for x in rendered.engines if x.id == engine_id)
    flags = _flags(e.argv)
    kv: dict[str, Any] = {}
    if isinstance(flags.get("kv-transfer-config"), str):
        try:
            kv = json.loads(flags["kv-transfer-config"])
        except ValueError:
            kv = {}
    model = e.argv[e.argv.index("serve") + 1] if "serve" in e.argv[:-1] else rendered.plan.model_dir
    return PdSide(e.id, release, e.role, e.tp_size, e.dp_size, kv.get("kv_connector"),
                  kv.get("kv_connector_extra_config") or {}, rendered.plan.vllm_ascend_version,
                  rendered.plan.hardware, model, str(flags.get("served-model-name") or rendered.plan.served_model_name),
                  tuple((f, flags.get(f)) for f in KV_SHAPE_FLAGS))


def pair_problems(p: PdSide, d: PdSide) -> list[str]:
    """Why prefill engine p cannot hand KV to decode engine d (empty: compatible). Rules of vllm-ascend's
    MooncakeConnectorV1: one connector, prefill TP >= decode TP and divisible, each side's declared view of the
    other side's sizes matches reality, one vllm-ascend version, one hardware kind, one checkpoint, one KV shape."""
    who = f"{p.release} {p.engine} -> {d.release} {d.engine}"
    out: list[str] = []
    if p.connector != d.connector:
        out.append(f"{who}: kv_connector {p.connector} vs {d.connector}")
    if p.tp < d.tp or p.tp % d.tp:
        out.append(f"{who}: prefill TP {p.tp} must be >= decode TP {d.tp} and divisible by it")
    for side, other, view in ((p, d, "decode"), (d, p, "prefill")):
        declared = side.extra.get(view) if isinstance(side.extra, dict) else None
        if isinstance(declared, dict):
            for key, actual in (("tp_size", other.tp), ("dp_size", other.dp)):
                if key in declared and int(declared[key]) != actual:
                    out.append(f"{who}: {side.engine} declares {view} {key} {declared[key]}, "
                               f"{other.engine} runs {actual}")
    if p.version != d.version:
        out.append(f"{who}: vllm-ascend {p.version} vs {d.version} (a P/D pair must run one version)")
    if p.hardware != d.hardware:
        out.append(f"{who}: hardware {p.hardware} vs {d.hardware}")
    if (p.model, p.served) != (d.model, d.served):
        out.append(f"{who}: checkpoint {p.model} ({p.served}) vs {d.model} ({d.served})")
    for (flag, pv), (_, dv) in zip(p.kv_shape, d.kv_shape, strict=True):
        if pv != dv:
            out.append(f"{who}: --{flag} {pv} vs {dv} (the KV blocks would not line up)")
    return out


def mixed_pairs(old: Rendered, new: Rendered, touched: list[Slice], first: str) -> list[tuple[PdSide, PdSide]]:
    """The new (prefill, decode) pairs the router may form while the rollout goes role `first` first."""
    t_names = {s.name for s in touched}

    def sides(rendered: Rendered, role: str, release: str, only_touched: bool | None) -> list[PdSide]:
        return [pd_side(rendered, e.id, release) for e in rendered.engines if e.role == role and e.serves_http
                and (only_touched is None or (e.instance in t_names) == only_touched)]

    second = "prefill" if first == "decode" else "decode"
    pairs: list[tuple[PdSide, PdSide]] = []
    # Phase 1: `first` rolls while every `second` engine still runs the old release.
    a_new, b_old = sides(new, first, "new", True), sides(old, second, "old", None)
    # Phase 2: `second` rolls while every `first` engine already runs the new release.
    b_new, a_all = sides(new, second, "new", True), sides(new, first, "new", None)
    for x, y in [(a, b) for a in a_new for b in b_old] + [(b, a) for b in b_new for a in a_all]:
        pairs.append((x, y) if x.role == "prefill" else (y, x))
    return pairs


def choose_order(old: Rendered, new: Rendered, touched: list[Slice]) -> tuple[str | None, list[str]]:
    """Decode before prefill when every mixed pair of that order is compatible, else prefill first; (None,
    reasons) when neither order avoids an incompatible pair."""
    roles = {s.role for s in touched}
    candidates = ["decode", "prefill"] if roles == {"prefill", "decode"} else sorted(roles)
    reasons: list[str] = []
    for first in candidates:
        bad = [msg for p, d in mixed_pairs(old, new, touched, first) for msg in pair_problems(p, d)]
        if not bad:
            return first, []
        reasons += [f"{first} first: {m}" for m in dict.fromkeys(bad)][:6]
    return None, reasons


# --- batches ---------------------------------------------------------------------------------------------


@dataclass
class Batch:
    slices: list[Slice]
    canary: bool = False

    @property
    def role(self) -> str:
        return self.slices[0].role

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slices]


def plan_batches(touched: list[Slice], all_slices: dict[str, Slice], first: str, canary: int,
                 serial: int) -> tuple[list[Batch], list[str]]:
    """Canary slices first, then the rest in --serial batches; roles in order (`first`, then the other); a batch
    never drains every slice of its role, so the proxy keeps a live prefill and a live decode. Returns the batches
    and notes (caps applied)."""
    if canary < 0 or serial < 1:
        raise InvalidInput(f"--canary must be >= 0 and --serial >= 1 (got {canary} and {serial})")
    notes: list[str] = []
    order = sorted(touched, key=lambda s: (s.role != first, list(all_slices).index(s.name)))
    per_role_total = {r: sum(1 for s in all_slices.values() if s.role == r) for r in ROLES}
    for role in dict.fromkeys(s.role for s in order):
        if per_role_total[role] < 2:
            only = next(s.name for s in all_slices.values() if s.role == role)
            raise InvalidInput(
                f"{role} has a single instance ({only}): draining it leaves the proxy without a {role} engine, so "
                "it cannot change without downtime",
                hint="a zero-downtime rollout needs >= 2 instances of every changed role (4 A3 hosts give a3-pd "
                     "2P2D); `kimictl deploy` applies the change with the proxy failing requests meanwhile")
    batches: list[Batch] = []

    def group(slices: list[Slice], size: int, canary_batch: bool) -> None:
        for role in dict.fromkeys(s.role for s in slices):
            mine = [s for s in slices if s.role == role]
            cap = min(size, per_role_total[role] - 1)
            if size > cap and len(mine) > cap:
                what = "--canary" if canary_batch else "--serial"
                notes.append(f"{what} {size} capped to {cap} for {role} ({per_role_total[role]} instances; one "
                             "keeps serving while the others restart)")
            batches.extend(Batch(mine[i:i + cap], canary=canary_batch) for i in range(0, len(mine), cap))

    group(order[:canary], canary, True)
    group(order[canary:], serial, False)
    return batches, notes


# --- the routers' admin API ----------------------------------------------------------------------------------


class RouterError(KimictlError):
    """A router refused or failed an admin call."""


class RouterAdmin:
    """Runtime membership of one vllm-router: `GET /workers`, `POST /remove_worker?url=` (static P/D mode and
    IGW mode), `POST /workers {"url", "worker_type"}` (IGW mode only; static P/D mode answers 400)."""

    def __init__(self, url: str, timeout: float = 10.0, api_key: str | None = None):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.api_key = api_key
        self._runtime_add: bool | None = None

    def _call(self, method: str, path: str, body: Any = None) -> tuple[int, str]:
        return health.http_request(method, f"{self.url}{path}", body, timeout=self.timeout, api_key=self.api_key)

    def members(self) -> dict[str, str]:
        code, text = self._call("GET", "/workers")
        if code != 200:
            raise RouterError(f"router {self.url}: GET /workers -> {code or 'unreachable'}: {text[:200]}")
        try:
            doc = json.loads(text)
            return {str(w["url"]).rstrip("/"): str(w.get("worker_type") or "regular") for w in doc["workers"]}
        except (ValueError, KeyError, TypeError):
            raise RouterError(f"router {self.url}: GET /workers is not a worker list: {text[:200]}") from None

    def supports_runtime_add(self) -> bool:
        """Probe with a member it already has: IGW mode re-adds it (idempotent, 200), static P/D mode refuses."""
        if self._runtime_add is None:
            members = self.members()
            if not members:
                raise RouterError(f"router {self.url} has no workers; nothing to probe its admin API with")
            url, role = next(iter(members.items()))
            code, text = self._call("POST", "/workers", {"url": url, "worker_type": role})
            self._runtime_add = code == 200 and STATIC_PD_ROUTER_MARK not in text
        return self._runtime_add

    def remove(self, url: str) -> None:
        quoted = urllib.parse.quote(url, safe=":/")
        code, text = self._call("POST", f"/remove_worker?url={quoted}")
        if code != 200:
            raise RouterError(f"router {self.url}: cannot remove {url}: HTTP {code or 'unreachable'}: {text[:200]}")
        if url in self.members():
            raise RouterError(f"router {self.url} still lists {url} after removing it")

    def add(self, url: str, role: str) -> None:
        code, text = self._call("POST", "/workers", {"url": url, "worker_type": role})
        if code != 200 or STATIC_PD_ROUTER_MARK in text:
            raise RouterError(f"router {self.url}: cannot add {role} {url}: HTTP {code or 'unreachable'}: "
                              f"{text[:200]}")
        if url not in self.members():
            raise RouterError(f"router {self.url} does not list {url} after adding it")


# --- drain and probes -------------------------------------------------------------------------------------


def _busy_and_activity(ep: Endpoint) -> tuple[float, tuple[float, ...]] | None:
    totals = health.metric_totals(ep.ip, ep.port, timeout=3.0)
    if not totals:
        return None  # not answering: nothing can still be in flight there
    return sum(totals.get(g, 0.0) for g in BUSY_GAUGES), tuple(totals.get(c, 0.0) for c in ACTIVITY_COUNTERS)


def wait_drained(endpoints: list[Endpoint], *, timeout: float, quiet: float,
                 sample: Callable[[Endpoint], tuple[float, tuple[float, ...]] | None] = _busy_and_activity,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 ) -> dict[str, Any]:
    """Wait until no endpoint runs, queues or holds anything and none served a request for `quiet` seconds (a
    request the router paired with it just before the drain may still be in its prefill elsewhere). Returns
    {seconds, timed_out: [engine ids still busy when the timeout hit]}."""
    t0 = clock()
    last: dict[str, tuple[float, ...] | None] = {}
    quiet_since: dict[str, float] = {}
    pending = {ep.engine: ep for ep in endpoints}
    while pending:
        now = clock()
        for eid, ep in list(pending.items()):
            got = sample(ep)
            if got is None:
                del pending[eid]
                continue
            busy, activity = got
            if busy > 0 or last.get(eid) != activity:
                quiet_since[eid] = now
            last[eid] = activity
            if busy == 0 and now - quiet_since.setdefault(eid, now) >= quiet:
                del pending[eid]
        if not pending:
            break
        if clock() - t0 > timeout:
            return {"seconds": round(clock() - t0, 2), "timed_out": sorted(pending)}
        sleep(0.25)
    return {"seconds": round(clock() - t0, 2), "timed_out": []}


def _completion(url: str, body: dict[str, Any], request_id: str, timeout: float) -> tuple[int, Any]:
    code, text = health.http_request("POST", url, body, timeout=timeout, headers={"X-Request-Id": request_id})
    try:
        return code, json.loads(text)
    except ValueError:
        return code, text


def pair_probe(p: Endpoint, d: Endpoint, served: str, timeout: float = 60.0) -> dict[str, Any]:
    """One P/D hand-over between exactly these two endpoints, the way vllm-router does it: the prefill engine
    prefills with `do_remote_decode` and returns kv_transfer_params, the decode engine pulls the KV with them.
    Both sides' counters must move."""
    t0 = time.monotonic()
    before_p = health.metric_totals(p.ip, p.port).get(health.PREFILL_COUNTER, 0.0)
    before_d = health.metric_totals(d.ip, d.port).get(health.DECODE_COUNTER, 0.0)
    rid = f"___prefill_addr_{p.ip}:{p.port}___decode_addr_{d.ip}:{d.port}_{uuid.uuid4().hex}"
    prompt = health.smoke_prompt(96)
    code, body = _completion(f"{p.url}/v1/completions", {
        "model": served, "prompt": prompt, "max_tokens": 1, "min_tokens": 1, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                               "remote_block_ids": None, "remote_host": None, "remote_port": None}}, rid, timeout)
    result: dict[str, Any] = {"prefill": p.engine, "decode": d.engine, "ok": False}
    kv = body.get("kv_transfer_params") if isinstance(body, dict) else None
    if code != 200 or not isinstance(kv, dict):
        result["detail"] = f"prefill {p.engine} at {p.url}: HTTP {code}: {str(body)[:200]}"
        return result
    code, body = _completion(f"{d.url}/v1/completions", {"model": served, "prompt": prompt, "max_tokens": 4,
                                                         "kv_transfer_params": kv}, rid, timeout)
    if code != 200 or not isinstance(body, dict) or not body.get("choices"):
        result["detail"] = f"decode {d.engine} at {d.url} (KV from {p.engine}): HTTP {code}: {str(body)[:200]}"
        return result
    moved_p = health.metric_totals(p.ip, p.port).get(health.PREFILL_COUNTER, 0.0) - before_p
    moved_d = health.metric_totals(d.ip, d.port).get(health.DECODE_COUNTER, 0.0) - before_d
    result.update(ok=moved_p > 0 and moved_d > 0, seconds=round(time.monotonic() - t0, 2),
                  detail=f"prefill prompt tokens +{moved_p:.0f}, decode external prefix cache +{moved_d:.0f}")
    return result


# --- the rollout --------------------------------------------------------------------------------------------


@dataclass
class RolloutOptions:
    canary: int = 1
    serial: int = 1
    check: bool = False
    drain_timeout: float = 300.0
    drain_quiet: float = 5.0
    ready_timeout: float | None = None
    allow_proxy_restart: bool = False
    routers: list[str] = field(default_factory=list)
    accept_new_host_keys: bool = False


@dataclass
class SliceReport:
    name: str
    role: str
    hosts: list[str]
    engines: list[str]
    batch: int
    canary: bool
    result: str = "pending"  # pending | rolled-out | rolled-back | failed
    seconds: dict[str, float] = field(default_factory=dict)
    probes: list[dict[str, Any]] = field(default_factory=list)
    drain_timed_out: list[str] = field(default_factory=list)


@dataclass
class RolloutResult:
    cluster: str
    result: str  # check | no-changes | rolled-out | rolled-back
    release: str
    previous_release: str
    sets: list[str]
    first_role: str | None
    batches: list[list[str]]
    membership: dict[str, str]
    slices: list[SliceReport]
    notes: list[str]
    run_dir: str | None
    proxy_restarts: list[dict[str, Any]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": ROLLOUT_SCHEMA_VERSION, "cluster": self.cluster, "result": self.result,
                "release": self.release, "previous_release": self.previous_release, "sets": self.sets,
                "first_role": self.first_role, "batches": self.batches, "membership": self.membership,
                "slices": [vars(s) for s in self.slices], "proxy_restarts": self.proxy_restarts,
                "notes": self.notes, "run_dir": self.run_dir, "seconds": self.seconds, "error": self.error}


def release_of(releases: dict[str, str]) -> str:
    """The cluster release id: the same hash deploy gives the same per-host releases."""
    h = hashlib.sha256()
    for host, rel in sorted(releases.items()):
        h.update(f"{host}:{rel}".encode() + b"\0")
    return h.hexdigest()[:16]


def deployed_release(cluster: str) -> tuple[dict[str, Any], Rendered]:
    """The current release record and its render snapshot (what the cluster runs, per the control node)."""
    path = control_dir(cluster) / "current.json"
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        raise InvalidInput(f"no current release of cluster {cluster} is recorded ({path}); nothing to roll out "
                           "from", hint="deploy first: kimictl deploy -i INV --topology T") from None
    snap = Path(rec.get("run_dir", "")) / "rendered.json"
    if not snap.exists():
        raise InvalidInput(f"the current release {rec.get('release')} of {cluster} has no render snapshot ({snap})",
                           hint="converge with `kimictl deploy` once, then roll out")
    return rec, Rendered.model_validate_json(snap.read_text())


def recorded_topology(rec: dict[str, Any], old: Rendered) -> str:
    """The topology the current release was made from: the effective file a rollout wrote, else the source."""
    eff = Path(rec.get("run_dir", "")) / "topology.yml"
    if eff.exists():
        return str(eff)
    src = old.plan.topology_source
    if src and Path(src).exists():
        return src
    raise InvalidInput(f"the topology of the current release ({src or old.plan.topology}) is not readable here",
                       hint="pass --topology")


class Rollout(EngineOps):
    """One rollout run over a deployed P/D cluster."""

    def __init__(self, inv: Inventory, record: dict[str, Any], old: Rendered, new: Rendered, topo: Topology,
                 sets: list[Setting], opts: RolloutOptions, say: Callable[[str], None],
                 on_event: Callable[[str, str, str], None] | None = None):
        self.release = release_of(new.releases)
        super().__init__(inv, new.plan.cluster, new.plan.served_model_name, f"rollout-{self.release[:8]}",
                         DeployOptions(ready_timeout=opts.ready_timeout,
                                       accept_new_host_keys=opts.accept_new_host_keys), say, on_event)
        self.record, self.old, self.new, self.topo, self.sets, self.ro = record, old, new, topo, sets, opts
        self.previous = str(record.get("release"))
        self.slices = slices_of(new)
        self.reports: dict[str, SliceReport] = {}
        self.proxy_restarts: list[dict[str, Any]] = []
        self.routers: list[RouterAdmin] = []
        self.own_routers = 0  # the first ones in self.routers: the copies behind kimictl's proxy front
        self.runtime = True
        self.proxy_proc: Proc | None = None
        self.observed: dict[str, HostObservation] = {}
        self.switched: set[str] = set()
        self.touched_done: list[Slice] = []  # slices this run drained (the rollback set), in order
        self.stage: dict[str, str] = {}  # slice -> drained | restarted

    # --- planning (no changes) -------------------------------------------------------------------------

    def _prepare(self) -> tuple[Analysis, str | None, list[Batch], list[str]]:
        if self.new.plan.mode != "pd" or self.new.proxy is None:
            raise InvalidInput(f"topology {self.new.plan.topology} is {self.new.plan.mode}: there is no proxy to "
                               "drain slices through", hint="use `kimictl deploy` to change a colocated cluster")
        a = analyze(self.old, self.new)
        if a.problems:
            raise InvalidInput("this change cannot be rolled out slice by slice", details=a.problems,
                               hint="apply it with `kimictl deploy` (every engine restarts; the proxy fails "
                                    "requests meanwhile)")
        notes: list[str] = []
        first, batches = None, []
        if a.touched:
            first, reasons = choose_order(self.old, self.new, a.touched)
            if first is None:
                raise InvalidInput("the change makes P/D pairs of the old and the new release incompatible; one "
                                   "router would pair them during a rolling change (pair-wise rolling needs an "
                                   "atomic switch of the router's membership, which vllm-router cannot do)",
                                   details=reasons,
                                   hint="apply it with `kimictl deploy` (all engines restart together)")
            batches, notes = plan_batches(a.touched, self.slices, first, self.ro.canary, self.ro.serial)
        if a.proxy_changed and not self.ro.allow_proxy_restart:
            raise InvalidInput("the change alters the proxy's own command (policy or membership), so the router "
                               "must restart: clients get refused connections meanwhile",
                               hint="add --allow-proxy-restart to accept that, or leave the proxy settings alone")
        return a, first, batches, notes

    def _observe_and_check(self) -> None:
        """The cluster must run exactly the recorded release, every endpoint must answer, the routers must too."""
        self.observed = observe(self.inv, accept_new_keys=self.ro.accept_new_host_keys)
        drift = []
        for proc in desired_procs(self.old, self.inv):
            st = self.observed.get(proc.host, HostObservation({}, None)).states.get(proc.id)
            if st is None or st.get("state") not in LIVE_STATES:
                drift.append(f"{proc.host}:{proc.id} (not running)")
            elif st.get("tag") != proc.tag:
                drift.append(f"{proc.host}:{proc.id} (runs another release)")
            elif proc.id == "proxy":
                self.proxy_proc = Proc(proc.host, "proxy", "proxy", str(st["tag"]), list(st["cmd"]), proc.ip,
                                       proc.port, True, "proxy")
        if drift:
            raise HostError(f"the cluster does not run its recorded release {self.previous}: "
                            + ", ".join(drift[:6]), step="check",
                            hint="see `kimictl status`; converge with `kimictl deploy` or `kimictl start` first")
        sick = [ep for s in self.slices.values() for ep in s.endpoints
                if not health.engine_ready(ep.ip, ep.port, self.served_model_name).ok]
        if sick:
            ep = sick[0]
            raise HostError("the cluster is not healthy before the rollout: " + ", ".join(x.engine for x in sick)
                            + " do not answer", host=ep.host, step="check", log_tail=self.log_tail(ep.host, ep.engine),
                            hint="fix it first (kimictl status)")
        assert self.new.proxy is not None and self.old.proxy is not None
        self.routers = self._own_routers(self.old)
        self.own_routers = len(self.routers)
        self.routers += [RouterAdmin(u) for u in dict.fromkeys(self.ro.routers) if u not in
                         [r.url for r in self.routers]]
        for i, r in enumerate(self.routers):
            try:
                runtime = r.supports_runtime_add()
            except RouterError as exc:
                raise HostError(exc.message, host=self.new.proxy.host_name if i == 0 else None, step="check") from None
            if not runtime and i >= self.own_routers:
                raise InvalidInput(f"router {r.url} cannot add workers at runtime (static P/D mode); kimictl can only "
                                   "restart the proxy it deployed",
                                   hint="run extra routers with --enable-igw, or leave them out of --router")
            self.runtime = self.runtime and runtime

    def _own_routers(self, rendered: Rendered) -> list[RouterAdmin]:
        """The proxy kimictl deployed: behind its front each router copy has its own membership, reached through
        the front with the admin key (a release made before the admin key: with the client key)."""
        assert rendered.proxy is not None and rendered.plan.proxy is not None
        base = f"http://{rendered.proxy.host}:{rendered.proxy.port}"
        own = [f"{base}/kimictl/router/{i}" for i in range(len(rendered.proxy.routers))] or [base]
        key = proxy_admin_key(self.cluster) if rendered.plan.proxy.admin_key else self.api_key
        return [RouterAdmin(u, api_key=key) for u in own]

    def _membership(self) -> dict[str, str]:
        return {r.url: "runtime" if r._runtime_add else "reload" if i < self.own_routers and self.front else "restart"
                for i, r in enumerate(self.routers)}

    # --- the run ---------------------------------------------------------------------------------------

    def run(self) -> RolloutResult:
        t_all = time.monotonic()
        a, first, batches, notes = self._prepare()
        self._observe_and_check()
        if a.touched and not self.runtime and self.front:
            notes.append("the proxy's routers (vllm-router, static P/D mode) drop workers at runtime but cannot add "
                         "them back: each batch ends with a restart of the router copies one at a time behind the "
                         "proxy port (clients are not refused)")
        elif a.touched and not self.runtime:
            notes.append(f"the proxy {self.routers[0].url} runs vllm-router in static P/D mode: it drops workers at "
                         "runtime but cannot add them back, so each batch ends with a graceful restart of the proxy "
                         "(in-flight requests finish; new connections are refused for a moment)")
            if not self.ro.allow_proxy_restart and not self.ro.check:
                raise InvalidInput("the deployed proxy cannot re-add a slice without restarting; a restart refuses "
                                   "client connections for a moment", details=notes[-1:],
                                   hint="add --allow-proxy-restart to accept that, or run the proxy with runtime "
                                        "membership (see docs/operate.md, kimictl rollout)")
        for i, b in enumerate(batches):
            for s in b.slices:
                self.reports[s.name] = SliceReport(s.name, s.role, list(s.hosts), list(s.engines), i, b.canary)
        result = RolloutResult(self.cluster, "check", self.release, self.previous, [s.raw for s in self.sets], first,
                               [b.names for b in batches], self._membership(), list(self.reports.values()), notes,
                               None)
        for n in notes:
            self.say(f"note: {n}")
        if self.ro.check:
            return result
        if not a.touched and not a.changed_hosts:
            self.say(f"no changes: every slice already runs release {self.previous}")
            result.result = "no-changes"
            return result
        result.run_dir = str(self.run_dir)
        self._write_run_dir()
        try:
            self._install(sorted(a.changed_hosts))
            for i, b in enumerate(batches):
                self.say(f"batch {i + 1}/{len(batches)}{' (canary)' if b.canary else ''}: {', '.join(b.names)}")
                self._roll_batch(b)
            if a.proxy_changed:
                self._restart_proxy(next(p for p in desired_procs(self.new, self.inv) if p.id == "proxy"),
                                    "proxy change")
                own = self._own_routers(self.new)
                self.routers[:self.own_routers], self.own_routers = own, len(own)
            rest = sorted(set(a.changed_hosts) - self.switched)
            if rest:
                self._switch({h: self.new.releases[h] for h in rest})
            self._check_membership()
            smoke = self._final_smoke()
            self.say(f"final smoke through the proxy: {smoke}")
        except (KimictlError, KeyboardInterrupt) as exc:
            failure = exc if isinstance(exc, KimictlError) else HostError("interrupted", step="rollout")
            result.error = failure.message
            self._rollback_all(failure)
            result.result = "rolled-back"
            result.seconds = {**self.timings, "total": round(time.monotonic() - t_all, 2)}
            result.proxy_restarts = self.proxy_restarts
            self._record("rolled-back" if self.touched_done else "failed", result)
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise self._failure(failure) from None
        finally:
            from kimictl.ansible import close_control_masters

            close_control_masters(self.run_dir)
        result.result = "rolled-out"
        result.proxy_restarts = self.proxy_restarts
        result.seconds = {**self.timings, "total": round(time.monotonic() - t_all, 2)}
        self._record("deployed", result)
        return result

    def _write_run_dir(self) -> None:
        write_rendered(self.new, self.run_dir / "rendered")
        (self.run_dir / "plan.json").write_text(json.dumps(self.new.plan.model_dump(mode="json"), indent=1))
        (self.run_dir / "rendered.json").write_text(self.new.model_dump_json())
        (self.run_dir / "topology.yml").write_text(effective_topology_yaml(self.topo))

    def _install(self, hosts: list[str]) -> None:
        """Unpack the new release next to the running one on every host whose files change (nothing restarts)."""
        if not hosts:
            return
        self.say(f"installing release files on {', '.join(hosts)}")
        self.install_release(self.new, hosts)

    def _switch(self, releases: dict[str, str]) -> None:
        self._playbook("switch.yml", {"state_dir_of": self.state_dir_of,
                                      "hosts": {h: {"release": r} for h, r in releases.items()}}, sorted(releases))

    # --- one batch -------------------------------------------------------------------------------------

    def _old_proc(self, host: str, pid: str, ep: Endpoint | None, role: str) -> Proc:
        st = self.observed[host].states[pid]
        return Proc(host, pid, "engine", str(st.get("tag") or ""), list(st["cmd"]), ep.ip if ep else "",
                    ep.port if ep else 0, ep is not None, role)

    def _procs(self, s: Slice, release: str) -> list[Proc]:
        if release == "new":
            return [p for p in desired_procs(self.new, self.inv) if p.id in s.engines]
        eps = {ep.engine: ep for ep in s.endpoints}
        hosts = {e.id: e.host for e in self.new.engines}
        return [self._old_proc(hosts[e], e, eps.get(e), s.role) for e in s.engines]

    def _drain(self, slices: list[Slice]) -> dict[str, Any]:
        self.touched_done += [s for s in slices if s not in self.touched_done]
        eps = [ep for s in slices for ep in s.endpoints]
        for attempt in range(3):
            for r in self.routers:
                members = r.members()
                for ep in eps:
                    if ep.url in members:
                        r.remove(ep.url)
            for s in slices:
                self.stage[s.name] = "drained"
            self.say(f"drained {', '.join(s.name for s in slices)} from {len(self.routers)} router(s); waiting for "
                     "in-flight requests")
            got = wait_drained(eps, timeout=self.ro.drain_timeout, quiet=self.ro.drain_quiet)
            # A router restarted meanwhile (by its supervisor) comes back with every worker: drain again.
            back = [ep.engine for r in self.routers for ep in eps if ep.url in r.members()]
            if not back:
                if got["timed_out"]:
                    self.say(f"drain timeout ({self.ro.drain_timeout:.0f}s): {', '.join(got['timed_out'])} still "
                             "busy; their in-flight requests are cut")
                return got
            self.say(f"a router lists {', '.join(back)} again (did it restart?); draining again ({attempt + 1}/3)")
        raise HostError(f"cannot keep {', '.join(s.name for s in slices)} out of the routers", step="drain",
                        host=slices[0].hosts[0])

    def _restart(self, slices: list[Slice], release: str) -> list[Proc]:
        stops: dict[str, list[str]] = {}
        starts: dict[str, list[dict[str, Any]]] = {}
        procs: list[Proc] = []
        for s in slices:
            for p in self._procs(s, release):
                stops.setdefault(p.host, []).append(p.id)
                starts.setdefault(p.host, []).append({"id": p.id, "cmd": p.cmd, "tag": p.tag, "replace": False})
                procs.append(p)
        self.apply_actions(stops, starts, f"restart on the {release} release")
        return procs

    def _live_partners(self, role: str, exclude: set[str]) -> list[Endpoint]:
        other = "decode" if role == "prefill" else "prefill"
        return [ep for s in self.slices.values() if s.role == other and s.name not in exclude for ep in s.endpoints]

    def _pair_gate(self, slices: list[Slice], exclude: set[str]) -> list[dict[str, Any]]:
        results = []
        for s in slices:
            partners = self._live_partners(s.role, exclude)
            if not partners:
                raise HostError(f"no live {('decode' if s.role == 'prefill' else 'prefill')} endpoint to pair "
                                f"{s.name} with", host=s.hosts[0], step="smoke")
            for i, ep in enumerate(s.endpoints):
                # A second partner tells a broken slice from a partner that just failed.
                tries = []
                for k in range(min(2, len(partners))):
                    other = partners[(i + k) % len(partners)]
                    p, d = (ep, other) if s.role == "prefill" else (other, ep)
                    tries.append(pair_probe(p, d, self.served_model_name))
                    if tries[-1]["ok"]:
                        break
                results.append(tries[-1])
                if not tries[-1]["ok"]:
                    raise HostError(f"pair smoke of {ep.engine} failed: "
                                    + "; ".join(f"{t['prefill']} -> {t['decode']}: {t['detail']}" for t in tries),
                                    host=ep.host, step=f"smoke {ep.engine}", log_tail=self.log_tail(ep.host, ep.engine))
        return results

    def _readd(self, slices: list[Slice]) -> None:
        """Back into every router: at runtime where the router can add workers, else by restarting the proxy
        kimictl deployed (its rendered membership lists every endpoint)."""
        eps = [ep for s in slices for ep in s.endpoints]
        for r in self.routers:
            if r._runtime_add:
                for ep in eps:
                    r.add(ep.url, ep.role)
        if self.runtime:
            return
        assert self.proxy_proc is not None
        why = "re-add " + ", ".join(s.name for s in slices)
        if self.front:
            self._reload_proxy(why)
        else:
            self._restart_proxy(self.proxy_proc, why)
        for r in self.routers[:self.own_routers]:
            missing = [ep.url for ep in eps if ep.url not in r.members()]
            if missing:
                raise HostError(f"router {r.url} came back without {', '.join(missing)}", host=self.proxy_proc.host,
                                step="proxy", log_tail=self.log_tail(self.proxy_proc.host, "proxy"))

    @property
    def front(self) -> bool:
        """The deployed proxy is kimictl's front with router copies behind it (older releases ran one router)."""
        return bool(self.old.proxy and self.old.proxy.routers)

    def _reload_proxy(self, why: str) -> None:
        assert self.proxy_proc is not None
        t0 = time.monotonic()
        self.say(f"restarting the proxy's routers one at a time ({why})")
        self._playbook("engines.yml", {"state_dir_of": self.state_dir_of, "grace": STOP_GRACE_S,
                                       "actions": {self.proxy_proc.host: {"reload_proxy": True}}},
                       [self.proxy_proc.host])
        self.proxy_restarts.append({"why": why, "seconds": round(time.monotonic() - t0, 2), "kind": "routers"})

    def _restart_proxy(self, proc: Proc, why: str) -> None:
        t0 = time.monotonic()
        self.apply_actions({proc.host: ["proxy"]},
                           {proc.host: [{"id": "proxy", "cmd": proc.cmd, "tag": proc.tag, "replace": False}]},
                           f"proxy restart ({why})")
        self.wait_ready([proc])
        self.proxy_proc = proc
        self.proxy_restarts.append({"why": why, "seconds": round(time.monotonic() - t0, 2), "kind": "proxy"})

    def _proxy_gate(self, slices: list[Slice], attempts_per_endpoint: int = 8, timeout: float = 120.0,
                    ) -> dict[str, Any]:
        """Requests through the deployed proxy until every endpoint of the batch served its side of a P/D hand-over
        (counters moved) and the other side's counters moved too; every request must succeed."""
        assert self.new.proxy is not None
        url = f"http://{self.new.proxy.host}:{self.new.proxy.port}/v1/completions"
        eps = [ep for s in slices for ep in s.endpoints]
        counter = {"prefill": health.PREFILL_COUNTER, "decode": health.DECODE_COUNTER}
        others = [ep for s in self.slices.values() for ep in s.endpoints if ep.role != eps[0].role]

        def total(ep: Endpoint) -> float:
            return health.metric_totals(ep.ip, ep.port).get(counter[ep.role], 0.0)

        before = {ep.engine: total(ep) for ep in eps}
        other_before = sum(total(ep) for ep in others)
        n_role = sum(len(s.endpoints) for s in self.slices.values() if s.role == eps[0].role)
        sent = 0
        waiting = set(before)
        deadline = time.monotonic() + timeout
        for _ in range(attempts_per_endpoint * n_role):
            # A fresh prefix per request, so cache- or prefix-aware policies spread them like round robin does.
            prompt = f"rollout probe {uuid.uuid4().hex}: {health.smoke_prompt(64)}"
            code, body = health.http_post_json(url, {"model": self.served_model_name, "prompt": prompt,
                                                     "max_tokens": 2}, timeout=60, api_key=self.api_key)
            sent += 1
            if code != 200:
                raise HostError(f"a request through the proxy failed after re-adding "
                                f"{', '.join(s.name for s in slices)}: HTTP {code}: {str(body)[:200]}",
                                host=self.new.proxy.host_name, step="proxy smoke",
                                log_tail=self.log_tail(self.new.proxy.host_name, "proxy"))
            waiting = {e for e in waiting if total(next(x for x in eps if x.engine == e)) <= before[e]}
            if not waiting or time.monotonic() > deadline:
                break
        moved_other = sum(total(ep) for ep in others) - other_before
        if waiting or moved_other <= 0:
            ep = next(x for x in eps if x.engine in waiting) if waiting else eps[0]
            raise HostError(f"{len(waiting)} endpoint(s) of {', '.join(s.name for s in slices)} got no P/D traffic "
                            f"through the proxy in {sent} requests ({', '.join(sorted(waiting)) or 'other side idle'})",
                            host=ep.host, step="proxy smoke", log_tail=self.log_tail(ep.host, ep.engine))
        return {"requests": sent, "ok": True}

    def _roll_batch(self, b: Batch) -> None:
        names = set(b.names)
        t0 = time.monotonic()
        drained = self._drain(b.slices)
        t1 = time.monotonic()
        for s in b.slices:
            self.reports[s.name].drain_timed_out = [e for e in drained["timed_out"] if e in s.engines]
            self.reports[s.name].result = "failed"
            self.stage[s.name] = "restarted"
        procs = self._restart(b.slices, "new")
        self.wait_ready(procs)
        t2 = time.monotonic()
        probes = self._pair_gate(b.slices, names)
        t3 = time.monotonic()
        self._switch({h: self.new.releases[h] for s in b.slices for h in s.hosts})
        self.switched |= {h for s in b.slices for h in s.hosts}
        t4 = time.monotonic()
        self._readd(b.slices)
        t5 = time.monotonic()
        gate = self._proxy_gate(b.slices)
        t6 = time.monotonic()
        secs = {"drain": t1 - t0, "restart_ready": t2 - t1, "pair_smoke": t3 - t2, "switch_current": t4 - t3,
                "readd": t5 - t4, "proxy_smoke": t6 - t5, "total": t6 - t0}
        for s in b.slices:
            r = self.reports[s.name]
            r.result = "rolled-out"
            r.probes = [p for p in probes if p["prefill"] in s.engines or p["decode"] in s.engines]
            r.seconds = {k: round(v, 2) for k, v in secs.items()}
        self.say(f"{', '.join(b.names)}: rolled out in {secs['total']:.1f}s (" + ", ".join(
            f"{k.replace('_', ' ')} {v:.1f}s" for k, v in secs.items() if k != "total")
                 + f"; {len(probes)} pair probe(s), {gate['requests']} proxy request(s))")

    # --- failure: back to the last good release ---------------------------------------------------------

    def _rollback_all(self, exc: KimictlError) -> None:
        touched = list(dict.fromkeys(self.touched_done))
        self.say(f"gate failed ({exc.message.splitlines()[0][:200]}); rolling back "
                 f"{', '.join(s.name for s in touched) or 'nothing (no slice was changed)'}")
        self.opts.ready_timeout = ROLLBACK_READY_TIMEOUT_S
        for s in reversed(touched):
            try:
                self._rollback_slice(s)
                self.reports[s.name].result = "rolled-back"
            except KimictlError as again:
                self.say(f"rollback of {s.name} incomplete: {again.message}")
                self.reports[s.name].result = "failed"
        back = {h: r for h, r in self.old.releases.items() if h in self.switched}
        if back:
            try:
                self._switch(back)
            except KimictlError as again:
                self.say(f"could not point current back on {', '.join(back)}: {again.message}")

    def _rollback_slice(self, s: Slice) -> None:
        if self.stage.get(s.name) == "restarted":
            if any(ep.url in r.members() for r in self.routers for ep in s.endpoints):
                self._drain([s])
            procs = self._restart([s], "old")
            self.wait_ready(procs)
            self._pair_gate([s], {s.name})
        if not all(ep.url in r.members() for r in self.routers for ep in s.endpoints):
            self._readd([s])
        self.stage.pop(s.name, None)
        self.say(f"{s.name}: back on release {self.previous}")

    def _failure(self, exc: KimictlError) -> HostError:
        rolled = [r.name for r in self.reports.values() if r.result == "rolled-back"]
        failed = [r.name for r in self.reports.values() if r.result == "failed"]
        msg = (f"rollout to release {self.release} failed: {exc.message.splitlines()[0]}; "
               + (f"rolled back {', '.join(rolled)} to release {self.previous}" if rolled else "nothing was changed"))
        details = [*exc.details]
        if failed:
            details.append(f"rollback incomplete for {', '.join(failed)}: see `kimictl status`")
        return HostError(msg, host=getattr(exc, "host", None), step=getattr(exc, "step", None),
                         log_tail=getattr(exc, "log_tail", None), details=details, hint=exc.hint)

    def _check_membership(self) -> None:
        """Every endpoint of the plan is back in every router (a missed re-add would silently lose capacity)."""
        want = {ep.url: ep for s in self.slices.values() for ep in s.endpoints}
        for r in self.routers:
            missing = sorted(set(want) - set(r.members()))
            if missing:
                ep = want[missing[0]]
                raise HostError(f"router {r.url} lacks {len(missing)} endpoint(s) after the rollout: "
                                + ", ".join(missing), host=ep.host, step="membership")

    def _final_smoke(self) -> dict[str, Any]:
        assert self.new.proxy is not None
        eps = [ep for s in self.slices.values() for ep in s.endpoints]
        before = {ep.engine: health.metric_totals(ep.ip, ep.port) for ep in eps}
        code, body = health.http_post_json(f"http://{self.new.proxy.host}:{self.new.proxy.port}/v1/completions",
                                           {"model": self.served_model_name, "prompt": health.smoke_prompt(),
                                            "max_tokens": 8}, timeout=60, api_key=self.api_key)
        after = {ep.engine: health.metric_totals(ep.ip, ep.port) for ep in eps}

        def moved(role: str, metric: str) -> float:
            return sum(after[e.engine].get(metric, 0) - before[e.engine].get(metric, 0) for e in eps if e.role == role)

        p, d = moved("prefill", health.PREFILL_COUNTER), moved("decode", health.DECODE_COUNTER)
        if code != 200 or p <= 0 or d <= 0:
            raise HostError(f"final smoke through the proxy failed: HTTP {code}, prefill +{p:.0f}, decode +{d:.0f}: "
                            f"{str(body)[:200]}", host=self.new.proxy.host_name, step="smoke")
        return {"prefill_prompt_tokens": p, "decode_external_prefix_cache_queries": d}

    # --- the release record ----------------------------------------------------------------------------

    def _record(self, result: str, res: RolloutResult) -> None:
        hosts = self.new.releases if result == "deployed" else self.old.releases
        rec = {"release": self.release if result == "deployed" else self.previous,
               "at": datetime.now(UTC).isoformat(timespec="seconds"), "by": getpass.getuser(),
               "cluster": self.cluster, "topology": self.new.plan.topology, "hosts": hosts, "result": result,
               "run_dir": str(self.run_dir) if result == "deployed" else self.record.get("run_dir"),
               "kind": "rollout", "attempted_release": self.release, "previous_release": self.previous,
               "rollout_run_dir": str(self.run_dir), "sets": [s.raw for s in self.sets],
               "changes": [{"slice": r.name, "hosts": r.hosts, "engines": r.engines, "result": r.result}
                           for r in self.reports.values()], "error": res.error}
        path = control_dir(self.cluster) / "releases.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        if result == "deployed":
            cur = control_dir(self.cluster) / "current.json"
            tmp = cur.with_suffix(".tmp")
            tmp.write_text(json.dumps(rec, indent=1))
            tmp.replace(cur)


def prepare_rollout(inventory: Path, topology: str | None, set_items: list[str]) -> tuple[
        Inventory, dict[str, Any], Rendered, Rendered, Topology, list[Setting]]:
    """Validate everything exactly like deploy (plan + render of the new inputs) before any host is touched."""
    from kimictl.inventory import load_inventory
    from kimictl.pipeline import prepare
    from kimictl.plan import make_plan
    from kimictl.render import render

    if topology:
        p = prepare(inventory, topology)
        sets = parse_sets(set_items, p.topology)  # bad --set: exit 2 before the recorded state is read
        record, old = deployed_release(p.inventory.cluster.name)
    else:
        record, old = deployed_release(load_inventory(inventory).cluster.name)
        p = prepare(inventory, recorded_topology(record, old))
        sets = parse_sets(set_items, p.topology)
    topo, inv = apply_sets(p.topology, p.inventory, sets)
    plan = make_plan(inv, topo) if sets else p.plan
    return inv, record, old, render(plan, inv, topo), topo, sets
