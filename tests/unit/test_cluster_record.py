"""The cluster is the record (issue 34): deploy, rollout and rollback write their release records to the record hosts
(the first three by name) through record.yml; a control node with an empty state dir reads them back over SSH,
checks them as data (garbled lines skipped, garbage, oversized or mismatched answers refused, naming the host),
takes the newest, reports drift, and caches it so `rollback` and `rollout` work from it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml
from fake_sessions import fake_sessions
from test_orchestration import CLUSTER, _inventory

from kimictl import cluster_record, state
from kimictl.deploy import rollback_target
from kimictl.deployed import current_deployment
from kimictl.errors import HostError
from kimictl.inventory import Inventory, load_inventory
from kimictl.plan import make_plan
from kimictl.remote import read_record
from kimictl.render import Rendered, render
from kimictl.rollout.overrides import apply_sets, parse_sets
from kimictl.rundir import run_snapshot, run_topology
from kimictl.ssh import SSHError
from kimictl.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state" / CLUSTER


@pytest.fixture
def cluster(tmp_path: Path) -> tuple[Inventory, Rendered, Rendered]:
    """Four hosts, and the renders of two releases of a3-pd (the second changes the decode engines' flags)."""
    inv = _inventory(tmp_path, 4)
    topo = load_topology("a3-pd")
    old = render(make_plan(inv, topo), inv, topo)
    t2, i2 = apply_sets(topo, inv, parse_sets(["decode.serve.max-num-seqs=16"], topo))
    return inv, old, render(make_plan(i2, t2), i2, t2)


def _rec(r: Rendered, at: str, result: str = "deployed", **kw: Any) -> state.ReleaseRecord:
    return state.ReleaseRecord(release=state.release_id(r.releases), at=at, by="ci", cluster=CLUSTER,
                               topology="a3-pd", hosts=r.releases, result=result, run_dir="/elsewhere/runs/x", **kw)


def _answer(records: list[state.ReleaseRecord], current: state.ReleaseRecord | None,
            snapshots: dict[str, str]) -> str:
    """What read_record.py prints for a host holding these."""
    return json.dumps({"releases": "".join(r.to_line() + "\n" for r in records) if records else None,
                       "current": state.current_json(current) if current else None,
                       "snapshots": {rel: {"rendered.json": text, "topology.yml": None}
                                     for rel, text in snapshots.items()}, "skipped": []})


def _hosts(monkeypatch, answers: dict[str, Any]) -> list[str]:
    """The record hosts answer `answers[host]` (an SSHError: unreachable); the commands they were sent."""
    sent: list[str] = []

    def answer(host: str, cmd: str) -> str:
        sent.append(cmd)
        got = answers[host]
        if isinstance(got, SSHError):
            raise got
        return got

    monkeypatch.setattr(cluster_record, "Sessions", fake_sessions(answer))
    return sent


# --- which hosts, what is written ----------------------------------------------------------------------------


def test_the_record_hosts_are_the_first_three_names(tmp_path: Path, cluster) -> None:
    inv, _, _ = cluster
    assert cluster_record.record_hosts(inv) == ["atlas-01", "atlas-02", "atlas-03"]
    assert cluster_record.record_hosts(inv.limited(["atlas-04", "atlas-02"])) == ["atlas-02", "atlas-04"]


class RecordOps:
    """HostOps as publish sees it: a run directory and record.yml runs (hosts in `unwritable` fail, with why)."""

    def __init__(self, run_dir: Path, unwritable: dict[str, str] | None = None):
        self.run_dir, self.unwritable = run_dir, unwritable or {}
        self.runs: list[tuple[dict[str, Any], list[str]]] = []

    def write_record(self, extravars: dict[str, Any], hosts: list[str]) -> dict[str, str]:
        self.runs.append((extravars, hosts))
        return {h: w for h, w in self.unwritable.items() if h in hosts}


def _run_dir(tmp_path: Path, r: Rendered, topology: str | None = None) -> Path:
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "rendered.json").write_text(r.model_dump_json())
    if topology is not None:
        (run / "topology.yml").write_text(topology)
    return run


