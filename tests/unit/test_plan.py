"""Planner: the presets' layouts, host assignment, HBM fit numbers and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kimictl.errors import PlanError
from kimictl.facts import GIB, model_facts
from kimictl.inventory import load_inventory
from kimictl.plan import make_plan
from kimictl.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]


def _inventory(tmp_path: Path, hosts: dict[str, dict], **cluster) -> Path:
    doc = {"all": {"vars": {"kimi_cluster": "t", "kimi_model_dir": "/m", "kimi_nic": "eth0", **cluster},
                   "hosts": hosts}}
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _hosts(n: int, hw: str, **extra) -> dict[str, dict]:
    return {f"h{i:02d}": {"ansible_host": f"10.0.0.{i + 1}", "kimi_hardware": hw, **extra} for i in range(n)}


def test_model_facts_total_is_about_500_gib() -> None:
    m = model_facts()
    assert 470 * GIB < m.total_bytes < 520 * GIB
    assert m.parts["routed_experts"] > 0.95 * m.total_bytes - 20 * GIB
    assert m.kv_bytes_per_token == (512 + 64) * 61 * 2


def test_a3_pd_layout() -> None:
    plan = make_plan(load_inventory(ROOT / "inventories/a3-pd.yml"), load_topology("a3-pd"))
    assert plan.host_roles == {"a3-node-01": "prefill", "a3-node-02": "decode"}
    assert [(i.name, i.dp, i.tp, i.ep, i.kv_port) for i in plan.instances] == [
        ("prefill-0", 2, 8, 16, 36000), ("decode-0", 4, 4, 16, 36100)]
    assert [e.devices for e in plan.engines if e.role == "decode"] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert [e.port for e in plan.engines if e.role == "prefill"] == [7100, 7101]
    assert plan.proxy is not None and plan.proxy.host == "a3-node-01"
    assert all(f.fits for f in plan.fits.values())


@pytest.mark.parametrize(("n", "expect"), [(2, (1, 1)), (3, (2, 1)), (4, (2, 2)), (5, (3, 2))])
def test_a3_pd_scales_instances_with_hosts(tmp_path: Path, n: int, expect: tuple[int, int]) -> None:
    plan = make_plan(load_inventory(_inventory(tmp_path, _hosts(n, "atlas-800-a3"))), load_topology("a3-pd"))
    roles = list(plan.host_roles.values())
    assert (roles.count("prefill"), roles.count("decode")) == expect
    kv = [i.kv_port for i in plan.instances]
    assert len(set(kv)) == len(kv)
    assert len(plan.proxy.prefill) == 2 * expect[0] and len(plan.proxy.decode) == 4 * expect[1]


def test_pins_are_honoured(tmp_path: Path) -> None:
    hosts = _hosts(3, "atlas-800-a3")
    hosts["h00"]["kimi_role"] = "decode"
    plan = make_plan(load_inventory(_inventory(tmp_path, hosts)), load_topology("a3-pd"))
    assert plan.host_roles["h00"] == "decode"
    assert sorted(plan.host_roles.values()) == ["decode", "prefill", "prefill"]


def test_a2_pd_refused_on_two_hosts_with_numbers(tmp_path: Path) -> None:
    with pytest.raises(PlanError) as err:
        make_plan(load_inventory(_inventory(tmp_path, _hosts(2, "atlas-800-a2"))), load_topology("a2-pd"))
    text = err.value.render()
    assert "at least 4 hosts" in text
    assert "routed experts 59.4 GiB" in text and "does not fit" in text and "57.6 GiB" in text


def test_a2_pd_on_four_hosts_spans_two_hosts_per_instance() -> None:
    plan = make_plan(load_inventory(ROOT / "inventories/a2-pd.yml"), load_topology("a2-pd"))
    pre = plan.instance("prefill-0")
    assert pre.hosts == ["a2-node-01", "a2-node-02"] and pre.ep == 16 and pre.kv_port == 28000
    ranks = [(e.host, e.dp_ranks, e.devices[0], e.port) for e in plan.engines if e.instance == "decode-0"]
    assert ranks == [("a2-node-03", [0], 0, 7100), ("a2-node-03", [1], 4, 7101),
                     ("a2-node-04", [2], 0, 7100), ("a2-node-04", [3], 4, 7101)]
    assert plan.instance("decode-0").master_ip == "192.168.20.13"


def test_fused_mc2_skipped_above_ep32(tmp_path: Path) -> None:
    topo_text = (ROOT / "kimictl/data/topologies/a3-pd.yml").read_text()
    topo_text = topo_text.replace("name: a3-pd", "name: a3-pd-big").replace(
        "    nodes: 1\n    dp: 4\n    tp: 4", "    nodes: 3\n    dp: 12\n    tp: 4")
    topo_path = tmp_path / "big.yml"
    topo_path.write_text(topo_text)
    plan = make_plan(load_inventory(_inventory(tmp_path, _hosts(4, "atlas-800-a3"))), load_topology(str(topo_path)))
    dec = [s for s in plan.switches if s.role == "decode" and s.switch == "fused_mc2"]
    assert dec[0].state == "skipped" and "EP 48 > 32" in dec[0].note
    pre = [s for s in plan.switches if s.role == "prefill" and s.switch == "fused_mc2"]
    assert pre[0].state == "on"


def test_kv_capacity_grows_with_utilization() -> None:
    from kimictl.facts import hardware_catalogue
    from kimictl.plan import memory_fit

    hw = hardware_catalogue()["atlas-800-a3"]
    serve = {"enable-expert-parallel": True, "max-model-len": 32768, "max-num-batched-tokens": 128}
    low = memory_fit("decode", hw, 4, 4, {**serve, "gpu-memory-utilization": 0.8}, {}, False)
    high = memory_fit("decode", hw, 4, 4, {**serve, "gpu-memory-utilization": 0.95}, {}, False)
    assert high.kv_tokens_per_dp_rank > low.kv_tokens_per_dp_rank > 0
    assert high.max_seqs_per_dp_rank == high.kv_tokens_per_dp_rank // 32768
    with_draft = memory_fit("decode", hw, 4, 4, {**serve, "gpu-memory-utilization": 0.95}, {}, True)
    assert with_draft.kv_cache_gib < high.kv_cache_gib
