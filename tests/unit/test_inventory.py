"""Inventory loading: Ansible var precedence, defaults, line numbers in errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimictl.errors import InventoryError
from kimictl.inventory import load_inventory

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "inv.yml"
    p.write_text(text)
    return p


def _ansible_hostvars(path: Path, tmp_path: Path) -> dict:
    """Every host's vars as ansible-inventory itself reads the file."""
    import json
    import subprocess
    import sys

    tool = Path(sys.executable).with_name("ansible-inventory")
    out = subprocess.run([str(tool), "-i", str(path), "--list"], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"),
                              "HOME": str(tmp_path)})
    return json.loads(out.stdout)["_meta"]["hostvars"]


def test_examples_load() -> None:
    for name in ("a3-pd", "a2-pd", "a3-colocated", "a2-colocated"):
        inv = load_inventory(ROOT / "inventories" / f"{name}.yml")
        assert inv.hosts


def test_group_vars_apply_and_host_vars_win(tmp_path: Path) -> None:
    inv = load_inventory(_write(tmp_path, """
all:
  vars: {kimi_cluster: c1, kimi_model_dir: /m, kimi_nic: eth0}
  children:
    racks:
      vars: {kimi_hardware: atlas-800-a3, kimi_nic: bond0}
      children:
        pinned:
          vars: {kimi_role: decode, kimi_nic: bond1}
          hosts:
            n2: {ansible_host: 10.1.0.2}
      hosts:
        n1: {ansible_host: 10.1.0.1, kimi_nic: ib0, ansible_user: admin}
"""))
    n1, n2 = inv.hosts
    assert (n1.name, n1.kimi_nic, n1.kimi_hardware, n1.kimi_role) == ("n1", "ib0", "atlas-800-a3", None)
    assert (n2.kimi_nic, n2.kimi_role) == ("bond1", "decode")
    assert n1.ansible_vars["ansible_user"] == "admin"
    assert inv.cluster.kimi_model_source == "modelscope" and inv.cluster.model_revision == "master"
    assert inv.cluster.kimi_runtime == "container" and n1.kimi_state_dir == "/var/lib/kimi"


def test_errors_point_at_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, """all:
  vars:
    kimi_cluster: c1
    kimi_model_dir: /m
    kimi_nic: eth0
  hosts:
    n1:
      ansible_host: 10.1.0.1
      kimi_hardware: atlas-800-a5
      kimi_rol: prefill
""")
    with pytest.raises(InventoryError) as err:
        load_inventory(path)
    text = err.value.render()
    assert f"{path}:9: host n1: kimi_hardware: 'atlas-800-a5' is not a known hardware" in text
    assert f"{path}:10: host n1: unknown key 'kimi_rol' (did you mean 'kimi_role'?)" in text


def test_limit_restricts_hosts() -> None:
    inv = load_inventory(ROOT / "inventories/a2-pd.yml")
    assert [h.name for h in inv.limited(["a2-node-02"]).hosts] == ["a2-node-02"]
    with pytest.raises(InventoryError, match="a2-node-9"):
        inv.limited(["a2-node-9"])


def test_api_key_file_must_be_private_and_not_empty(tmp_path) -> None:
    from kimictl.errors import InvalidInput
    from kimictl.secret_file import read_secret_file

    f = tmp_path / "key"
    f.write_text("sk-1234\n")
    f.chmod(0o644)
    with pytest.raises(InvalidInput, match="readable by others"):
        read_secret_file(f, "all.vars.kimi_api_key_file")
    f.chmod(0o600)
    assert read_secret_file(f, "all.vars.kimi_api_key_file") == "sk-1234"
    f.write_text("\n")
    with pytest.raises(InvalidInput, match="is empty"):
        read_secret_file(f, "all.vars.kimi_api_key_file")
    with pytest.raises(InvalidInput, match=r"all\.vars\.kimi_api_key_file .*/missing"):
        read_secret_file(tmp_path / "missing", "all.vars.kimi_api_key_file")


SIBLINGS = """
all:
  vars: {kimi_cluster: c1, kimi_model_dir: /m, kimi_nic: eth0, kimi_hardware: atlas-800-a3}
  children:
    zeta:
      vars: {kimi_nic: zeta0, ansible_user: zeta, kimi_engine_command: /opt/zeta}
      hosts:
        n1: {ansible_host: 10.1.0.1}
        n3: {ansible_host: 10.1.0.3}
    alpha:
      vars: {kimi_nic: alpha0, ansible_user: alpha}
      hosts:
        n1:
        n2: {ansible_host: 10.1.0.2}
      children:
        deep:
          vars: {kimi_nic: deep0}
          hosts:
            n3:
        shared:
    bravo:
      vars: {kimi_role: prefill, ansible_group_priority: 10, kimi_state_dir: /srv/bravo}
      hosts:
        n2:
        n4: {ansible_host: 10.1.0.4}
    charlie:
      vars: {kimi_role: decode, kimi_state_dir: /srv/charlie}
      hosts:
        n2:
        n4:
shared:
  vars: {kimi_nic: shared0, ansible_user: shared}
  hosts:
    n5: {ansible_host: 10.1.0.5}
top:
  vars: {kimi_engine_command: /opt/top}
  children:
    shared:
"""