def test_publish_writes_the_record_to_three_of_four_hosts(tmp_path: Path, cluster) -> None:
    inv, old, _ = cluster
    run = _run_dir(tmp_path, old, "name: eff\n")
    rec = _rec(old, "2025-01-01T00:00:00+00:00").model_copy(update={"run_dir": str(run)})
    ops, said = RecordOps(tmp_path / "ops"), []
    assert cluster_record.publish(ops, inv, rec, say=said.append) == {} and not said
    (vars_, hosts), = ops.runs
    assert hosts == ["atlas-01", "atlas-02", "atlas-03"] and sorted(vars_["state_dir_of"]) == hosts
    assert vars_["line"] == rec.to_line() and vars_["release"] == rec.release
    assert Path(vars_["current"]).read_text() == state.current_json(rec)
    assert vars_["snapshot"] == {"rendered.json": str(run / "rendered.json"), "topology.yml": str(run / "topology.yml")}
    # a failed deploy's record: the history line only (no current, no snapshot)
    ops.runs.clear()
    cluster_record.publish(ops, inv, _rec(old, "2025-01-02T00:00:00+00:00", "failed"), say=said.append)
    assert [(v["current"], v["release"], v["snapshot"]) for v, _ in ops.runs] == [(None, None, {})]


def test_a_host_not_written_is_a_warning_and_no_host_written_is_an_error(tmp_path: Path, cluster) -> None:
    inv, old, _ = cluster
    rec = _rec(old, "2025-01-01T00:00:00+00:00")
    said: list[str] = []
    got = cluster_record.publish(RecordOps(tmp_path, {"atlas-02": "unreachable"}), inv, rec, say=said.append)
    assert got == {"atlas-02": "unreachable"}
    assert said == [f"warning: the release record of {rec.release} was not written to record host atlas-02: "
                    "unreachable"]
    dead = RecordOps(tmp_path, dict.fromkeys(["atlas-01", "atlas-02", "atlas-03", "atlas-04"], "no route"))
    with pytest.raises(HostError, match="could not be written to any record host") as err:
        cluster_record.publish(dead, inv, rec, say=said.append)
    assert err.value.step == "record" and err.value.host == "atlas-01"
    assert err.value.details == ["atlas-01: no route", "atlas-02: no route", "atlas-03: no route"]
    said.clear()
    cluster_record.publish(dead, inv, rec, say=said.append, required=False)   # a failed deploy's record: warned
    assert len(said) == 4 and "could not be written to any record host (atlas-01, atlas-02, atlas-03)" in said[-1]


