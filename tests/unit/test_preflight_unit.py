"""Preflight pieces that need no hosts: section framing, ping-mesh planning, SSH option parsing."""

from __future__ import annotations

from pathlib import Path

from kimictl.inventory import load_inventory
from kimictl.plan import make_plan
from kimictl.preflight import _ping_plan, parse_sections
from kimictl.ssh import _common_args, target_for
from kimictl.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]


def test_parse_sections_keeps_output_and_rc() -> None:
    out = "@@kimi begin a\nline1\nline2\n\n@@kimi end a 0\n@@kimi begin b\n\n@@kimi end b 3\n"
    assert parse_sections(out) == {"a": ("line1\nline2\n", 0), "b": ("", 3)}


def test_ping_plan_covers_every_peer_and_npu() -> None:
    plan = make_plan(load_inventory(ROOT / "inventories/a2-pd.yml"), load_topology("a2-pd"))
    ips = {h: [f"10.9.{n}.{i}" for i in range(8)] for n, h in enumerate(plan.host_roles)}
    pings = _ping_plan(plan, ips)
    # a2-node-01 shares prefill-0 with a2-node-02 and pairs with both decode hosts.
    assert {p["peer"] for p in pings["a2-node-01"]} == {"a2-node-02", "a2-node-03", "a2-node-04"}
    assert sorted(p["npu"] for p in pings["a2-node-01"]) == list(range(8))
    for host, plist in pings.items():
        for p in plist:
            assert p["address"] == ips[p["peer"]][p["npu"]] and p["peer"] != host


def test_ping_plan_skips_hosts_without_peers() -> None:
    plan = make_plan(load_inventory(ROOT / "inventories/a3-colocated.yml"), load_topology("a3-colocated"))
    assert _ping_plan(plan, {"a3-node-01": ["10.0.0.1"] * 16}) == {"a3-node-01": []}


def test_ssh_options_from_ansible_args(tmp_path: Path) -> None:
    args = _common_args("-o UserKnownHostsFile=/s/known_hosts -o StrictHostKeyChecking=yes -i /s/key -oPort=2201")
    assert args["known_hosts"] == ["/s/known_hosts"] and args["strict"] is True
    assert args["keys"] == ["/s/key"] and args["port"] == 2201
    inv_text = (ROOT / "inventories/a3-colocated.yml").read_text().replace(
        "kimi_hardware: atlas-800-a3}", "kimi_hardware: atlas-800-a3, ansible_port: 2222, ansible_user: ops, "
        "ansible_ssh_common_args: '-o StrictHostKeyChecking=no'}")
    (tmp_path / "i.yml").write_text(inv_text)
    t = target_for(load_inventory(tmp_path / "i.yml").hosts[0])
    assert (t.port, t.user, t.strict) == (2222, "ops", False)
