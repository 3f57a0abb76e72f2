"""Bad input through the real CLI, fourth round (issue 27's third held-out corpus): ssh options checked as kimictl's
own connections read them, Ansible's host_vars/ and group_vars/ beside the inventory, serve values, raw switch keys,
SLO targets, --topology as given, recipe crashes, write failures under --out and float flags. Each: exit 2, the
file/flag and key (and host) named, no traceback; remote commands refuse before the lease and any host or hub."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_bad_inputs import A3D, A3P, _inv, _invoke, _pd
from test_bad_inputs_third import EP, _refused
from test_recipe_import import _recipe, _write
from test_rollout import _inventory, _record_deploy

from kimictl.inventory import load_inventory
from kimictl.ssh import target_for

# --- the inventory ---------------------------------------------------------------------------------------------

INVENTORY_CASES: list[tuple[str, dict[str, Any], dict[str, Any], tuple[str, ...]]] = [
    ("user-at-ip", {}, {"ansible_user": "root@10.0.0.9"}, ("host a3-d", "ansible_user", "names a host after '@'")),
    ("user-at-own-host", {}, {"ansible_user": "root@a3-d"}, ("host a3-d", "ansible_user", "names a host")),
    ("port-word", {}, {"ansible_ssh_common_args": "-o Port=abc"},
     ("host a3-d", "ansible_ssh_common_args", "-o Port=abc", "not a TCP port")),
    ("port-spaced", {}, {"ansible_ssh_common_args": "-o 'Port 70000'"},
     ("host a3-d", "ansible_ssh_common_args", "not a TCP port")),
    ("p-zero", {}, {"ansible_ssh_extra_args": "-p 0"}, ("host a3-d", "ansible_ssh_extra_args", "-p 0", "TCP port")),
    ("p-joined", {}, {"ansible_ssh_extra_args": "-p99999"}, ("host a3-d", "ansible_ssh_extra_args", "-p 99999")),
    ("option-no-value", {}, {"ansible_ssh_common_args": "-o UserKnownHostsFile"},
     ("host a3-d", "ansible_ssh_common_args", "UserKnownHostsFile", "no value")),
    ("o-last", {}, {"ansible_ssh_common_args": "-o StrictHostKeyChecking=yes -o"},
     ("host a3-d", "ansible_ssh_common_args", "-o has no value")),
    ("i-no-path", {}, {"ansible_ssh_common_args": "-i"}, ("host a3-d", "ansible_ssh_common_args", "-i has no value")),
    ("F-no-path", {}, {"ansible_ssh_extra_args": "-o StrictHostKeyChecking=yes -F"},
     ("host a3-d", "ansible_ssh_extra_args", "-F has no value")),
    ("args-list", {}, {"ansible_ssh_common_args": ["-o", "Port=22"]},
     ("host a3-d", "ansible_ssh_common_args", "not a string")),
    ("o-user-at-ip", {}, {"ansible_ssh_common_args": "-o User=root@10.0.0.9"},
     ("host a3-d", "ansible_ssh_common_args", "User", "names a host")),
    ("version-trailing-space", {"kimi_vllm_ascend_version": "0.23.0 "}, {},
     ("kimi_vllm_ascend_version", "'0.23.0 '", "spaces")),
    ("version-leading-space", {"kimi_vllm_ascend_version": " 0.30"}, {}, ("kimi_vllm_ascend_version", "spaces")),
]


@pytest.mark.parametrize(("vars_", "d", "expect"), [pytest.param(v, h, e, id=i) for i, v, h, e in INVENTORY_CASES])
def test_inventory_refusals_name_the_file_key_and_host(inventory_factory, vars_, d, expect) -> None:
    inv = inventory_factory(_inv(vars_, {"a3-p": A3P, "a3-d": {**A3D, **d}}))
    for command in ("validate", "plan", "render"):
        _refused([command, "-i", str(inv), "--topology", "a3-pd"], str(inv), *expect)


def test_ssh_options_are_read_as_ssh_reads_them(inventory_factory) -> None:
    """Validation and kimictl's own connections read the same options: joined, spaced and `=` forms alike."""
    d = {**A3D, "ansible_user": "ops.admin@corp",   # a domain login: '@' alone is no host
         "ansible_ssh_common_args": "-o 'Port 2200' -o 'UserKnownHostsFile /s/kh /s/kh2' -i~/.ssh/k1",
         "ansible_ssh_extra_args": "-oIdentityFile=/s/k2 -F /s/cfg"}
    p = {**A3P, "ansible_ssh_extra_args": "-p2222"}
    path = inventory_factory(_inv({}, {"a3-p": p, "a3-d": d}))
    assert _invoke(["validate", "-i", str(path), "--topology", "a3-pd"]).exit_code == 0
    inv = load_inventory(path)
    tp, td = target_for(inv.host("a3-p")), target_for(inv.host("a3-d"))
    assert tp.port == 2222
    assert (td.port, td.user, td.known_hosts, td.ssh_config) == (2200, "ops.admin@corp", ("/s/kh", "/s/kh2"), "/s/cfg")
    assert td.key_files[1] == "/s/k2" and td.key_files[0].endswith("/.ssh/k1")


