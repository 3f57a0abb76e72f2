"""CLI through typer's runner: exit codes, JSON on stdout only, no tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from kimictl.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def _run(*args: str):
    return runner.invoke(app, list(args))


def test_topologies_lists_presets() -> None:
    r = _run("topologies", "--output", "json")
    assert r.exit_code == 0
    names = [t["name"] for t in json.loads(r.stdout)["topologies"]]
    assert names == ["a2-colocated", "a2-pd", "a3-colocated", "a3-pd", "a3-pd-2p1d"]


def test_validate_ok_and_json() -> None:
    r = _run("validate", "-i", str(ROOT / "inventories/a3-pd.yml"), "--topology", "a3-pd", "--output", "json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["valid"] is True and doc["engines"] == 6


def test_plan_text_and_json() -> None:
    r = _run("plan", "-i", str(ROOT / "inventories/a3-pd.yml"), "--topology", "a3-pd")
    assert r.exit_code == 0, r.output
    assert "prefill-0" in r.stdout and "estimate" in r.stdout and "enable_fused_mc2" in r.stdout
    j = json.loads(_run("plan", "-i", str(ROOT / "inventories/a3-pd.yml"), "-t", "a3-pd", "-o", "json").stdout)
    assert j["schema_version"] == 1 and j["fits"]["decode"]["fits"] is True


def test_plan_shows_the_2p1d_decode_instance_over_two_hosts() -> None:
    """kimictl plan -i <4 x A3> --topology a3-pd-2p1d: 2 prefill instances, one 32-rank decode over two hosts."""
    r = _run("plan", "-i", str(ROOT / "inventories/a3-pd-2p1d.yml"), "--topology", "a3-pd-2p1d")
    assert r.exit_code == 0, r.output
    assert "a3-node-03 (ranks 0-15), a3-node-04 (ranks 16-31)" in r.stdout and "32 x 1" in r.stdout
    doc = json.loads(_run("plan", "-i", str(ROOT / "inventories/a3-pd-2p1d.yml"), "--topology", "a3-pd-2p1d",
                          "--output", "json").stdout)
    assert [(i["name"], len(i["hosts"]), i["dp"], i["tp"], i["ep"]) for i in doc["instances"]] == [
        ("prefill-0", 1, 2, 8, 16), ("prefill-1", 1, 2, 8, 16), ("decode-0", 2, 32, 1, 32)]
    decode = [e for e in doc["engines"] if e["role"] == "decode"]
    assert len(decode) == 32 and {e["dp_ranks"][0] for e in decode if e["host"] == "a3-node-04"} == set(range(16, 32))


def test_render_writes_out_dir(tmp_path: Path) -> None:
    r = _run("render", "-i", str(ROOT / "inventories/a3-pd.yml"), "--topology", "a3-pd", "--out", str(tmp_path),
             "--output", "json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert json.loads((tmp_path / "render.json").read_text()) == doc
    assert (tmp_path / "a3-node-02" / "engines" / "decode-0-dp3.sh").stat().st_mode & 0o111


def test_invalid_input_exits_2_with_json_error(tmp_path: Path) -> None:
    r = _run("plan", "-i", str(ROOT / "inventories/a2-colocated.yml"), "--topology", "a3-pd", "--output", "json")
    assert r.exit_code == 2
    err = json.loads(r.stdout)["error"]
    assert err["code"] == 2 and "atlas-800-a3" in err["message"]
    assert "Traceback" not in r.output


def test_missing_inventory_file_is_exit_2() -> None:
    r = _run("validate", "-i", "/nonexistent/inv.yml", "--topology", "a3-pd")
    assert r.exit_code == 2
    assert "inventory not found: /nonexistent/inv.yml" in r.output


def test_schema_commands() -> None:
    inv = json.loads(_run("schema", "inventory").stdout)
    assert "kimi_device_ips" in inv["host_vars"]["properties"] and inv["keys"]["kimi_cluster"]["scope"] == "cluster"
    topo = json.loads(_run("schema", "topology").stdout)
    assert "roles" in topo["properties"]


def test_help_does_not_import_heavy_modules() -> None:
    code = ("import sys; from kimictl.cli.main import app; "
            "heavy = [m for m in ('rich.table', 'jinja2', 'ansible_runner', 'paramiko', 'kimictl.plan', "
            "'kimictl.render', 'yaml', 'prometheus_client') if m in sys.modules]; print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