def _local_inventory(tmp_path: Path, hosts: int) -> Path:
    """Hosts that are this machine (Ansible's local connection), each with its own state dir."""
    doc = {"all": {"vars": {"kimi_cluster": CLUSTER, "kimi_model_dir": "/data/models/Kimi-K2.5-W4A8",
                            "kimi_runtime": "host", "kimi_nic": "eth0",
                            "kimi_proxy_script": "/opt/vllm-ascend/examples/proxy.py"},
                   "hosts": {f"atlas-{i:02d}": {"ansible_host": f"127.0.0.{i}", "kimi_hardware": "atlas-800-a3",
                                                "ansible_connection": "local", "ansible_python_interpreter":
                                                    sys.executable, "kimi_state_dir": str(tmp_path / f"h{i}")}
                             for i in range(1, hosts + 1)}}}
    (tmp_path / "local.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return tmp_path / "local.yml"


@pytest.mark.slow
def test_record_yml_writes_root_only_files_that_read_record_reads_back(tmp_path: Path, cluster) -> None:
    """A real ansible-playbook run (local connection) of record.yml, twice, on 3 of 4 hosts; read_record.py reads a
    host's copy back and it passes the control node's checks (a torn line in between is skipped, not fatal)."""
    from kimictl.hostops import HostOps

    _, old, new = cluster
    inv = load_inventory(_local_inventory(tmp_path, 4))
    ops = HostOps(inv, "m", tmp_path / "run", say=lambda m: None)
    first = _rec(old, "2025-01-01T00:00:00+00:00").model_copy(update={"run_dir": str(_run_dir(tmp_path, old))})
    assert cluster_record.publish(ops, inv, first, say=pytest.fail) == {}
    (tmp_path / "h1" / "record" / "releases.jsonl").open("a").write('{"release": "cut-off mid-wri')
    run2 = tmp_path / "run2"
    run2.mkdir()
    (run2 / "rendered.json").write_text(new.model_dump_json())
    (run2 / "topology.yml").write_text("name: {{ not a template }}\n")
    second = _rec(new, "2025-01-02T00:00:00+00:00", kind="rollout").model_copy(update={"run_dir": str(run2)})
    assert cluster_record.publish(ops, inv, second, say=pytest.fail) == {}
    assert not (tmp_path / "h4").exists()   # not a record host
    for i in (1, 2, 3):
        rd = tmp_path / f"h{i}" / "record"
        assert (rd.stat().st_mode & 0o777, (rd / "snapshots").stat().st_mode & 0o777) == (0o700, 0o700)
        assert (rd / "current.json").read_text() == state.current_json(second)   # JSON as written, not re-dumped
        lines = (rd / "releases.jsonl").read_text().splitlines()
        assert lines[0] == first.to_line() and lines[-1] == second.to_line() and len(lines) == (3 if i == 1 else 2)
        for rel, r in ((first.release, old), (second.release, new)):
            snap = rd / "snapshots" / rel / "rendered.json"
            assert snap.read_text() == r.model_dump_json() and snap.stat().st_mode & 0o777 == 0o600
        assert (rd / "snapshots" / second.release / "topology.yml").read_text() == "name: {{ not a template }}\n"
        assert all((p.stat().st_mode & 0o077) == 0 for p in rd.rglob("*"))
    out = subprocess.run([sys.executable, "-I", "-", str(tmp_path / "h1"), first.release],
                         input=(ROOT / "kimictl/remote/read_record.py").read_text(), capture_output=True, text=True,
                         check=True).stdout
    said: list[str] = []
    got = cluster_record.parse_answer("atlas-01", out, CLUSTER, said.append)
    assert [r.release for r in got.history] == [first.release, second.release]
    assert got.current == second and list(got.snapshots) == [second.release]   # first's: the caller has it
    assert said == ["warning: record host atlas-01: line 2 of its release history is skipped: not a release record "
                    "(1 error(s))"]


def test_record_yml_parses_and_names_every_extravar_it_uses() -> None:
    text = (ROOT / "playbooks/record.yml").read_text()
    header = "".join(line for line in text.splitlines(True) if line.startswith("#"))
    used = set(re.findall(r"kimi\.(\w+)", text.replace(header, "")))
    assert used == {"state_dir_of", "line", "current", "release", "snapshot"}
    assert all(f"kimi.{name}" in header for name in used)
    play = yaml.safe_load(text)[0]
    loop = play["tasks"][0]["loop"]
    dirs = jinja2.Environment().from_string(loop).render(rd="/sd/record", kimi={"release": "ab12"})
    assert yaml.safe_load(dirs) == ["/sd/record", "/sd/record/snapshots", "/sd/record/snapshots/ab12"]
    check = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "--syntax-check", "-i",
                            "localhost,", str(ROOT / "playbooks/record.yml")], capture_output=True, text=True,
                           check=False)
    assert check.returncode == 0, check.stderr


# --- reading it back -----------------------------------------------------------------------------------------


def test_an_empty_control_node_reads_the_newest_record_back_and_rolls_back_from_it(monkeypatch, cluster,
                                                                                   state_dir: Path) -> None:
    inv, old, new = cluster
    r_old, r_new = _rec(old, "2025-01-01T00:00:00+00:00"), _rec(new, "2025-01-02T00:00:00+00:00")
    snaps = {r_old.release: old.model_dump_json(), r_new.release: new.model_dump_json()}
    full = _answer([r_old, r_new], r_new, snaps)
    sent = _hosts(monkeypatch, {"atlas-01": full, "atlas-02": full,
                                "atlas-03": _answer([r_old], r_old, {r_old.release: snaps[r_old.release]})})
    said: list[str] = []
    report = cluster_record.sync(inv, say=said.append)
    assert len(sent) == 3 and all(c.startswith("python3 - /var/lib/kimi") for c in sent)   # one round trip each
    assert (report.answered, report.added, report.current) == (["atlas-01", "atlas-02", "atlas-03"], 2, r_new.release)
    # atlas-03 missed the last write: drift, naming it and what differs
    assert report.drift == [f"record hosts disagree on the current release: atlas-01 {r_new.release} ({r_new.at}), "
                            f"atlas-02 {r_new.release} ({r_new.at}), atlas-03 {r_old.release} ({r_old.at})",
                            "record host atlas-03 lacks 1 of the 2 release record(s) the others hold"]
    assert [f"warning: record drift: {d}" for d in report.drift] == said[:2]
    assert said[2] == (f"read the cluster's release record from atlas-01, atlas-02, atlas-03: 2 record(s) new to "
                       f"this control node; current release {r_new.release}")
    cur = current_deployment(CLUSTER)
    assert cur.record.release == r_new.release and cur.rendered == new
    assert cur.record.run_dir == str(state_dir / "record" / "snapshots" / r_new.release)   # never the writer's path
    assert (state_dir / "record" / "snapshots" / r_new.release / "rendered.json").stat().st_mode & 0o777 == 0o600
    target, rendered = rollback_target(CLUSTER, inv=inv)   # syncs again: nothing new, nothing printed
    assert target.release == r_old.release and rendered == old
    # the snapshots it keeps are not asked for again
    assert sent[-1].endswith(" " + ",".join(sorted(snaps)))


