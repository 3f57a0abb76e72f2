"""Version profiles against each release's own source: kimictl renders only the additional-config keys and the
vllm-ascend env vars that release reads (its ascend_config.py / envs.py and the package, parsed with ast)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from upstream_sdist import PINS, source_keys

from kimictl.facts import switch_rules, version_key, version_profile
from kimictl.inventory import load_inventory
from kimictl.plan import make_plan
from kimictl.render import render
from kimictl.topology import load_topology, preset_names

ROOT = Path(__file__).resolve().parents[2]
RELEASES = sorted(PINS["sdists"])


def _namespace() -> set[str]:
    """Env vars that belong to vllm-ascend: read by any pinned release, or spelled VLLM_ASCEND_*."""
    return set().union(*(source_keys(r).env for r in RELEASES))


@pytest.mark.parametrize("release", RELEASES)
def test_profile_key_lists_are_the_source_s(release: str) -> None:
    """additional_config_keys, scheduler_config_keys and strictness equal what the release's source reads."""
    src, prof = source_keys(release), version_profile(PINS["sdists"][release]["profile"])
    assert prof.upstream == release
    assert sorted(prof.additional_config_keys or []) == sorted(src.additional_config)
    assert sorted(prof.scheduler_config_keys or []) == sorted(src.scheduler_config)
    assert prof.strict_additional_config == src.strict


@pytest.mark.parametrize("release", RELEASES)
def test_switch_spellings_are_read(release: str) -> None:
    src, prof = source_keys(release), version_profile(PINS["sdists"][release]["profile"])
    for name, sp in prof.switches.items():
        if sp.env:
            assert sp.env in src.env, f"{release}: switch {name} spelled env {sp.env}, which it does not read"
        else:
            top, _, sub = sp.additional_config.partition(".")  # type: ignore[union-attr]
            assert top in src.additional_config, f"{release}: switch {name}: {top} is not read"
            assert not sub or sub in src.scheduler_config, f"{release}: switch {name}: {sp.additional_config}"
    missing = {n for n, rule in switch_rules().items() if n not in prof.switches and not rule.unavailable_note}
    assert not missing, f"{release}: switches without a spelling: {missing}"


@pytest.mark.parametrize("release", RELEASES)
def test_removed_env_is_complete_and_true(release: str) -> None:
    """Every vllm-ascend env var an older pinned release reads and this one does not is in removed_env (a plan
    refuses it), and nothing in removed_env is read by it."""
    src, prof = source_keys(release), version_profile(PINS["sdists"][release]["profile"])
    older = set().union(set(), *(source_keys(r).env for r in RELEASES
                                 if version_key(r) < version_key(release)))
    gone = {e for e in older - src.env if e.startswith(("VLLM_ASCEND_", "MSMONITOR_"))}
    assert gone <= set(prof.removed_env), f"{release}: not in removed_env: {sorted(gone - set(prof.removed_env))}"
    assert not set(prof.removed_env) & src.env, f"{release}: removed_env lists env vars it reads"


def _renders(release: str, tmp_path: Path) -> list[tuple[str, str, dict[str, Any], dict[str, str]]]:
    """(preset, engine, additional-config, env) of every preset rendered for the release, drafts on."""
    import json

    out = []
    for preset in preset_names():
        text = (ROOT / "inventories" / f"{preset}.yml").read_text()
        inv_doc = yaml.safe_load(text)
        inv_doc["all"]["vars"].update({"kimi_vllm_ascend_version": release, "kimi_draft_model_dir": "/data/draft"})
        path = tmp_path / f"{preset}-{release}.yml"
        path.write_text(yaml.safe_dump(inv_doc))
        inv, topo = load_inventory(path), load_topology(preset)
        for e in render(make_plan(inv, topo), inv, topo).engines:
            extra = json.loads(e.argv[e.argv.index("--additional-config") + 1]) if "--additional-config" in e.argv \
                else {}
            out.append((preset, e.id, extra, e.env))
    return out


@pytest.mark.parametrize("release", RELEASES)
def test_renders_use_only_what_the_release_reads(release: str, tmp_path: Path) -> None:
    """Every preset rendered for the release: its --additional-config keys and vllm-ascend env vars are read by
    that release's source (0.28+ would refuse an unknown key at start-up; a stale env var is silently ignored)."""
    src, namespace = source_keys(release), _namespace()
    renders = _renders(release, tmp_path)
    assert len(renders) >= 40
    for preset, engine, extra, env in renders:
        for key, value in extra.items():
            assert key in src.additional_config, f"{release} {preset}/{engine}: additional-config {key}"
            if key == "scheduler_config":
                assert set(value) <= src.scheduler_config, f"{release} {preset}/{engine}: scheduler_config {value}"
        for name in env:
            if name in namespace or name.startswith("VLLM_ASCEND_"):
                assert name in src.env, f"{release} {preset}/{engine}: env {name} is not read"


def test_0_30_decode_renders_the_mlapo_mitigation(tmp_path: Path) -> None:
    """On 0.30.0rc2 the a3-pd decode gets mlapo_keep_prefill_weights and nested scheduler keys, read by its source."""
    renders = {(p, e): x for p, e, x, _ in _renders("0.30.0rc2", tmp_path)}
    dec = renders[("a3-pd", "decode-0-dp0")]
    assert dec["mlapo_keep_prefill_weights"] is True and dec["enable_mlapo"] is True
    assert dec["scheduler_config"] == {"recompute_scheduler_enable": True}
    assert "recompute_scheduler_enable" not in dec
    assert "mlapo_keep_prefill_weights" in source_keys("0.30.0rc2").additional_config