@pytest.mark.parametrize("directory", ["host_vars", "group_vars"])
def test_ansible_vars_directories_beside_the_inventory_are_refused(inventory_factory, tmp_path: Path,
                                                                   directory: str) -> None:
    inv = inventory_factory(_inv({}, {"a3-p": A3P, "a3-d": A3D}))
    d = tmp_path / directory
    d.mkdir()
    (d / ".keep").write_text("")   # hidden files are not read by Ansible: still fine
    assert _invoke(["validate", "-i", str(inv), "--topology", "a3-pd"]).exit_code == 0
    (d / "a3-p.yml").write_text("kimi_role: decode\n")
    for command in ("validate", "plan", "render"):
        _refused([command, "-i", str(inv), "--topology", "a3-pd"], str(inv), f"{d}:", f"{directory}/",
                 "Ansible applies")


def test_router_command_passing_a_flag_kimictl_gives_the_router_is_refused(inventory_factory) -> None:
    topo = inventory_factory(_pd(serve=EP, proxy={"port": 8000, "router": "vllm-router"},
                                 roles={"prefill": {"dp": 2, "tp": 8},
                                        "decode": {"dp": 4, "tp": 4, "switches": {"recompute_scheduler": False}}}),
                             name="topology.yml")
    ok = inventory_factory(_inv({}, {"a3-p": {**A3P, "kimi_router_command": "/opt/vllm-router --log-level debug"},
                                     "a3-d": A3D}), name="ok.yml")
    assert _invoke(["validate", "-i", str(ok), "--topology", str(topo)]).exit_code == 0
    for command in ("vllm-router --port 1", "vllm-router --policy=random", "vllm-router --prometheus-port 9"):
        inv = inventory_factory(_inv({}, {"a3-p": {**A3P, "kimi_router_command": command}, "a3-d": A3D}))
        flag = command.split()[1].split("=")[0]
        _refused(["validate", "-i", str(inv), "--topology", str(topo)], f"{inv} with topology {topo}",
                 "host a3-p", "kimi_router_command", flag)


# --- the topology ----------------------------------------------------------------------------------------------

TOPOLOGY_CASES: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("serve-value-newline", {"roles": {"prefill": {"dp": 2, "tp": 8}, "decode": {
        "dp": 4, "tp": 4, "serve": {"tool-call-parser": "kimi_k2\n--port=1"}}}},
     ("roles.decode.serve", "tool-call-parser", "control character")),
    ("serve-value-tab", {"serve": {**EP, "tool-call-parser": "kimi\tk2"}}, ("tool-call-parser", "control character")),
    ("slo-ttft-inf", {"slo": {"ttft_ms": float("inf")}}, ("slo.ttft_ms", "finite")),
    ("slo-tpot-nan", {"slo": {"tpot_ms": float("nan")}}, ("slo.tpot_ms",)),
    ("heal-deadline-inf", {"heal": {"hang_deadline_s": float("inf")}}, ("heal.hang_deadline_s", "finite")),
]


@pytest.mark.parametrize(("changes", "expect"), [pytest.param(c, e, id=i) for i, c, e in TOPOLOGY_CASES])
def test_topology_refusals_name_the_file_and_key(inventory_factory, changes, expect) -> None:
    inv = inventory_factory(_inv({}, {"a3-p": A3P, "a3-d": A3D}))
    topo = inventory_factory(_pd(**{"serve": EP, **changes}), name="topology.yml")
    _refused(["validate", "-i", str(inv), "--topology", str(topo)], str(topo), *expect)


