"""`--set KEY=VALUE` over a topology (and cluster-wide inventory keys): parse, locate, apply, validate.

Pure: no hosts, no state. A bad key is an exit-2 error naming it, with a did-you-mean."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimictl.errors import InvalidInput, InventoryError, TopologyError, did_you_mean
from kimictl.inventory import KEYS, ClusterSettings, Inventory
from kimictl.topology import Ports, Proxy, Role, Speculative, Topology

ROLES = ("prefill", "decode", "colocated")


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


def _key_value(item: str) -> tuple[str, str]:
    """KEY=VALUE split; the key exactly as typed (a quoted ' decode.dp=4' is no shell word split)."""
    key, sep, raw_value = item.partition("=")
    if not sep or not key.strip():
        raise _bad(item, "expected KEY=VALUE")
    if key != key.strip():
        raise _bad(item, f"the key {key!r} has blanks around it; write KEY=VALUE without them "
                         f"({key.strip()}={raw_value})")
    if raw_value == "":
        raise _bad(item, "empty value (write KEY=null to remove a key)")
    return key, raw_value


def parse_set(item: str, topo: Topology) -> Setting:
    """Parse and locate one K=V; an unknown key is an error naming the key, with a did-you-mean."""
    key, raw_value = _key_value(item)
    if key.startswith("kimi_"):
        spec = KEYS.get(key)
        if spec is None:
            raise _bad(item, f"unknown inventory key '{key}'{did_you_mean(key, list(KEYS))}")
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
        raise _bad(item, f"unknown topology key '{head}'{did_you_mean(head, [*_TOPO_FIELDS, *ROLES])}; "
                         f"top-level keys: {', '.join(_TOPO_FIELDS)}, or a role ({', '.join(topo.roles)})")
    if head == "source":
        raise _bad(item, "'source' is not a topology setting")
    as_string = False
    if head == "roles":
        if len(parts) < 3:
            raise _bad(item, f"'{key}' names a whole role; set one of its keys ({', '.join(_ROLE_FIELDS)})")
        role = parts[1]
        if role not in topo.roles:
            raise _bad(item, f"topology {topo.name} has no role '{role}'{did_you_mean(role, list(topo.roles))}; "
                             f"roles: {', '.join(topo.roles)}")
        fld = parts[2]
        if fld not in _ROLE_FIELDS:
            raise _bad(item, f"unknown key '{fld}' of role {role}{did_you_mean(fld, _ROLE_FIELDS)}; "
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
            raise _bad(item, f"unknown key '{parts[1]}' of {head}{did_you_mean(parts[1], names)}; "
                             f"keys: {', '.join(names)}")
        nested_map = head == "speculative" and parts[1] == "num_speculative_tokens"
        _check_depth(item, parts[1:], nested_map)
    else:
        _check_depth(item, parts, False)
    if len(parts) > 1 and parts[-2] == "serve":
        _check_serve_flag(item, parts[-1], topo)
    return Setting(item, key, "topology", tuple(parts), _value(raw_value, as_string=as_string))


def _check_serve_flag(item: str, flag: str, topo: Topology) -> None:
    """A serve flag the topology does not set yet but that is one typo away from one it sets is a mistake."""
    known = set(topo.serve) | {f for r in topo.roles.values() for f in r.serve}
    if flag.startswith("-"):
        raise _bad(item, f"serve flag '{flag}': write it without leading dashes")
    if flag not in known:
        hint = did_you_mean(flag, sorted(known), cutoff=0.85)
        if hint:
            raise _bad(item, f"serve flag '{flag}' is not set by topology {topo.name}{hint}")


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
        _cross_check(cluster, inv, inv_sets)
        new_inv = inv.model_copy(update={"cluster": cluster})
    return new_topo, new_inv


def _cross_check(cluster: ClusterSettings, inv: Inventory, inv_sets: list[Setting]) -> None:
    """The checks `validate` makes across an inventory's keys and hosts (proxy host an inventory host, API key file
    private, directories apart ...), over the cluster keys as --set leaves them; a problem names its --set."""
    from kimictl.inventory import cross_check_errors

    errors = cross_check_errors(cluster, inv.hosts, Path(inv.path))
    if errors:
        raise InventoryError(f"--set makes inventory {inv.path} invalid", details=[
            f"{', '.join(f'--set {s.raw}' for s in inv_sets if s.key in msg) or inv.path}: {msg}"
            for msg in errors])


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
