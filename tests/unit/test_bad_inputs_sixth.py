"""Bad input through the real CLI, sixth round (issue 27's fifth held-out corpus): kimi_nic given an IP address,
device IPs listed twice (on one host, across hosts), recipe ports and a recipe env that is a list (merged with `<<`
or written out), `validate --live` with a bad inventory, a regular file as the sandbox directory, and
KIMICTL_ENGINE_API_KEY without the clients' key. Each: exit 2, the file/flag/variable and key (and host) named, no
traceback, nothing contacted. Also: `kimictl schema topology` does not offer `source` (kimictl's own field)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_bad_inputs import A3D, A3P, _inv, _invoke
from test_bad_inputs_fifth import untouched  # noqa: F401 - a fixture
from test_bad_inputs_fourth import _set_template_flag, _spoiled
from test_bad_inputs_third import _refused
from test_recipe_import import _kv, _recipe, _write
from test_rollout import _inventory

IPS_P = [f"10.20.0.{i}" for i in range(1, 17)]
IPS_D = [f"10.20.1.{i}" for i in range(1, 17)]

# --- the inventory ---------------------------------------------------------------------------------------------

INVENTORY_CASES: list[tuple[str, dict[str, Any], dict[str, Any], tuple[str, ...]]] = [
    ("nic-ipv4", A3P, {**A3D, "kimi_nic": "10.0.0.2"}, ("host a3-d", "kimi_nic", "'10.0.0.2' is an IP address")),
    ("nic-ipv6", A3P, {**A3D, "kimi_nic": "fe80::1"}, ("host a3-d", "kimi_nic", "is an IP address")),
    ("nic-too-long", A3P, {**A3D, "kimi_nic": "e" * 16}, ("host a3-d", "kimi_nic", "at most 15 characters")),
    ("nic-slash", {**A3P, "kimi_nic": "eth0/1"}, A3D, ("host a3-p", "kimi_nic", "network interface name")),
    ("nic-dotdot", {**A3P, "kimi_nic": ".."}, A3D, ("host a3-p", "kimi_nic", "network interface name")),
    ("device-ips-twice-on-one-host", A3P, {**A3D, "kimi_device_ips": [*IPS_D[:4], IPS_D[3], *IPS_D[5:]]},
     ("host a3-d: kimi_device_ips lists device IP 10.20.1.4 twice",)),
    ("device-ip-16-times", {**A3P, "kimi_device_ips": ["10.20.0.1"] * 16}, A3D,
     ("host a3-p: kimi_device_ips lists device IP 10.20.0.1 16 times",)),
    ("device-ips-on-two-hosts", {**A3P, "kimi_device_ips": IPS_P}, {**A3D, "kimi_device_ips": IPS_P},
     ("host a3-d: kimi_device_ips shares 16 address(es) with host a3-p's kimi_device_ips: device IP 10.20.0.1, "
      "10.20.0.2,", "10.20.0.16 (each NPU")),
]


@pytest.mark.parametrize(("p", "d", "expect"), [pytest.param(p, d, e, id=i) for i, p, d, e in INVENTORY_CASES])
def test_inventory_refusals_name_the_file_key_and_host(inventory_factory, p, d, expect) -> None:
    inv = inventory_factory(_inv({}, {"a3-p": p, "a3-d": d}))
    for command in ("validate", "plan", "render"):
        err = _refused([command, "-i", str(inv), "--topology", "a3-pd"], str(inv), *expect)
        assert "is also used by a3-d" not in err and err.count("\n  - ") == 1   # one problem, said once


@pytest.mark.parametrize("nic", ["eth0", "bond0", "enp1s0f0np0", "ens3f0.100", "ib_0-x"])
def test_interface_names_are_fine(inventory_factory, nic: str) -> None:
    inv = inventory_factory(_inv({"kimi_nic": nic}, {"a3-p": {**A3P, "kimi_device_ips": IPS_P},
                                                     "a3-d": {**A3D, "kimi_device_ips": IPS_D}}))
    result = _invoke(["validate", "-i", str(inv), "--topology", "a3-pd"])
    assert result.exit_code == 0, result.output


def test_validate_live_refuses_a_bad_inventory_before_any_host(inventory_factory, untouched,  # noqa: F811
                                                               monkeypatch) -> None:
    def live(*_a, **_k):
        raise AssertionError("validate --live went live with an inventory its static checks refuse")

    monkeypatch.setattr("kimictl.cli.preflight.run_and_print", live)
    inv = inventory_factory(_inv({}, {"a3-p": A3P, "a3-d": {**A3D, "kimi_nic": "192.168.1.1"}}))
    for output in ("text", "json"):
        _refused(["validate", "-i", str(inv), "-t", "a3-pd", "--live", "-o", output], str(inv), "host a3-d",
                 "kimi_nic", "IP address")


# --- the topology schema -----------------------------------------------------------------------------------------

def test_the_topology_schema_does_not_offer_source(tmp_path: Path) -> None:
    """`source` is where kimictl read the file (a topology file giving it is refused): the schema must not list it."""
    result = _invoke(["schema", "topology"])
    assert result.exit_code == 0, result.output
    schema = json.loads(result.stdout)
    assert "source" not in schema["properties"] and "roles" in schema["properties"]


# --- topology import ---------------------------------------------------------------------------------------------

def _envs_list_merged(tmp_path: Path) -> Path:
    """The recipe with node 2's envs merging (`<<: *env_decode`) an anchor that is a list of NAME=VALUE."""
    doc = _recipe()
    doc["templates"][2]["envs"] = {"<<": "MERGE-HERE", "HCCL_BUFFSIZE": "1800"}
    path = _write(tmp_path, doc)
    text = path.read_text()
    assert text.count("'<<': MERGE-HERE") == 1
    path.write_text("env_decode: &env_decode\n- HCCL_BUFFSIZE=1800\n" + text.replace("'<<': MERGE-HERE",
                                                                                       "<<: *env_decode"))
    return path


