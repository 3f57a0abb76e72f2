"""Control-node state (kimictl/state.py): records round-trip, one release id, one manifest cache, and a damaged
file gives one clear message (exit 2, the file and line named, no traceback) in every command that reads it."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kimictl import state
from kimictl.cli.main import app
from kimictl.errors import EXIT_INVALID, StateError

CLUSTER = "st-unit"


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state" / CLUSTER


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    doc = {"all": {"vars": {"kimi_cluster": CLUSTER, "kimi_model_dir": "/data/models/Kimi-K2.5-W4A8",
                            "kimi_runtime": "host", "kimi_nic": "eth0",
                            "kimi_proxy_script": "/opt/vllm-ascend/examples/proxy.py"},
                   "hosts": {f"atlas-{i}": {"ansible_host": f"10.9.0.{i}", "kimi_hardware": "atlas-800-a3"}
                             for i in (1, 2)}}}
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _rec(release: str, result: str = "deployed", **kw) -> state.ReleaseRecord:
    return state.ReleaseRecord.now(release=release, cluster=CLUSTER, topology="a3-pd", hosts={"atlas-1": "h1"},
                                   result=result, run_dir=f"/runs/{release}", **kw)


def test_records_round_trip_and_only_deployed_becomes_current(state_dir: Path) -> None:
    assert state.history(CLUSTER) == [] and state.current(CLUSTER) is None
    state.record_release(CLUSTER, _rec("r1"))
    state.record_release(CLUSTER, _rec("r2", "failed", changes=[{"host": "atlas-1", "id": "x", "action": "start"}]))
    assert [r.release for r in state.history(CLUSTER)] == ["r1", "r2"]
    assert state.current(CLUSTER).release == "r1"
    line = json.loads((state_dir / "releases.jsonl").read_text().splitlines()[0])
    assert list(line) == ["release", "at", "by", "cluster", "topology", "hosts", "result", "run_dir"]
    state.record_release(CLUSTER, _rec("r3", kind="rollout", previous_release="r1", error=None))
    cur = json.loads((state_dir / "current.json").read_text())
    assert cur["release"] == "r3" and cur["kind"] == "rollout" and cur["error"] is None


def test_release_id_hashes_every_host_release() -> None:
    a = state.release_id({"h1": "r1", "h2": "r2"})
    assert a == state.release_id({"h2": "r2", "h1": "r1"}) and len(a) == 16
    assert a != state.release_id({"h1": "r1", "h2": "r3"})


@pytest.mark.parametrize("module", ["state", "secret_file"])
def test_the_ground_floor_imports_nothing_of_kimictl_but_errors(module: str) -> None:
    """state.py and secret_file.py stand below render and inventory (no circle through them): every kimictl import
    in them, lazy or for typing too, is kimictl.errors."""
    tree = ast.parse((Path(state.__file__).parent / f"{module}.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {n for n in names if n.split(".")[0] == "kimictl"} == {"kimictl.errors"}


def test_one_manifest_cache(state_dir: Path) -> None:
    assert state.cached_manifest_bytes(CLUSTER) == (None, False)
    state.write_manifest_cache(CLUSTER, json.dumps({"files": [{"path": "a", "size": 3}, {"path": "b", "size": 4}]}))
    assert state.cached_manifest_bytes(CLUSTER) == (7, True)
    assert sorted(p.name for p in state_dir.iterdir()) == ["weights-manifest.json"]
    (state_dir / "weights-manifest.json").write_text('{"files": [{"path": "a", "si')
    assert state.cached_manifest_bytes(CLUSTER) == (None, False)  # a damaged cache: read the hub again


@pytest.mark.parametrize("damage", ["truncated", "not-a-record"])
def test_a_damaged_history_names_file_and_line(state_dir: Path, damage: str) -> None:
    state.record_release(CLUSTER, _rec("r1"))
    state.record_release(CLUSTER, _rec("r2"))
    with (state_dir / "releases.jsonl").open("a") as f:
        f.write('{"release": "r3", "at": "2026-01-0' if damage == "truncated" else '{"hosts": {}}\n')
    with pytest.raises(StateError) as exc:
        state.history(CLUSTER)
    assert exc.value.code == EXIT_INVALID
    assert f"{state_dir / 'releases.jsonl'} (line 3) is damaged" in exc.value.message
    assert "delete that line" in exc.value.hint


def test_a_record_after_a_cut_off_line_stays_intact(state_dir: Path) -> None:
    state.record_release(CLUSTER, _rec("r1"))
    with (state_dir / "releases.jsonl").open("a") as f:
        f.write('{"release": "r2", "at": "2026-01-0')   # a write that was interrupted
    state.record_release(CLUSTER, _rec("r3"))
    lines = (state_dir / "releases.jsonl").read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2])["release"] == "r3"
    with pytest.raises(StateError, match=r"\(line 2\) is damaged"):
        state.history(CLUSTER)


def _damage_current(state_dir: Path) -> None:
    state.record_release(CLUSTER, _rec("r1"))
    (state_dir / "current.json").write_text('{"release": "r1", "hosts": {"atl')


def _truncate_history(state_dir: Path) -> None:
    state.record_release(CLUSTER, _rec("r1"))
    state.record_release(CLUSTER, _rec("r2"))
    text = (state_dir / "releases.jsonl").read_text()
    (state_dir / "releases.jsonl").write_text(text[:-25])   # the last write was cut off


@pytest.mark.parametrize(("damage", "args", "needle"), [
    (_damage_current, ["plan", "--topology", "a3-pd"], "current.json is damaged"),
    (_damage_current, ["status"], "current.json is damaged"),
    (_damage_current, ["rollout", "--set", "decode.serve.max-num-seqs=16", "--yes"], "current.json is damaged"),
    (_truncate_history, ["rollback", "--yes"], "releases.jsonl (line 2) is damaged"),
], ids=["plan-current", "status-current", "rollout-current", "rollback-history"])
def test_a_damaged_record_is_one_clear_message_in_every_command(state_dir: Path, inventory: Path, damage, args,
                                                                needle: str, monkeypatch) -> None:
    from kimictl import hostops, status

    damage(state_dir)
    # nothing may reach a host: the record is read first
    monkeypatch.setattr(status, "_probe", lambda *a, **k: pytest.fail("hosts were contacted"))
    monkeypatch.setattr(hostops, "observe", lambda *a, **k: pytest.fail("hosts were contacted"))
    for output in ([], ["--output", "json"]):
        r = CliRunner().invoke(app, [args[0], "-i", str(inventory), *args[1:], *output])
        assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
        assert r.exit_code == EXIT_INVALID, r.output
        assert "Traceback" not in r.output
        if output:
            err = json.loads(r.stdout)["error"]
            assert err["type"] == "StateError" and needle in err["message"] and err["hint"]
        else:
            assert needle in r.stderr and r.stderr.count("\nerror:") == 0 and r.stderr.startswith("error: ")
