"""Planner: hosts -> roles and instances, DP ranks, devices, ports, kv_ports, switches and the HBM fit."""

from __future__ import annotations

import ipaddress
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from kimictl.errors import PlanError, did_you_mean
from kimictl.facts import (
    EP_PARTS,
    GIB,
    MIB,
    REPLICATED_PARTS,
    TP_PARTS,
    EngineProfile,
    Hardware,
    KvTransfer,
    ModelFacts,
    VersionProfile,
    engine_profile,
    find_model,
    model_catalogue,
    model_facts,
    spells_config_key,
    switch_rules,
    switch_spellings,
    version_profile,
)
from kimictl.inventory import Host, Inventory
from kimictl.router_kinds import RouterKind, router_kind
from kimictl.topology import RESERVED_FLAGS, FrontLimits, Role, Topology, reserved_why

HCCL_DEFAULT_BUFFSIZE_MIB = 200  # HCCL's own default when HCCL_BUFFSIZE is unset


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


class MemoryFit(_Model):
    """Per-NPU HBM estimate for one role (every NPU of an instance carries the same load)."""

    role: str
    dp: int
    tp: int
    ep: int
    hbm_gib: float
    gpu_memory_utilization: float
    usable_gib: float
    weights_gib: dict[str, float]
    weights_total_gib: float
    reserve_gib: float
    activation_gib: float
    draft_gib: float
    kv_cache_gib: float
    kv_bytes_per_token: int
    kv_tokens_per_dp_rank: int
    max_model_len: int
    max_seqs_per_dp_rank: int
    fits: bool
    reason: str = ""


class SwitchDecision(_Model):
    role: str
    switch: str
    state: Literal["on", "off", "skipped"]
    spelled: str  # "env VLLM_ASCEND_ENABLE_MLAPO=1" / "additional-config enable_mlapo=true" / ""
    why: str
    note: str = ""


class Instance(_Model):
    role: str
    index: int
    name: str  # prefill-0
    hosts: list[str]
    dp: int
    tp: int
    ep: int
    master_host: str
    master_ip: str
    rpc_port: int
    kv_port: int | None
    engine_id: str | None


class Engine(_Model):
    id: str
    host: str
    host_ip: str
    role: str
    instance: str
    dp_ranks: list[int]
    dp_size: int
    tp_size: int
    devices: list[int]
    port: int
    serves_http: bool
    headless: bool


class Endpoint(_Model):
    host: str
    ip: str
    port: int
    engine: str


class RouterPort(_Model):
    port: int
    metrics_port: int


class ProxyPlan(_Model):
    host: str
    ip: str
    port: int
    router: str  # the router kind (data/routers.yml)
    policy: str | None  # vllm-router's --policy; None for a router that schedules by itself
    prefill: list[Endpoint]
    decode: list[Endpoint]
    routers: list[RouterPort] = []  # loopback ports of the router copies behind the proxy port
    api_key: bool = False  # clients must send the inventory's kimi_api_key_file
    router_why: str = ""  # why this router kind (printed by `kimictl plan`)
    # The routers' own API behind the front needs kimictl's admin key (False: a release made before it had one,
    # whose front took the client key there).
    admin_key: bool = False
    limits: FrontLimits = FrontLimits()


class PortUse(_Model):
    host: str
    first: int
    last: int
    what: str


class RoleConfig(_Model):
    """Resolved per-role settings shared by every engine of that role."""

    env: dict[str, str]
    env_prepend: dict[str, str]
    additional_config: dict[str, Any]
    serve: dict[str, Any]
    preload: list[str] = []  # libraries preloaded when present (LD_PRELOAD), e.g. jemalloc


class Plan(_Model):
    cluster: str
    topology: str
    topology_source: str
    vllm_ascend_version: str
    image: str
    hardware: str
    mode: str
    launch: str
    runtime: str
    model_dir: str
    served_model_name: str
    engine_profile: str = "ascend"
    kv_connector: str | None = None  # the engine profile's P/D connector (None: the version profile's)
    host_roles: dict[str, str]
    instances: list[Instance]
    engines: list[Engine]
    proxy: ProxyPlan | None
    role_config: dict[str, RoleConfig]
    fits: dict[str, MemoryFit]
    switches: list[SwitchDecision]
    ports: list[PortUse]
    warnings: list[str]
    # Engines require an API key (kimi_api_key_file is set; cluster_secrets.engine_key_file says which key), delivered
    # from a 0600 env file on the host; they listen on the host's business IP unless the topology's engine_bind is all.
    engine_api_key: bool = False
    engine_bind: str = "host-ip"

    def engines_on(self, host: str) -> list[Engine]:
        return [e for e in self.engines if e.host == host]

    def instance(self, name: str) -> Instance:
        return next(i for i in self.instances if i.name == name)


# --- HBM fit ---------------------------------------------------------------------------------------------


