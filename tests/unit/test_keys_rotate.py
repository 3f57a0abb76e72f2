"""`kimictl keys rotate` (issue 34): a new admin key is installed on the proxy host through release.yml (a path in
its extravars, never the key), checked against the front (200, not 403), and only then kept as this control node's
copy; a failed check drops the copy so the next command reads back what the cluster holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from kimictl import keys_rotate
from kimictl.cluster_secrets import ADMIN_KEY, cluster_secret_path, keep_copy
from kimictl.errors import HostError, InvalidInput
from kimictl.hostops import HostOps
from kimictl.inventory import load_inventory
from kimictl.plan import make_plan
from kimictl.render import render
from kimictl.topology import load_topology

CLUSTER = "keys-unit"
OLD = "the-old-admin-key"


@pytest.fixture(autouse=True)
def _state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("KIMICTL_PROXY_ADMIN_KEY", raising=False)


def _setup(tmp_path: Path, topology: str = "a3-pd", **all_vars: Any):
    doc = {"all": {"vars": {"kimi_cluster": CLUSTER, "kimi_model_dir": "/data/models/Kimi-K2.5-W4A8",
                            "kimi_runtime": "host", "kimi_nic": "eth0",
                            "kimi_proxy_script": "/opt/vllm-ascend/examples/proxy.py", **all_vars},
                   "hosts": {f"atlas-{i:02d}": {"ansible_host": f"10.9.0.{10 + i}", "kimi_hardware": "atlas-800-a3"}
                             for i in (1, 2)}}}
    (tmp_path / "inv.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    inv = load_inventory(tmp_path / "inv.yml")
    topo = load_topology(topology)
    return inv, render(make_plan(inv, topo), inv, topo)


class Front:
    """kimictl's proxy front: its admin paths take only the key in its key file (it re-reads the file)."""

    def __init__(self, key: str, takes_new_keys: bool = True):
        self.key, self.takes_new_keys = key, takes_new_keys
        self.asked: list[tuple[str, str | None]] = []

    def http_get(self, url: str, timeout: float = 3.0, api_key: str | None = None) -> tuple[int, str]:
        self.asked.append((url, api_key))
        return (200, "{}") if api_key == self.key else (403, "router admin paths need the admin key")


def _ops(tmp_path: Path, inv, front: Front, fail: bool = False) -> HostOps:
    """The real HostOps with release.yml replaced by a record of its extravars; the front takes the key file it
    installs."""
    ops = HostOps(inv, "kimi", tmp_path / "run", say=lambda m: None, http=front)
    ops.runs = []

    def playbook(name: str, extravars: dict[str, Any], hosts: list[str]) -> None:
        ops.runs.append((name, json.loads(json.dumps(extravars)), hosts))
        if fail:
            raise HostError("playbook release.yml failed", host=hosts[0], step="Copy the admin key")
        if front.takes_new_keys:
            front.key = Path(extravars["admin_key_file"]).read_text().strip()

    ops.playbook = playbook
    ops.observe = lambda hosts=None: {}
    ops.close = lambda: None
    return ops


