"""Bundle and tail selection without hosts: tar layout, 0600 and atomic write, redaction before writing."""

from __future__ import annotations

import json
import re
import stat
import tarfile
from pathlib import Path

import pytest
from fake_sessions import fake_sessions
from typer.testing import CliRunner

from kimictl import logs
from kimictl.inventory import load_inventory
from kimictl.logs import MASK, Redactor, build_bundle, select, write_tarball

ROOT = Path(__file__).resolve().parents[2]
PLANTED = "hf_plantedUnitTest0123456789abcdefXY"
API = "unit-api-key-value-123"


def _fake_hosts(inv):
    def collect(_inv, _cap, timeout=300.0):
        out = {}
        for h in _inv.hosts:
            out[h.name] = {"files": {
                "npu-smi-info.txt": "| 0 Ascend910 | OK |\n",
                "hccn/npu00-link.txt": "link status: UP\n",
                "logs/prefill-0-dp0.log": f"start\nHF_TOKEN={PLANTED}\nbare {PLANTED}\nready\n",
                "logs/prefill-0-dp0.log.1": f"vllm serve /m --api-key {API} --port 8000\n",
                "release/manifest.json": json.dumps({"release": "r1", "engines": []}),
                "release/engines/prefill-0-dp0.env": f"HF_TOKEN='{PLANTED}'\nVLLM_USE_V1='1'\n",
                "run/prefill-0-dp0.json": json.dumps({"cmd": ["bash", "x.sh"], "state": "running"}),
            }, "meta": {"current": "r1", "errors": []}}
        return out
    return collect


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def _control(state_dir: Path, cluster: str) -> None:
    base = state_dir / cluster
    (base / "runs" / "20261202T100000Z-aaaa").mkdir(parents=True)
    (base / "runs" / "20261202T110000Z-bbbb").mkdir(parents=True)
    (base / "runs" / "20261202T120000Z-stop").mkdir(parents=True)  # no plan.json: not a deploy run
    (base / "runs" / "20261202T100000Z-aaaa" / "plan.json").write_text('{"old": true}')
    (base / "runs" / "20261202T110000Z-bbbb" / "plan.json").write_text(
        json.dumps({"new": True, "env": {"HF_TOKEN": PLANTED}}))
    (base / "releases.jsonl").write_text('{"release": "r1", "result": "deployed"}\n')
    (base / "current.json").write_text('{"release": "r1"}')
    (base / "preflight.json").write_text('{"summary": {"error": 0}}')
    (base / "weights-manifest.json").write_text('{"files": []}')


def test_bundle_layout_mode_and_no_secret(tmp_path: Path, state_dir: Path, monkeypatch) -> None:
    inv = load_inventory(ROOT / "inventories/a3-pd.yml")
    cluster = inv.cluster.name
    _control(state_dir, cluster)
    monkeypatch.setattr(logs, "collect_host_files", _fake_hosts(inv))
    dest = tmp_path / "out" / "diag.tar.gz"
    dest.parent.mkdir()
    res = build_bundle(inv, dest, Redactor.with_literals([API]))
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600
    assert [p.name for p in dest.parent.iterdir()] == ["diag.tar.gz"]  # no temp file left behind
    with tarfile.open(dest) as tar:
        names = tar.getnames()
        texts = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers()}
    for h in inv.hosts:
        for rel in ("npu-smi-info.txt", "hccn/npu00-link.txt", "logs/prefill-0-dp0.log", "logs/prefill-0-dp0.log.1",
                    "release/manifest.json", "release/engines/prefill-0-dp0.env", "run/prefill-0-dp0.json",
                    "host.json"):
            assert f"{cluster}/{h.name}/{rel}" in names
    assert json.loads(texts[f"{cluster}/_control-node/plan.json"])["new"] is True
    assert f"{cluster}/_control-node/releases.jsonl" in names and f"{cluster}/_control-node/current.json" in names
    for rel in ("preflight.json", "weights-manifest.json"):   # preflight and weights-verify results travel too
        assert f"{cluster}/_control-node/{rel}" in names
    assert all(n.startswith(f"{cluster}/") for n in names)
    blob = "\n".join(texts.values())
    assert PLANTED not in blob and API not in blob
    assert res.redactions == blob.count(MASK) and res.files == len(names)
    index = json.loads(texts[f"{cluster}/bundle.json"])
    assert index["hosts"] == {h.name: "ok" for h in inv.hosts} and index["redactions"] == res.redactions


