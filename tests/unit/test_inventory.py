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
