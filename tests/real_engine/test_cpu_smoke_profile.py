"""The cpu-smoke engine profile as data: what it renders differently from production, and what it refuses.
No lane needed (these run in the ordinary suite); the lane's deploy tests prove vLLM accepts the result."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest

from kimictl.errors import InventoryError, PlanError
from kimictl.facts import engine_profile, engine_profiles
from kimictl.inventory import ClusterSettings, load_inventory
from kimictl.plan import make_plan
from kimictl.render import engine_shims, render
from kimictl.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGIES = Path(__file__).parent / "topologies"
LANE = "/var/tmp/kimictl-vllm-venv/bin/python"
PROXY_SCRIPT = "/opt/vllm-ascend/examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py"
INV = """\
all:
  vars:
    kimi_cluster: {cluster}
    kimi_model_dir: /tmp/models/tiny
    kimi_model_source: local
    kimi_runtime: {runtime}
    kimi_engine_profile: {profile}
    kimi_engine_command: {command}
    kimi_nic: eth0
    kimi_proxy_script: {proxy_script}
  hosts:
    atlas-01: {{ansible_host: 10.200.0.11, kimi_hardware: atlas-800-a3}}
    atlas-02: {{ansible_host: 10.200.0.12, kimi_hardware: atlas-800-a3}}