def test_bundle_fails_if_redaction_is_skipped(tmp_path: Path, state_dir: Path, monkeypatch) -> None:
    """Guards the guard: with a no-op redactor the planted token does reach the tarball."""
    inv = load_inventory(ROOT / "inventories/a3-pd.yml")
    monkeypatch.setattr(logs, "collect_host_files", _fake_hosts(inv))

    class NoRedaction(Redactor):
        def redact(self, text: str) -> str:
            return text

    dest = tmp_path / "raw.tar.gz"
    build_bundle(inv, dest, NoRedaction())
    with tarfile.open(dest) as tar:
        blob = b"".join(tar.extractfile(m).read() for m in tar.getmembers())
    assert PLANTED.encode() in blob


def test_unreachable_host_is_recorded_not_fatal(tmp_path: Path, state_dir: Path, monkeypatch) -> None:
    from kimictl.ssh import SSHError

    inv = load_inventory(ROOT / "inventories/a3-pd.yml")
    good = _fake_hosts(inv)

    def collect(_inv, cap, timeout=300.0):
        out = good(_inv, cap)
        out[inv.hosts[1].name] = SSHError("cannot reach 10.0.0.2:22: No route to host")
        return out

    monkeypatch.setattr(logs, "collect_host_files", collect)
    res = build_bundle(inv, tmp_path / "b.tar.gz", Redactor())
    assert res.hosts[inv.hosts[0].name] == "ok" and "No route" in res.hosts[inv.hosts[1].name]
    with tarfile.open(tmp_path / "b.tar.gz") as tar:
        assert f"{inv.cluster.name}/{inv.hosts[1].name}/ERROR.txt" in tar.getnames()


def test_write_tarball_replaces_atomically(tmp_path: Path) -> None:
    dest = tmp_path / "b.tar.gz"
    dest.write_text("old")
    dest.chmod(0o644)
    write_tarball(dest, {"c/h/a.txt": "x"})
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600
    with tarfile.open(dest) as tar:
        assert tar.getnames() == ["c/h/a.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.tar.gz"]


def test_select_uses_the_manifest_then_supervisor_states() -> None:
    found = {
        "a1": {"sd": "/s", "manifest": {"engines": [{"id": "prefill-0-dp0", "role": "prefill"},
                                                    {"id": "prefill-0-dp1", "role": "prefill"}],
                                        "proxy": {"port": 8000}}, "states": ["prefill-0-dp0", "old-x"]},
        "a2": {"sd": "/t", "manifest": None, "states": ["decode-0-dp0", "decode-0-dp1"]},
    }
    assert [(t.host, t.id, t.role, t.path) for t in select(found, None, None)] == [
        ("a1", "prefill-0-dp0", "prefill", "/s/logs/prefill-0-dp0.log"),
        ("a1", "prefill-0-dp1", "prefill", "/s/logs/prefill-0-dp1.log"), ("a1", "proxy", "proxy", "/s/logs/proxy.log"),
        ("a2", "decode-0-dp0", "decode", "/t/logs/decode-0-dp0.log"),
        ("a2", "decode-0-dp1", "decode", "/t/logs/decode-0-dp1.log")]
    assert [t.id for t in select(found, ["decode", "proxy"], None)] == ["proxy", "decode-0-dp0", "decode-0-dp1"]
    assert [t.id for t in select(found, None, ["prefill-0-dp1"])] == ["prefill-0-dp1"]