def _raw_key_topology(inventory_factory, role: str, extra: dict[str, Any], name: str) -> Path:
    roles: dict[str, Any] = {"prefill": {"dp": 2, "tp": 8}, "decode": {"dp": 4, "tp": 4}}
    roles[role] = {**roles[role], "serve": {"additional-config": extra}}
    return inventory_factory(_pd(serve=EP, roles=roles), name=name)


@pytest.mark.parametrize(("version", "role", "extra", "expect"), [
    ("0.23.0", "decode", {"enable_flashcomm1": True}, ("role decode", "enable_flashcomm1", "switch flashcomm1")),
    ("0.23.0", "decode", {"enable_flashcomm1": 1}, ("role decode", "switch flashcomm1")),
    ("0.30.0rc2", "prefill", {"scheduler_config": {"recompute_scheduler_enable": True}},
     ("role prefill", "scheduler_config.recompute_scheduler_enable", "switch recompute_scheduler")),
    ("0.23.0", "prefill", {"enable_mlapo": True}, ("role prefill", "switch mlapo")),
])
def test_a_raw_switch_key_obeys_the_switch_role_rule(inventory_factory, version, role, extra, expect) -> None:
    inv = inventory_factory(_inv({"kimi_vllm_ascend_version": version}, {"a3-p": A3P, "a3-d": A3D}))
    topo = _raw_key_topology(inventory_factory, role, extra, "topology.yml")
    _refused(["validate", "-i", str(inv), "--topology", str(topo)], f"{inv} with topology {topo}", *expect)


@pytest.mark.parametrize(("version", "role", "extra"), [
    ("0.23.0", "prefill", {"enable_flashcomm1": True}),     # where the switch belongs
    ("0.23.0", "decode", {"enable_flashcomm1": False}),     # switched off
    ("0.30.0rc2", "decode", {"scheduler_config": {"recompute_scheduler_enable": True}}),
])
def test_a_raw_switch_key_where_its_switch_may_be_plans(inventory_factory, version, role, extra) -> None:
    inv = inventory_factory(_inv({"kimi_vllm_ascend_version": version}, {"a3-p": A3P, "a3-d": A3D}))
    topo = _raw_key_topology(inventory_factory, role, extra, "topology.yml")
    result = _invoke(["validate", "-i", str(inv), "--topology", str(topo)])
    assert result.exit_code == 0, result.output


def test_topology_flag_is_named_as_given(inventory_factory) -> None:
    inv = inventory_factory(_inv({}, {"a3-p": A3P, "a3-d": A3D}))
    _refused(["validate", "-i", str(inv), "--topology", "https://example.com/t.yml"],
             "--topology https://example.com/t.yml", "URL")
    _refused(["plan", "-i", str(inv), "--topology", "./a3-pd"], "--topology ./a3-pd", "not found",
             "--topology a3-pd")
    _refused(["plan", "-i", str(inv), "--topology", "./nope/t.yml"], "--topology ./nope/t.yml", "topology not found")


# --- topology import -------------------------------------------------------------------------------------------

def _spoiled(change) -> dict[str, Any]:
    doc = _recipe()
    change(doc)
    return doc


def _set_template_flag(doc: dict[str, Any], node: int, flag: str, value: str) -> None:
    args = doc["templates"][node]["server_cmd_template"]
    args[args.index(flag) + 1] = value


RECIPE_CASES: list[tuple[str, Any, tuple[str, ...]]] = [
    ("spec-json-broken", lambda d: _set_template_flag(d, 0, "--speculative-config", '{"method": "eagle3", "mod'),
     ("templates[0]", "--speculative-config", "not JSON")),
    ("spec-json-list", lambda d: _set_template_flag(d, 0, "--speculative-config", "[1, 2]"),
     ("templates[0]", "--speculative-config", "not a JSON object")),
    ("spec-no-model", lambda d: _set_template_flag(d, 0, "--speculative-config", '{"method": "eagle3"}'),
     ("templates[0]", "--speculative-config", "no model")),
    ("kv-json-broken", lambda d: _set_template_flag(d, 2, "--kv-transfer-config", "{kv"),
     ("templates[2]", "--kv-transfer-config", "not JSON")),
    ("additional-json-broken", lambda d: _set_template_flag(d, 2, "--additional-config", "{"),
     ("templates[2]", "--additional-config", "not JSON")),
    ("compilation-json-broken", lambda d: _set_template_flag(d, 2, "--compilation-config", "{'x': 1}"),
     ("templates[2]", "--compilation-config", "not JSON")),
    ("gmu-word", lambda d: _set_template_flag(d, 2, "--gpu-memory-utilization", "most"),
     ("templates[2]", "--gpu-memory-utilization", "not a number")),
    ("tp-word", lambda d: d["config"][2].update(tp_size="eight"), ("config[2].tp_size", "'eight'", "whole number")),
    ("dp-float", lambda d: d["config"][0].update(dp_size=2.5), ("config[0].dp_size", "whole number")),
    ("port-bool", lambda d: d["config"][1].update(port_start=True), ("config[1].port_start", "whole number")),
    ("num-nodes-word", lambda d: d.update(num_nodes="four"), ("num_nodes", "whole number")),
    ("group-index-word", lambda d: d["routing"]["groups"].update(decoder=[2, "three"]),
     ("routing.groups.decoder", "whole number")),
    ("config-not-list", lambda d: d.update(config={"node_index": 0}), ("config", "list of mappings")),
    ("npu-per-node-8", lambda d: d.update(npu_per_node=8), ("npu_per_node is 8", "config[0]", "16 NPUs")),
]


