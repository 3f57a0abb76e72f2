"""Renderer: golden files per preset, determinism, contract shape, quoting, version profiles."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from kimictl.inventory import load_inventory
from kimictl.plan import make_plan
from kimictl.render import argv_lines, render, write_rendered
from kimictl.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
PRESETS = ["a3-pd", "a2-pd", "a3-colocated", "a2-colocated"]


def _render(preset: str, inventory: Path | None = None):
    inv = load_inventory(inventory or ROOT / "inventories" / f"{preset}.yml")
    topo = load_topology(preset)
    return render(make_plan(inv, topo), inv, topo)


@pytest.mark.parametrize("preset", PRESETS)
def test_golden_files(preset: str, tmp_path: Path) -> None:
    """Rendered files equal the reviewed golden copies (KIMICTL_UPDATE_GOLDEN=1 rewrites them; review the diff)."""
    write_rendered(_render(preset), tmp_path)
    got = {p.relative_to(tmp_path).as_posix(): p.read_text() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    gold_dir = GOLDEN / preset
    if os.environ.get("KIMICTL_UPDATE_GOLDEN") == "1":
        for rel, text in got.items():
            (gold_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            (gold_dir / rel).write_text(text)
    want = {p.relative_to(gold_dir).as_posix(): p.read_text() for p in sorted(gold_dir.rglob("*")) if p.is_file()}
    assert sorted(got) == sorted(want)
    for rel in want:
        assert got[rel] == want[rel], f"{preset}/{rel} differs from the golden copy"


@pytest.mark.parametrize("preset", PRESETS)
def test_render_is_deterministic(preset: str) -> None:
    a, b = _render(preset), _render(preset)
    assert a.files == b.files
    assert a.contract() == b.contract()


def test_a3_pd_contract_shape() -> None:
    doc = _render("a3-pd").contract()
    assert doc["schema_version"] == 1
    assert doc["vllm_ascend_version"] == "0.23.0"
    prefill = [e for e in doc["engines"] if e["role"] == "prefill"]
    decode = [e for e in doc["engines"] if e["role"] == "decode"]
    assert len(prefill) == 2 and {e["host"] for e in prefill} == {"a3-node-01"}
    assert len(decode) == 4 and {e["host"] for e in decode} == {"a3-node-02"}
    assert all((e["dp_size"], e["tp_size"]) == (2, 8) for e in prefill)
    assert all((e["dp_size"], e["tp_size"]) == (4, 4) for e in decode)
    for e in doc["engines"]:
        argv = e["argv"]
        assert argv[:3] == ["vllm", "serve", "/data/models/Kimi-K2.5-W4A8"]
        assert "--enable-expert-parallel" in argv
        assert argv[argv.index("--quantization") + 1] == "ascend"
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == "MooncakeConnectorV1"
        assert kv["kv_role"] == ("kv_producer" if e["role"] == "prefill" else "kv_consumer")
        assert kv["kv_connector_extra_config"] == {"prefill": {"dp_size": 2, "tp_size": 8},
                                                   "decode": {"dp_size": 4, "tp_size": 4}}
        assert int(kv["kv_port"]) >= 36000
        assert argv[argv.index("--data-parallel-rank") + 1] == str(e["dp_ranks"][0])
        assert e["env"]["ASCEND_RT_VISIBLE_DEVICES"] == ",".join(map(str, e["devices"]))
        for item in argv:  # JSON-valued flags are single argv items holding valid JSON
            if item.startswith("{"):
                json.loads(item)
    proxy = doc["proxy"]
    assert len(proxy["prefill"]) == 2 and len(proxy["decode"]) == 4
    assert {(p["host"], p["port"]) for p in proxy["prefill"]} == {("192.168.10.11", 7100), ("192.168.10.11", 7101)}


def test_role_switches_follow_references() -> None:
    """MLAPO and recompute on decode only, FlashComm1 on prefill only, fused MC2 on A3 only, eager prefill."""
    doc = _render("a3-pd").contract()
    for e in doc["engines"]:
        argv = e["argv"]
        extra = json.loads(argv[argv.index("--additional-config") + 1])
        assert extra["enable_fused_mc2"] == 1
        if e["role"] == "prefill":
            assert extra["enable_flashcomm1"] is True and extra["enable_mlapo"] is False
            assert "recompute_scheduler_enable" not in extra
            assert "--enforce-eager" in argv and "--compilation-config" not in argv
        else:
            assert extra["enable_mlapo"] is True and extra["recompute_scheduler_enable"] is True
            assert "enable_flashcomm1" not in extra
            comp = json.loads(argv[argv.index("--compilation-config") + 1])
            assert comp["cudagraph_mode"] == "FULL_DECODE_ONLY" and "--enforce-eager" not in argv
    a2 = _render("a2-pd").contract()
    for e in a2["engines"]:
        assert "enable_fused_mc2" not in e["argv"][e["argv"].index("--additional-config") + 1]
        assert not any(k.startswith("VLLM_ASCEND_ENABLE_FUSED") for k in e["env"])


def test_version_0_18_uses_env_switches(tmp_path: Path) -> None:
    text = (ROOT / "inventories" / "a3-pd.yml").read_text().replace('"0.23.0"', '"0.18.0"')
    inv_path = tmp_path / "inv.yml"
    inv_path.write_text(text)
    doc = _render("a3-pd", inv_path).contract()
    assert doc["vllm_ascend_version"] == "0.18.0"
    dec = next(e for e in doc["engines"] if e["role"] == "decode")
    pre = next(e for e in doc["engines"] if e["role"] == "prefill")
    assert dec["env"]["VLLM_ASCEND_ENABLE_MLAPO"] == "1" and pre["env"]["VLLM_ASCEND_ENABLE_MLAPO"] == "0"
    assert pre["env"]["VLLM_ASCEND_ENABLE_FLASHCOMM1"] == "1" and pre["env"]["VLLM_ASCEND_ENABLE_FUSED_MC2"] == "1"
    assert dec["env"]["ASCEND_BUFFER_POOL"] == "4:8"
    extra = json.loads(dec["argv"][dec["argv"].index("--additional-config") + 1])
    assert extra == {"recompute_scheduler_enable": True, "multistream_overlap_shared_expert": False}


def test_speculative_only_with_draft_dir(tmp_path: Path) -> None:
    assert not any("--speculative-config" in e["argv"] for e in _render("a3-pd").contract()["engines"])
    text = (ROOT / "inventories" / "a3-pd.yml").read_text().replace(
        "    kimi_runtime: container", "    kimi_runtime: container\n    kimi_draft_model_dir: /data/models/eagle3")
    inv_path = tmp_path / "inv.yml"
    inv_path.write_text(text)
    for e in _render("a3-pd", inv_path).contract()["engines"]:
        spec = json.loads(e["argv"][e["argv"].index("--speculative-config") + 1])
        assert spec == {"method": "eagle3", "model": "/data/models/eagle3",
                        "num_speculative_tokens": 1 if e["role"] == "prefill" else 3}


def test_internal_dp_headless_worker() -> None:
    doc = _render("a2-colocated").contract()
    n0, n1 = doc["engines"]
    assert n0["serves_http"] and not n1["serves_http"]
    assert "--headless" not in n0["argv"] and "--headless" in n1["argv"]
    assert n1["argv"][n1["argv"].index("--data-parallel-start-rank") + 1] == "1"
    for e in (n0, n1):
        assert e["argv"][e["argv"].index("--data-parallel-address") + 1] == "192.168.20.11"
        assert e["argv"][e["argv"].index("--data-parallel-size-local") + 1] == "1"
    assert doc["proxy"] is None


def test_launch_script_runs_the_exact_argv(tmp_path: Path) -> None:
    """The rendered script, executed by bash, passes every argv item through unchanged (quoting is safe)."""
    r = _render("a3-pd")
    write_rendered(r, tmp_path)
    eng = r.engines[0]
    script = tmp_path / eng.host / "engines" / f"{eng.id}.sh"
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "vllm").write_text('#!/usr/bin/env python3\nimport json, os, sys\n'
                                   'print(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ)}))\n')
    (fake_bin / "vllm").chmod(0o755)
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True,
                         env={"PATH": f"{fake_bin}:/usr/bin:/bin", "LD_LIBRARY_PATH": "/opt/x"})
    seen = json.loads(out.stdout)
    assert seen["argv"] == eng.argv[1:]
    for key, value in eng.env.items():
        assert seen["env"][key] == value
    assert seen["env"]["LD_LIBRARY_PATH"] == eng.env_prepend["LD_LIBRARY_PATH"] + ":/opt/x"


def test_argv_lines_quotes_hostile_values() -> None:
    argv = ["vllm", "serve", "/m", "--x", "a b; rm -rf /", "--y", "$(reboot)", "--j", '{"k":"v w"}']
    line = argv_lines(argv).replace("\\\n", " ")
    assert shlex.split(line) == argv


def test_proxy_front_with_api_key_renders_the_key_path_never_the_key(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("sk-never-rendered\n")
    key.chmod(0o600)
    text = (ROOT / "inventories" / "a3-pd.yml").read_text().replace(
        "  vars:\n", f"  vars:\n    kimi_api_key_file: {key}\n", 1)
    inv_path = tmp_path / "inv.yml"
    inv_path.write_text(text)
    r = _render("a3-pd", inv_path)
    script = r.files["a3-node-01"]["proxy/proxy.sh"]
    argv = shlex.split(script.split("exec ", 1)[1].replace("\\\n", " "))
    front, router = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    assert front[:3] == ["python3", "/var/lib/kimi/bin/proxy_front.py", "run"]
    assert front[front.index("--api-key-file") + 1] == "/var/lib/kimi/secrets/proxy-api-key"
    assert front[front.index("--admin-key-file") + 1] == "/var/lib/kimi/secrets/proxy-admin-key"
    assert [front[i + 1] for i, a in enumerate(front) if a == "--router"] == ["8001:8002", "8003:8004"]
    # Each copy gets its loopback --host/--port from the front; the rendered router command carries none.
    assert router[:4] == ["bash", "./router.container.sh", "python3", "/vllm-workspace/vllm-ascend/examples/"
                          "disaggregated_prefill_v1/load_balance_proxy_server_example.py"]
    assert "--port" not in router and "--host" not in router
    assert r.contract()["proxy"]["api_key"] is True
    assert json.loads(r.files["a3-node-01"]["manifest.json"])["proxy"]["routers"] == 2
    assert not any("sk-never-rendered" in t for files in r.files.values() for t in files.values())
    assert "sk-never-rendered" not in r.model_dump_json()


def test_router_ports_follow_the_proxy_port_and_collisions_are_named(tmp_path: Path) -> None:
    from kimictl.errors import PlanError
    from kimictl.topology import Proxy

    inv = load_inventory(ROOT / "inventories" / "a3-pd.yml")
    topo = load_topology("a3-pd")
    moved = topo.model_copy(update={"proxy": Proxy(port=9000, routers=3)})
    assert [(p.port, p.metrics_port) for p in make_plan(inv, moved).proxy.routers] == [(9001, 9002), (9003, 9004),
                                                                                      (9005, 9006)]
    clash = topo.model_copy(update={"proxy": Proxy(port=9000, router_port_base=7101)})
    with pytest.raises(PlanError, match=r"P/D router\(s\) behind the proxy \(ports 7101-7104\) collides with"):
        make_plan(inv, clash)


def test_front_limits_come_from_the_topology_and_the_front_accepts_them() -> None:
    import importlib.util

    from kimictl.topology import Proxy

    inv = load_inventory(ROOT / "inventories" / "a3-pd.yml")
    topo = load_topology("a3-pd")
    tuned = topo.model_copy(update={"proxy": Proxy(max_connections=4096, max_body_mib=16, header_timeout_s=5,
                                                   io_timeout_s=60, idle_timeout_s=20)})
    script = render(make_plan(inv, tuned), inv, tuned).files["a3-node-01"]["proxy/proxy.sh"]
    argv = shlex.split(script.split("exec ", 1)[1].replace("\\\n", " "))
    spec = importlib.util.spec_from_file_location("proxy_front_parser", ROOT / "kimictl" / "remote" / "proxy_front.py")
    front = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(front)
    args = front.parser().parse_args(argv[2:argv.index("--")])  # the front's own parser: no flag it does not know
    assert (args.max_connections, args.max_body, args.header_timeout, args.io_timeout, args.idle_timeout) == (
        4096, 16 * 2**20, 5.0, 60.0, 20.0)
    assert args.admin_key_file == "/var/lib/kimi/secrets/proxy-admin-key" and args.api_key_file is None
