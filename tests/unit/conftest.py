"""Shared unit-test fixtures."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml


def write_yaml(path: Path, data: Any) -> Path:
    """Write python data as a block-style YAML file (keys in insertion order)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False, default_flow_style=False))
    return path


@pytest.fixture
def inventory_factory(tmp_path: Path) -> Callable[..., Path]:
    """`inventory_factory(data, name="inventory.yml")` writes `data` as YAML under tmp_path, returns the path.

    Also fine for topology files: `inventory_factory(topo_dict, name="topo.yml")`.
    """

    def make(data: Any, name: str = "inventory.yml") -> Path:
        return write_yaml(tmp_path / name, data)

    return make


@pytest.fixture(scope="session")
def host_python() -> str:
    """The interpreter that runs host-side code in tests: KIMICTL_HOST_PYTHON (scripts/test.sh sets it to the host
    Python floor's, kimictl.HOST_PYTHON_FLOOR, for a second pass over the host-side tests), else this one."""
    return os.environ.get("KIMICTL_HOST_PYTHON") or sys.executable


@pytest.fixture(autouse=True)
def _key_read_back_reaches_no_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit tests reach no host: a cluster key this control node has no copy of is read back (kimictl/key_readback.py)
    from hosts that answer they hold none; a test whose hosts hold keys sets its own (fake_sessions.held_keys)."""
    from fake_sessions import held_keys

    monkeypatch.setattr("kimictl.key_readback.Sessions", held_keys({}))


EMPTY_RECORD = '{"releases": null, "current": null, "snapshots": {}, "skipped": []}'


@pytest.fixture(autouse=True)
def record_hosts_hold_no_record(monkeypatch) -> None:
    """The cluster's record hosts (kimictl/cluster_record.py) answer, holding no release record: no unit test reaches
    a real host when a command reads the record back. Tests of the read-back replace this with their own hosts."""
    from fake_sessions import fake_sessions

    monkeypatch.setattr("kimictl.cluster_record.Sessions", fake_sessions(lambda _host, _cmd: EMPTY_RECORD))
