"""What a change does to the slices of a deployed P/D cluster (kimictl.slices.model): which slices it touches,
whether old and new engines can pair during a rolling change, which role goes first, and the batches.

Pure: renders in, plans out; no hosts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kimictl.errors import InvalidInput
from kimictl.hostops import process_tag
from kimictl.render import Rendered
from kimictl.rollout.overrides import ROLES
from kimictl.slices.model import Slice, slices_of

# Flags whose values shape the KV cache a prefill engine hands to a decode engine: both sides must agree.
KV_SHAPE_FLAGS = ("block-size", "kv-cache-dtype", "quantization")


# --- what changes ------------------------------------------------------------------------------------------


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
