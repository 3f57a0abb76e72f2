"""Bad input through the real CLI, third round (issue 27's second held-out corpus): refusals name the file or the
flag, remote commands refuse before the lease and any host, and written outputs fail as usage errors. Each: exit 2,
the file/flag and key named, no traceback. Hosts point at a closed port: contacting one would exit 1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_bad_inputs import A3D, A3P, _inv, _invoke, _pd
from test_rollout import _inventory, _record_deploy

from kimictl.errors import EXIT_INVALID

EP = {"enable-expert-parallel": True}


def _refused(args: list[str], *expect: str) -> str:
    result = _invoke(args)
    assert result.exit_code == EXIT_INVALID, result.output
    for want in expect:
        assert want in result.stderr, f"{want!r} not in:\n{result.stderr}"
    return result.stderr


INVENTORY_CASES: list[tuple[str, dict[str, Any], dict[str, Any], tuple[str, ...]]] = [
    ("model-dir-too-long", {"kimi_model_dir": "/data/" + "m" * 5000}, {},
     ("kimi_model_dir", "longer than Linux allows")),
    ("model-dir-name-too-long", {"kimi_model_dir": "/data/" + "m" * 300}, {}, ("kimi_model_dir", "each name")),
    ("device-ips-loopback", {}, {"a3-d": {**A3D, "kimi_device_ips": [f"127.0.1.{i}" for i in range(1, 17)]}},
     ("host a3-d", "kimi_device_ips", "127.0.1.1", "loopback")),
    ("host-ip-loopback", {}, {"a3-d": {**A3D, "ansible_host": "d.example.com", "kimi_host_ip": "127.0.0.1"}},
     ("host a3-d", "kimi_host_ip", "loopback")),
    ("ansible-user-option", {}, {"a3-d": {**A3D, "ansible_user": "-oProxyCommand=id"}},
     ("host a3-d", "ansible_user", "not a login name")),
    ("strict-host-key-maybe", {}, {"a3-d": {**A3D, "ansible_ssh_extra_args": "-o StrictHostKeyChecking=maybe"}},
     ("host a3-d", "ansible_ssh_extra_args", "StrictHostKeyChecking=maybe")),
    ("strict-host-key-joined", {}, {"a3-d": {**A3D, "ansible_ssh_common_args": "-oStrictHostKeyChecking=nope"}},
     ("host a3-d", "ansible_ssh_common_args", "StrictHostKeyChecking=nope")),
]


@pytest.mark.parametrize(("vars_", "hosts", "expect"),
                         [pytest.param(v, h, e, id=i) for i, v, h, e in INVENTORY_CASES])
def test_inventory_refusals_name_the_file_key_and_host(inventory_factory, vars_, hosts, expect) -> None:
    inv = inventory_factory(_inv(vars_, {"a3-p": A3P, "a3-d": A3D, **hosts}))
    _refused(["validate", "-i", str(inv), "--topology", "a3-pd"], str(inv), *expect)


def test_a_one_host_cluster_may_use_a_loopback_business_ip(inventory_factory) -> None:
    solo = {**A3P, "ansible_host": "solo.example.com", "kimi_host_ip": "127.0.0.1"}
    inv = inventory_factory(_inv({}, {"solo": solo}))
    result = _invoke(["validate", "-i", str(inv), "--topology", "a3-colocated"])
    assert result.exit_code == 0, result.output


def test_ssh_options_ssh_accepts_are_accepted(inventory_factory) -> None:
    inv = inventory_factory(_inv({}, {"a3-p": {**A3P, "ansible_user": "ops.admin@corp",
                                               "ansible_ssh_extra_args": "-o StrictHostKeyChecking=accept-new"},
                                      "a3-d": A3D}))
    assert _invoke(["validate", "-i", str(inv), "--topology", "a3-pd"]).exit_code == 0


@pytest.mark.parametrize("command", ["validate", "plan", "render"])
@pytest.mark.parametrize(("topo", "expect"), [
    (_pd(serve=EP, roles={"prefill": {"dp": 2, "tp": 8},
                          "decode": {"dp": 4, "tp": 4, "switches": {"flashcomm1": True}}}), ("flashcomm1", "decode")),
    (_pd(serve=EP, ports={"http_base": 7100, "rpc": 12321, "kv_base": 7100}), ("7100", "collides")),
])
def test_plan_errors_name_both_inputs(inventory_factory, command, topo, expect) -> None:
    inv = inventory_factory(_inv({}, {"a3-p": A3P, "a3-d": A3D}))
    path = inventory_factory(topo, name="topology.yml")
    _refused([command, "-i", str(inv), "--topology", str(path)], f"{inv} with topology {path}", *expect)


def test_a_preset_is_named_as_the_user_named_it(inventory_factory) -> None:
    inv = inventory_factory(_inv({"kimi_engine_profile": "cpu-smoke"}, {"a3-p": A3P, "a3-d": A3D}))
    _refused(["validate", "-i", str(inv), "--topology", "a3-pd"], f"{inv} with topology a3-pd:", "kimi_runtime")


def test_a_colocated_topology_with_a_proxy_is_refused(inventory_factory) -> None:
    inv = inventory_factory(_inv({}, {"a3-p": A3P}))
    topo = {"name": "colo", "description": "x", "hardware": "atlas-800-a3", "mode": "colocated",
            "launch": "internal-dp", "proxy": {"port": 8000}, "roles": {"colocated": {"dp": 2, "tp": 8}}}
    path = inventory_factory(topo, name="topology.yml")
    _refused(["validate", "-i", str(inv), "--topology", str(path)], str(path), "proxy", "colocated")


def test_a_draft_without_speculative_is_named_in_a_warning(inventory_factory) -> None:
    inv = inventory_factory(_inv({"kimi_draft_model_dir": "/data/models/eagle3"}, {"a3-p": A3P, "a3-d": A3D}))
    topo = _pd(serve=EP)
    del topo["speculative"]
    path = inventory_factory(topo, name="topology.yml")
    result = _invoke(["plan", "-i", str(inv), "--topology", str(path)])
    assert result.exit_code == 0, result.output
    assert "kimi_draft_model_dir /data/models/eagle3 is set but topology bad-typed has no speculative" in \
        result.output


def test_pipeline_parallelism_is_refused(inventory_factory) -> None:
    inv = inventory_factory(_inv({}, {"a3-p": A3P, "a3-d": A3D}))
    path = inventory_factory(_pd(serve={**EP, "pipeline-parallel-size": 2}), name="topology.yml")
    _refused(["validate", "-i", str(inv), "--topology", str(path)], str(path), "pipeline-parallel-size")
    ok = inventory_factory(_pd(serve={**EP, "pipeline-parallel-size": 1}), name="ok.yml")
    assert _invoke(["validate", "-i", str(inv), "--topology", str(ok)]).exit_code == 0


# --- written outputs --------------------------------------------------------------------------------------------

def test_render_and_observe_out_refusals(inventory_factory, tmp_path: Path) -> None:
    inv = inventory_factory(_inv({}, {"a3-p": A3P, "a3-d": A3D}))
    base = ["-i", str(inv), "--topology", "a3-pd"]
    _refused(["render", *base, "--out", ""], "--out is empty")
    _refused(["render", *base, "--out", "/proc/kimictl-test-out"], "--out /proc/kimictl-test-out", "cannot write")
    afile = tmp_path / "afile"
    afile.write_text("x")
    _refused(["observe", "render", *base, "--out", str(afile)], f"--out {afile}", "not a directory")
    _refused(["observe", "render", *base, "--out", str(tmp_path / "o"), "--prefix", "/etc/prom, /root/.ssh"],
             "--prefix '/etc/prom, /root/.ssh'")
    assert not (tmp_path / "o").exists()


def test_topology_import_flags_are_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    _refused(["topology", "import", str(missing)], str(missing), "not found")
    _refused(["topology", "import", str(tmp_path)], str(tmp_path), "directory")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: x\n")
    _refused(["topology", "import", str(recipe), "--version", "9.9"], "--version 9.9", "unsupported")
    _refused(["topology", "import", str(recipe), "--name", "Bad Name!"], "--name 'Bad Name!'")
    _refused(["topology", "import", str(recipe), "--out", str(tmp_path)], f"--out {tmp_path}", "is a directory")


def test_a_recipe_alias_bomb_is_refused_at_once(tmp_path: Path) -> None:
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join(['*l' + str(i - 1)] * 10)}]" for i in range(1, 9)]
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text("\n".join(lines) + "\nmodel: *l8\n")
    _refused(["topology", "import", str(recipe)], str(recipe), "expands to more than")


# --- remote commands refuse before the lease and the hosts -------------------------------------------------------

@pytest.fixture
def recorded(tmp_path: Path, monkeypatch) -> Path:
    inv = _inventory(tmp_path, hosts=2, ansible_port=9)
    _record_deploy(tmp_path, inv, monkeypatch)
    return inv


def test_remote_flags_are_refused_before_any_host(recorded: Path, tmp_path: Path) -> None:
    inv = str(recorded)
    _refused(["rollout", "-i", inv, "--check", "--router", "ftp://10.0.0.9/"], "--router 'ftp://10.0.0.9/'")
    _refused(["rollout", "-i", inv, "--check", "--set", "decode.tp=3"], "--set decode.tp=3", "TP 3")
    _refused(["logs", "-i", inv, "--engine", "decode-9-dp9"], "--engine decode-9-dp9", "no such engine")
    _refused(["deploy", "-i", inv, "-t", "a3-pd", "--check", "--skip-preflight", " "], "--skip-preflight")
    _refused(["preflight", "-i", inv, "-t", "a3-pd", "--skip-check", "NOPE-999"], "--skip-check 'NOPE-999'")
    _refused(["weights", "pull", "-i", inv, "--mode", "control"], "--mode control needs --from")
    ckpt = tmp_path / "ckpt.bin"
    ckpt.write_text("x")
    _refused(["weights", "pull", "-i", inv, "--mode", "control", "--from", str(ckpt)], f"--from {ckpt}")
    tok = tmp_path / "tok"
    tok.write_bytes(b"ms-tok\0en")
    tok.chmod(0o600)
    _refused(["weights", "pull", "-i", inv, "--mode", "shared", "--token-file", str(tok)], f"--token-file {tok}",
             "control character")
