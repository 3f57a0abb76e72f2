"""What a host reports is data, checked before use (issue 27): `supervisor.py status` and `current` (observe, for
stop, deploy, rollout) and the current release start reads. A host whose report holds something kimictl never
wrote is refused by name, with the value shown as data."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kimictl.errors import HostError
from kimictl.hostops import observe
from kimictl.inventory import load_inventory
from kimictl.lifecycle import checked_current
from kimictl.plan import make_plan
from kimictl.render import render
from kimictl.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
JINJA = "x{{ lookup('pipe', 'id') }}"


class FakeSessions:
    """Sessions whose every host answers the observe probe with `stdout[host]`."""

    def __init__(self, stdout: dict[str, str]):
        self.stdout = stdout

    def __call__(self, inv, **_kw):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def each(self, fn):
        return {h: fn(h, SimpleNamespace(run=lambda cmd, timeout, h=h: SimpleNamespace(stdout=self.stdout[h])))
                for h in self.stdout}


def _status(records, current="releases/0123456789abcdef") -> str:
    return json.dumps(records) + "\n@@current\n" + (f"/var/lib/kimi/{current}\n" if current else "")


@pytest.fixture
def inv():
    return load_inventory(ROOT / "inventories/a3-pd.yml")


def _observe(inv, report: str):
    hosts = [h.name for h in inv.hosts]
    stdout = {h: _status([{"name": "decode-0-dp0", "state": "running", "tag": "ab", "cmd": ["bash", "/r/e.sh"]}])
              for h in hosts}
    stdout[hosts[1]] = report
    return hosts[1], observe(inv, connect=FakeSessions(stdout))


def test_observe_reads_what_the_supervisor_reports(inv):
    host, got = _observe(inv, _status([{"name": "proxy", "state": "running", "tag": "0a1b", "cmd": ["bash", "/p"]},
                                       {"name": "prefill-0-dp1", "state": "unreadable"}]))
    assert set(got[host].states) == {"proxy", "prefill-0-dp1"} and got[host].current == "0123456789abcdef"
    assert _observe(inv, _status([], current=None))[1][host].current is None
    assert _observe(inv, "Traceback (most recent call last):\n@@current\n")[1][host].states == {}


@pytest.mark.parametrize(("report", "shown"), [
    (_status([{"name": JINJA, "state": "running"}]), JINJA),
    (_status([{"name": "../../etc/x", "state": "running"}]), "../../etc/x"),
    (_status([{"state": "running"}]), "None"),
    (_status({"decode-0": {"state": "running"}}), "decode-0"),
    (_status([{"name": "d0", "state": "running", "cmd": f"bash {JINJA}"}]), JINJA),
    (_status([{"name": "d0", "state": "running", "cmd": ["bash", 7]}]), "7"),
    (_status([{"name": "d0", "state": "running", "tag": ["x"]}]), "['x']"),
    (_status([], current=f"releases/{JINJA}"), JINJA),
    (_status([], current="releases/r1\"\nx"), "r1"),
], ids=["jinja-id", "path-id", "no-id", "not-a-list", "cmd-string", "cmd-int", "tag-list", "jinja-current",
        "quote-current"])
def test_observe_refuses_a_host_whose_report_kimictl_never_wrote(inv, report, shown):
    with pytest.raises(HostError) as err:
        _observe(inv, report)
    assert err.value.host == inv.hosts[1].name and err.value.step == "observe"
    assert shown in err.value.message and "\n" not in err.value.render()


def _current(name: str) -> dict:
    inv = load_inventory(ROOT / f"inventories/{name}.yml")
    topo = load_topology(name)
    rendered = render(make_plan(inv, topo), inv, topo)
    return {h: {"release": rendered.releases[h], "manifest": json.loads(files["manifest.json"]),
                "files": {k: v for k, v in files.items() if k.startswith(("engines/", "proxy/"))}}
            for h, files in rendered.files.items()}


@pytest.mark.parametrize("name", ["a3-pd", "a2-pd", "a3-colocated"])
def test_every_release_kimictl_renders_passes_the_check(name):
    for host, cur in _current(name).items():
        assert checked_current(host, cur) is cur
    assert checked_current("h", None) is None


def _bad(cur: dict, what: str) -> dict:
    cur = json.loads(json.dumps(cur))
    man = cur["manifest"]
    e = man["engines"][0]
    if what == "release":
        cur["release"] = JINJA
    elif what == "id":
        e["id"] = JINJA
    elif what == "command":
        e["command"] = ["bash", f"engines/{JINJA}.sh"]
    elif what == "elsewhere":
        e["command"] = ["bash", "/tmp/x.sh"]
    elif what == "port":
        e["port"] = "8000"
    elif what == "proxy":
        man["proxy"] = {**(man.get("proxy") or {}), "command": ["sh", "-c", JINJA], "port": 8000}
    elif what == "files":
        cur["files"] = {"engines/x.sh": 1}
    elif what == "engines":
        man["engines"] = JINJA
    return cur


@pytest.mark.parametrize("what", ["release", "id", "command", "elsewhere", "port", "proxy", "files", "engines"])
def test_start_refuses_a_current_release_kimictl_never_installed(what):
    host, cur = next((h, c) for h, c in _current("a3-pd").items() if c["manifest"]["engines"])
    with pytest.raises(HostError) as err:
        checked_current(host, _bad(cur, what))
    assert err.value.host == host and err.value.step == "read current" and "\n" not in err.value.render()
