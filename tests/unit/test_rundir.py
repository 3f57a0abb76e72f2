"""Run directories (kimictl/rundir.py): what a run saves is the render its release is read back from; a missing or
damaged snapshot is one clear StateError naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kimictl import rundir, state
from kimictl.errors import StateError
from kimictl.inventory import load_inventory
from kimictl.plan import make_plan
from kimictl.render import render
from kimictl.topology import load_topology


def _rendered(tmp_path: Path):
    doc = {"all": {"vars": {"kimi_cluster": "rd-unit", "kimi_model_dir": "/data/models/Kimi-K2.5-W4A8",
                            "kimi_runtime": "host", "kimi_nic": "eth0",
                            "kimi_proxy_script": "/opt/vllm-ascend/examples/proxy.py"},
                   "hosts": {f"atlas-{i}": {"ansible_host": f"10.9.0.{i}", "kimi_hardware": "atlas-800-a3"}
                             for i in (1, 2)}}}
    (tmp_path / "inv.yml").write_text(yaml.safe_dump(doc))
    inv, topo = load_inventory(tmp_path / "inv.yml"), load_topology("a3-pd")
    return render(make_plan(inv, topo), inv, topo)


def _rec(run_dir: Path | None) -> state.ReleaseRecord:
    return state.ReleaseRecord(release="r1", run_dir=str(run_dir) if run_dir else None)


def test_a_saved_run_reads_back_as_its_render(tmp_path: Path) -> None:
    full = _rendered(tmp_path)
    run = tmp_path / "runs" / "r1"
    rundir.save_run(run, full, full, "name: eff\n")
    assert rundir.run_snapshot(_rec(run), "release") == full
    assert (run / "rendered").is_dir() and (run / "plan.json").is_file()
    assert rundir.run_topology(_rec(run)) == run / "topology.yml"
    rundir.save_run(tmp_path / "deploy", full, full)  # a deploy keeps no effective topology
    assert rundir.run_topology(_rec(tmp_path / "deploy")) is None and rundir.run_topology(_rec(None)) is None


def test_a_missing_or_damaged_snapshot_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(StateError, match=r"release r1 has no render snapshot \(.*rendered.json\)"):
        rundir.run_snapshot(_rec(tmp_path / "gone"), "release")
    with pytest.raises(StateError, match="has no render snapshot"):
        rundir.run_snapshot(_rec(None), "release")
    (tmp_path / "rendered.json").write_text('{"plan": 1}')
    with pytest.raises(StateError, match=rf"the render snapshot {tmp_path}/rendered.json of release r1 is damaged"):
        rundir.run_snapshot(_rec(tmp_path), "release")