def test_deleting_the_cache_loses_nothing(monkeypatch, cluster, state_dir: Path) -> None:
    inv, old, new = cluster
    r_old, r_new = _rec(old, "2025-01-01T00:00:00+00:00"), _rec(new, "2025-01-02T00:00:00+00:00")
    full = _answer([r_old, r_new], r_new, {r_old.release: old.model_dump_json(), r_new.release: new.model_dump_json()})
    _hosts(monkeypatch, dict.fromkeys(["atlas-01", "atlas-02", "atlas-03"], full))
    cluster_record.sync(inv, say=lambda m: None)
    before = [r.release for r in state.history(CLUSTER)]
    import shutil

    shutil.rmtree(state_dir)
    assert current_deployment(CLUSTER, inv).rendered == new
    assert [r.release for r in state.history(CLUSTER)] == before == [r_old.release, r_new.release]


def test_the_local_record_newer_than_the_clusters_stays_current(monkeypatch, cluster, state_dir: Path) -> None:
    """A record the cluster missed (written here while no record host answered) is kept; the older one does not win."""
    inv, old, new = cluster
    r_old, r_new = _rec(old, "2025-01-01T00:00:00+00:00"), _rec(new, "2025-01-02T00:00:00+00:00")
    state.record_release(CLUSTER, r_new.model_copy(update={"run_dir": str(_run_dir(state_dir.parent, new))}))
    _hosts(monkeypatch, dict.fromkeys(["atlas-01", "atlas-02", "atlas-03"],
                                      _answer([r_old], r_old, {r_old.release: old.model_dump_json()})))
    report = cluster_record.sync(inv, say=lambda m: None)
    assert report.current == r_new.release and state.current(CLUSTER).release == r_new.release
    assert [r.release for r in state.history(CLUSTER)] == [r_old.release, r_new.release]


def _bad(old: Rendered, new: Rendered, r_old: state.ReleaseRecord, kind: str) -> str:
    if kind == "garbage":
        return "Traceback (most recent call last): {{ 7*7 }}"
    if kind == "oversized":
        return _answer([r_old] * 200, r_old, {})
    if kind == "mismatched":   # the newer release's render under the older release's name
        return _answer([r_old], r_old, {r_old.release: new.model_dump_json()})
    if kind == "other-cluster":
        other = old.model_copy(update={"plan": old.plan.model_copy(update={"cluster": "someone-else"})})
        return _answer([r_old], r_old, {r_old.release: other.model_dump_json()})
    if kind == "not-a-render":
        return _answer([r_old], r_old, {r_old.release: '{"plan": 1}'})
    # a current record naming a "release" that is a path
    return _answer([r_old], r_old.model_copy(update={"release": "../../etc"}), {})


