"""Bad input through the real CLI, fifth round (issue 27's fourth held-out corpus): the keys an operator supplies
(KIMICTL_PROXY_ADMIN_KEY, KIMICTL_ENGINE_API_KEY, the inventory's key files) checked once before any host, commands
that are options, a loopback business IP, null group names, a switch's env spelling, recipe node indices and sizes,
blanks in --set and --router, logs --host and a FIFO as --secrets-file, bench beyond the deployed max-model-len.
Each: exit 2, the file/flag/variable and key (and host) named, no traceback, nothing contacted."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_bad_inputs import A3D, A3P, _inv, _invoke, _pd
from test_bad_inputs_fourth import _spoiled
from test_bad_inputs_third import EP, _refused
from test_recipe_import import _write
from test_rollout import _inventory, _record_deploy

from kimictl.errors import InvalidInput

# --- the inventory ---------------------------------------------------------------------------------------------

INVENTORY_CASES: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any], tuple[str, ...]]] = [
    ("python-option", {"kimi_python": "-c"}, A3P, A3D, ("kimi_python", "'-c'", "an option, not the command")),
    ("proxy-python-option", {}, {**A3P, "kimi_proxy_python": "-I python3"}, A3D,
     ("host a3-p", "kimi_proxy_python", "an option")),
    ("engine-command-option", {}, A3P, {**A3D, "kimi_engine_command": "--help"},
     ("host a3-d", "kimi_engine_command", "an option")),
    ("ansible-host-loopback", {}, A3P, {**A3D, "ansible_host": "127.0.0.1"},
     ("host a3-d", "ansible_host 127.0.0.1", "loopback", "host a3-p cannot reach", "kimi_host_ip")),
]


@pytest.mark.parametrize(("vars_", "p", "d", "expect"),
                         [pytest.param(v, p, d, e, id=i) for i, v, p, d, e in INVENTORY_CASES])
def test_inventory_refusals_name_the_file_key_and_host(inventory_factory, vars_, p, d, expect) -> None:
    inv = inventory_factory(_inv(vars_, {"a3-p": p, "a3-d": d}))
    for command in ("validate", "plan", "render"):
        _refused([command, "-i", str(inv), "--topology", "a3-pd"], str(inv), *expect)


@pytest.mark.parametrize(("hosts", "topology"), [
    pytest.param({"a3-p": {**A3P, "ansible_host": "127.0.0.1"}, "a3-d": {**A3D, "ansible_host": "127.0.0.2"}},
                 "a3-pd", id="every-host-on-loopback"),   # one machine: a test bed (engine sim, closed ports)
    pytest.param({"a3-p": A3P, "a3-d": {**A3D, "ansible_host": "127.0.0.1", "kimi_host_ip": "10.0.0.5"}},
                 "a3-pd", id="reached-over-a-tunnel"),    # the business IP is kimi_host_ip
    pytest.param({"a3-p": {**A3P, "ansible_host": "127.0.0.1"}}, "a3-colocated", id="one-host"),
    pytest.param({"a3-p": {**A3P, "kimi_proxy_python": "/opt/py3.11/bin/python3 -I"}, "a3-d": A3D}, "a3-pd",
                 id="command-with-an-option-after-it"),
])
def test_loopback_and_commands_that_are_fine(inventory_factory, hosts, topology) -> None:
    inv = inventory_factory(_inv({}, hosts))
    result = _invoke(["validate", "-i", str(inv), "--topology", topology])
    assert result.exit_code == 0, result.output


def test_a_loopback_ssh_address_is_refused_by_the_plan_only(inventory_factory) -> None:
    """ansible_host is first the SSH address (a tunnel; a closed port in tests): only a plan makes it the business
    IP that the other hosts must reach."""
    from kimictl.inventory import load_inventory

    inv = load_inventory(inventory_factory(_inv({}, {"a3-p": A3P, "a3-d": {**A3D, "ansible_host": "127.0.0.1"}})))
    assert inv.host("a3-d").ip == "127.0.0.1"


@pytest.mark.parametrize("where", ["children", "top-level"])
def test_a_null_group_name_is_refused(tmp_path: Path, where: str) -> None:
    inv = tmp_path / "inventory.yml"
    group = "    children:\n      ~:\n        hosts: {a3-d: }\n" if where == "children" else "~:\n  hosts: {a3-d: }\n"
    text = ("all:\n  vars: {kimi_cluster: kimi-test, kimi_model_dir: /data/models/Kimi-K2.5-W4A8, kimi_nic: eth0}\n"
            "  hosts:\n    a3-p: {ansible_host: 10.0.0.1, kimi_hardware: atlas-800-a3}\n"
            "    a3-d: {ansible_host: 10.0.0.2, kimi_hardware: atlas-800-a3}\n")
    inv.write_text(text + (group.replace("    children", "  children") if where == "children" else group))
    expect = ("group 'all': children: group name 'None'",) if where == "children" else ("group name 'None'",)
    _refused(["validate", "-i", str(inv), "--topology", "a3-pd"], f"{inv}:", *expect, "not text", "null")


# --- a switch's env spelling -----------------------------------------------------------------------------------

def _env_topology(inventory_factory, prefill_env: dict[str, str], decode_env: dict[str, str],
                  env: dict[str, str] | None = None) -> Path:
    roles = {"prefill": {"dp": 2, "tp": 8, "env": prefill_env}, "decode": {"dp": 4, "tp": 4, "env": decode_env}}
    return inventory_factory(_pd(serve=EP, roles=roles, **({"env": env} if env else {})), name="topology.yml")


@pytest.mark.parametrize(("prefill_env", "decode_env", "env", "expect"), [
    ({"VLLM_ASCEND_ENABLE_MLAPO": "1"}, {}, None,
     ("role prefill", "env VLLM_ASCEND_ENABLE_MLAPO=1", "switch mlapo", "decode, colocated only")),
    ({}, {}, {"VLLM_ASCEND_ENABLE_MLAPO": "1"}, ("role prefill", "VLLM_ASCEND_ENABLE_MLAPO", "switch mlapo")),
    ({}, {"VLLM_ASCEND_ENABLE_FLASHCOMM1": "1"}, None,
     ("role decode", "VLLM_ASCEND_ENABLE_FLASHCOMM1", "switch flashcomm1")),
])
def test_a_switch_env_spelling_obeys_the_switch_role_rule(inventory_factory, prefill_env, decode_env, env,
                                                           expect) -> None:
    inv = inventory_factory(_inv({}, {"a3-p": A3P, "a3-d": A3D}))
    topo = _env_topology(inventory_factory, prefill_env, decode_env, env)
    err = _refused(["validate", "-i", str(inv), "--topology", str(topo)], f"{inv} with topology {topo}", *expect)
    assert "hint" in err and "env" in err.split("hint", 1)[1]


@pytest.mark.parametrize(("prefill_env", "decode_env"), [
    ({}, {"VLLM_ASCEND_ENABLE_MLAPO": "1"}),       # where the switch belongs
    ({"VLLM_ASCEND_ENABLE_MLAPO": "0"}, {}),       # switched off
    ({"VLLM_ASCEND_ENABLE_FLASHCOMM1": "1"}, {}),
])
def test_a_switch_env_spelling_where_its_switch_may_be_plans(inventory_factory, prefill_env, decode_env) -> None:
    inv = inventory_factory(_inv({}, {"a3-p": A3P, "a3-d": A3D}))
    topo = _env_topology(inventory_factory, prefill_env, decode_env)
    result = _invoke(["validate", "-i", str(inv), "--topology", str(topo)])
    assert result.exit_code == 0, result.output


# --- topology import -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("change", "expect"), [
    pytest.param(lambda d: d["config"][1].update(node_index=0), ("config[1].node_index is 0", "position"),
                 id="duplicate-node-index"),
    pytest.param(lambda d: d["config"][3].update(node_index=7), ("config[3].node_index is 7",), id="node-index-out"),
    pytest.param(lambda d: d["config"][0].update(dp_size=0), ("config[0].dp_size is 0", "at least 1"),
                 id="dp-size-zero"),
    pytest.param(lambda d: d["config"][2].update(tp_size=0), ("config[2].tp_size is 0", "at least 1"),
                 id="tp-size-zero"),
    pytest.param(lambda d: d["config"][2].update(dp_size_local=0), ("config[2].dp_size_local is 0",),
                 id="dp-size-local-zero"),
])
def test_recipe_node_indices_and_sizes_are_checked(tmp_path: Path, change, expect) -> None:
    recipe = _write(tmp_path, _spoiled(change))
    _refused(["topology", "import", str(recipe)], str(recipe), *expect)


# --- remote commands: refused before the record, the lease and any host ------------------------------------------

@pytest.fixture
def untouched(monkeypatch) -> None:
    """Contacting a host (SSH: the lease, the commands), reading the cluster's record back or asking the engines is a
    test failure: every refusal here comes first."""
    def contacted(*_a, **_k):
        raise AssertionError("a host was contacted before the bad input was refused")

    monkeypatch.setattr("kimictl.ssh.Session.connect", contacted)
    monkeypatch.setattr("kimictl.cluster_record.sync", contacted)
    monkeypatch.setattr("kimictl.status.collect_status", contacted)


@pytest.fixture
def recorded(tmp_path: Path, monkeypatch, untouched) -> Path:
    """A recorded a3-pd deploy (max-model-len 32768) of two hosts whose clients' key is kimi_api_key_file."""
    key = tmp_path / "client-key"
    key.write_text("sk-unit-client-1\n")
    key.chmod(0o600)
    inv = _inventory(tmp_path, hosts=2, ansible_port=9, kimi_api_key_file=str(key))
    _record_deploy(tmp_path, inv, monkeypatch)
    for var in ("KIMICTL_PROXY_ADMIN_KEY", "KIMICTL_ENGINE_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    return inv


REMOTE = [
    ["deploy", "-t", "a3-pd", "--yes", "--skip-preflight", "unit", "--skip-weights"],
    ["rollout", "--set", "decode.serve.max-num-seqs=16", "--yes"],
    ["rollback", "--yes"],
    ["status"],
    ["heal", "--once"],
    ["stop", "--yes"],
    ["start", "--yes"],
    ["logs"],
    ["bench"],
    ["keys", "rotate", "--yes"],
]


def _remote(args: list[str], inv: Path) -> list[str]:
    n = 2 if args[0] == "keys" else 1
    return [*args[:n], "-i", str(inv), *args[n:]]


@pytest.mark.parametrize("args", REMOTE, ids=lambda a: "-".join(a[:2]))
@pytest.mark.parametrize(("var", "value"), [
    ("KIMICTL_PROXY_ADMIN_KEY", "adm key"),
    ("KIMICTL_PROXY_ADMIN_KEY", "~adm"),
    ("KIMICTL_PROXY_ADMIN_KEY", "adm\nX=1"),
    ("KIMICTL_PROXY_ADMIN_KEY", "a" * 70000),
    ("KIMICTL_ENGINE_API_KEY", 'ek"1'),
    ("KIMICTL_ENGINE_API_KEY", "$HOME"),
])
def test_a_bad_supplied_key_in_the_environment_is_refused_first(recorded: Path, monkeypatch, args, var,
                                                                value) -> None:
    monkeypatch.setenv(var, value)
    err = _refused(_remote(args, recorded), f"error: {var}:")
    assert value not in err   # the value is never shown


def test_the_engine_key_variable_counts_only_where_engines_are_keyed(tmp_path: Path, monkeypatch) -> None:
    from kimictl.cluster_secrets import check_supplied_keys
    from kimictl.inventory import load_inventory

    monkeypatch.setenv("KIMICTL_ENGINE_API_KEY", "a b")
    with pytest.raises(InvalidInput, match=r"KIMICTL_ENGINE_API_KEY is set but .* no all\.vars\.kimi_api_key_file"):
        check_supplied_keys(load_inventory(_inventory(tmp_path, hosts=2)))   # unkeyed engines: never unused
    monkeypatch.setenv("KIMICTL_PROXY_ADMIN_KEY", "adm-unit-1")
    key = tmp_path / "k"
    key.write_text("sk-unit-1\n")
    key.chmod(0o600)
    keyed = load_inventory(_inventory(tmp_path, hosts=2, kimi_api_key_file=str(key)))
    with pytest.raises(InvalidInput, match="KIMICTL_ENGINE_API_KEY"):
        check_supplied_keys(keyed)
    monkeypatch.setenv("KIMICTL_ENGINE_API_KEY", "ek-unit-1")
    check_supplied_keys(keyed)


def test_keys_rotate_refuses_an_inventory_supplied_admin_key_before_the_record(tmp_path: Path, monkeypatch,
                                                                              untouched) -> None:
    adm = tmp_path / "adm"
    adm.write_text("adm-unit-1\n")
    adm.chmod(0o600)
    inv = _inventory(tmp_path, hosts=2, ansible_port=9, kimi_proxy_admin_key_file=str(adm))
    _record_deploy(tmp_path, inv, monkeypatch)
    monkeypatch.delenv("KIMICTL_PROXY_ADMIN_KEY", raising=False)
    err = _refused(["keys", "rotate", "-i", str(inv), "--yes"], f"{inv}: ", "all.vars.kimi_proxy_admin_key_file",
                   "cannot rotate")
    assert "adm-unit-1" not in err


@pytest.mark.parametrize(("args", "expect"), [
    (["rollout", "--check", "--set", " decode.dp=4"], ("--set  decode.dp=4", "' decode.dp'", "blanks")),
    (["rollout", "--check", "--set", "decode.dp =4"], ("--set decode.dp =4", "blanks")),
    (["rollout", "--check", "--router", " http://10.0.0.9:8000", "--set", "decode.serve.max-num-seqs=16"],
     ("--router ' http://10.0.0.9:8000'", "blanks")),
    (["rollout", "--check", "--router", "http://10.0.0.9:8000\t", "--set", "decode.serve.max-num-seqs=16"],
     ("--router", "blanks or control characters")),
    (["logs", "--host", ""], ("--host names hosts not in", "''")),
    (["bench", "--input-tokens", "40000"], ("--input-tokens 40000", "max-model-len 32768")),
    (["bench", "--input-tokens", "32705", "--output-tokens", "64"], ("--input-tokens 32705", "--output-tokens 64")),
])
def test_bad_flags_of_remote_commands_are_refused_first(recorded: Path, args: list[str], expect) -> None:
    _refused(_remote(args, recorded), *expect)


def test_bench_judges_only_a_known_max_model_len(recorded: Path) -> None:
    from kimictl.bench import BenchSpec, check_fits
    from kimictl.deployed import cached_deployment

    deployed = cached_deployment("ro-unit")
    assert deployed is not None
    check_fits(BenchSpec(input_tokens=32704, output_tokens=64), deployed.rendered)   # exactly fits
    check_fits(BenchSpec(input_tokens=10**7), None)   # nothing recorded here: not judged
    with pytest.raises(InvalidInput, match="--input-tokens 32705"):
        check_fits(BenchSpec(input_tokens=32705, output_tokens=64), deployed.rendered)


def _at_once(fn: Callable[[], Any], fifo: Path) -> Any:
    """fn's result, or a test failure when it blocks (the FIFO is then opened for writing to set it free)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:   # handed to the test thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
        pytest.fail(f"blocked on the FIFO {fifo}")
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_fifo_as_secrets_file_is_refused_at_once(recorded: Path, tmp_path: Path) -> None:
    from kimictl.logs import Redactor

    fifo = tmp_path / "sec"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(InvalidInput, match=f"--secrets-file {fifo} is not a regular file"):
        _at_once(lambda: Redactor.from_config({}, fifo), fifo)
    err = _at_once(lambda: _refused(["logs", "-i", str(recorded), "--bundle", str(tmp_path / "b.tar.gz"),
                                     "--secrets-file", str(fifo)], f"--secrets-file {fifo}"), fifo)
    assert "not a regular file" in err and not (tmp_path / "b.tar.gz").exists()