def test_sibling_group_precedence_matches_ansible_inventory(tmp_path: Path) -> None:
    """Groups at the same depth: higher ansible_group_priority wins, then the later name; a deeper group wins over
    both; a group listed under two parents takes the deeper depth and both parents' vars. Checked against
    ansible-inventory itself."""
    path = _write(tmp_path, SIBLINGS)
    want = _ansible_hostvars(path, tmp_path)
    inv = load_inventory(path)
    got = {h.name: {**h.ansible_vars, **h.model_dump(exclude={"name", "ansible_vars"}, exclude_none=True)}
           for h in inv.hosts}
    keys = ("kimi_nic", "kimi_role", "kimi_state_dir", "kimi_engine_command", "ansible_user")
    for host, hv in want.items():
        for k in keys:
            assert got[host].get(k) == hv.get(k, got[host].get(k) if k == "kimi_state_dir" else None), (host, k)
    # the cases the inventory is built for, spelled out
    assert (got["n1"]["kimi_nic"], got["n1"]["ansible_user"]) == ("zeta0", "zeta")      # name order: zeta last
    assert (got["n2"]["kimi_role"], got["n2"]["kimi_state_dir"]) == ("prefill", "/srv/bravo")  # priority 10
    assert got["n3"]["kimi_nic"] == "deep0"                                              # depth 2 beats depth 1
    assert got["n4"]["kimi_role"] == "prefill"
    assert (got["n5"]["kimi_nic"], got["n5"]["kimi_engine_command"]) == ("shared0", "/opt/top")  # two parents


def test_group_priority_must_be_an_integer_and_cycles_are_errors(tmp_path: Path) -> None:
    path = _write(tmp_path, """all:
  vars: {kimi_cluster: c1, kimi_model_dir: /m, kimi_nic: eth0, kimi_hardware: atlas-800-a3}
  children:
    a:
      vars: {ansible_group_priority: high}
      hosts:
        n1: {ansible_host: 10.1.0.1}
      children:
        b:
b:
  children:
    a:
""")
    with pytest.raises(InventoryError) as err:
        load_inventory(path)
    text = err.value.render()
    assert f"{path}:5: group a: ansible_group_priority must be an integer, got 'high'" in text
    assert "is its own ancestor" in text


MERGED = """
all:
  vars:
    kimi_cluster: c1
    kimi_model_dir: /m
    defaults: &defaults {kimi_hardware: atlas-800-a3, kimi_nic: eth0, ansible_user: admin}
    racked: &racked {kimi_nic: bond0, kimi_role: decode}
  hosts:
    n1:
      <<: *defaults
      ansible_host: 10.1.0.1
      kimi_nic: ib0
    n2:
      <<: [*racked, *defaults]
      ansible_host: 10.1.0.2
"""


def test_yaml_merge_keys_read_the_way_ansible_reads_them(tmp_path: Path) -> None:
    """`<<: *defaults` merges a mapping and a key written beside it wins; a list of merges as Ansible reads it.
    Checked against ansible-inventory itself."""
    path = _write(tmp_path, MERGED)
    want = _ansible_hostvars(path, tmp_path)
    inv = load_inventory(path)
    for h in inv.hosts:
        for k in ("kimi_nic", "kimi_role", "ansible_user", "kimi_hardware", "ansible_host"):
            got = h.ansible_vars.get(k, getattr(h, k, None))
            assert got == want[h.name].get(k), (h.name, k, got, want[h.name].get(k))
    assert [h.kimi_nic for h in inv.hosts] == ["ib0", "eth0"]   # as ansible-inventory reads a list of merges


def test_a_key_written_twice_is_still_a_duplicate_beside_a_merge(tmp_path: Path) -> None:
    text = MERGED.replace("      kimi_nic: ib0\n", "      kimi_nic: ib0\n      kimi_nic: ib1\n")
    with pytest.raises(Exception, match=r"inv.yml:13: .*duplicate key 'kimi_nic' \(first at line 12\)"):
        load_inventory(_write(tmp_path, text))
