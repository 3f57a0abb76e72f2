"""Property tests of the planner and renderer: random valid inventories x topologies derived from the presets.

For every generated case make_plan either raises an InvalidInput (exit 2) or returns a plan whose engines,
ranks, devices, ports and kv-transfer configs satisfy the invariants vllm-ascend's external-DP P/D launch needs
(vllm-ascend's pd_disaggregation_mooncake_multi_node.md and the Kimi-K2.5 tutorial, releases/v0.23.0).
"""

from __future__ import annotations

import copy
import itertools
import json
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kimictl.errors import InvalidInput
from kimictl.facts import hardware_catalogue
from kimictl.inventory import Inventory, load_inventory
from kimictl.plan import Plan, make_plan
from kimictl.render import render
from kimictl.topology import PRESET_DIR, Topology

HW = hardware_catalogue()
PRESETS = {p.stem: yaml.safe_load(p.read_text()) for p in PRESET_DIR.glob("*.yml")}
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

NAMES = st.from_regex(r"[a-z][a-z0-9-]{0,10}[a-z0-9]", fullmatch=True)


# --- strategies ------------------------------------------------------------------------------------------


@st.composite
def role_shape(draw, npus: int, max_tp: int | None = None) -> dict[str, int]:
    """nodes, dp, tp of one role: DP splits evenly over the nodes, and DP-per-node x TP fits one host."""
    tps = [t for t in (1, 2, 4, 8, 16) if t <= min(npus, max_tp or npus)]
    tp = draw(st.sampled_from(tps))
    full = npus // tp
    if not draw(st.integers(0, 9)):  # anything the schema allows (mostly rejected: uneven DP, too many NPUs)
        return {"nodes": draw(st.integers(1, 4)), "dp": draw(st.integers(1, 64)), "tp": draw(st.integers(1, 16))}
    if draw(st.integers(0, 3)):  # mostly whole hosts and EP >= 16, so the experts fit in HBM
        nodes = draw(st.integers(max(1, 16 // npus), 4))
        per_node = full
    else:
        nodes = draw(st.integers(1, 4))
        per_node = draw(st.integers(1, full))
    return {"nodes": nodes, "dp": nodes * per_node, "tp": tp}


@st.composite
def case(draw) -> tuple[dict[str, Any], dict[str, Any]]:
    """(inventory document, topology document)."""
    hardware = draw(st.sampled_from(sorted(HW)))
    npus = HW[hardware].npus
    short = "a2" if hardware == "atlas-800-a2" else "a3"
    mode = draw(st.sampled_from(["pd", "colocated"]))
    topo = copy.deepcopy(PRESETS[f"{short}-{'pd' if mode == 'pd' else 'colocated'}"])
    topo["name"] = f"hyp-{topo['name']}"
    if draw(st.booleans()):
        topo.pop("hardware")  # "any one kind": the inventory is single-kind anyway

    if mode == "pd":
        p = draw(role_shape(npus))
        # decode TP <= prefill TP (mostly; sometimes anything, which the planner must reject cleanly)
        d = draw(st.one_of(role_shape(npus, max_tp=p["tp"]), role_shape(npus)))
        topo["roles"]["prefill"].update(p)
        topo["roles"]["decode"].update(d)
        topo["share"] = {"prefill": draw(st.integers(1, 3)), "decode": draw(st.integers(1, 3))}
        topo["proxy"]["port"] = draw(st.one_of(st.just(8000), st.integers(1024, 65535)))
    else:
        topo["roles"]["colocated"].update(draw(role_shape(npus)))
        topo["launch"] = draw(st.sampled_from(["internal-dp", "external-dp"]))
    topo["ports"] = {
        "http_base": draw(st.one_of(st.just(7100), st.integers(1024, 65000))),
        "rpc": draw(st.one_of(st.just(12321), st.integers(1024, 65535))),
    }
    kv_base = draw(st.one_of(st.none(), st.integers(1024, 65000), st.integers(20000, 40000)))
    if kv_base is not None:
        topo["ports"]["kv_base"] = kv_base

    roles = topo["roles"].values()
    exact = sum(draw(st.integers(1, 3)) * r["nodes"] for r in roles)  # a host count that splits into instances
    n = draw(st.one_of(st.just(min(exact, 16)), st.integers(1, 16)))
    names = draw(st.lists(NAMES, min_size=n, max_size=n, unique=True))
    hosts: dict[str, Any] = {}
    for i, name in enumerate(names):
        h: dict[str, Any] = {"ansible_host": f"10.{i // 200}.{i % 200}.{i + 1}", "kimi_hardware": hardware}
        if mode == "pd":
            role = draw(st.sampled_from([None, None, None, "prefill", "decode"]))
            if role:
                h["kimi_role"] = role
        if draw(st.booleans()):
            h["kimi_device_ips"] = [f"172.16.{i}.{k + 1}" for k in range(npus)]
        hosts[name] = h
    cluster: dict[str, Any] = {
        "kimi_cluster": draw(NAMES), "kimi_model_dir": "/data/models/Kimi-K2.5-W4A8", "kimi_nic": "eth0",
        "kimi_runtime": draw(st.sampled_from(["container", "host"])),
    }
    if draw(st.booleans()):  # host runtime without it: the planner refuses vllm-ascend-proxy (exit 2)
        cluster["kimi_proxy_script"] = "/opt/vllm-ascend/examples/disaggregated_prefill_v1/proxy.py"
    if draw(st.booleans()):
        cluster["kimi_draft_model_dir"] = "/data/models/kimi-k2.5-eagle3"
    if mode == "pd" and draw(st.booleans()):
        cluster["kimi_proxy_host"] = draw(st.sampled_from(names))
    return {"all": {"vars": cluster, "hosts": hosts}}, topo


def _load(inv_doc: dict[str, Any], topo_doc: dict[str, Any]) -> tuple[Inventory, Topology]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "inventory.yml"
        path.write_text(yaml.safe_dump(inv_doc, sort_keys=False))
        inv = load_inventory(path)  # generated inventories are valid: this must not raise
    return inv, Topology(**topo_doc, source="hypothesis")


def _plan_or_none(inv: Inventory, topo: Topology) -> Plan | None:
    try:
        return make_plan(inv, topo)
    except InvalidInput as exc:  # any other exception fails the test: user input must never crash kimictl
        assert exc.code == 2
        assert exc.message
        if "cannot use these" in exc.message:
            assert not _some_split_exists(inv, topo), f"a split exists but the planner said: {exc.message}"
        return None


def _some_split_exists(inv: Inventory, topo: Topology) -> bool:
    """Brute force: can the hosts be cut into whole instances of each role, honouring every kimi_role pin?"""
    n = len(inv.hosts)
    if topo.mode == "colocated":
        k = topo.roles["colocated"].nodes
        return n % k == 0 and not any(h.kimi_role for h in inv.hosts)
    np_, nd = topo.roles["prefill"].nodes, topo.roles["decode"].nodes
    pp = sum(h.kimi_role == "prefill" for h in inv.hosts)
    pd = sum(h.kimi_role == "decode" for h in inv.hosts)
    return any(ip * np_ + idd * nd == n and pp <= ip * np_ and pd <= idd * nd
               for ip in range(1, n + 1) for idd in range(1, n + 1))


def _flag(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


# --- invariants ------------------------------------------------------------------------------------------


def _check_assignment(plan: Plan, inv: Inventory) -> None:
    names = [h.name for h in inv.hosts]
    assert set(plan.host_roles) == set(names), "every inventory host gets a role"
    for h in inv.hosts:
        if h.kimi_role:
            assert plan.host_roles[h.name] == h.kimi_role, f"pinned host {h.name} keeps its role"
    seen: list[str] = [h for inst in plan.instances for h in inst.hosts]
    assert sorted(seen) == sorted(names), "each host is in exactly one instance"
    for inst in plan.instances:
        assert all(plan.host_roles[h] == inst.role for h in inst.hosts)
        assert inst.master_host == inst.hosts[0]


def _check_ranks_and_devices(plan: Plan, topo: Topology, npus: int) -> None:
    ids = [e.id for e in plan.engines]
    assert len(ids) == len(set(ids)), "engine ids unique"
    by_instance: dict[str, list[int]] = defaultdict(list)
    for e in plan.engines:
        inst = plan.instance(e.instance)
        assert e.host in inst.hosts and e.role == inst.role
        assert (e.dp_size, e.tp_size) == (inst.dp, inst.tp) == (topo.roles[e.role].dp, topo.roles[e.role].tp)
        by_instance[e.instance] += e.dp_ranks
        if plan.launch == "external-dp":
            assert len(e.dp_ranks) == 1 and e.serves_http and not e.headless
        assert len(e.devices) == len(e.dp_ranks) * e.tp_size
    for inst in plan.instances:
        assert sorted(by_instance[inst.name]) == list(range(inst.dp)), f"{inst.name}: ranks cover [0, dp) once"
    for host in plan.host_roles:
        used: set[int] = set()
        for e in plan.engines_on(host):
            devs = e.devices
            assert devs == list(range(devs[0], devs[0] + len(devs))), f"{e.id}: devices contiguous"
            assert devs[0] >= 0 and devs[-1] < npus, f"{e.id}: devices within the host's {npus} NPUs"
            assert not used & set(devs), f"{host}: engines share NPUs"
            used |= set(devs)


def _check_ports(plan: Plan, topo: Topology, kv_min: int) -> None:
    spans: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for e in plan.engines:
        if e.serves_http:
            spans[e.host].append((e.port, e.port, f"{e.id} http"))
    for inst in plan.instances:
        spans[inst.master_host].append((inst.rpc_port, inst.rpc_port, f"{inst.name} rpc"))
        if plan.mode == "pd":
            assert inst.kv_port is not None
            width = inst.dp * inst.tp
            for h in inst.hosts:
                spans[h].append((inst.kv_port, inst.kv_port + width - 1, f"{inst.name} kv"))
            base = topo.ports.kv_base
            assert inst.kv_port >= (kv_min if base is None or base >= kv_min else base)
            assert inst.kv_port + width - 1 <= 65535
        else:
            assert inst.kv_port is None
    if plan.proxy:
        spans[plan.proxy.host].append((plan.proxy.port, plan.proxy.port, "proxy"))
    for host, items in spans.items():
        items.sort()
        for (a0, a1, aw), (b0, b1, bw) in itertools.pairwise(items):
            assert a1 < b0, f"{host}: {aw} {a0}-{a1} overlaps {bw} {b0}-{b1}"
        assert all(a >= 1024 and b <= 65535 for a, b, _ in items)


def _check_proxy(plan: Plan, inv: Inventory, contract: dict[str, Any]) -> None:
    if plan.mode != "pd":
        assert plan.proxy is None and contract["proxy"] is None
        return
    assert plan.proxy is not None
    want_host = inv.cluster.kimi_proxy_host or next(i for i in plan.instances if i.role == "prefill").master_host
    assert plan.proxy.host == want_host
    by_id = {e.id: e for e in plan.engines}
    urls = [(x.ip, x.port) for x in [*plan.proxy.prefill, *plan.proxy.decode]]
    assert len(urls) == len(set(urls)), "every proxy endpoint is a distinct ip:port"
    for role, listed in (("prefill", plan.proxy.prefill), ("decode", plan.proxy.decode)):
        serving = sorted((e.host, e.port) for e in plan.engines if e.role == role and e.serves_http)
        assert sorted((x.host, x.port) for x in listed) == serving, f"proxy lists every {role} endpoint once"
        assert all(by_id[x.engine].host_ip == x.ip and by_id[x.engine].role == role for x in listed)
        doc = sorted((x["host"], x["port"]) for x in contract["proxy"][role])
        assert doc == sorted((by_id[x.engine].host_ip, x.port) for x in listed)
        assert sorted(_routed(contract["proxy"]["argv"], role)) == sorted(f"http://{h}:{p}" for h, p in doc), \
            "proxy command routes to every endpoint"


def _routed(argv: list[str], role: str) -> list[str]:
    """The endpoint URLs of one role in a router copy's command, in either kind's spelling."""
    if f"--{role}" in argv:  # vllm-router: --prefill URL --decode URL ...
        return [v for k, v in itertools.pairwise(argv) if k == f"--{role}"]
    side = {"prefill": "prefiller", "decode": "decoder"}[role]  # vllm-ascend-proxy: parallel host and port lists

    def values(flag: str) -> list[str]:
        rest = argv[argv.index(flag) + 1:]
        return list(itertools.takewhile(lambda a: not a.startswith("--"), rest))

    return [f"http://{h}:{p}" for h, p in zip(values(f"--{side}-hosts"), values(f"--{side}-ports"), strict=True)]


def _check_argv(plan: Plan, topo: Topology, contract: dict[str, Any]) -> None:
    engine_ids: set[str] = set()
    for e in contract["engines"]:
        inst = plan.instance(e["instance"])
        argv: list[str] = e["argv"]
        assert _flag(argv, "--data-parallel-size") == str(inst.dp)
        assert _flag(argv, "--tensor-parallel-size") == str(inst.tp)
        assert _flag(argv, "--port") == str(e["port"])
        assert _flag(argv, "--data-parallel-address") == inst.master_ip
        assert _flag(argv, "--data-parallel-rpc-port") == str(inst.rpc_port)
        assert e["env"]["ASCEND_RT_VISIBLE_DEVICES"] == ",".join(map(str, e["devices"]))
        if plan.launch == "external-dp":
            if inst.dp > 1:
                assert _flag(argv, "--data-parallel-rank") == str(e["dp_ranks"][0])
            else:  # vLLM refuses a DP rank (external load balancing) with DP size 1
                assert "--data-parallel-rank" not in argv
            assert "--headless" not in argv
        else:
            assert "--data-parallel-rank" not in argv
            assert _flag(argv, "--data-parallel-size-local") == str(len(e["dp_ranks"]))
        for item in argv:  # JSON-valued flags are single valid-JSON argv items
            if item[:1] in "{[":
                json.loads(item)
        if plan.mode != "pd":
            assert "--kv-transfer-config" not in argv
            continue
        kv = json.loads(_flag(argv, "--kv-transfer-config"))
        assert kv["kv_role"] == ("kv_producer" if e["role"] == "prefill" else "kv_consumer")
        assert kv["kv_port"] == str(inst.kv_port) and kv["engine_id"] == inst.engine_id
        extra = kv["kv_connector_extra_config"]
        for role in ("prefill", "decode"):
            assert extra[role] == {"dp_size": topo.roles[role].dp, "tp_size": topo.roles[role].tp}
        assert extra["prefill"]["tp_size"] >= extra["decode"]["tp_size"]
        assert extra["prefill"]["tp_size"] % extra["decode"]["tp_size"] == 0
        engine_ids.add(kv["engine_id"])
    if plan.mode == "pd":
        kv_ids = [i.engine_id for i in plan.instances]
        assert len(kv_ids) == len(set(kv_ids)), "kv engine_ids unique per DP group"
        assert engine_ids == set(kv_ids)


# --- the properties --------------------------------------------------------------------------------------


@SETTINGS
@given(case())
def test_plan_and_render_invariants(generated) -> None:
    inv_doc, topo_doc = generated
    inv, topo = _load(inv_doc, topo_doc)
    plan = _plan_or_none(inv, topo)
    event(f"{topo.mode}: {'plan' if plan else 'rejected'}")
    if plan is None:
        return
    hw = HW[plan.hardware]
    assert plan == make_plan(inv, topo), "make_plan is deterministic"
    _check_assignment(plan, inv)
    _check_ranks_and_devices(plan, topo, hw.npus)
    _check_ports(plan, topo, hw.kv_port_min)
    first, second = render(plan, inv, topo), render(plan, inv, topo)
    assert first.files == second.files, "render is deterministic"
    assert first.contract() == second.contract()
    contract = first.contract()
    json.dumps(contract)  # the CONTRACT document is plain JSON
    assert [e["id"] for e in contract["engines"]] == [e.id for e in plan.engines]
    _check_proxy(plan, inv, contract)
    _check_argv(plan, topo, contract)
    assert set(first.files) == set(plan.host_roles), "every host gets its files"
    for e in plan.engines:
        assert {f"engines/{e.id}.env", f"engines/{e.id}.sh", "manifest.json"} <= set(first.files[e.host])


@SETTINGS
@given(case())
def test_failures_are_invalid_input(generated) -> None:
    """Also with the topology's hardware swapped: the planner rejects, never crashes."""
    inv_doc, topo_doc = generated
    other = next(h for h in HW if h != next(iter(inv_doc["all"]["hosts"].values()))["kimi_hardware"])
    topo_doc = {**topo_doc, "hardware": other}
    inv, topo = _load(inv_doc, topo_doc)
    plan = _plan_or_none(inv, topo)
    assert plan is None, "hosts of another hardware than the topology's must be rejected"