@pytest.mark.parametrize(("change", "expect"), [pytest.param(c, e, id=i) for i, c, e in RECIPE_CASES])
def test_recipe_refusals_name_the_file_and_key(tmp_path: Path, change, expect) -> None:
    recipe = _write(tmp_path, _spoiled(change))
    _refused(["topology", "import", str(recipe)], str(recipe), *expect)
    _refused(["topology", "import", str(recipe), "-o", "json"], str(recipe), *expect)


def test_import_out_write_failure_names_out(tmp_path: Path) -> None:
    recipe = _write(tmp_path, _recipe())
    _refused(["topology", "import", str(recipe), "--out", "/dev/full"], "--out /dev/full", "No space left")


# --- flags of remote commands, refused before the lease, any host or the hub -----------------------------------

@pytest.fixture
def recorded(tmp_path: Path, monkeypatch) -> Path:
    """A recorded deploy of two hosts on a closed port: contacting one would exit 1."""
    inv = _inventory(tmp_path, hosts=2, ansible_port=9)
    _record_deploy(tmp_path, inv, monkeypatch)
    return inv


@pytest.mark.parametrize(("args", "flag"), [
    (["observe", "up", "-t", "a3-pd", "--scrape-timeout", "nan"], "--scrape-timeout"),
    (["observe", "up", "-t", "a3-pd", "--scrape-timeout", "inf"], "--scrape-timeout"),
    (["observe", "up", "-t", "a3-pd", "--scrape-timeout", "-1"], "--scrape-timeout"),
    (["bench", "--slo-tpot-ms", "-5"], "--slo-tpot-ms"),
    (["bench", "--slo-tpot-ms", "0"], "--slo-tpot-ms"),
    (["bench", "--slo-ttft-ms", "nan"], "--slo-ttft-ms"),
    (["rollback", "--to", "", "--yes"], "--to"),
    (["rollback", "--to", "  ", "--yes"], "--to"),
])
def test_bad_flag_values_are_refused_while_the_flags_are_read(recorded: Path, args: list[str], flag: str) -> None:
    err = _refused([*args[:2], "-i", str(recorded), *args[2:]] if args[0] == "observe" else
                   [args[0], "-i", str(recorded), *args[1:]], flag)
    assert "record" not in err   # the cluster record was not read back from any host


def test_weights_pull_from_an_empty_directory_is_refused(recorded: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    (ckpt / "sub").mkdir(parents=True)
    _refused(["weights", "pull", "-i", str(recorded), "--mode", "control", "--from", str(ckpt)], f"--from {ckpt}",
             "holds no files")


def test_preflight_checks_the_inventory_before_the_hub(inventory_factory, monkeypatch) -> None:
    def no_hub(*_a, **_k):
        raise AssertionError("preflight reached the hub listing before the inventory's static checks")

    monkeypatch.setattr("kimictl.preflight.checkpoint_bytes", no_hub)
    inv = inventory_factory(_inv({"kimi_model_endpoint": "http://127.0.0.1:9"},
                                 {"a3-p": A3P, "a3-d": {**A3D, "ansible_ssh_common_args": "-o Port=abc"}}))
    _refused(["preflight", "-i", str(inv), "-t", "a3-pd"], str(inv), "host a3-d", "ansible_ssh_common_args",
             "not a TCP port")