"""


def _inv(tmp_path: Path, *, hosts: int = 2, cluster: str = "lane", runtime: str = "host",
         profile: str = "cpu-smoke", command: str = LANE, connector: str | None = None) -> Path:
    text = INV.format(cluster=cluster, runtime=runtime, profile=profile, command=command, proxy_script=PROXY_SCRIPT)
    if connector:
        text = text.replace("kimi_nic: eth0", f"kimi_nic: eth0\n    kimi_kv_connector: {connector}")
    if hosts == 1:
        text = "\n".join(ln for ln in text.splitlines() if "atlas-02" not in ln) + "\n"
    path = tmp_path / "inv.yml"
    path.write_text(text)
    return path


def _render(inv_path: Path, topology: str):
    inv = load_inventory(inv_path)
    topo = load_topology(topology)
    plan = make_plan(inv, topo)
    return plan, render(plan, inv, topo)


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_inventory_accepts_exactly_the_profiles_in_data() -> None:
    allowed = typing.get_args(ClusterSettings.model_fields["kimi_engine_profile"].annotation)
    assert sorted(allowed) == sorted(engine_profiles()) == ["ascend", "cpu-smoke"]
    assert ClusterSettings.model_fields["kimi_engine_profile"].default == "ascend"


def test_unknown_profile_is_an_inventory_error(tmp_path: Path) -> None:
    with pytest.raises(InventoryError) as exc:
        load_inventory(_inv(tmp_path, profile="cpu-smok"))
    assert any("kimi_engine_profile" in d and "cpu-smoke" in d for d in exc.value.details)


def test_colocated_renders_the_lane_command_without_ascend_parts(tmp_path: Path) -> None:
    plan, r = _render(_inv(tmp_path, hosts=1), str(TOPOLOGIES / "cpu-smoke-colocated.yml"))
    (e,) = r.engines
    assert e.argv[:5] == [LANE, "-m", "vllm.entrypoints.openai.api_server", "--model", "/tmp/models/tiny"]
    assert "serve" not in e.argv
    for flag in ("--enforce-eager", "--trust-remote-code", "--enable-expert-parallel"):
        assert flag in e.argv
    assert _flag(e.argv, "--gpu-memory-utilization") == "0.1"
    assert _flag(e.argv, "--served-model-name") == plan.served_model_name == "kimi-k2.5-tiny"
    for flag in ("--quantization", "--additional-config", "--kv-transfer-config"):
        assert flag not in e.argv
    assert sorted(e.env) == ["GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_HOST_IP"]
    # sandbox hosts share the machine's cores: vLLM must not pin every engine's threads to the cores it picks
    assert e.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert e.env_prepend == {}
    assert sorted(r.files["atlas-01"]) == ["engines/colocated-0-n0.env", "engines/colocated-0-n0.sh",
                                          "manifest.json"]
    assert plan.engine_profile == "cpu-smoke"
    fit = plan.fits["colocated"]
    assert fit.fits and fit.weights_total_gib < 0.01  # the tiny model's numbers, not Kimi K2.5's 489 GiB


def test_pd_moves_kv_with_nixl_over_the_hosts_nic_by_default(tmp_path: Path) -> None:
    plan, r = _render(_inv(tmp_path, cluster="lane-pd"), str(TOPOLOGIES / "cpu-smoke-pd.yml"))
    assert plan.kv_connector == "nixl"
    by_role = {e.role: e for e in r.engines}
    assert sorted(by_role) == ["decode", "prefill"]
    ips = {"prefill": "10.200.0.11", "decode": "10.200.0.12"}
    for role, kv_role, port in (("prefill", "kv_producer", 36000), ("decode", "kv_consumer", 36100)):
        e = by_role[role]
        # no engine_id: vLLM names the engine afresh at each start (a restarted prefill is a new peer)
        assert json.loads(_flag(e.argv, "--kv-transfer-config")) == {
            "kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu"}
        # UCX over TCP on the host's NIC; the side channel on the host's IP at the instance's port
        assert {k: e.env[k] for k in e.env if k.startswith(("UCX_", "VLLM_"))} == {
            "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0", "VLLM_HOST_IP": ips[role],
            "VLLM_NIXL_SIDE_CHANNEL_HOST": ips[role], "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        assert "PYTHONPATH" not in e.env
    for e in by_role.values():  # DP size 1: vLLM refuses --data-parallel-rank (external load balancing)
        assert "--data-parallel-rank" not in e.argv and _flag(e.argv, "--data-parallel-size") == "1"
    # preflight checks what the plan reserves: each side channel on its own host
    assert [(u.host, u.first, u.last) for u in plan.ports if "NIXL side channel" in u.what] == [
        ("atlas-01", 36000, 36000), ("atlas-02", 36100, 36100)]
    assert not [u for u in plan.ports if "kv_port range" in u.what]
    assert r.proxy is not None and [x["port"] for x in r.proxy.prefill + r.proxy.decode] == [7100, 7100]
    # the default router kind, vllm-ascend's own proxy: NIXL's kv_transfer_params hand-over is its own
    assert plan.proxy.router == "vllm-ascend-proxy" and r.proxy.argv[1] == PROXY_SCRIPT
    assert r.proxy.argv[2:10] == ["--prefiller-hosts", "10.200.0.11", "--prefiller-ports", "7100",
                                  "--decoder-hosts", "10.200.0.12", "--decoder-ports", "7100"]
    assert engine_shims(plan) == {}
    assert "--watch" not in r.files["atlas-01"]["proxy/proxy.sh"]  # NIXL's engine id travels with each request
    assert not [f for files in r.files.values() for f in files if "kimictl-kv" in files[f]]


def test_pd_with_mooncake_loads_the_cpu_shim_and_tells_the_router_the_bootstrap_port(tmp_path: Path) -> None:
    inv = _inv(tmp_path, cluster="lane-mc", connector="mooncake")
    plan, r = _render(inv, str(TOPOLOGIES / "cpu-smoke-pd.yml"))
    assert plan.kv_connector == "mooncake"
    by_role = {e.role: e for e in r.engines}
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        e = by_role[role]
        assert json.loads(_flag(e.argv, "--kv-transfer-config")) == {
            "kv_connector": "MooncakeConnector", "kv_role": kv_role,
            "kv_connector_module_path": "kimictl_mooncake_cpu",
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
        assert e.env["PYTHONPATH"] == "/var/lib/kimi/bin"  # where deploy ships the shim
        assert not [k for k in e.env if k.startswith(("UCX_", "VLLM_NIXL"))]
    # only prefill binds a fixed port (its bootstrap server); decode's Mooncake ports are random
    assert by_role["prefill"].env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == "36000"
    assert "VLLM_MOONCAKE_BOOTSTRAP_PORT" not in by_role["decode"].env
    # a transfer may take as long as the profile lets a completion take (a busy 2-core machine), on both sides
    wait = str(int(engine_profile("cpu-smoke").probe_timeout_s))
    for e in by_role.values():
        assert {e.env[k] for k in ("MC_TRANSFER_TIMEOUT", "MC_TCP_PROGRESS_TIMEOUT_SEC",
                                   "MC_TCP_STATUS_TIMEOUT_SEC")} == {wait}, e.env
    assert [(u.host, u.first) for u in plan.ports if "Mooncake bootstrap" in u.what] == [("atlas-01", 36000)]
    # vllm-ascend's proxy (the profile's default) does not speak it: the plan takes vllm-router and says why
    assert plan.proxy.router == "vllm-router" and "kimi_kv_connector mooncake" in plan.proxy.router_why
    argv = r.proxy.argv
    assert argv[argv.index("--kv-connector") + 1] == "mooncake"
    assert argv[argv.index("--prefill") + 1:argv.index("--prefill") + 3] == ["http://10.200.0.11:7100", "36000"]
    # the router learns prefill's engine id from the bootstrap server only at its start: the front watches it
    assert "--watch http://10.200.0.11:36000/query" in r.files["atlas-01"]["proxy/proxy.sh"]
    shims = engine_shims(plan)
    assert list(shims) == ["kimictl_mooncake_cpu.py"] and Path(shims["kimictl_mooncake_cpu.py"]).is_file()
    assert "kimictl.remote" not in shims["kimictl_mooncake_cpu.py"].replace("/", ".")


def test_mooncake_behind_a_router_that_cannot_speak_it_is_refused(tmp_path: Path) -> None:
    topo = tmp_path / "pd-ascend-proxy.yml"
    topo.write_text((TOPOLOGIES / "cpu-smoke-pd.yml").read_text().replace(
        "proxy: {port: 8000}", "proxy: {port: 8000, router: vllm-ascend-proxy}"))
    with pytest.raises(PlanError) as exc:
        _render(_inv(tmp_path, connector="mooncake"), str(topo))
    assert "kimi_kv_connector mooncake" in exc.value.message and "vllm-ascend-proxy" in exc.value.message
    assert exc.value.code == 2 and "vllm-router" in (exc.value.hint or "")
    plan, _ = _render(_inv(tmp_path, connector="nixl"), str(topo))  # NIXL is fine behind it
    assert plan.proxy.router == "vllm-ascend-proxy"


def test_a_connector_the_profile_lacks_is_refused_naming_the_key(tmp_path: Path) -> None:
    inv = _inv(tmp_path, connector="mooncak")
    with pytest.raises(InventoryError) as exc:
        load_inventory(inv)
    assert any("kimi_kv_connector" in d and "no connector 'mooncak'" in d and "nixl" in d for d in exc.value.details)
    prod = tmp_path / "a3-pd.yml"
    prod.write_text((ROOT / "inventories" / "a3-pd.yml").read_text().replace(
        "kimi_runtime: container", "kimi_runtime: container\n    kimi_kv_connector: nixl"))
    with pytest.raises(InventoryError) as exc:
        load_inventory(prod)
    assert any("kimi_kv_connector" in d and "MooncakeConnectorV1" in d for d in exc.value.details)


def test_a_production_preset_loses_only_its_ascend_parts(tmp_path: Path) -> None:
    inv = ROOT / "inventories" / "a3-pd.yml"
    text = inv.read_text().replace("kimi_runtime: container", "kimi_runtime: host\n    kimi_engine_profile: cpu-smoke\n"
                                   f"    kimi_proxy_script: {PROXY_SCRIPT}")
    path = tmp_path / "a3-pd-cpu.yml"
    path.write_text(text)
    # The preset's shape with TP4 prefill: the tiny model has 4 attention heads (TP8 is refused, as vLLM would).
    topo = tmp_path / "a3-pd-tp4.yml"
    topo.write_text((ROOT / "kimictl/data/topologies/a3-pd.yml").read_text().replace("    tp: 8", "    tp: 4"))
    with pytest.raises(PlanError, match=r"TP 8 does not divide the model's 4 attention heads.*use TP 1, 2 or 4"):
        _render(path, "a3-pd")
    plan, r = _render(path, str(topo))
    argv = r.engines[0].argv
    assert argv[:2] == ["python3", "-m"]  # the profile's default command
    assert "--quantization" not in argv and "--additional-config" not in argv
    assert _flag(argv, "--gpu-memory-utilization") == "0.1"  # the profile overrides the preset's 0.8
    assert "--data-parallel-rank" in argv  # DP2: external DP ranks stay
    assert any("--quantization ascend not rendered" in w for w in plan.warnings)
    assert any("switches fused_mc2" in w for w in plan.warnings)
    assert {d.state for d in plan.switches} <= {"skipped", "off"} and not any(d.spelled for d in plan.switches)
    env = r.engines[0].env
    assert not [k for k in env if k.startswith(("ASCEND_", "HCCL_IF", "HCCL_SOCKET", "HCCL_OP", "PYTORCH_NPU"))]
    assert env["HCCL_BUFFSIZE"] == "512"  # the topology's own env is the user's and stays
    assert r.engines[0].preload == [] and not [w for w in plan.warnings if "mlapo_keep_prefill_weights" in w]


def test_ascend_profile_spelled_out_renders_the_same_as_the_default(tmp_path: Path) -> None:
    inv = ROOT / "inventories" / "a3-pd.yml"
    path = tmp_path / "a3-pd-ascend.yml"
    path.write_text(inv.read_text().replace("kimi_runtime: container",
                                            "kimi_runtime: container\n    kimi_engine_profile: ascend"))
    plan, r = _render(path, "a3-pd")
    _, default = _render(inv, "a3-pd")
    assert r.files == default.files and r.contract() == default.contract()
    assert r.engines[0].argv[:3] == ["vllm", "serve", "/data/models/Kimi-K2.5-W4A8"]
    assert plan.engine_profile == "ascend"


def test_cpu_smoke_needs_host_runtime(tmp_path: Path) -> None:
    with pytest.raises(PlanError) as exc:
        _render(_inv(tmp_path, hosts=1, runtime="container"), str(TOPOLOGIES / "cpu-smoke-colocated.yml"))
    assert "kimi_runtime: host" in exc.value.message and exc.value.code == 2


def test_profile_data_is_complete() -> None:
    cpu = engine_profile("cpu-smoke")
    assert not cpu.ascend and cpu.runtime == "host" and cpu.min_ready_timeout_s >= 300
    assert list(cpu.kv_connectors) == ["nixl", "mooncake"]  # NIXL the default
    facts = cpu.facts()
    assert (facts.text.num_hidden_layers, facts.text.n_routed_experts, facts.text.vocab_size) == (2, 8, 512)
    assert facts.text.kv_lora_rank + facts.text.qk_rope_head_dim == 576  # MLA on vLLM CPU needs 512 + 64
    assert engine_profile(None).name == "ascend" and engine_profile("ascend").serve_args == ["serve", "{model_dir}"]


@pytest.mark.parametrize(("connector", "host", "port", "what"), [
    ("nixl", "atlas-01", 36000, "prefill-0 NIXL side channel"),
    ("nixl", "atlas-02", 36100, "decode-0 NIXL side channel"),
    ("mooncake", "atlas-01", 36000, "prefill-0 Mooncake bootstrap server"),
])
def test_preflight_refuses_a_taken_connector_port(tmp_path: Path, connector: str, host: str, port: int,
                                                  what: str) -> None:
    from kimictl.preflight import Probe, _host_checks, _Judge

    inv_path = _inv(tmp_path, connector=connector)
    plan, _ = _render(inv_path, str(TOPOLOGIES / "cpu-smoke-pd.yml"))
    inv = load_inventory(inv_path)

    def res003(listening: str) -> tuple[str, str]:
        j = _Judge(set())
        probe = Probe({"listen": (listening, 0), "ps": ("4242 4242", 0), "supervised": ("", 0)})
        _host_checks(j, inv, plan, inv.host(host), probe, 0, True)
        (r,) = [r for r in j.results if r.id == "RES-003"]
        return r.status, r.message

    line = f"LISTEN 0 100 10.200.0.11:{port} 0.0.0.0:* users:((\"python3\",pid=4242,fd=3))"
    assert res003(line) == ("fail", f"port {port} ({what}) in use by pid 4242")
    assert res003("")[0] == "pass"
    if connector == "mooncake":  # decode binds no fixed Mooncake port: nothing reserved there
        assert "36100" not in str([u for u in plan.ports if u.host == "atlas-02"])
