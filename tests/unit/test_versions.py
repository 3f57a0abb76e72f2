"""Version profiles and models as data: names, defaults, per-version spellings, the planner's version rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kimictl.errors import InvalidInput, InventoryError, PlanError
from kimictl.facts import find_model, model_facts, newest_version, version_key, version_profile
from kimictl.inventory import load_inventory
from kimictl.plan import make_plan
from kimictl.render import render
from kimictl.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]


def _inv(tmp_path: Path, preset: str = "a3-pd", **cluster: Any) -> Path:
    doc = yaml.safe_load((ROOT / "inventories" / f"{preset}.yml").read_text())
    doc["all"]["vars"].update(cluster)
    path = tmp_path / f"{preset}-inv.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _topo(tmp_path: Path, base: str = "a3-pd", **roles: dict[str, Any]) -> Path:
    """A copy of a preset with per-role overrides merged into roles.<role> (dicts merged one level deep)."""
    doc = yaml.safe_load((ROOT / "kimictl" / "data" / "topologies" / f"{base}.yml").read_text())
    for role, over in roles.items():
        for key, value in over.items():
            cur = doc["roles"][role].get(key)
            doc["roles"][role][key] = {**cur, **value} if isinstance(cur, dict) and isinstance(value, dict) else value
    path = tmp_path / "topo.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _plan(tmp_path: Path, topo: str | Path = "a3-pd", inventory: str = "a3-pd", **cluster: Any):
    inv = load_inventory(_inv(tmp_path, inventory, **cluster))
    t = load_topology(str(topo))
    return make_plan(inv, t), inv, t


def _extra(plan, inv, topo, role: str) -> dict[str, Any]:
    e = next(e for e in render(plan, inv, topo).engines if e.role == role)
    return json.loads(e.argv[e.argv.index("--additional-config") + 1])


def test_version_names_and_default() -> None:
    assert version_key("0.26.0rc1") < version_key("0.26.0") < version_key("0.26.0.post1") < version_key("0.28.0rc1")
    assert newest_version() == "0.23.0"  # release candidates are opt-in
    for name, want in [("0.23.0", "0.23.0"), ("0.23.0.post1", "0.23.0"), ("v0.23.0.post1", "0.23.0"),
                       ("0.23", "0.23.0"), ("0.30.0rc2", "0.30.0rc2"), ("v0.28.0rc1", "0.28.0rc1"),
                       ("0.26", "0.26.0rc1"), ("0.18", "0.18.0")]:
        assert version_profile(name).version == want, name
    with pytest.raises(InvalidInput, match=r"'0\.26\.0'; supported: 0\.18\.0, 0\.23\.0\.post1, 0\.26\.0rc1"):
        version_profile("0.26.0")


def test_inventory_takes_upstream_version_strings(tmp_path: Path) -> None:
    assert load_inventory(_inv(tmp_path, kimi_vllm_ascend_version="0.23.0.post1")).cluster.kimi_vllm_ascend_version
    with pytest.raises(InventoryError) as err:
        load_inventory(_inv(tmp_path, kimi_vllm_ascend_version="0.26.0"))
    assert "0.26.0rc1" in err.value.render()


def test_scheduler_keys_nest_from_0_26(tmp_path: Path) -> None:
    for version, nested in [("0.23.0", False), ("0.26.0rc1", True), ("0.30.0rc2", True)]:
        plan, inv, topo = _plan(tmp_path, kimi_vllm_ascend_version=version)
        dec = _extra(plan, inv, topo, "decode")
        if nested:
            assert dec["scheduler_config"] == {"recompute_scheduler_enable": True} and \
                "recompute_scheduler_enable" not in dec
        else:
            assert dec["recompute_scheduler_enable"] is True and "scheduler_config" not in dec


def test_mlapo_keep_prefill_weights_from_0_28_warning_before(tmp_path: Path) -> None:
    plan, inv, topo = _plan(tmp_path, kimi_vllm_ascend_version="0.28.0rc1")
    assert _extra(plan, inv, topo, "decode")["mlapo_keep_prefill_weights"] is True
    assert "mlapo_keep_prefill_weights" not in _extra(plan, inv, topo, "prefill")
    auto = next(s for s in plan.switches if s.switch == "mlapo_keep_prefill_weights")
    assert auto.state == "on" and "max-num-batched-tokens 128 <= 1024" in auto.note
    old, inv, topo = _plan(tmp_path, kimi_vllm_ascend_version="0.23.0")
    assert "mlapo_keep_prefill_weights" not in _extra(old, inv, topo, "decode")
    [warn] = [w for w in old.warnings if "#11882" in w]
    assert warn.startswith("decode: ") and "max-num-batched-tokens > 1024" in warn and "mlapo: false" in warn


@pytest.mark.parametrize("override", [{"switches": {"mlapo": False}}, {"serve": {"max-num-batched-tokens": 2048}}])
def test_mlapo_mitigation_only_where_weights_are_freed(tmp_path: Path, override: dict[str, Any]) -> None:
    topo = _topo(tmp_path, decode=override)
    new, inv, t = _plan(tmp_path, topo, kimi_vllm_ascend_version="0.30.0rc2")
    assert "mlapo_keep_prefill_weights" not in _extra(new, inv, t, "decode")
    old, _, _ = _plan(tmp_path, topo, kimi_vllm_ascend_version="0.23.0")
    assert not [w for w in old.warnings if "#11882" in w]


def test_unknown_additional_config_key_warns_then_fails_from_0_28(tmp_path: Path) -> None:
    topo = _topo(tmp_path, decode={"serve": {"additional-config": {"enable_mlapoo": True}}})
    plan, _, _ = _plan(tmp_path, topo, kimi_vllm_ascend_version="0.23.0")
    assert any("enable_mlapoo is not read by vllm-ascend 0.23.0 (did you mean 'enable_mlapo'?)" in w
               for w in plan.warnings)
    with pytest.raises(PlanError, match=r"enable_mlapoo is not read by vllm-ascend 0\.28\.0rc1.*refuses unknown keys"):
        _plan(tmp_path, topo, kimi_vllm_ascend_version="0.28.0rc1")
    nested = _topo(tmp_path, decode={"serve": {"additional-config": {"scheduler_config": {"dyntra_lb_config": {}}}}})
    assert _plan(tmp_path, nested, kimi_vllm_ascend_version="0.30.0rc2")[0]  # a 0.28+ scheduler key
    with pytest.raises(PlanError, match=r"scheduler_config\.dyntra_lb_cfg is not read"):
        _plan(tmp_path, _topo(tmp_path, decode={"serve": {"additional-config": {
            "scheduler_config": {"dyntra_lb_cfg": {}}}}}), kimi_vllm_ascend_version="0.30.0rc2")
    with pytest.raises(PlanError, match=r"lmhead_tensor_parallel_size is not valid.*finegrained_tp_config"):
        _plan(tmp_path, _topo(tmp_path, decode={"serve": {"additional-config": {"lmhead_tensor_parallel_size": 16}}}))


def test_stale_switch_env_refused_from_0_28(tmp_path: Path) -> None:
    topo = _topo(tmp_path, prefill={"env": {"VLLM_ASCEND_ENABLE_FUSED_MC2": "1"}})
    assert _plan(tmp_path, topo, kimi_vllm_ascend_version="0.23.0")[0]
    with pytest.raises(PlanError, match=r"VLLM_ASCEND_ENABLE_FUSED_MC2 is not valid for vllm-ascend 0\.28\.0rc1.*"
                                        r"use the switch fused_mc2"):
        _plan(tmp_path, topo, kimi_vllm_ascend_version="0.28.0rc1")


def test_fused_mc2_with_a_small_hccl_buffer_warns(tmp_path: Path) -> None:
    assert not [w for w in _plan(tmp_path)[0].warnings if "HCCL_BUFFSIZE" in w]
    plan, _, _ = _plan(tmp_path, _topo(tmp_path, prefill={"env": {"HCCL_BUFFSIZE": "256"}}))
    assert "prefill: switch fused_mc2 with HCCL_BUFFSIZE 256; every upstream recipe running it uses >= 512 MiB" \
        in plan.warnings


def test_shared_expert_dp_switch(tmp_path: Path) -> None:
    plan, inv, topo = _plan(tmp_path, _topo(tmp_path, prefill={"switches": {"shared_expert_dp": True}}))
    assert _extra(plan, inv, topo, "prefill")["enable_shared_expert_dp"] is True
    skipped, _, _ = _plan(tmp_path, _topo(tmp_path, "a3-pd-2p1d", decode={"switches": {"shared_expert_dp": True}}),
                          inventory="a3-pd-2p1d")
    assert "decode: switch shared_expert_dp skipped (TP 1 < 2)" in skipped.warnings


def test_prefetch_dropped_where_unverified(tmp_path: Path) -> None:
    plan, inv, topo = _plan(tmp_path, kimi_vllm_ascend_version="0.18.0")
    assert "prefill: --safetensors-load-strategy prefetch not rendered (vllm-ascend 0.18.0's vLLM does not " \
           "take it)" in plan.warnings
    assert all("--safetensors-load-strategy" not in e.argv for e in render(plan, inv, topo).engines)
    plan, inv, topo = _plan(tmp_path)
    assert all(e.argv[e.argv.index("--safetensors-load-strategy") + 1] == "prefetch"
               for e in render(plan, inv, topo).engines)


def test_jemalloc_preloaded_only_when_present(tmp_path: Path) -> None:
    plan, inv, topo = _plan(tmp_path)
    r = render(plan, inv, topo)
    e = r.engines[0]
    assert e.preload == ["/usr/lib/aarch64-linux-gnu/libjemalloc.so.2"]
    script = r.files[e.host][f"engines/{e.id}.sh"]
    assert 'if [ -e /usr/lib/aarch64-linux-gnu/libjemalloc.so.2 ]; then export ' \
           'LD_PRELOAD=/usr/lib/aarch64-linux-gnu/libjemalloc.so.2"${LD_PRELOAD:+:${LD_PRELOAD}}"; fi' in script
    assert script.index("LD_PRELOAD") < script.index("exec ")


def test_models_chosen_by_kimi_model_id(tmp_path: Path) -> None:
    assert find_model("eco-tech/kimi-k2.6-W4A8").served_model_name == "kimi-k2.6"  # type: ignore[union-attr]
    k27 = model_facts("kimi-k2.7-w4a8")
    assert k27.model_id == "Eco-Tech/Kimi-K2.7-Code-w4a8" and k27.parts == model_facts().parts  # inherits K2.5
    plan, inv, topo = _plan(tmp_path, kimi_model_id="Eco-Tech/Kimi-K2.7-Code-w4a8")
    assert plan.served_model_name == "kimi-k2.7" and not [w for w in plan.warnings if "model facts" in w]
    argv = render(plan, inv, topo).engines[0].argv
    assert argv[argv.index("--served-model-name") + 1] == "kimi-k2.7"
    odd, _, _ = _plan(tmp_path, kimi_model_id="acme/kimi-k25-mirror")
    assert odd.served_model_name == "kimi-k2.5"
    assert any("kimi_model_id acme/kimi-k25-mirror has no model facts" in w for w in odd.warnings)


def test_dflash_drafter(tmp_path: Path) -> None:
    doc = yaml.safe_load((ROOT / "kimictl/data/topologies/a3-pd.yml").read_text())
    doc["speculative"] = {"method": "dflash", "model_id": "z-lab/Kimi-K2.5-DFlash",
                          "num_speculative_tokens": {"prefill": 1, "decode": 15}}
    path = tmp_path / "dflash.yml"
    path.write_text(yaml.safe_dump(doc))
    plan, inv, topo = _plan(tmp_path, path, kimi_model_id="Eco-Tech/Kimi-K2.6-w4a8", kimi_draft_model_dir="/d")
    assert plan.fits["decode"].draft_gib == model_facts().drafts["dflash"]
    dec = next(e for e in render(plan, inv, topo).engines if e.role == "decode")
    assert json.loads(dec.argv[dec.argv.index("--speculative-config") + 1]) == {
        "method": "dflash", "model": "/d", "num_speculative_tokens": 15}


def test_profile_messages_are_whole() -> None:
    """A ' #' inside a plain YAML scalar starts a comment and silently cuts the message short."""
    from kimictl.facts import version_profiles

    for prof in version_profiles().values():
        for key, why in {**prof.removed_env, **prof.removed_additional_config}.items():
            assert why.count("(") == why.count(")") and not why.endswith((",", "(")), (prof.version, key, why)