@pytest.mark.parametrize(("kind", "why"), [
    ("garbage", "read_record.py answered 'Traceback"),
    ("oversized", "over its cap"),
    ("mismatched", "is release"),
    ("other-cluster", "of cluster 'someone-else'"),
    ("not-a-render", "is not a render"),
    ("bad-release", "not a release id"),
])
def test_a_host_answering_garbage_is_refused_by_name_and_the_others_win(monkeypatch, cluster, state_dir: Path,
                                                                        kind: str, why: str) -> None:
    inv, old, new = cluster
    monkeypatch.setattr(cluster_record, "HISTORY_MAX", 16 * 1024)   # 200 lines are more
    r_old = _rec(old, "2025-01-01T00:00:00+00:00")
    good = _answer([r_old], r_old, {r_old.release: old.model_dump_json()})
    _hosts(monkeypatch, {"atlas-01": _bad(old, new, r_old, kind), "atlas-02": good, "atlas-03": good})
    said: list[str] = []
    report = cluster_record.sync(inv, say=said.append)
    assert list(report.refused) == ["atlas-01"] and why in report.refused["atlas-01"], report.refused
    assert said[0].startswith("warning: the release record of record host atlas-01 is refused: ")
    assert report.answered == ["atlas-02", "atlas-03"] and not report.drift
    assert report.problems() == [f"record host atlas-01 refused: {report.refused['atlas-01']}"]
    assert current_deployment(CLUSTER).rendered == old   # the good hosts' snapshot, not atlas-01's


def test_a_garbled_history_line_is_skipped_by_name(monkeypatch, cluster) -> None:
    inv, old, new = cluster
    r_old, r_new = _rec(old, "2025-01-01T00:00:00+00:00"), _rec(new, "2025-01-02T00:00:00+00:00")
    torn = json.loads(_answer([r_old, r_new], r_new, {r_new.release: new.model_dump_json()}))
    torn["releases"] = torn["releases"].replace(r_old.to_line(), r_old.to_line()[:30])
    _hosts(monkeypatch, dict.fromkeys(["atlas-01", "atlas-02", "atlas-03"], json.dumps(torn)))
    said: list[str] = []
    cluster_record.sync(inv, say=said.append)
    assert said[:3] == [f"warning: record host {h}: line 1 of its release history is skipped: not a release record "
                        "(1 error(s))" for h in ("atlas-01", "atlas-02", "atlas-03")]
    assert [r.release for r in state.history(CLUSTER)] == [r_new.release]


def test_no_record_host_answering_leaves_the_local_cache_with_a_warning(monkeypatch, cluster, tmp_path: Path,
                                                                        capsys) -> None:
    inv, old, _ = cluster
    mine = _rec(old, "2025-01-01T00:00:00+00:00").model_copy(update={"run_dir": str(_run_dir(tmp_path, old))})
    state.record_release(CLUSTER, mine)
    _hosts(monkeypatch, {h: SSHError(f"cannot reach {h}:22: timed out") for h in ("atlas-01", "atlas-02", "atlas-03")})
    dep = current_deployment(CLUSTER, inv)
    assert dep.record == mine and run_topology(dep.record) is None and run_snapshot(dep.record, "x") == old
    err = capsys.readouterr().err
    assert err.startswith("record: warning: no record host answered (atlas-01: cannot reach atlas-01:22: timed out; ")
    assert f"using this control node's cached record in {state.control_dir(CLUSTER)}" in err


def test_rollback_with_nothing_recorded_anywhere_names_the_record_hosts(monkeypatch, cluster) -> None:
    from kimictl.errors import InvalidInput

    inv, _, _ = cluster
    with pytest.raises(InvalidInput, match=r"nor on its record hosts \(atlas-01, atlas-02, atlas-03\)"):
        rollback_target(CLUSTER, inv=inv)


def test_read_record_caps_what_it_sends(tmp_path: Path, monkeypatch) -> None:
    rd = tmp_path / "record"
    (rd / "snapshots" / "ab12").mkdir(parents=True)
    (rd / "snapshots" / "ab12" / "rendered.json").write_text("x" * 100)
    (rd / "snapshots" / "not-a-release").mkdir()
    (rd / "releases.jsonl").write_text("y" * 50)
    monkeypatch.setattr(read_record, "HISTORY_MAX", 10)
    got = read_record.read_record(str(tmp_path), set())
    assert got["releases"] is None and "over the 10-byte cap" in got["skipped"][0]
    assert list(got["snapshots"]) == ["ab12"] and got["current"] is None
    assert read_record.read_record(str(tmp_path), {"ab12"})["snapshots"] == {}


