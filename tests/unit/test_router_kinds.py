"""Router kinds: the planner's choice and refusals, each kind's rendered argv, the front's per-kind flags."""

from __future__ import annotations

import itertools
import json
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from kimictl.errors import PlanError
from kimictl.inventory import load_inventory
from kimictl.plan import make_plan
from kimictl.render import render
from kimictl.router_kinds import router_kinds
from kimictl.topology import Proxy, Topology, load_topology

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py"


def _inv(tmp_path: Path, **all_vars) -> Path:
    text = (ROOT / "inventories" / "a3-pd.yml").read_text()
    doc = yaml.safe_load(text)
    doc["all"]["vars"].update(all_vars)
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _topo(**proxy) -> Topology:
    t = load_topology("a3-pd")
    return t.model_copy(update={"proxy": Proxy(**{"port": 8000, **proxy})})


def _plan_render(tmp_path: Path, topo: Topology | None = None, **all_vars):
    inv = load_inventory(_inv(tmp_path, **all_vars))
    topo = topo or load_topology("a3-pd")
    plan = make_plan(inv, topo)
    return plan, render(plan, inv, topo)


def _front_and_router(rendered) -> tuple[list[str], list[str]]:
    script = rendered.files["a3-node-01"]["proxy/proxy.sh"]
    argv = shlex.split(script.split("exec ", 1)[1].replace("\\\n", " "))
    return argv[:argv.index("--")], argv[argv.index("--") + 1:]


def _values(argv: list[str], flag: str) -> list[str]:
    return list(itertools.takewhile(lambda a: not a.startswith("--"), argv[argv.index(flag) + 1:]))


def test_the_topology_names_exactly_the_kinds_in_the_data() -> None:
    assert set(typing.get_args(typing.get_args(Proxy.model_fields["router"].annotation)[0])) == set(router_kinds())


def test_ascend_profile_defaults_to_the_upstream_proxy_run_from_the_engines_image(tmp_path: Path) -> None:
    plan, r = _plan_render(tmp_path)
    assert plan.proxy.router == "vllm-ascend-proxy" and plan.proxy.policy is None
    assert "engine profile ascend's default" in plan.proxy.router_why and "recomputed" in plan.proxy.router_why
    doc = r.contract()["proxy"]
    assert doc["router"] == "vllm-ascend-proxy"
    assert doc["argv"][:4] == ["bash", "./router.container.sh", "python3", f"/vllm-workspace/vllm-ascend/{SCRIPT}"]
    # one host/port pair per DP-rank endpoint: 2 prefill ranks on node 1, 4 decode ranks on node 2
    argv = doc["argv"]
    assert _values(argv, "--prefiller-hosts") == ["192.168.10.11"] * 2
    assert _values(argv, "--prefiller-ports") == ["7100", "7101"]
    assert _values(argv, "--decoder-hosts") == ["192.168.10.12"] * 4
    assert _values(argv, "--decoder-ports") == ["7100", "7101", "7102", "7103"]
    assert argv[argv.index("--waiting-retry-interval") + 1] == "1" and "--workers" not in argv
    front, router = _front_and_router(r)
    assert router == argv
    assert front[front.index("--router-health") + 1] == "/healthcheck" and "--no-router-metrics" in front
    files = r.files["a3-node-01"]
    assert 'cd "$(dirname "${BASH_SOURCE[0]}")"' in files["proxy/proxy.sh"]
    wrapper = files["proxy/router.container.sh"]
    assert f"{plan.image}" in wrapper and "--env OPENAI_API_KEY" in wrapper and "--net=host" in wrapper
    manifest = json.loads(files["manifest.json"])
    assert manifest["proxy"]["router"] == "vllm-ascend-proxy"


def test_host_runtime_runs_the_script_the_inventory_names_and_refuses_without_it(tmp_path: Path) -> None:
    script = f"/opt/vllm-ascend/{SCRIPT}"
    _, r = _plan_render(tmp_path, kimi_runtime="host", kimi_proxy_script=script,
                           kimi_proxy_python="env PYTHONPATH=/opt/pydeps /usr/bin/python3")
    argv = r.contract()["proxy"]["argv"]
    assert argv[:4] == ["env", "PYTHONPATH=/opt/pydeps", "/usr/bin/python3", script]
    assert "proxy/router.container.sh" not in r.files["a3-node-01"]
    assert "cd " not in r.files["a3-node-01"]["proxy/proxy.sh"]
    with pytest.raises(PlanError) as exc:
        _plan_render(tmp_path, kimi_runtime="host")
    assert "kimi_proxy_script" in exc.value.message and "a3-node-01" in exc.value.message
    assert "kimi_runtime: container" in exc.value.hint


def test_vllm_router_keeps_its_argv_and_the_front_its_defaults(tmp_path: Path) -> None:
    topo = _topo(router="vllm-router").model_copy(update={"roles": {
        **load_topology("a3-pd").roles,
        "decode": load_topology("a3-pd").roles["decode"].model_copy(update={"switches": {"mlapo": True}})}})
    plan, r = _plan_render(tmp_path, topo)
    assert plan.proxy.router == "vllm-router" and plan.proxy.policy == "round_robin"
    assert "topology proxy.router" in plan.proxy.router_why
    front, router = _front_and_router(r)
    assert router[:4] == ["vllm-router", "--policy", "round_robin", "--vllm-pd-disaggregation"]
    assert [v for k, v in itertools.pairwise(router) if k == "--decode"] == [
        f"http://192.168.10.12:{p}" for p in range(7100, 7104)]
    assert "--router-health" not in front and "--no-router-metrics" not in front
    assert "proxy/router.container.sh" not in r.files["a3-node-01"]