def test_cli_rejects_filters_with_bundle_and_bad_secrets_file(tmp_path: Path) -> None:
    import typer

    from kimictl.cli.logs import logs as logs_cmd

    app = typer.Typer()
    app.command()(logs_cmd)
    app.command()(lambda: None)  # two commands: invoke by name like the real CLI
    inv = str(ROOT / "inventories/a3-pd.yml")
    r = CliRunner().invoke(app, ["logs", "-i", inv, "--bundle", str(tmp_path / "b.tgz"), "--role", "decode"])
    assert r.exit_code == 2 and "--bundle" in r.output
    r = CliRunner().invoke(app, ["logs", "-i", inv, "--secrets-file", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "secrets-file" in r.output
    r = CliRunner().invoke(app, ["logs", "-i", inv, "--role", "router"])
    assert r.exit_code == 2


HOSTILE = {
    "../../etc/cron.d/x": "* * * * * root sh -c 'pwned'\n",
    "logs/../../../../etc/passwd": "root::0:0::/root:/bin/sh\n",
    "/etc/shadow": "root:x\n",
    "logs/..": "dot-dot\n",
    "logs/.hidden.log": "hidden\n",
    "logs/-rf.log": "option-like\n",
    "logs/a\x00b\nc.log": "nul and newline\n",
    "logs/a_b_c.log": "taken first by the sanitised name above\n",
    "logs/" + "x" * 5000 + ".log": "long\n",
    "release/engines": "a file where kimictl's folder is\n",
    "release/engines/../../../x.sh": "climb out of the release\n",
    "host.json": "forged meta\n",
    "npu-smi-info.txt": "| 0 Ascend910 | OK |\n",
    "logs/prefill-0-dp0.log": "an ordinary log\n",
    "logs/not-text.log": {"a": 1},
}


def test_host_reported_names_stay_inside_the_hosts_folder_and_extract_cleanly(tmp_path: Path, state_dir: Path,
                                                                             monkeypatch) -> None:
    inv = load_inventory(ROOT / "inventories/a3-pd.yml")
    cluster, first, second = inv.cluster.name, inv.hosts[0].name, inv.hosts[1].name

    def collect(_inv, _cap, timeout=300.0):
        out = _fake_hosts(inv)(_inv, _cap)
        out[first] = {"files": dict(HOSTILE), "meta": {"hostname": "evil\n"}}
        return out

    monkeypatch.setattr(logs, "collect_host_files", collect)
    _control(state_dir, cluster)
    dest = tmp_path / "b.tar.gz"
    build_bundle(inv, dest, Redactor())
    with tarfile.open(dest) as tar:
        members = tar.getmembers()
        texts = {m.name: tar.extractfile(m).read().decode() for m in members}
        tar.extractall(tmp_path / "x", filter="data")  # refuses absolute names, '..', links: nothing to refuse here
    mine = sorted(n[len(f"{cluster}/{first}/"):] for n in texts if n.startswith(f"{cluster}/{first}/"))
    assert len(mine) == len(HOSTILE) + 1  # every reported file is kept (renamed), plus host.json
    for rel in mine:
        parts = rel.split("/")
        assert all(re.fullmatch(r"[A-Za-z0-9_+][A-Za-z0-9._+-]{0,130}", p) for p in parts), rel
        assert rel in ("npu-smi-info.txt", "host.json") or "/".join(parts[:-1]) in (*logs.HOST_FOLDERS, "other")
    assert all(m.isfile() for m in members) and len(texts) == len(members)
    assert {p.name for p in (tmp_path / "x").iterdir()} == {cluster}
    assert sorted(p.name for p in (tmp_path / "x" / cluster).iterdir()) == sorted([first, second, "_control-node",
                                                                                   "bundle.json"])
    base = f"{cluster}/{first}"
    expected = {  # reported name -> member under the host's folder
        "../../etc/cron.d/x": "other/_._.._etc_cron.d_x",
        "logs/../../../../etc/passwd": "other/logs_.._.._.._.._etc_passwd",
        "/etc/shadow": "other/_etc_shadow",
        "logs/..": "logs/_.",
        "logs/.hidden.log": "logs/_hidden.log",
        "logs/-rf.log": "logs/_rf.log",
        "release/engines": "release/engines-2",   # kimictl's folder keeps its name
        "release/engines/../../../x.sh": "other/release_engines_.._.._.._x.sh",
        "host.json": "other/host.json",           # the control node writes host.json
        "npu-smi-info.txt": "npu-smi-info.txt",
        "logs/prefill-0-dp0.log": "logs/prefill-0-dp0.log",
        "logs/" + "x" * 5000 + ".log": "logs/" + "x" * logs.MAX_MEMBER_NAME,
    }
    for reported, member in expected.items():
        assert texts[f"{base}/{member}"] == HOSTILE[reported], reported
    # two names that sanitise alike both arrive: the second (in sorted order) gets a suffix
    assert texts[f"{base}/logs/a_b_c.log"] == HOSTILE["logs/a\x00b\nc.log"]
    assert texts[f"{base}/logs/a_b_c.log-2"] == HOSTILE["logs/a_b_c.log"]
    assert json.loads(texts[f"{base}/logs/not-text.log"]) == {"a": 1}
    assert json.loads(texts[f"{base}/host.json"]) == {"hostname": "evil\n"}


@pytest.mark.parametrize("report", ["not json", "[1, 2]", '{"files": ["a"]}', '{"meta": {}}'])
def test_a_report_that_is_not_a_diagnostics_document_is_that_hosts_error(monkeypatch, report: str) -> None:
    from kimictl.ssh import SSHError

    inv = load_inventory(ROOT / "inventories/a3-pd.yml")
    monkeypatch.setattr(logs, "Sessions", fake_sessions(lambda _host, _cmd: report))
    got = logs.collect_host_files(inv, 1024)
    assert all(isinstance(v, SSHError) and "the host's report" in str(v) for v in got.values())