def test_rotate_installs_a_new_key_on_the_proxy_host_checks_it_and_keeps_it(tmp_path: Path) -> None:
    inv, rendered = _setup(tmp_path)
    keep_copy(CLUSTER, ADMIN_KEY, OLD, replace=True)
    front = Front(OLD)
    ops = _ops(tmp_path, inv, front)
    res = keys_rotate.rotate_admin_key(inv, rendered, lambda m: None, ops=ops, http=front)
    proxy = rendered.plan.proxy
    [(name, extravars, hosts)] = ops.runs
    assert (name, hosts) == ("release.yml", [proxy.host])   # the proxy host only
    new = front.key
    assert new != OLD and len(new) >= 40
    assert new not in json.dumps(extravars) and extravars["admin_key_file"].endswith("secrets/proxy-admin-key.new")
    assert extravars["hosts"] == {proxy.host: {"release": rendered.releases[proxy.host],
                                               "bundle": str(tmp_path / "run" / "bundles" / f"{proxy.host}.tar.gz")}}
    assert (tmp_path / "run" / "rendered" / proxy.host).is_dir()   # the release's own files, were it missing there
    copy = cluster_secret_path(CLUSTER, ADMIN_KEY.name)
    assert copy.read_text() == new + "\n" and copy.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in copy.parent.iterdir()) == ["proxy-admin-key"]   # no pending file left
    # router copy 0's own health path (vllm-ascend's proxy: /healthcheck; it has no /health)
    assert front.asked == [(f"http://{proxy.ip}:{proxy.port}/kimictl/router/0/healthcheck", new)]
    assert res.to_json() == {"schema_version": 1, "cluster": CLUSTER, "rotated": ["admin"], "proxy_host": proxy.host,
                             "check": {"path": "/kimictl/router/0/healthcheck", "code": 200},
                             "run_dir": str(tmp_path / "run")}


@pytest.mark.parametrize("fail", ["check", "playbook"])
def test_a_rotation_that_is_not_taken_drops_the_copy(tmp_path: Path, fail: str) -> None:
    inv, rendered = _setup(tmp_path)
    keep_copy(CLUSTER, ADMIN_KEY, OLD, replace=True)
    front = Front(OLD, takes_new_keys=False)
    ops = _ops(tmp_path, inv, front, fail=fail == "playbook")
    with pytest.raises(HostError) as exc:
        keys_rotate.rotate_admin_key(inv, rendered, lambda m: None, ops=ops, http=front, check_timeout=0)
    assert exc.value.host == rendered.plan.proxy.host
    if fail == "check":
        assert exc.value.step == "keys check" and "with HTTP 403, not 200" in exc.value.message
    # the cluster may hold either key now: no copy, so the next command reads back the one it holds
    assert not any(cluster_secret_path(CLUSTER, ADMIN_KEY.name).parent.iterdir())


def test_rotate_refuses_a_supplied_key_and_a_cluster_without_a_front(tmp_path: Path, monkeypatch) -> None:
    inv, rendered = _setup(tmp_path)
    monkeypatch.setenv("KIMICTL_PROXY_ADMIN_KEY", "from-ci")
    with pytest.raises(InvalidInput, match="supplied by KIMICTL_PROXY_ADMIN_KEY") as exc:
        keys_rotate.rotate_admin_key(inv, rendered, lambda m: None, ops=_ops(tmp_path, inv, Front(OLD)))
    assert "kimictl deploy" in exc.value.hint
    monkeypatch.delenv("KIMICTL_PROXY_ADMIN_KEY")
    inv, rendered = _setup(tmp_path, topology="a3-colocated")
    with pytest.raises(InvalidInput, match="no proxy front with an admin key"):
        keys_rotate.check_rotatable(inv, rendered)


def test_the_cli_holds_the_lease_and_prints_json(tmp_path: Path, monkeypatch) -> None:
    import contextlib

    from kimictl import deployed, lease
    from kimictl.cli.main import app

    _, rendered = _setup(tmp_path)
    monkeypatch.setattr(deployed, "current_deployment",
                        lambda cluster, inv=None, accept_new_keys=False: type("D", (), {"rendered": rendered})())
    held: list[str] = []

    @contextlib.contextmanager
    def fake_held(inv_, command, **_kw):
        held.append(command)
        yield

    def fake_rotate(inv_, rendered_, say, **_kw):
        assert held == ["keys rotate"]   # inside the lease
        return keys_rotate.RotateResult(CLUSTER, rendered_.plan.proxy.host, "/runs/x", 200)

    monkeypatch.setattr(lease, "held", fake_held)
    monkeypatch.setattr(keys_rotate, "rotate_admin_key", fake_rotate)
    out = CliRunner().invoke(app, ["keys", "rotate", "-i", str(tmp_path / "inv.yml"), "--yes", "--output", "json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["rotated"] == ["admin"] and held == ["keys rotate"]
