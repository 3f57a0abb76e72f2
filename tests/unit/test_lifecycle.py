"""Stop/start pieces without hosts: stop order, tags and commands of the current release equal deploy's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimictl.hostops import desired_procs, process_tag
from kimictl.inventory import load_inventory
from kimictl.lifecycle import current_procs, stop_plan
from kimictl.plan import make_plan
from kimictl.render import render
from kimictl.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("inventory", "topology"), [("a3-pd", "a3-pd"), ("a2-pd", "a2-pd"),
                                                     ("a3-colocated", "a3-colocated")])
def test_current_release_procs_equal_what_deploy_started(inventory: str, topology: str) -> None:
    """start rebuilds each process from the host's release files; a tag mismatch would restart everything."""
    inv = load_inventory(ROOT / f"inventories/{inventory}.yml")
    topo = load_topology(topology)
    rendered = render(make_plan(inv, topo), inv, topo)
    current = {h: {"release": rendered.releases[h], "manifest": json.loads(files["manifest.json"]),
                   "files": {k: v for k, v in files.items() if k.startswith(("engines/", "proxy/"))}}
               for h, files in rendered.files.items()}
    want = sorted(desired_procs(rendered, inv), key=lambda p: (p.host, p.id))
    got = sorted(current_procs(inv, current), key=lambda p: (p.host, p.id))
    assert got == want


def test_process_tag_hashes_only_that_processes_files() -> None:
    files = {"engines/p-0.env": "A=1\n", "engines/p-0.sh": "run\n", "engines/p-1.sh": "other\n",
             "proxy/proxy.sh": "router\n"}
    base = process_tag(files, "p-0")
    assert process_tag({**files, "engines/p-1.sh": "changed\n"}, "p-0") == base
    assert process_tag({**files, "engines/p-0.env": "A=2\n"}, "p-0") != base
    assert process_tag(files, "proxy") != process_tag({**files, "proxy/proxy.sh": "x\n"}, "proxy")


def test_stop_goes_proxy_then_decode_then_prefill_and_skips_stopped() -> None:
    run, stopped = {"state": "running"}, {"state": "stopped"}
    states = {
        "a1": {"proxy": run, "prefill-0-dp0": run, "prefill-0-dp1": {"state": "backoff"}, "old": {"state": "dead"}},
        "a2": {"decode-0-dp0": run, "decode-0-dp1": stopped, "decode-0-dp2": {"state": "failed"}},
        "a3": {"prefill-1-dp0": stopped},
    }
    assert stop_plan(states) == [
        {"a1": ["proxy"]},
        {"a2": ["decode-0-dp0"]},
        {"a1": ["old", "prefill-0-dp0", "prefill-0-dp1"]},
    ]
    assert stop_plan({"a1": {"proxy": stopped}, "a2": {}}) == []
