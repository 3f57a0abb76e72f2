"""`kimictl topology import` on recipes written here in the upstream schema (the real ones: test_recipe_parity)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from kimictl.cli.main import app
from kimictl.errors import InvalidInput
from kimictl.recipe import import_recipe
from kimictl.topology import load_topology

COMMON_ARGS = ["--host", "0.0.0.0", "--port", "$SERVER_PORT", "--data-parallel-size", "${DP_SIZE}",
               "--data-parallel-rank", "${DP_RANK}", "--data-parallel-address", "${DP_ADDRESS}",
               "--data-parallel-rpc-port", "${DP_RPC_PORT}", "--tensor-parallel-size", "${TP_SIZE}",
               "--enable-expert-parallel", "--seed", "1024", "--max-model-len", "32768", "--trust-remote-code"]


def _kv(role: str, port: str, engine: str) -> str:
    return json.dumps({"kv_connector": "MooncakeConnectorV1", "kv_role": role, "kv_port": port, "engine_id": engine,
                       "kv_connector_extra_config": {"use_ascend_direct": True, "prefill": {"dp_size": 2, "tp_size": 8},
                                                     "decode": {"dp_size": 32, "tp_size": 1}}})


def _recipe() -> dict[str, Any]:
    """2P1D on four A3 nodes: P DP2xTP8 per node, D DP32xTP1 over nodes 2-3."""
    def node(i: int, dp: int, local: int, start: int, tp: int, master: int) -> dict[str, Any]:
        return {"node_index": i, "port_start": 7100, "dp_rpc_port": 12321, "dp_size": dp, "dp_size_local": local,
                "dp_rank_start": start, "tp_size": tp, "dp_address": f"${{NODE_{master}_IP}}"}

    env = {"SERVER_PORT": "${PORT}", "VLLM_RPC_TIMEOUT": "3600000", "OMP_NUM_THREADS": "1",
           "ASCEND_RT_VISIBLE_DEVICES": "${VISIBLE_DEVICES}", "VLLM_USE_MODELSCOPE": "true"}
    prefill = {"envs": {**env, "HCCL_BUFFSIZE": "512", "VLLM_ASCEND_ENABLE_FLASHCOMM1": "1",
                        "VLLM_ASCEND_ENABLE_MLAPO": "1"},
               "server_cmd_template": [*COMMON_ARGS, "--max-num-batched-tokens", "8192", "--enforce-eager",
                                       "--gpu-memory-utilization", "0.8", "--allowed-local-media-path", "/",
                                       "--speculative-config", '{"method": "eagle3", "model": "lightseekorg/'
                                       'kimi-k2.5-eagle3", "num_speculative_tokens": 1}',
                                       "--kv-transfer-config", "KV"]}
    decode = {"envs": {**env, "HCCL_BUFFSIZE": "1800", "VLLM_ASCEND_ENABLE_MLAPO": "1"},
              "server_cmd_template": [*COMMON_ARGS, "--max-num-batched-tokens", "256", "--gpu-memory-utilization",
                                      "0.95", "--compilation-config", '{"cudagraph_mode": "FULL_DECODE_ONLY"}',
                                      "--additional-config", '{"recompute_scheduler_enable": true, '
                                      '"lmhead_tensor_parallel_size": 16, "enable_prefill_mc2": true}',
                                      "--speculative-config", '{"method": "eagle3", "model": "lightseekorg/'
                                      'kimi-k2.5-eagle3", "num_speculative_tokens": 3}',
                                      "--kv-transfer-config", "KV"]}
    templates = []
    for i, (base, role, port, engine) in enumerate([(prefill, "kv_producer", "30000", "0"),
                                                    (prefill, "kv_producer", "30100", "1"),
                                                    (decode, "kv_consumer", "30200", "2"),
                                                    (decode, "kv_consumer", "30200", "2")]):
        t = copy.deepcopy(base)
        t["node_index"] = i
        t["server_cmd_template"][-1] = _kv(role, port, engine)
        templates.append(t)
    return {"test_name": "synthetic 2P1D", "model": "Eco-Tech/Kimi-K2.5-W4A8", "num_nodes": 4, "npu_per_node": 16,
            "routing": {"type": "disaggregated_prefill", "groups": {"prefiller": [0, 1], "decoder": [2, 3]}},
            "config": [node(0, 2, 2, 0, 8, 0), node(1, 2, 2, 0, 8, 1), node(2, 32, 16, 0, 1, 2),
                       node(3, 32, 16, 16, 1, 2)],
            "templates": templates, "benchmarks": {"perf": {"case_type": "performance"}}}


def _write(tmp_path: Path, doc: dict[str, Any], name: str = "Synthetic-2P1D.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_maps_roles_instances_switches_and_flags(tmp_path: Path) -> None:
    r = import_recipe(_write(tmp_path, _recipe()))
    t = r.topology
    assert (t["name"], t["hardware"], t["share"], t["ports"]) == (
        "synthetic-2p1d", "atlas-800-a3", {"prefill": 2, "decode": 1}, {"http_base": 7100, "rpc": 12321})
    p, d = t["roles"]["prefill"], t["roles"]["decode"]
    assert (p["nodes"], p["dp"], p["tp"], d["nodes"], d["dp"], d["tp"]) == (1, 2, 8, 2, 32, 1)
    assert p["switches"] == {"flashcomm1": True}  # MLAPO on prefill: vllm-ascend ignores it there
    assert d["switches"] == {"mlapo": True, "recompute_scheduler": True}
    assert d["serve"]["additional-config"] == {"enable_prefill_mc2": True}  # read by 0.23, passed through
    assert (p["env"], d["env"]) == ({"HCCL_BUFFSIZE": "512"}, {"HCCL_BUFFSIZE": "1800"})
    assert t["serve"] == {"enable-expert-parallel": True, "seed": 1024, "max-model-len": 32768,
                          "trust-remote-code": True}
    assert p["serve"]["gpu-memory-utilization"] == 0.8 and d["serve"]["max-num-batched-tokens"] == 256
    assert d["serve"]["compilation-config"] == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    assert t["speculative"] == {"method": "eagle3", "model_id": "lightseekorg/kimi-k2.5-eagle3",
                                "num_speculative_tokens": {"prefill": 1, "decode": 3}}
    assert "env" not in t  # VLLM_RPC_TIMEOUT and OMP_NUM_THREADS equal the version profile's
    ids = {dv.id for dv in r.deviations}
    assert {"kv-port", "engine-id", "media-path", "api-key", "model-path", "draft-path", "use-ascend-direct",
            "switch-spelling", "switch-not-for-role", "unread-additional-config", "harness-env"} <= ids
    assert "lmhead_tensor_parallel_size not rendered" in next(dv.detail for dv in r.deviations
                                                             if dv.id == "unread-additional-config")
    assert [u.where for u in r.unmapped] == ["benchmarks", "routing"]
    # the file is a topology kimictl loads
    out = tmp_path / "t.yml"
    out.write_text(r.yaml())
    assert load_topology(str(out)).roles["decode"].dp == 32


def test_scheduler_config_spelling_and_unread_keys_for_0_30(tmp_path: Path) -> None:
    doc = _recipe()
    for t in doc["templates"][2:]:
        i = t["server_cmd_template"].index("--additional-config")
        t["server_cmd_template"][i + 1] = json.dumps({"scheduler_config": {"recompute_scheduler_enable": True,
                                                                           "dyntra_lb_config": {"enabled": True}},
                                                      "enable_mlapo": True, "weight_prefetch_config": {}})
    r = import_recipe(_write(tmp_path, doc), version="0.30.0rc2")
    d = r.topology["roles"]["decode"]
    assert d["switches"] == {"mlapo": True, "recompute_scheduler": True}
    assert d["serve"]["additional-config"] == {"scheduler_config": {"dyntra_lb_config": {"enabled": True}}}
    assert r.version == "0.30.0rc2"
    assert any("weight_prefetch_config not rendered" in dv.detail for dv in r.deviations)


def test_unmapped_items_are_listed(tmp_path: Path) -> None:
    doc = _recipe()
    doc["special_dependencies"] = {"mooncake": "x"}
    for t in doc["templates"]:
        t["envs"]["MY_HARNESS"] = "${WORKSPACE}/x"
        t["server_cmd_template"] += ["--api-key", "s3cret"]
    r = import_recipe(_write(tmp_path, doc))
    got = {(u.where, u.what) for u in r.unmapped}
    assert ("special_dependencies", "not read") in got
    assert ("templates[0].envs.MY_HARNESS", "${WORKSPACE}/x") in got
    assert ("templates[0]: --api-key", "(a key)") in got
    assert "s3cret" not in r.yaml() and "s3cret" not in json.dumps(r.model_dump())


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d["routing"].update(type="generic_dp"), "only disaggregated_prefill"),
    (lambda d: d.update(npu_per_node=4), "npu_per_node 4 matches no Atlas host"),
    (lambda d: d["config"][3].update(dp_rank_start=0), "does not continue instance 2's ranks"),
    (lambda d: d["config"][1].update(dp_address="10.0.0.1"), "kimictl needs ${NODE_<i>_IP}"),
    (lambda d: d["config"][0].update(cp_size=2), "cp_size is 2; kimictl plans DP x TP only"),
    (lambda d: d["config"][1].update(port_start=7200), "port_start [7100, 7200]"),
    (lambda d: d["templates"][1]["envs"].update(HCCL_BUFFSIZE="1024"), "templates[0] and templates[1] (both "
                                                                       "prefill) differ in env"),
    (lambda d: d["templates"][0]["server_cmd_template"].__setitem__(-1, _kv("kv_producer", "1", "0").replace(
        "MooncakeConnectorV1", "MooncakeLayerwiseConnector")), "kimictl renders MooncakeConnectorV1"),
    (lambda d: d.pop("templates"), "missing templates"),
])
def test_refuses_what_has_no_kimictl_equivalent(tmp_path: Path, mutate, message: str) -> None:
    doc = _recipe()
    mutate(doc)
    with pytest.raises(InvalidInput) as err:
        import_recipe(_write(tmp_path, doc))
    assert message in err.value.render()


def test_cli_prints_topology_and_report(tmp_path: Path) -> None:
    path = _write(tmp_path, _recipe())
    runner = CliRunner()
    r = runner.invoke(app, ["topology", "import", str(path)])
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(r.stdout)["roles"]["decode"]["dp"] == 32
    assert "kimi_model_id: Eco-Tech/Kimi-K2.5-W4A8" in r.stderr and "routing: the CI proxy" in r.stderr
    out = tmp_path / "imported.yml"
    r = runner.invoke(app, ["topology", "import", str(path), "--out", str(out), "--name", "mine"])
    assert r.exit_code == 0 and f"wrote {out}: topology mine" in r.stdout
    assert load_topology(str(out)).name == "mine"
    assert out.read_text().startswith("# Imported by `kimictl topology import` from Synthetic-2P1D.yaml")
    r = runner.invoke(app, ["topology", "import", str(path), "--output", "json"])
    doc = json.loads(r.stdout)
    assert doc["hosts"] == 4 and doc["topology"]["roles"]["prefill"]["dp"] == 2 and doc["out"] is None
    assert {d["id"] for d in doc["deviations"]} >= {"kv-port", "media-path"} and doc["unmapped"]
    bad = _write(tmp_path, {**_recipe(), "routing": {"type": "generic_dp", "groups": {"worker": [0]}}}, "bad.yaml")
    r = runner.invoke(app, ["topology", "import", str(bad), "--output", "json"])
    assert r.exit_code == 2 and json.loads(r.stdout)["error"]["code"] == 2 and "Traceback" not in r.output