def memory_fit(role: str, hw: Hardware, dp: int, tp: int, serve: dict[str, Any], env: dict[str, str],
               with_draft: bool, m: ModelFacts | None = None, draft_method: str = "eagle3") -> MemoryFit:
    """Estimate per-NPU bytes for weights, reserve and KV cache of model m (default Kimi K2.5); label: estimate."""
    m = m or model_facts()
    ep = dp * tp if serve.get("enable-expert-parallel") else 1
    expert_div = ep if ep > 1 else tp
    parts = m.parts
    per_npu = {k: parts[k] / expert_div for k in EP_PARTS}
    per_npu.update({k: parts[k] / tp for k in TP_PARTS})
    per_npu.update({k: float(parts[k]) for k in REPLICATED_PARTS})
    weights = sum(per_npu.values())
    util = float(serve.get("gpu-memory-utilization", 0.9))
    usable = hw.hbm_bytes * util
    buff = int(env.get("HCCL_BUFFSIZE", HCCL_DEFAULT_BUFFSIZE_MIB))
    reserve = m.runtime_reserve_mib * MIB + m.hccl_buffers * buff * MIB
    activation = int(serve.get("max-num-batched-tokens", 8192)) * m.activation_bytes_per_token
    draft = m.drafts.get(draft_method, 0.0) * GIB if with_draft else 0.0
    kv = usable - weights - reserve - activation - draft
    max_len = int(serve.get("max-model-len", m.text.max_position_embeddings))
    tokens = max(0, int(kv // m.kv_bytes_per_token))
    reason = ""
    if kv <= 0:
        reason = (f"weights {weights / GIB:.1f} GiB + reserve {(reserve + activation + draft) / GIB:.1f} GiB per NPU "
                  f"exceed the usable {usable / GIB:.1f} GiB ({hw.hbm_mib // 1024} GiB x {util:.2f})")
        if "HCCL_BUFFSIZE" in env and m.hccl_buffers:  # the topology's env sizes part of the reserve: say how much
            reason += (f"; the reserve holds {m.hccl_buffers} HCCL buffers of env HCCL_BUFFSIZE {buff} MiB "
                       f"({m.hccl_buffers * buff * MIB / GIB:.1f} GiB)")
    elif tokens < max_len:
        reason = (f"KV cache holds {tokens} tokens per DP rank, less than one sequence of max-model-len {max_len}")
    return MemoryFit(
        role=role, dp=dp, tp=tp, ep=ep,
        hbm_gib=round(hw.hbm_bytes / GIB, 2), gpu_memory_utilization=util, usable_gib=round(usable / GIB, 2),
        weights_gib={k: round(v / GIB, 3) for k, v in per_npu.items()},
        weights_total_gib=round(weights / GIB, 2), reserve_gib=round(reserve / GIB, 2),
        activation_gib=round(activation / GIB, 2), draft_gib=round(draft / GIB, 2),
        kv_cache_gib=round(max(kv, 0) / GIB, 2), kv_bytes_per_token=m.kv_bytes_per_token,
        kv_tokens_per_dp_rank=tokens, max_model_len=max_len, max_seqs_per_dp_rank=tokens // max_len,
        fits=not reason, reason=reason,
    )


# --- host assignment -------------------------------------------------------------------------------------


def _hardware_of(inv: Inventory, topo: Topology) -> Hardware:
    kinds = {h.kimi_hardware for h in inv.hosts}
    if topo.hardware:
        wrong = [h for h in inv.hosts if h.kimi_hardware != topo.hardware]
        if wrong:
            raise PlanError(
                f"topology {topo.name} runs on {topo.hardware} hosts only",
                details=[f"host {h.name}: kimi_hardware is {h.kimi_hardware}" for h in wrong],
                hint="use the matching preset (a2-* for Atlas 800 A2, a3-* for A3) or fix kimi_hardware",
            )
    elif len(kinds) > 1:
        raise PlanError(
            "hosts mix hardware kinds (" + ", ".join(sorted(kinds)) + "); one deployment uses one kind "
            "(vllm-ascend does not support P on A2 with D on A3)")
    return inv.hosts[0].hardware


def _split_counts(topo: Topology, total: int, pinned: dict[str, int]) -> dict[str, int] | None:
    """Instances per role that use every host exactly once, closest to the preset's share."""
    roles = list(topo.roles)
    if len(roles) == 1:
        n = topo.roles[roles[0]].nodes
        return {roles[0]: total // n} if total % n == 0 and total >= n else None
    np_, nd = topo.roles["prefill"].nodes, topo.roles["decode"].nodes
    sp, sd = topo.share.get("prefill", 1), topo.share.get("decode", 1)
    best: tuple[float, int, dict[str, int]] | None = None
    for ip in range(1, total // np_ + 1):
        rest = total - ip * np_
        if rest <= 0 or rest % nd:
            continue
        idd = rest // nd
        if pinned.get("prefill", 0) > ip * np_ or pinned.get("decode", 0) > idd * nd:
            continue
        score = abs(ip / (ip + idd) - sp / (sp + sd))
        key = (score, -ip)  # on a tie prefer more prefill (the source article's 2P1D)
        if best is None or key < best[:2]:
            best = (score, -ip, {"prefill": ip, "decode": idd})
    return best[2] if best else None


def _assign(inv: Inventory, topo: Topology, hw: Hardware) -> dict[str, list[list[Host]]]:
    if topo.mode == "colocated":
        pinned_wrong = [h for h in inv.hosts if h.kimi_role]
        if pinned_wrong:
            raise PlanError(
                f"topology {topo.name} is colocated (no prefill/decode split)",
                details=[f"host {h.name}: kimi_role {h.kimi_role} has no meaning here" for h in pinned_wrong],
                hint="remove kimi_role, or use a P/D topology (a2-pd, a3-pd)")
    pinned = {r: sum(1 for h in inv.hosts if h.kimi_role == r) for r in ("prefill", "decode")}
    counts = _split_counts(topo, len(inv.hosts), pinned)
    if counts is None:
        raise _host_count_error(inv, topo, hw, pinned)
    pools: dict[str, list[Host]] = {r: [h for h in inv.hosts if h.kimi_role == r] for r in topo.roles}
    free = [h for h in inv.hosts if not h.kimi_role]
    for role in topo.roles:  # prefill first, then decode
        need = counts[role] * topo.roles[role].nodes - len(pools[role])
        pools[role].extend(free[:need])
        free = free[need:]
    groups: dict[str, list[list[Host]]] = {}
    for role, hosts in pools.items():
        n = topo.roles[role].nodes
        groups[role] = [hosts[i * n:(i + 1) * n] for i in range(counts[role])]
    return groups


def _host_count_error(inv: Inventory, topo: Topology, hw: Hardware, pinned: dict[str, int]) -> PlanError:
    need = " + ".join(f"{r} instances of {topo.roles[r].nodes} host(s)" for r in topo.roles)
    details = [f"the inventory has {len(inv.hosts)} host(s)"
               + (f", pinned: {pinned['prefill']} prefill, {pinned['decode']} decode" if any(pinned.values()) else "")]
    minimum = sum(r.nodes for r in topo.roles.values())
    if len(inv.hosts) < minimum:
        # Show why the instances cannot simply shrink onto fewer hosts: the per-NPU numbers on one host.
        facts = engine_profile(inv.cluster.kimi_engine_profile).facts(inv.cluster.kimi_model_id)
        for role, spec in topo.roles.items():
            if spec.nodes <= 1:
                continue
            dp1 = max(1, hw.npus // spec.tp)
            fit = memory_fit(role, hw, dp1, spec.tp, topo.role_serve(role), {**topo.env, **spec.env}, False,
                             facts)
            details.append(
                f"{role} on one {hw.name} host (DP{dp1}xTP{spec.tp}, EP{fit.ep}) would need "
                f"{fit.weights_total_gib:.1f} GiB of weights per NPU (routed experts "
                f"{fit.weights_gib['routed_experts']:.1f} GiB) + {fit.reserve_gib + fit.activation_gib:.1f} GiB "
                f"reserve; usable is {fit.usable_gib:.1f} GiB ({fit.hbm_gib:.0f} GiB x "
                f"{fit.gpu_memory_utilization:.2f}): " + ("fits" if fit.fits else "does not fit"))
    return PlanError(
        f"topology {topo.name} cannot use these {len(inv.hosts)} {hw.name} host(s): it needs {need}, "
        f"every host used exactly once (at least {minimum} hosts)",
        details=details,
        hint="add hosts, change kimi_role pins, or pick another topology (`kimictl topologies`)")


# --- switches and per-role config ------------------------------------------------------------------------


def _resolve_switches(topo: Topology, role: str, hw: Hardware, ep: int, tp: int, ver: VersionProfile,
                      env: dict[str, str], extra: dict[str, Any], serve: dict[str, Any],
                      decisions: list[SwitchDecision], warnings: list[str]) -> None:
    rules = switch_rules()
    asked = topo.roles[role].switches  # type: ignore[index]
    wanted_by = {name: (wanted, "") for name, wanted in asked.items()}
    for name, rule in rules.items():  # switches the planner turns on by itself (a known crash's mitigation)
        auto = rule.auto
        if auto is None or name in asked or role not in rule.roles:
            continue
        if auto.unless_off and asked.get(auto.unless_off) is False:
            continue
        batched = serve.get("max-num-batched-tokens")
        if auto.max_batched_tokens is not None and (batched is None or batched > auto.max_batched_tokens):
            continue
        wanted_by[name] = (True, f"on by kimictl (max-num-batched-tokens {batched} <= {auto.max_batched_tokens})")
    for name, (wanted, auto_note) in wanted_by.items():
        rule = rules[name]
        spelling = ver.switches.get(name)
        if spelling is None:
            if not rule.unavailable_note:
                raise PlanError(f"role {role}: switch {name} is not available in vllm-ascend {ver.version}")
            if wanted:
                decisions.append(SwitchDecision(role=role, switch=name, state="skipped", spelled="", why=rule.why,
                                                note=f"not in vllm-ascend {ver.version}"))
                warnings.append(f"{role}: {rule.unavailable_note}")
            continue
        if wanted and role not in rule.roles:
            raise PlanError(
                f"role {role}: switch {name} is for {', '.join(rule.roles)} only",
                details=[rule.why], hint=f"set {name}: false or remove it from roles.{role}.switches")
        skip = ""
        if wanted and rule.hardware and hw.name not in rule.hardware:
            skip = f"{hw.name} is not {', '.join(rule.hardware)}"
        elif wanted and rule.max_ep and ep > rule.max_ep:
            skip = f"EP {ep} > {rule.max_ep}"
        elif wanted and rule.min_tp and tp < rule.min_tp:
            skip = f"TP {tp} < {rule.min_tp}"
        value = spelling.value if wanted else spelling.off_value
        if skip:
            decisions.append(SwitchDecision(role=role, switch=name, state="skipped", spelled="", why=rule.why,
                                            note=f"{skip}: {rule.off_note or 'not rendered'}"))
            warnings.append(f"{role}: switch {name} skipped ({skip})")
            continue
        if value is None:
            decisions.append(SwitchDecision(role=role, switch=name, state="off", spelled="(left unset)", why=rule.why))
            continue
        if spelling.env:
            env[spelling.env] = str(value)
            spelled = f"env {spelling.env}={value}"
        else:
            set_nested(extra, spelling.additional_config, value)  # type: ignore[arg-type]
            spelled = f"additional-config {spelling.additional_config}={_json_scalar(value)}"
        if wanted and rule.min_hccl_buffsize_mib:
            buff = int(env.get("HCCL_BUFFSIZE", HCCL_DEFAULT_BUFFSIZE_MIB))
            if buff < rule.min_hccl_buffsize_mib:
                warnings.append(f"{role}: switch {name} with HCCL_BUFFSIZE {buff}; every upstream recipe running it "
                                f"uses >= {rule.min_hccl_buffsize_mib} MiB")
        decisions.append(SwitchDecision(role=role, switch=name, state="on" if wanted else "off", spelled=spelled,
                                        why=rule.why, note=auto_note))


def set_nested(doc: dict[str, Any], dotted: str, value: Any) -> None:
    """doc["a"]["b"] = value for "a.b" (creating the inner mappings)."""
    *outer, last = dotted.split(".")
    for key in outer:
        doc = doc.setdefault(key, {})
    doc[last] = value


def _json_scalar(v: Any) -> str:
    import json

    return json.dumps(v)


def _role_config(topo: Topology, role: str, hw: Hardware, ver: VersionProfile, ep: int,
                 decisions: list[SwitchDecision], warnings: list[str], prof: EngineProfile) -> RoleConfig:
    spec = topo.roles[role]  # type: ignore[index]
    env = dict(ver.env) if prof.ascend else dict(prof.env)
    env.update(topo.env)
    env.update(spec.env)
    for key in [*topo.env, *spec.env]:
        if key in ver.removed_env:
            raise PlanError(f"role {role}: env {key} is not valid for vllm-ascend {ver.version}: "
                            f"{ver.removed_env[key]}")
    serve = topo.role_serve(role)
    for flag, values in prof.drop_serve.items():
        if flag in serve and serve[flag] in values:
            warnings.append(f"{role}: --{flag} {serve.pop(flag)} not rendered (engine profile {prof.name}: "
                            "vLLM-Ascend only)")
    if prof.ascend:
        for flag, values in ver.drop_serve.items():
            if flag in serve and serve[flag] in values:
                warnings.append(f"{role}: --{flag} {serve.pop(flag)} not rendered (vllm-ascend {ver.version}'s "
                                "vLLM does not take it)")
    serve = {k: v for k, v in {**serve, **prof.serve}.items() if v is not False}
    extra = json_copy(serve.pop("additional-config", None) or {})
    if prof.ascend:
        _check_raw_switch_keys(role, extra, {**topo.env, **spec.env})
        _check_additional_config(role, extra, ver, warnings)
        _resolve_switches(topo, role, hw, ep, spec.tp, ver, env, extra, serve, decisions, warnings)
    else:
        _skip_ascend_only(role, spec.switches, extra, prof, decisions, warnings)
        extra = {}
    if role == "prefill" and serve.get("max-num-seqs") and "enforce-eager" not in serve:
        warnings.append("prefill: no --enforce-eager; every vllm-ascend P/D guide runs prefill eager")
    return RoleConfig(env=env, env_prepend=dict(ver.env_prepend) if prof.ascend else {}, additional_config=extra,
                      serve=serve, preload=list(ver.preload) if prof.ascend else [])


def json_copy(doc: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of a JSON-shaped mapping (the topology's own stays untouched when switches nest into it)."""
    import json

    return json.loads(json.dumps(doc))


def _check_additional_config(role: str, extra: dict[str, Any], ver: VersionProfile, warnings: list[str]) -> None:
    """Raw --additional-config keys: removed ones fail; unknown ones fail where vllm-ascend forbids them (0.28+)
    and warn where it silently ignores them."""
    known = ver.additional_config_keys
    nested = {"scheduler_config": ver.scheduler_config_keys}
    for key, value in extra.items():
        if key in ver.removed_additional_config:
            raise PlanError(f"role {role}: additional-config key {key} is not valid for vllm-ascend "
                            f"{ver.version}: {ver.removed_additional_config[key]}")
        unknown = [key] if known is not None and key not in known else []
        if not unknown and isinstance(value, dict) and nested.get(key) is not None:
            unknown = [f"{key}.{k}" for k in value if k not in nested[key]]  # type: ignore[operator]
        for name in unknown:
            hint = did_you_mean(name.rsplit(".", 1)[-1], known or [])
            if ver.strict_additional_config:
                raise PlanError(f"role {role}: additional-config key {name} is not read by vllm-ascend {ver.version}"
                                f"{hint}; this version refuses unknown keys at start-up")
            warnings.append(f"{role}: additional-config key {name} is not read by vllm-ascend {ver.version}{hint}; "
                            "it has no effect")


def _check_raw_switch_keys(role: str, extra: dict[str, Any], env: dict[str, str]) -> None:
    """A raw additional-config key or env variable (the topology's and the role's) that is a switch's spelling (in
    any version) turns that switch on just the same: the switch's role rule holds for it too."""
    rules = switch_rules()
    nested = extra.get("scheduler_config")
    keys = [*extra.items(), *((f"scheduler_config.{k}", v) for k, v in nested.items())] \
        if isinstance(nested, dict) else list(extra.items())
    for name, sp in switch_spellings():
        if role in rules[name].roles:
            continue
        raw = [(f"additional-config {path}: {_json_scalar(value)}", f"remove {path} from the additional-config "
                f"{role} gets (roles.{role}.serve, or the topology's serve)")
               for path, value in keys if spells_config_key(sp, path) and value == sp.value]
        if sp.env and sp.env in env and env[sp.env] == str(sp.value):
            raw.append((f"env {sp.env}={env[sp.env]}", f"remove {sp.env} from roles.{role}.env (or the topology's "
                                                       "env)"))
        if raw:
            what, hint = raw[0]
            raise PlanError(f"role {role}: {what} turns on switch {name}, which is for "
                            f"{', '.join(rules[name].roles)} only", details=[rules[name].why], hint=hint)


def _skip_ascend_only(role: str, switches: dict[str, bool], extra: dict[str, Any], prof: EngineProfile,
                      decisions: list[SwitchDecision], warnings: list[str]) -> None:
    """A non-Ascend engine profile renders no switches and no --additional-config; say so, per role."""
    rules = switch_rules()
    note = f"engine profile {prof.name} runs no vLLM-Ascend"
    for name, wanted in switches.items():
        decisions.append(SwitchDecision(role=role, switch=name, state="skipped" if wanted else "off", spelled="",
                                        why=rules[name].why, note=note))
    on = [n for n, wanted in switches.items() if wanted]
    if on:
        warnings.append(f"{role}: switches {', '.join(on)} not rendered ({note})")
    if extra:
        warnings.append(f"{role}: additional-config {', '.join(sorted(extra))} not rendered ({note})")


# --- the planner -----------------------------------------------------------------------------------------


class _Ports:
    def __init__(self) -> None:
        self.uses: list[PortUse] = []

    def take(self, host: str, first: int, last: int, what: str) -> None:
        if last > 65535:
            raise PlanError(f"host {host}: {what} needs ports {first}-{last}, beyond 65535")
        for u in self.uses:
            if u.host == host and first <= u.last and u.first <= last:
                raise PlanError(f"host {host}: {what} (ports {first}-{last}) collides with {u.what} "
                                f"(ports {u.first}-{u.last})", hint="change ports in the topology")
        self.uses.append(PortUse(host=host, first=first, last=last, what=what))


# Flags kimictl gives every vllm-router copy (render.proxy_argv; the proxy front adds --host, --port and the
# metrics flag): kimi_router_command passing one would contradict them.
ROUTER_FLAGS = {"host", "port", "policy", "vllm-pd-disaggregation", "prefill", "decode"}


def _check_engine_commands(inv: Inventory, prof: EngineProfile) -> None:
    """kimi_engine_command's words go before the serve flags kimictl computes: a reserved flag there (or --config,
    which reads more flags from a file) would override or hide them, as it would under a topology's serve.
    kimi_router_command likewise must not pass a flag kimictl gives the router."""
    vllm_router = router_kind("vllm-router")
    router_flags = ROUTER_FLAGS | {w[2:] for w in [vllm_router.metrics_flag or "", *vllm_router.args]
                                   if w.startswith("--")}
    router_flags |= {w[2:] for kv in prof.kv_connectors.values() for r in kv.routers.values() for w in r.args
                     if w.startswith("--")}
    for h in inv.hosts:
        for key, command, reserved in (("kimi_engine_command", h.kimi_engine_command, RESERVED_FLAGS | {"config"}),
                                       ("kimi_router_command", h.kimi_router_command, router_flags)):
            for word in (command or "").split():
                flag = word[2:].split("=", 1)[0] if word.startswith("--") else ""
                if flag not in reserved:
                    continue
                if key == "kimi_engine_command":
                    raise PlanError(f"host {h.name}: kimi_engine_command passes --{flag}, which {reserved_why(flag)}",
                                    hint="give kimi_engine_command the engine's command only; serve flags go in the "
                                         "topology's serve")
                raise PlanError(f"host {h.name}: kimi_router_command passes --{flag}, which kimictl gives every "
                                "router copy from the plan (its loopback port, policy and the engines' endpoints)",
                                hint="give kimi_router_command the router's command only (default vllm-router); the "
                                     "policy is the topology's proxy.policy")


def make_plan(inv: Inventory, topo: Topology) -> Plan:
    """Compile inventory + topology into a plan; raise PlanError (exit 2) when it cannot work."""
    ver = version_profile(inv.cluster.kimi_vllm_ascend_version)
    prof = engine_profile(inv.cluster.kimi_engine_profile)
    if prof.runtime and inv.cluster.kimi_runtime != prof.runtime:
        raise PlanError(f"engine profile {prof.name} needs kimi_runtime: {prof.runtime} "
                        f"(the inventory says {inv.cluster.kimi_runtime})", hint=f"set kimi_runtime: {prof.runtime} "
                        "under all.vars, or use kimi_engine_profile: ascend")
    facts = prof.facts(inv.cluster.kimi_model_id)
    _check_engine_commands(inv, prof)
    hw = _hardware_of(inv, topo)
    warnings: list[str] = []
    decisions: list[SwitchDecision] = []
    if not prof.model and find_model(inv.cluster.kimi_model_id) is None:
        warnings.append(f"kimi_model_id {inv.cluster.kimi_model_id} has no model facts (known: "
                        f"{', '.join(m.model_id for m in model_catalogue().values())}); "
                        f"the HBM estimate and the served name are {facts.name}'s")
    if inv.cluster.kimi_draft_model_dir and not topo.speculative:
        warnings.append(f"kimi_draft_model_dir {inv.cluster.kimi_draft_model_dir} is set but topology {topo.name} has "
                        "no speculative section: the draft is not staged or loaded")
    fits, role_cfg = _fit_roles(inv, topo, hw, ver, prof, facts, decisions, warnings)
    conn = prof.connector(inv.cluster.kimi_kv_connector) if topo.mode == "pd" else None
    groups = _assign(inv, topo, hw)
    ports = _Ports()
    instances, engines, host_roles = _place(topo, hw, groups, fits, conn, ports, warnings)
    proxy = _proxy_plan(inv, topo, prof, ver, role_cfg, decisions, groups, engines, ports, conn)
    _check_loopback_business_ips(inv, {e.host for e in engines} | ({proxy.host} if proxy else set()))
    return Plan(
        cluster=inv.cluster.name, topology=topo.name, topology_source=topo.source,
        vllm_ascend_version=ver.version, image=ver.image(hw, inv.cluster.kimi_image_repo), hardware=hw.name,
        mode=topo.mode, launch=topo.launch, runtime=inv.cluster.kimi_runtime, model_dir=inv.cluster.kimi_model_dir,
        served_model_name=facts.served_model_name, engine_profile=prof.name, kv_connector=conn[0] if conn else None,
        host_roles=host_roles,
        instances=instances, engines=engines, proxy=proxy, role_config=role_cfg, fits=fits, switches=decisions,
        ports=ports.uses, warnings=warnings, engine_api_key=inv.cluster.kimi_api_key_file is not None,
        engine_bind=topo.engine_bind,
    )


def _check_loopback_business_ips(inv: Inventory, used: set[str]) -> None:
    """A host the plan uses whose business IP is its loopback ansible_host (no kimi_host_ip) is reached by no other
    host: refused when another host the plan uses is not on loopback (hosts all on loopback share one machine: a
    test bed). A loopback kimi_host_ip is the inventory's own error."""
    def loopback(ip: str) -> bool:
        try:
            return ipaddress.ip_address(ip).is_loopback
        except ValueError:   # a DNS name (kimi_host_ip gives its address)
            return False

    hosts = [h for h in inv.hosts if h.name in used]
    remote = [h.name for h in hosts if not loopback(h.ip)]
    for h in hosts:
        if remote and loopback(h.ip):
            raise PlanError(f"host {h.name}: ansible_host {h.ansible_host} is a loopback address and no kimi_host_ip "
                            f"is set, so it is this host's business IP, which host {remote[0]} cannot reach",
                            hint="set kimi_host_ip to the address the other hosts reach it at")


def _npus_per_host(role: str, spec: Role, hw: Hardware, heads: int) -> int:
    """Check one role's shape (TP divides the attention heads, DP splits over its hosts, the host has the NPUs);
    the NPUs it uses per host."""
    if heads % spec.tp:
        ok = [str(t) for t in (1, 2, 4, 8, 16) if heads % t == 0]
        choices = ok[0] if len(ok) == 1 else f"{', '.join(ok[:-1])} or {ok[-1]}"
        raise PlanError(f"role {role}: TP {spec.tp} does not divide the model's {heads} attention heads "
                        f"(vLLM refuses to start); use TP {choices}")
    if spec.dp % spec.nodes:
        raise PlanError(f"role {role}: DP {spec.dp} does not split evenly over {spec.nodes} hosts")
    per_node = spec.dp // spec.nodes * spec.tp
    if per_node > hw.npus:
        raise PlanError(f"role {role}: DP{spec.dp}xTP{spec.tp} over {spec.nodes} host(s) needs {per_node} NPUs "
                        f"per host; {hw.name} has {hw.npus}")
    return per_node


def _fit_roles(inv: Inventory, topo: Topology, hw: Hardware, ver: VersionProfile, prof: EngineProfile,
               facts: ModelFacts, decisions: list[SwitchDecision],
               warnings: list[str]) -> tuple[dict[str, MemoryFit], dict[str, RoleConfig]]:
    """Per-role shape checks, configuration (switches, serve args, env) and HBM fit."""
    with_draft = bool(topo.speculative and inv.cluster.kimi_draft_model_dir)
    draft_method = topo.speculative.method if topo.speculative else "eagle3"
    fits: dict[str, MemoryFit] = {}
    role_cfg: dict[str, RoleConfig] = {}
    for role, spec in topo.roles.items():
        per_node = _npus_per_host(role, spec, hw, facts.text.num_attention_heads)
        serve = topo.role_serve(role)
        ep = spec.dp * spec.tp if serve.get("enable-expert-parallel") else 1
        role_cfg[role] = _role_config(topo, role, hw, ver, ep, decisions, warnings, prof)
        fit = memory_fit(role, hw, spec.dp, spec.tp, role_cfg[role].serve, role_cfg[role].env, with_draft, facts,
                         draft_method)
        fits[role] = fit
        if not fit.fits:
            raise PlanError(
                f"role {role} does not fit in HBM (estimate): {fit.reason}",
                details=fit_lines(fit), hint="use more NPUs per instance (larger DP x TP, more hosts) "
                "or lower max-model-len" + (" or HCCL_BUFFSIZE" if "HCCL_BUFFSIZE" in fit.reason else ""))
        if per_node < hw.npus:
            warnings.append(f"{role}: uses {per_node} of {hw.npus} NPUs per host")
    if topo.mode == "pd":
        p, d = topo.roles["prefill"], topo.roles["decode"]
        if p.tp < d.tp or p.tp % d.tp:
            raise PlanError(f"prefill TP {p.tp} must be >= decode TP {d.tp} and divisible by it "
                            "(MooncakeConnectorV1 pulls KV from P TP ranks into D TP ranks)")
    return fits, role_cfg


def _place(topo: Topology, hw: Hardware, groups: dict[str, list[list[Host]]], fits: dict[str, MemoryFit],
           conn: tuple[str, KvTransfer] | None, ports: _Ports,
           warnings: list[str]) -> tuple[list[Instance], list[Engine], dict[str, str]]:
    """The instances on their host groups, each with its KV port range (P/D) and engines; ports taken as it goes."""
    instances: list[Instance] = []
    engines: list[Engine] = []
    host_roles: dict[str, str] = {}
    kv_next = topo.ports.kv_base or hw.kv_port_min
    if kv_next < hw.kv_port_min:
        warnings.append(f"kv_base {kv_next} is inside AscendDirectTransport's random range on {hw.name} "
                        f"(use >= {hw.kv_port_min}); expect 'Address already in use'")
    for role, role_groups in groups.items():
        spec = topo.roles[role]  # type: ignore[index]
        for idx, hosts in enumerate(role_groups):
            name = f"{role}-{idx}"
            master = hosts[0]
            ep = fits[role].ep
            kv_port = engine_id = None
            if topo.mode == "pd":
                width = spec.dp * spec.tp
                kv_port, engine_id = kv_next, name
                kv_next += math.ceil(width / 100) * 100
                if conn is None:
                    for h in hosts:
                        ports.take(h.name, kv_port, kv_port + width - 1, f"{name} kv_port range")
                elif conn[1].port and role in conn[1].port.roles:  # the port + each DP rank, on every host
                    for h in hosts:
                        ports.take(h.name, kv_port, kv_port + spec.dp - 1, f"{name} {conn[1].port.what}")
            ports.take(master.name, topo.ports.rpc, topo.ports.rpc, f"{name} data-parallel-rpc-port")
            instances.append(Instance(role=role, index=idx, name=name, hosts=[h.name for h in hosts], dp=spec.dp,
                                      tp=spec.tp, ep=ep, master_host=master.name, master_ip=master.ip,
                                      rpc_port=topo.ports.rpc, kv_port=kv_port, engine_id=engine_id))
            for k, h in enumerate(hosts):
                host_roles[h.name] = role
                engines.extend(_host_engines(topo, spec, role, name, k, h, ports))
    return instances, engines, host_roles


def _host_engines(topo: Topology, spec: Role, role: str, name: str, k: int, h: Host, ports: _Ports) -> list[Engine]:
    """The engines of instance `name` on its k-th host: one per DP rank (external-dp), else one for all of them."""
    per_node = spec.dp // spec.nodes
    ranks = list(range(k * per_node, (k + 1) * per_node))
    if topo.launch == "external-dp":
        out = []
        for i, r in enumerate(ranks):
            port = topo.ports.http_base + i
            ports.take(h.name, port, port, f"{name}-dp{r} HTTP")
            out.append(Engine(
                id=f"{name}-dp{r}", host=h.name, host_ip=h.ip, role=role, instance=name,
                dp_ranks=[r], dp_size=spec.dp, tp_size=spec.tp,
                devices=list(range(i * spec.tp, (i + 1) * spec.tp)), port=port,
                serves_http=True, headless=False))
        return out
    port = topo.ports.http_base
    if k == 0:
        ports.take(h.name, port, port, f"{name} HTTP")
    return [Engine(
        id=f"{name}-n{k}", host=h.name, host_ip=h.ip, role=role, instance=name, dp_ranks=ranks,
        dp_size=spec.dp, tp_size=spec.tp, devices=list(range(per_node * spec.tp)), port=port,
        serves_http=k == 0, headless=k > 0)]


def _proxy_plan(inv: Inventory, topo: Topology, prof: EngineProfile, ver: VersionProfile,
                role_cfg: dict[str, RoleConfig], decisions: list[SwitchDecision],
                groups: dict[str, list[list[Host]]], engines: list[Engine], ports: _Ports,
                conn: tuple[str, KvTransfer] | None) -> ProxyPlan | None:
    """The P/D proxy and its routers (None without P/D or without a proxy)."""
    if not (topo.mode == "pd" and topo.proxy):
        return None
    phost = inv.host(inv.cluster.kimi_proxy_host) if inv.cluster.kimi_proxy_host else \
        inv.host(groups["prefill"][0][0].name)
    ports.take(phost.name, topo.proxy.port, topo.proxy.port, "P/D proxy")
    base, n = topo.proxy.router_port_base or topo.proxy.port + 1, topo.proxy.routers
    ports.take(phost.name, base, base + 2 * n - 1, f"{n} P/D router(s) behind the proxy")
    routers = [RouterPort(port=base + 2 * i, metrics_port=base + 2 * i + 1) for i in range(n)]

    def endpoints(role: str) -> list[Endpoint]:
        return [Endpoint(host=e.host, ip=e.host_ip, port=e.port, engine=e.id)
                for e in engines if e.role == role and e.serves_http]

    kind, why = _router_kind(inv, topo, prof, role_cfg, decisions, ver, phost, conn)
    return ProxyPlan(host=phost.name, ip=phost.ip, port=topo.proxy.port, router=kind.name,
                     policy=topo.proxy.policy or "round_robin" if kind.name == "vllm-router" else None,
                     prefill=endpoints("prefill"), decode=endpoints("decode"), routers=routers,
                     api_key=inv.cluster.kimi_api_key_file is not None, router_why=why, admin_key=True,
                     limits=FrontLimits(**{k: getattr(topo.proxy, k) for k in FrontLimits.model_fields}))


def recompute_roles(role_cfg: dict[str, RoleConfig], decisions: list[SwitchDecision],
                    ver: VersionProfile) -> list[str]:
    """Roles whose engines end requests as "recomputed" for the proxy to replay: the recompute_scheduler switch,
    or its additional-config key set directly (top level, or nested under scheduler_config as 0.26+ reads it)."""
    spelling = ver.switches.get("recompute_scheduler")
    key = (spelling.additional_config or "").rsplit(".", 1)[-1] if spelling else "recompute_scheduler_enable"
    out = [d.role for d in decisions if d.switch == "recompute_scheduler" and d.state == "on"]
    for role, cfg in role_cfg.items():
        extra = cfg.additional_config
        nested = extra.get("scheduler_config")
        if (extra.get(key) or (isinstance(nested, dict) and nested.get(key))) and role not in out:
            out.append(role)
    return out


def _router_kind(inv: Inventory, topo: Topology, prof: EngineProfile, role_cfg: dict[str, RoleConfig],
                 decisions: list[SwitchDecision], ver: VersionProfile, phost: Host,
                 conn: tuple[str, KvTransfer] | None = None) -> tuple[RouterKind, str]:
    """The P/D router kind and why; PlanError for a combination that cannot work. The engine profile's connector
    (kimi_kv_connector) lists the router kinds that speak its protocol: without a topology choice the first of them
    replaces a profile default it does not list."""
    assert topo.proxy is not None
    kind = router_kind(topo.proxy.router or prof.router)
    source = "topology proxy.router" if topo.proxy.router else f"engine profile {prof.name}'s default"
    if conn and kind.name not in conn[1].routers:
        if topo.proxy.router:
            speak = ", ".join(conn[1].routers)
            raise PlanError(f"kimi_kv_connector {conn[0]} ({conn[1].kv_connector}) does not work behind proxy.router "
                            f"{kind.name}", hint=f"use a router that speaks its protocol ({speak}), or another "
                            "kimi_kv_connector")
        kind = router_kind(next(iter(conn[1].routers)))
        source = f"kimi_kv_connector {conn[0]} works behind {', '.join(conn[1].routers)} only"
    why = f"{kind.name} ({source}): {kind.why}"
    if kind.name == "vllm-router":
        roles = recompute_roles(role_cfg, decisions, ver)
        if roles:
            raise PlanError(
                f"{', '.join(roles)}: switch recompute_scheduler is on, but proxy.router vllm-router does not replay "
                "requests a decode engine ends as \"recomputed\" when its KV cache runs out: clients would get "
                "truncated answers",
                details=["vllm-ascend's RecomputeScheduler ends the request with stop_reason \"recomputed\" and "
                         "leaves the replay to the P/D proxy; vllm-router passes that ending to the client"],
                hint="use proxy.router: vllm-ascend-proxy (the default for vLLM-Ascend; it replays them), or turn "
                     f"recompute off (roles.{roles[0]}.switches.recompute_scheduler: false, and no "
                     "recompute_scheduler_enable in its additional-config)")
    if kind.engine_key != "env" and inv.cluster.kimi_api_key_file:
        raise PlanError(
            f"kimi_api_key_file is set, so every engine requires an API key, but proxy.router {kind.name} can send "
            "the engines a key only on its command line (--api-key), where any local user could read it",
            details=["measured: vllm-router 0.1.17 sends `Authorization: Bearer <--api-key or empty>` to the engines"],
            hint="use proxy.router: vllm-ascend-proxy (the default; it sends the key from its environment), or "
                 "remove kimi_api_key_file")
    if kind.name != "vllm-router" and topo.proxy.policy:
        raise PlanError(f"proxy.policy {topo.proxy.policy} is vllm-router's; proxy.router {kind.name} picks engines "
                        "by its own load score", hint="remove proxy.policy, or use proxy.router: vllm-router")
    if kind.script and inv.cluster.kimi_runtime == "host" and not phost.kimi_proxy_script:
        raise PlanError(
            f"proxy.router {kind.name} on kimi_runtime host needs kimi_proxy_script on {phost.name}: the path of "
            f"{kind.script.rsplit('/', 1)[-1]} on the proxy host",
            hint=f"install vllm-ascend's source tree on the proxy host and set kimi_proxy_script to "
                 f"<tree>/{kind.script} (and kimi_proxy_python to a python3 with "
                 f"{', '.join(kind.python_modules)}); or kimi_runtime: container (it runs from the image)")
    return kind, why


def fit_lines(fit: MemoryFit) -> list[str]:
    """Human-readable lines of one role's HBM estimate."""
    w = ", ".join(f"{k} {v:.2f}" for k, v in fit.weights_gib.items())
    return [
        f"DP{fit.dp} x TP{fit.tp}, EP{fit.ep}; HBM {fit.hbm_gib:.0f} GiB x {fit.gpu_memory_utilization:.2f} = "
        f"{fit.usable_gib:.1f} GiB usable per NPU",
        f"weights per NPU {fit.weights_total_gib:.2f} GiB ({w})",
        f"reserve {fit.reserve_gib:.2f} GiB, activations {fit.activation_gib:.2f} GiB, draft {fit.draft_gib:.2f} GiB",
        f"KV cache {fit.kv_cache_gib:.2f} GiB = {fit.kv_tokens_per_dp_rank} tokens per DP rank "
        f"({fit.kv_bytes_per_token} B/token)",
    ]