@pytest.mark.parametrize(("change", "expect"), [
    pytest.param(lambda d: [c.update(dp_rpc_port=0) for c in d["config"]], ("config[0].dp_rpc_port: 0",
                 "not a port (1-65535)"), id="rpc-port-zero"),
    pytest.param(lambda d: d["config"][1].update(dp_rpc_port=70000), ("config[1].dp_rpc_port: 70000", "1-65535"),
                 id="rpc-port-over"),
    pytest.param(lambda d: [c.update(dp_rpc_port=80) for c in d["config"]],
                 ("config[0].dp_rpc_port: 80", "outside 1024-65535", "ports.rpc"), id="rpc-port-privileged"),
    pytest.param(lambda d: [c.update(port_start=0) for c in d["config"]], ("config[0].port_start: 0", "not a port"),
                 id="port-start-zero"),
    pytest.param(lambda d: [c.update(port_start=65500) for c in d["config"]],
                 ("config[0].port_start: 65500", "outside 1024-65000", "ports.http_base"), id="port-start-high"),
    pytest.param(lambda d: _set_template_flag(d, 0, "--kv-transfer-config", _kv("kv_producer", "any", "0")),
                 ("templates[0]: --kv-transfer-config: kv_port: 'any' is not a whole number",), id="kv-port-word"),
    pytest.param(lambda d: _set_template_flag(d, 2, "--kv-transfer-config", _kv("kv_consumer", "0", "2")),
                 ("templates[2]: --kv-transfer-config: kv_port: 0 is not a port",), id="kv-port-zero"),
    pytest.param(lambda d: d["templates"][1].update(envs=["HCCL_BUFFSIZE=512"]),
                 ("templates[1].envs is ['HCCL_BUFFSIZE=512'], not a mapping",), id="envs-list"),
])
def test_recipe_ports_and_envs_are_named(tmp_path: Path, change, expect) -> None:
    recipe = _write(tmp_path, _spoiled(change))
    for output in ("text", "json"):
        _refused(["topology", "import", str(recipe), "-o", output], str(recipe), *expect)