def test_status_reads_the_record_back_and_its_json_carries_the_drift(monkeypatch, cluster, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kimictl import status
    from kimictl.cli.main import app

    _, old, new = cluster
    r_old, r_new = _rec(old, "2025-01-01T00:00:00+00:00"), _rec(new, "2025-01-02T00:00:00+00:00")
    snaps = {r_old.release: old.model_dump_json(), r_new.release: new.model_dump_json()}
    _hosts(monkeypatch, {"atlas-01": _answer([r_old, r_new], r_new, snaps), "atlas-02": "garbage",
                         "atlas-03": _answer([r_old], r_old, snaps)})
    monkeypatch.setattr(status, "_probe", lambda inv, timeout: {h.name: SSHError(f"{h.name}: down")
                                                                 for h in inv.hosts})
    r = CliRunner().invoke(app, ["status", "-i", str(tmp_path / "inv.yml"), "--output", "json"])
    doc = json.loads(r.stdout)
    assert doc["release"] == r_new.release   # the cluster's record, read back into an empty control node
    assert doc["record_drift"] == [
        f"record hosts disagree on the current release: atlas-01 {r_new.release} ({r_new.at}), atlas-03 "
        f"{r_old.release} ({r_old.at})", "record host atlas-03 lacks 1 of the 2 release record(s) the others hold",
        "record host atlas-02 refused: read_record.py answered 'garbage', not JSON"]
    assert "record: warning: record drift: record hosts disagree" in r.stderr
    _hosts(monkeypatch, dict.fromkeys(["atlas-01", "atlas-02", "atlas-03"], _answer([r_old, r_new], r_new, snaps)))
    again = json.loads(CliRunner().invoke(app, ["status", "-i", str(tmp_path / "inv.yml"), "--output", "json"]).stdout)
    assert "record_drift" not in again


def test_plan_detailed_exitcode_judges_against_the_clusters_record(monkeypatch, cluster) -> None:
    """A drift check from an empty control node (CI): `plan --detailed-exitcode` reads the record back, so the
    release the cluster runs is no change (exit 0) and another plan is (exit 3); plain `plan` reaches no host."""
    from typer.testing import CliRunner

    from kimictl.cli.main import app

    inv, old, _new = cluster
    r_old = _rec(old, "2025-01-01T00:00:00+00:00")
    sent = _hosts(monkeypatch, {h: _answer([r_old], r_old, {r_old.release: old.model_dump_json()})
                                for h in ("atlas-01", "atlas-02", "atlas-03")})
    plain = CliRunner().invoke(app, ["plan", "-i", inv.path, "--topology", "a3-pd"])
    assert plain.exit_code == 0 and not sent and "nothing recorded" in plain.stdout
    same = CliRunner().invoke(app, ["plan", "-i", inv.path, "--topology", "a3-pd", "--detailed-exitcode"])
    assert same.exit_code == 0, same.output
    assert f"deployed: release {r_old.release}; no changes" in same.stdout and len(sent) == 3
    topo = Path(inv.path).with_name("t.yml")   # a3-pd with decode's max-num-seqs 32 -> 16
    topo.write_text(Path(load_topology("a3-pd").source).read_text().replace("max-num-seqs: 32", "max-num-seqs: 16"))
    changed = CliRunner().invoke(app, ["plan", "-i", inv.path, "--topology", str(topo), "--detailed-exitcode"])
    assert changed.exit_code == 3, changed.output


def test_a_release_this_node_deployed_itself_is_not_sent_again_and_its_run_dir_serves(monkeypatch, cluster,
                                                                                       tmp_path: Path) -> None:
    """Control node A deployed release R (its run directory holds R's render); B deployed R again later. A's sync
    asks the hosts not to send R's snapshot (A has it), and the record read back names A's run directory."""
    inv, old, _new = cluster
    mine = _rec(old, "2025-01-01T00:00:00+00:00").model_copy(update={"run_dir": str(_run_dir(tmp_path, old))})
    state.record_release(CLUSTER, mine)
    theirs = _rec(old, "2025-01-03T00:00:00+00:00").model_copy(update={"by": "ci-runner"})
    sent = _hosts(monkeypatch, {h: _answer([mine, theirs], theirs, {}) for h in ("atlas-01", "atlas-02", "atlas-03")})
    cluster_record.sync(inv, say=lambda _m: None)
    assert all(c.endswith(" " + mine.release) for c in sent)   # A holds its snapshot: not asked for
    cur = current_deployment(CLUSTER)
    assert cur.record.at == theirs.at and cur.record.run_dir == mine.run_dir and cur.rendered == old