def test_vllm_router_with_recompute_is_refused_naming_the_switch_and_both_ways_out(tmp_path: Path) -> None:
    with pytest.raises(PlanError) as exc:
        _plan_render(tmp_path, _topo(router="vllm-router"))
    e = exc.value
    assert e.code == 2 and "recompute_scheduler" in e.message and "decode" in e.message
    assert "proxy.router: vllm-ascend-proxy" in e.hint and "recompute_scheduler: false" in e.hint
    # the raw additional-config key turns recompute on just the same
    base = load_topology("a3-pd")
    raw = base.roles["decode"].model_copy(update={
        "switches": {}, "serve": {"additional-config": {"recompute_scheduler_enable": True}}})
    with pytest.raises(PlanError, match="recompute"):
        _plan_render(tmp_path, _topo(router="vllm-router").model_copy(update={"roles": {**base.roles, "decode": raw}}))
    # and nested under scheduler_config, as 0.26+ reads it
    nested = raw.model_copy(update={"serve": {"additional-config": {
        "scheduler_config": {"recompute_scheduler_enable": True}}}})
    with pytest.raises(PlanError, match="recompute"):
        _plan_render(tmp_path, _topo(router="vllm-router").model_copy(
            update={"roles": {**base.roles, "decode": nested}}), kimi_vllm_ascend_version="0.30.0rc2")
    # without recompute, vllm-router plans
    off = raw.model_copy(update={"serve": {}})
    plan, _ = _plan_render(tmp_path, _topo(router="vllm-router").model_copy(
        update={"roles": {**base.roles, "decode": off}}))
    assert plan.proxy.router == "vllm-router"


def test_a_policy_with_the_upstream_proxy_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PlanError) as exc:
        _plan_render(tmp_path, _topo(policy="random"))
    assert "proxy.policy" in exc.value.message and "vllm-router" in exc.value.hint


def test_the_proxy_tag_covers_every_file_the_proxy_runs(tmp_path: Path) -> None:
    from kimictl.hostops import process_tag

    _, r = _plan_render(tmp_path)
    files = dict(r.files["a3-node-01"])
    before = process_tag(files, "proxy")
    files["proxy/router.container.sh"] += "# changed\n"
    assert process_tag(files, "proxy") != before


def _key(tmp_path: Path, text: str = "sk-client-key-71c2") -> Path:
    key = tmp_path / "client-key"
    key.write_text(text + "\n")
    key.chmod(0o600)
    return key


def test_keyed_engines_read_their_key_from_a_0600_env_file_never_a_rendered_file(tmp_path: Path) -> None:
    key = _key(tmp_path)
    plan, r = _plan_render(tmp_path, kimi_api_key_file=str(key))
    assert plan.engine_api_key
    env_file = "/var/lib/kimi/secrets/engine-api-key.env"
    container = r.files["a3-node-02"]["engines/decode-0-dp0.container.sh"]
    assert f"--env-file {env_file}" in container  # docker reads it; the key is on no command line
    proxy = r.files["a3-node-01"]["proxy/proxy.sh"]
    assert f". {env_file}" in proxy and 'export OPENAI_API_KEY="$VLLM_API_KEY"' in proxy
    assert "sk-client-key-71c2" not in r.model_dump_json()
    _, host = _plan_render(tmp_path, kimi_api_key_file=str(key), kimi_runtime="host",
                           kimi_proxy_script=f"/opt/vllm-ascend/{SCRIPT}")
    assert f". {env_file}" in host.files["a3-node-02"]["engines/decode-0-dp0.sh"]
    _, open_ = _plan_render(tmp_path)  # no client key: no engine key either
    assert "engine-api-key" not in json.dumps(open_.files)


def test_vllm_router_cannot_send_the_engines_key_so_it_is_refused_with_one(tmp_path: Path) -> None:
    base = load_topology("a3-pd")
    decode = base.roles["decode"].model_copy(update={"switches": {"mlapo": True}})
    topo = _topo(router="vllm-router").model_copy(update={"roles": {**base.roles, "decode": decode}})
    with pytest.raises(PlanError) as exc:
        _plan_render(tmp_path, topo, kimi_api_key_file=str(_key(tmp_path)))
    assert "--api-key" in exc.value.message and "vllm-ascend-proxy" in exc.value.hint


def test_the_engines_key_is_kimictls_own_in_pd_and_the_clients_colocated(tmp_path: Path, monkeypatch) -> None:
    from fake_sessions import held_keys

    from kimictl import key_readback
    from kimictl.cluster_secrets import engine_api_key, engine_key_file

    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(key_readback, "Sessions", held_keys({}))  # the cluster holds no engine key yet
    inv = load_inventory(_inv(tmp_path, kimi_api_key_file=str(_key(tmp_path))))
    assert engine_key_file(inv, pd=True) is None  # not made yet: only deploy and rollout make it
    made = engine_key_file(inv, pd=True, create=True)
    assert made and made.stat().st_mode & 0o777 == 0o600
    pd_key = engine_api_key(inv, pd=True)
    assert pd_key and pd_key != "sk-client-key-71c2" and engine_key_file(inv, pd=True, create=True) == made
    assert engine_api_key(inv, pd=False) == "sk-client-key-71c2"
    assert engine_api_key(load_inventory(_inv(tmp_path)), pd=True) is None


def test_router_kinds_are_static_facts_without_an_http_client() -> None:
    """plan, render and preflight read the kinds; the HTTP clients of their APIs are kimictl.routers, above them."""
    code = "import sys, kimictl.router_kinds; print(*(m for m in sys.modules if m.startswith('kimictl.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    loaded = set(out.split())
    assert "kimictl.router_kinds" in loaded and not loaded & {"kimictl.health", "kimictl.routers"}, loaded
