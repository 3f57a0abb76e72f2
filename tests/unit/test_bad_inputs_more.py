"""More bad input through the real CLI (issue 27's held-out corpus): topology serve flags and env that kimictl owns,
speculative token counts, seeds, the HBM fit naming HCCL_BUFFSIZE, and `rollout --set` values validated like the
files on disk before any host is contacted. Each: exit 2, the key named, no traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_bad_inputs import A3D, A3P, _inv, _pd
from test_rollout import _inventory, _record_deploy
from typer.testing import CliRunner

from kimictl import ssh
from kimictl.cli.main import app
from kimictl.errors import EXIT_INVALID
from kimictl.inventory import load_inventory
from kimictl.plan import make_plan
from kimictl.render import render
from kimictl.topology import RESERVED_ENV, load_topology

COMMANDS = ["validate", "plan", "render"]
EP = {"enable-expert-parallel": True}


def _run(args: list[str]):
    result = CliRunner().invoke(app, args)
    # CliRunner keeps an uncaught exception instead of printing it: anything but the exit is a crash
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result


def _roles(decode: dict[str, Any] | None = None, prefill: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"roles": {"prefill": {"dp": 2, "tp": 8, **(prefill or {})}, "decode": {"dp": 4, "tp": 4, **(decode or {})}}}


TOPOLOGY_CASES: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("serve-help", _pd(**_roles(decode={"serve": {"help": True}})),
     ("roles.decode.serve", "'help'", "usage and exit 0")),
    ("serve-version", _pd(serve={"version": True}), ("serve:", "'version'", "exit 0")),
    ("serve-help-abbreviated", _pd(**_roles(prefill={"serve": {"hel": True}})), ("'hel'", "abbreviates 'help'")),
    ("env-visible-devices", _pd(**_roles(decode={"env": {"ASCEND_RT_VISIBLE_DEVICES": "0,1"}})),
     ("roles.decode.env", "ASCEND_RT_VISIBLE_DEVICES", "set by kimictl", "NPUs the plan")),
    ("env-hccl-if-ip", _pd(**_roles(prefill={"env": {"HCCL_IF_IP": "1.2.3.4"}})),
     ("roles.prefill.env", "HCCL_IF_IP", "set by kimictl", "business IP")),
    ("env-api-key-top", _pd(env={"VLLM_API_KEY": "sk-1"}), ("env:", "VLLM_API_KEY", "set by kimictl")),
    ("spec-tokens-negative",
     _pd(speculative={"model_id": "lightseekorg/kimi-k2.5-eagle3", "num_speculative_tokens": {"decode": -1}}),
     ("speculative.num_speculative_tokens.decode", "greater than or equal to 1")),
    ("spec-tokens-zero",
     _pd(speculative={"model_id": "lightseekorg/kimi-k2.5-eagle3", "num_speculative_tokens": {"prefill": 0}}),
     ("speculative.num_speculative_tokens.prefill", "greater than or equal to 1")),
    ("spec-tokens-wrong-role",
     _pd(speculative={"model_id": "lightseekorg/kimi-k2.5-eagle3", "num_speculative_tokens": {"colocated": 3}}),
     ("num_speculative_tokens", "'colocated'", "roles: prefill, decode")),
    ("seed-2-32", _pd(serve={"enable-expert-parallel": True, "seed": 2**32}), ("'seed'", "4294967296", "0 to")),
    ("seed-negative", _pd(**_roles(decode={"serve": {"seed": -1}})), ("'seed'", "0 to 4294967295")),
]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("topo", "expect"), [pytest.param(t, e, id=i) for i, t, e in TOPOLOGY_CASES])
def test_topology_refusals_name_file_and_key(inventory_factory, topo: dict[str, Any], expect: tuple[str, ...],
                                             command: str) -> None:
    inv = inventory_factory(_inv({}, {"a3-p": A3P, "a3-d": A3D}))
    path = inventory_factory(topo, name="topology.yml")
    result = _run([command, "-i", str(inv), "--topology", str(path)])
    assert result.exit_code == EXIT_INVALID, result.output
    assert str(path) in result.stderr
    for want in expect:
        assert want in result.stderr, f"{want!r} not in:\n{result.stderr}"


@pytest.mark.parametrize("name", sorted(RESERVED_ENV))
def test_every_reserved_env_name_is_refused_in_a_topology(inventory_factory, name: str) -> None:
    inv = inventory_factory(_inv({}, {"a3-p": A3P, "a3-d": A3D}))
    path = inventory_factory(_pd(env={name: "x"}), name="topology.yml")
    result = _run(["validate", "-i", str(inv), "--topology", str(path)])
    assert result.exit_code == EXIT_INVALID and f"env '{name}' is set by kimictl" in result.stderr, result.output


def test_reserved_env_covers_what_render_sets_per_engine(inventory_factory) -> None:
    """Every env name render adds for an engine (not the version profile's or the topology's, which the topology may
    change) is in RESERVED_ENV; VLLM_API_KEY comes from the key env file the engine script sources after them."""
    inv = load_inventory(inventory_factory(_inv({}, {"a3-p": A3P, "a3-d": A3D})))
    topo = load_topology("a3-pd")
    rendered = render(make_plan(inv, topo), inv, topo)
    for e in rendered.engines:
        own = set(e.env) - set(rendered.plan.role_config[e.role].env)
        assert own and own <= set(RESERVED_ENV), own - set(RESERVED_ENV)
    assert "VLLM_API_KEY" in RESERVED_ENV


def test_seed_bounds_are_numpy_s(inventory_factory) -> None:
    inv = inventory_factory(_inv({}, {"a3-p": A3P, "a3-d": A3D}))
    for seed, code in ((2**32 - 1, 0), (0, 0), (2**32, EXIT_INVALID)):
        path = inventory_factory(_pd(serve={"enable-expert-parallel": True, "seed": seed}), name="topology.yml")
        assert _run(["validate", "-i", str(inv), "--topology", str(path)]).exit_code == code, seed


@pytest.mark.parametrize("command", COMMANDS)
def test_hbm_fit_names_a_huge_hccl_buffsize(inventory_factory, command: str) -> None:
    inv = inventory_factory(_inv({}, {"a3-p": A3P, "a3-d": A3D}))
    path = inventory_factory(_pd(serve=EP, **_roles(decode={"env": {"HCCL_BUFFSIZE": "99999999"}})),
                           name="topology.yml")
    result = _run([command, "-i", str(inv), "--topology", str(path)])
    assert result.exit_code == EXIT_INVALID, result.output
    first = result.stderr.splitlines()[0]
    assert "role decode does not fit in HBM" in first and "HCCL_BUFFSIZE 99999999 MiB" in first, first
    assert "HCCL_BUFFSIZE" in result.stderr.splitlines()[-1]  # the hint


def test_hbm_fit_message_without_hccl_buffsize_is_unchanged(inventory_factory) -> None:
    inv = inventory_factory(_inv({}, {"a3-p": A3P, "a3-d": A3D}))
    path = inventory_factory(_pd(serve=EP, **_roles(decode={"dp": 1, "tp": 2})), name="topology.yml")
    result = _run(["validate", "-i", str(inv), "--topology", str(path)])
    assert result.exit_code == EXIT_INVALID and "role decode does not fit in HBM" in result.stderr, result.output
    assert "HCCL_BUFFSIZE" not in result.stderr


# --- rollout --set: refused like the files on disk, before any host --------------------------------------------


@pytest.fixture
def recorded(tmp_path: Path, monkeypatch) -> tuple[Path, list[str]]:
    """A recorded a3-pd release (KIMICTL_STATE_DIR in tmp_path) and the hosts contacted (none may be)."""
    inv_path = _inventory(tmp_path)
    _record_deploy(tmp_path, inv_path, monkeypatch)
    contacted: list[str] = []

    def no_hosts(self, inv, *args, **kwargs) -> None:
        contacted.append(",".join(h.name for h in inv.hosts))
        raise RuntimeError("a host was contacted")

    monkeypatch.setattr(ssh.Sessions, "__init__", no_hosts)
    return inv_path, contacted


def test_a_valid_set_does_reach_the_hosts(recorded) -> None:
    """The guard of the cases below: a valid change goes on to the hosts (and trips it)."""
    inv_path, contacted = recorded
    result = CliRunner().invoke(app, ["rollout", "-i", str(inv_path), "--check", "--set",
                                      "decode.serve.max-num-seqs=16"])
    assert contacted and isinstance(result.exception, RuntimeError), result.output


def _key_file(tmp_path: Path, mode: int) -> Path:
    key = tmp_path / "key"
    key.write_text("sk-unit-key-1\n")
    key.chmod(mode)
    return key


SET_CASES: list[tuple[str, str, tuple[str, ...]]] = [
    ("spec-negative", "speculative.num_speculative_tokens.decode=-1",
     ("--set speculative.num_speculative_tokens.decode=-1", "greater than or equal to 1")),
    ("spec-wrong-role", "speculative.num_speculative_tokens.colocated=2",
     ("--set speculative.num_speculative_tokens.colocated=2", "'colocated'")),
    ("seed", "serve.seed=4294967296", ("--set serve.seed=4294967296", "'seed'")),
    ("serve-help", "decode.serve.help=true", ("--set decode.serve.help=true", "'help'")),
    ("env-reserved", "prefill.env.HCCL_IF_IP=1.2.3.4", ("--set prefill.env.HCCL_IF_IP=1.2.3.4", "set by kimictl")),
    ("proxy-host-ghost", "kimi_proxy_host=ghost", ("--set kimi_proxy_host=ghost", "'ghost' is not an inventory host")),
    ("monitor-host-typo", "kimi_monitor_host=atlas-1", ("--set kimi_monitor_host=atlas-1", "did you mean")),
    ("mode-flip", "mode=colocated", ("--set mode=colocated", "needs exactly one role")),
    ("media-holds-model", "kimi_media_dir=/data/models",
     ("--set kimi_media_dir=/data/models", "holds kimi_model_dir")),
    ("api-key-world-readable", "kimi_api_key_file={KEY644}",
     ("--set kimi_api_key_file={KEY644}", "readable by others (mode 644)")),
]


@pytest.mark.parametrize("topology", [None, "a3-pd"])
@pytest.mark.parametrize(("item", "expect"), [pytest.param(s, e, id=i) for i, s, e in SET_CASES])
def test_bad_set_is_exit_2_before_any_host(recorded, tmp_path: Path, item: str, expect: tuple[str, ...],
                                           topology: str | None) -> None:
    inv_path, contacted = recorded
    key = str(_key_file(tmp_path, 0o644))
    item = item.replace("{KEY644}", key)
    args = ["rollout", "-i", str(inv_path), "--check", "--set", item] + (["-t", topology] if topology else [])
    result = _run(args)
    assert result.exit_code == EXIT_INVALID, result.output
    assert not contacted
    for want in expect:
        assert want.replace("{KEY644}", key) in result.stderr, f"{want!r} not in:\n{result.stderr}"
    assert "all.vars" not in result.stderr  # the value came from --set, not the inventory file


def test_bad_set_json_is_one_error_document(recorded) -> None:
    inv_path, contacted = recorded
    result = _run(["rollout", "-i", str(inv_path), "--check", "--output", "json", "--set", "kimi_proxy_host=ghost"])
    assert result.exit_code == EXIT_INVALID and not contacted
    err = json.loads(result.stdout)["error"]
    assert err["type"] == "InventoryError" and str(inv_path) in err["message"]
    assert err["details"] == ["--set kimi_proxy_host=ghost: kimi_proxy_host 'ghost' is not an inventory host"]


def test_a_private_key_file_through_set_passes_the_cross_checks(recorded, tmp_path: Path) -> None:
    """The cross checks pass a good value: the rollout goes on to the hosts."""
    inv_path, contacted = recorded
    key = _key_file(tmp_path, 0o600)
    result = CliRunner().invoke(app, ["rollout", "-i", str(inv_path), "--check", "--allow-proxy-restart", "--set",
                                      f"kimi_api_key_file={key}"])
    assert contacted and isinstance(result.exception, RuntimeError), result.output