def test_a_recipe_env_merging_a_list_names_the_key(tmp_path: Path) -> None:
    recipe = _envs_list_merged(tmp_path)
    err = _refused(["topology", "import", str(recipe)], f"{recipe}:",
                   "templates[2].envs: `<<:` merges a list of plain values, not a mapping")
    assert "expected a mapping for merging" not in err


def test_merging_a_list_of_mappings_still_reads(tmp_path: Path) -> None:
    from kimictl.yamlsrc import load_yaml

    f = tmp_path / "m.yml"
    f.write_text("a: &a {x: 1}\nb: &b {y: 2}\nc:\n  <<: [*a, *b]\n  z: 3\n")
    assert load_yaml(f, "file")["c"] == {"x": 1, "y": 2, "z": 3}


# --- the sandbox directory ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [["status"], ["down"], ["fault", "clear:all"], ["up"]])
@pytest.mark.parametrize("inside", [False, True], ids=["file", "under-a-file"])
def test_a_regular_file_as_the_sandbox_dir_is_refused(tmp_path: Path, command: list[str], inside: bool) -> None:
    f = tmp_path / "f"
    f.write_text("x\n")
    d = f / "sb" if inside else f
    _refused(["sandbox", *command, "-d", str(d)], f"--dir/-d {d}", "not a directory")
    assert f.read_text() == "x\n"


# --- KIMICTL_ENGINE_API_KEY without the clients' key -----------------------------------------------------------

def test_an_engine_key_without_the_clients_key_is_refused_first(tmp_path: Path, monkeypatch,
                                                                untouched) -> None:  # noqa: F811
    inv = _inventory(tmp_path, hosts=2, ansible_port=9)
    monkeypatch.delenv("KIMICTL_PROXY_ADMIN_KEY", raising=False)
    monkeypatch.setenv("KIMICTL_ENGINE_API_KEY", "ek-unit-1")
    for args in (["deploy", "-i", str(inv), "-t", "a3-pd", "--yes", "--skip-preflight", "unit"],
                 ["status", "-i", str(inv)]):
        err = _refused(args, "KIMICTL_ENGINE_API_KEY is set", str(inv), "all.vars.kimi_api_key_file",
                       "engines are keyed only with kimi_api_key_file")
        assert "ek-unit-1" not in err


def test_a_url_port_that_is_no_number_and_a_hub_token_env_with_a_line_break(inventory_factory, monkeypatch,
                                                                              tmp_path) -> None:
    """Issue 27, the sixth held-out corpus: `host:port` with a word for the port is no port; a hub token from the
    environment with a line break never reaches an HTTP header (refused before the lease and any host)."""
    from test_bad_inputs import A3D, A3P, _inv, _invoke

    inv = inventory_factory(_inv({"kimi_model_endpoint": "http://mirror.example.com:port"}, {"a3-p": A3P, "a3-d": A3D}))
    r = _invoke(["validate", "-i", str(inv), "--topology", "a3-pd"])
    assert r.exit_code == 2 and "kimi_model_endpoint" in r.stderr and "port 'port' is not a TCP port" in r.stderr
    ok = inventory_factory(_inv({"kimi_model_endpoint": "http://mirror.example.com:8443/ms"},
                                {"a3-p": A3P, "a3-d": A3D}), name="ok.yml")
    assert _invoke(["validate", "-i", str(ok), "--topology", "a3-pd"]).exit_code == 0
    closed = {"a3-p": {**A3P, "ansible_port": 9}, "a3-d": {**A3D, "ansible_port": 9}}
    hf = inventory_factory(_inv({"kimi_model_source": "huggingface"}, closed), name="hf.yml")
    monkeypatch.setenv("HF_TOKEN", "hf_abc\nX-Evil: 1")
    r = _invoke(["weights", "pull", "-i", str(hf)])
    assert r.exit_code == 2 and "HF_TOKEN: a hub token is one printable word" in r.stderr, r.output
