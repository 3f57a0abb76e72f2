"""Rollout without hosts: --set parsing, slices and what a change touches, P/D compatibility, ordering and batches,
the router admin client, the drain wait, the recorded release, and the CLI's input errors."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import yaml
from typer.testing import CliRunner

from kimictl import hostops
from kimictl.cli.main import app
from kimictl.errors import EXIT_INVALID, InvalidInput, InventoryError, TopologyError
from kimictl.inventory import load_inventory
from kimictl.plan import make_plan
from kimictl.render import render
from kimictl.rollout import changes
from kimictl.rollout.changes import Batch, analyze, choose_order, pair_problems, pd_side, plan_batches
from kimictl.rollout.overrides import apply_sets, effective_topology_yaml, parse_set, parse_sets
from kimictl.rollout.run import prepare_rollout
from kimictl.routers import RouterAdmin, RouterError
from kimictl.slices.model import Endpoint, Slice, slices_of
from kimictl.slices.probes import wait_drained
from kimictl.state import release_id
from kimictl.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
PROXY_SCRIPT = "/opt/vllm-ascend/examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py"


def _inventory(tmp_path: Path, hosts: int = 4, **extra) -> Path:
    data = {"all": {"vars": {"kimi_cluster": "ro-unit", "kimi_model_dir": "/data/models/Kimi-K2.5-W4A8",
                             "kimi_vllm_ascend_version": "0.23.0", "kimi_runtime": "host", "kimi_nic": "eth0",
                             "kimi_proxy_script": PROXY_SCRIPT, **extra},
                    "hosts": {f"atlas-{i:02d}": {"ansible_host": f"10.9.0.{10 + i}", "kimi_hardware": "atlas-800-a3"}
                              for i in range(1, hosts + 1)}}}
    path = tmp_path / f"inv{hosts}.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def base(tmp_path: Path):
    inv = load_inventory(_inventory(tmp_path))
    topo = load_topology("a3-pd")
    return inv, topo, render(make_plan(inv, topo), inv, topo)


def _changed(base, *items: str):
    inv, topo, old = base
    sets = parse_sets(list(items), topo)
    t2, i2 = apply_sets(topo, inv, sets)
    return old, render(make_plan(i2, t2), i2, t2)


# --- --set --------------------------------------------------------------------------------------------------


def test_parse_set_locates_role_serve_env_common_and_inventory_keys() -> None:
    topo = load_topology("a3-pd")
    s = parse_set("decode.serve.max-num-seqs=32", topo)
    assert (s.target, s.path, s.value) == ("topology", ("roles", "decode", "serve", "max-num-seqs"), 32)
    s = parse_set("prefill.env.HCCL_OP_EXPANSION_MODE=AIV", topo)
    assert s.path == ("roles", "prefill", "env", "HCCL_OP_EXPANSION_MODE") and s.value == "AIV"
    assert parse_set("prefill.env.X=1", topo).value == "1"  # env values stay text
    assert parse_set("roles.decode.tp=4", topo).value == 4
    assert parse_set("serve.seed=7", topo).path == ("serve", "seed")
    assert parse_set("decode.serve.compilation-config={cudagraph_mode: FULL}", topo).value == {
        "cudagraph_mode": "FULL"}
    assert parse_set("prefill.serve.enforce-eager=null", topo).value is None
    s = parse_set("kimi_vllm_ascend_version=0.18.0", topo)
    assert (s.target, s.key, s.value) == ("inventory", "kimi_vllm_ascend_version", "0.18.0")


@pytest.mark.parametrize(("item", "needle"), [
    ("decod.serve.max-num-seqs=32", "did you mean 'decode'"),
    ("decode.srve.max-num-seqs=32", "did you mean 'serve'"),
    ("decode.serve.max-num-seq=16", "did you mean 'max-num-seqs'"),
    ("proxy.polcy=random", "did you mean 'policy'"),
    ("colocated.dp=2", "has no role 'colocated'"),
    ("decode.serve=1", "is a map"),
    ("decode.tp.x=1", "takes a value"),
    ("decode=1", "names a whole role"),
    ("kimi_vllm_ascend_versoin=0.18.0", "did you mean 'kimi_vllm_ascend_version'"),
    ("kimi_nic=eth1", "per-host inventory key"),
    ("kimi_cluster=other", "cannot be rolled out"),
    ("decode.tp=", "empty value"),
    ("decode.tp", "expected KEY=VALUE"),
    ("decode..tp=1", "empty path component"),
    ("decode.serve.--seed=1", "leading dashes"),
])
def test_parse_set_errors_name_the_key(item: str, needle: str) -> None:
    with pytest.raises(InvalidInput) as exc:
        parse_set(item, load_topology("a3-pd"))
    assert exc.value.code == EXIT_INVALID
    assert item.split("=", maxsplit=1)[0] in exc.value.message and needle in exc.value.message


def test_parse_sets_refuses_the_same_key_twice() -> None:
    with pytest.raises(InvalidInput, match=r"already set by --set decode\.tp=4"):
        parse_sets(["decode.tp=4", "roles.decode.tp=8"], load_topology("a3-pd"))


def test_apply_sets_changes_topology_and_inventory_and_validates(base) -> None:
    inv, topo, _ = base
    t2, i2 = apply_sets(topo, inv, parse_sets(["decode.serve.max-num-seqs=16", "prefill.serve.enforce-eager=null",
                                               "prefill.env.X=1", "kimi_vllm_ascend_version=0.18.0"], topo))
    assert t2.roles["decode"].serve["max-num-seqs"] == 16
    assert "enforce-eager" not in t2.roles["prefill"].serve and t2.roles["prefill"].env["X"] == "1"
    assert i2.cluster.kimi_vllm_ascend_version == "0.18.0" and inv.cluster.kimi_vllm_ascend_version == "0.23.0"
    assert t2.source == topo.source and topo.roles["decode"].serve["max-num-seqs"] == 32  # inputs untouched

    with pytest.raises(TopologyError) as exc:
        apply_sets(topo, inv, parse_sets(["decode.serve.gpu-memory-utilization=2"], topo))
    assert exc.value.code == EXIT_INVALID
    assert any("--set decode.serve.gpu-memory-utilization=2" in d and "fraction" in d for d in exc.value.details)
    with pytest.raises(InventoryError) as exc:
        apply_sets(topo, inv, parse_sets(["kimi_vllm_ascend_version=9.9.9"], topo))
    assert any("--set kimi_vllm_ascend_version=9.9.9" in d for d in exc.value.details)
    with pytest.raises(TopologyError, match="invalid"):
        apply_sets(topo, inv, parse_sets(["prefill.switches.fused_mc3=true"], topo))


# --- slices and what a change touches ------------------------------------------------------------------------


def test_slices_are_the_instances_of_a_2p2d_plan(base) -> None:
    _, _, r = base
    sl = slices_of(r)
    assert list(sl) == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    assert [len(s.endpoints) for s in sl.values()] == [2, 2, 4, 4]
    assert sl["decode-1"].hosts == ("atlas-04",) and sl["decode-1"].endpoints[3].url == "http://10.9.0.14:7103"
    assert {s.role for s in sl.values()} == {"prefill", "decode"}


def test_a_decode_serve_flag_touches_the_decode_slices_only(base) -> None:
    old, new = _changed(base, "decode.serve.max-num-seqs=16")
    a = analyze(old, new)
    assert not a.problems and not a.proxy_changed
    assert [s.name for s in a.touched] == ["decode-0", "decode-1"]
    assert sorted(a.changed_hosts) == ["atlas-03", "atlas-04"]
    assert a.changed_engines["decode-0"] == ["decode-0-dp0", "decode-0-dp1", "decode-0-dp2", "decode-0-dp3"]
    assert choose_order(old, new, a.touched) == ("decode", [])


def test_a_common_flag_touches_every_slice_and_goes_decode_first(base) -> None:
    old, new = _changed(base, "serve.seed=7")
    a = analyze(old, new)
    assert [s.name for s in a.touched] == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    first, why = choose_order(old, new, a.touched)
    assert (first, why) == ("decode", [])
    batches, notes = plan_batches(a.touched, slices_of(new), first, canary=1, serial=1)
    assert [(b.names, b.canary) for b in batches] == [
        (["decode-0"], True), (["decode-1"], False), (["prefill-0"], False), (["prefill-1"], False)]
    assert notes == []


def test_no_change_touches_nothing(base) -> None:
    old, new = _changed(base)
    a = analyze(old, new)
    assert a.touched == [] and a.changed_hosts == {} and not a.problems


def test_shape_and_proxy_changes(base) -> None:
    old, new = _changed(base, "decode.tp=8", "decode.dp=2")
    assert any("engines change shape" in p for p in analyze(old, new).problems)
    old, new = _changed(base, "proxy.routers=3")
    a = analyze(old, new)
    assert a.proxy_changed and a.touched == [] and list(a.changed_hosts) == ["atlas-01"] and not a.problems
    old, new = _changed(base, "proxy.port=8001")
    assert any("proxy moves" in p for p in analyze(old, new).problems)
    old, new = _changed(base, "proxy.max_body_mib=64")  # a front limit: a change of the proxy's command
    a = analyze(old, new)
    assert a.proxy_changed and a.touched == [] and not a.problems
    assert "--max-body 67108864" in new.files["atlas-01"]["proxy/proxy.sh"]


# --- P/D compatibility ---------------------------------------------------------------------------------------


def test_pair_rules_of_the_connector(base) -> None:
    _, _, r = base
    p, d = pd_side(r, "prefill-0-dp0", "old"), pd_side(r, "decode-1-dp2", "old")
    assert (p.tp, d.tp, p.connector) == (8, 4, "MooncakeConnectorV1")
    assert pair_problems(p, d) == []
    assert any("prefill TP 4 must be >= decode TP 8" in m for m in pair_problems(
        p.__class__(**{**vars(p), "tp": 4}), d.__class__(**{**vars(d), "tp": 8})))
    assert any("not divisible" in m or "divisible" in m for m in pair_problems(
        p.__class__(**{**vars(p), "tp": 6}), d))
    assert any("vllm-ascend 0.23.0 vs 0.18.0" in m for m in pair_problems(p, d.__class__(**{**vars(d),
                                                                                          "version": "0.18.0"})))
    assert any("kv_connector" in m for m in pair_problems(p, d.__class__(**{**vars(d), "connector": "X"})))
    assert any("declares decode tp_size 4" in m for m in pair_problems(p, d.__class__(**{**vars(d), "tp": 2})))


def test_a_version_change_is_refused_a_kv_shape_change_too(base) -> None:
    old, new = _changed(base, "kimi_vllm_ascend_version=0.18.0")
    a = analyze(old, new)
    assert a.touched and not a.problems
    first, why = choose_order(old, new, a.touched)
    assert first is None and any("vllm-ascend 0.23.0 vs 0.18.0" in w for w in why)

    old, new = _changed(base, "decode.serve.block-size=64")
    first, why = choose_order(old, new, analyze(old, new).touched)
    assert first is None and any("--block-size None vs 64" in w for w in why)


def test_prefill_goes_first_when_only_that_order_is_compatible(base, monkeypatch) -> None:
    old, new = _changed(base, "serve.seed=7")
    touched = analyze(old, new).touched
    # Pretend new decode cannot pull from old prefill, while new prefill serves old decode fine.
    monkeypatch.setattr(changes, "pair_problems",
                        lambda p, d: ["old P -> new D"] if (p.release, d.release) == ("old", "new") else [])
    assert choose_order(old, new, touched) == ("prefill", [])
    batches, _ = plan_batches(touched, slices_of(new), "prefill", canary=1, serial=1)
    assert [b.names for b in batches] == [["prefill-0"], ["prefill-1"], ["decode-0"], ["decode-1"]]


# --- batches ---------------------------------------------------------------------------------------------


def _slices(roles: dict[str, int]) -> dict[str, Slice]:
    out = {}
    for role, n in roles.items():
        for i in range(n):
            name = f"{role}-{i}"
            out[name] = Slice(name, role, (f"h-{name}",), (f"{name}-dp0",),
                              (Endpoint(f"{name}-dp0", f"h-{name}", "10.0.0.1", 7100 + i, role),))
    return out


def test_batches_never_drain_a_whole_role_and_caps_are_noted() -> None:
    sl = _slices({"prefill": 2, "decode": 3})
    batches, notes = plan_batches(list(sl.values()), sl, "decode", canary=1, serial=5)
    assert [b.names for b in batches] == [["decode-0"], ["decode-1", "decode-2"], ["prefill-0"], ["prefill-1"]]
    assert batches[0].canary and not batches[1].canary
    assert notes == ["--serial 5 capped to 1 for prefill (2 instances; one keeps serving while the others restart)"]
    for b in batches:
        assert len(b.slices) < sum(1 for s in sl.values() if s.role == b.role)

    batches, notes = plan_batches(list(sl.values()), sl, "decode", canary=0, serial=1)
    assert not any(b.canary for b in batches) and len(batches) == 5

    batches, notes = plan_batches(list(sl.values()), sl, "decode", canary=3, serial=1)
    assert [(b.names, b.canary) for b in batches][:3] == [(["decode-0", "decode-1"], True), (["decode-2"], True),
                                                          (["prefill-0"], False)]
    assert any("--canary 3 capped to 2 for decode" in n for n in notes)


def test_a_single_instance_role_cannot_roll_without_downtime() -> None:
    sl = _slices({"prefill": 1, "decode": 2})
    with pytest.raises(InvalidInput, match=r"prefill has a single instance \(prefill-0\)") as exc:
        plan_batches(list(sl.values()), sl, "decode", canary=1, serial=1)
    assert "2P2D" in (exc.value.hint or "")
    only_decode = [s for s in sl.values() if s.role == "decode"]
    assert [b.names for b in plan_batches(only_decode, sl, "decode", 1, 1)[0]] == [["decode-0"], ["decode-1"]]
    with pytest.raises(InvalidInput, match="--serial"):
        plan_batches(only_decode, sl, "decode", canary=1, serial=0)


def test_batch_role_and_names() -> None:
    sl = _slices({"decode": 2})
    b = Batch([sl["decode-0"]], canary=True)
    assert (b.role, b.names) == ("decode", ["decode-0"])


# --- router admin --------------------------------------------------------------------------------------------


class _FakeRouter(BaseHTTPRequestHandler):
    """vllm-router's admin answers: static P/D mode refuses runtime adds, IGW mode accepts them."""

    workers: dict[str, str]
    igw: bool

    def log_message(self, *args) -> None:
        pass

    def _send(self, code: int, body) -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/workers":
            self._send(200, {"workers": [{"url": u, "worker_type": t} for u, t in self.workers.items()]})
        else:
            self._send(404, "no")

    def do_POST(self) -> None:
        u = urlparse(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if u.path == "/remove_worker":
            self.workers.pop(parse_qs(u.query)["url"][0], None)
            self._send(200, "Successfully removed worker")
        elif u.path == "/workers" and not self.igw:
            self._send(400, {"error": "PD router requires specific add_prefill_server or add_decode_server methods",
                             "code": "ADD_WORKER_FAILED"})
        elif u.path == "/workers":
            doc = json.loads(body)
            self.workers[doc["url"]] = doc["worker_type"]
            self._send(200, {"success": True})
        else:
            self._send(404, "no")


@pytest.fixture
def fake_router():
    servers = []

    def make(igw: bool) -> RouterAdmin:
        handler = type("H", (_FakeRouter,), {"igw": igw, "workers": {"http://10.0.0.1:7100": "prefill",
                                                                     "http://10.0.0.2:7100": "decode"}})
        srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return RouterAdmin(f"http://127.0.0.1:{srv.server_address[1]}/")

    yield make
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_router_admin_static_mode_removes_but_cannot_add(fake_router) -> None:
    r = fake_router(igw=False)
    assert r.members() == {"http://10.0.0.1:7100": "prefill", "http://10.0.0.2:7100": "decode"}
    assert r.supports_runtime_add() is False
    assert r.members() == {"http://10.0.0.1:7100": "prefill", "http://10.0.0.2:7100": "decode"}  # probe: no change
    r.remove("http://10.0.0.2:7100")
    assert list(r.members()) == ["http://10.0.0.1:7100"]
    with pytest.raises(RouterError, match="cannot add decode"):
        r.add("http://10.0.0.2:7100", "decode")


def test_router_admin_igw_mode_adds_at_runtime(fake_router) -> None:
    r = fake_router(igw=True)
    assert r.supports_runtime_add() is True
    r.remove("http://10.0.0.2:7100")
    r.add("http://10.0.0.2:7100", "decode")
    assert r.members()["http://10.0.0.2:7100"] == "decode"


def test_router_admin_unreachable_is_an_error() -> None:
    with pytest.raises(RouterError, match="unreachable"):
        RouterAdmin("http://127.0.0.1:9", timeout=1).members()


# --- drain ---------------------------------------------------------------------------------------------


def _ep(name: str) -> Endpoint:
    return Endpoint(name, "h", "10.0.0.1", 7100, "decode")


def test_drain_waits_for_idle_and_quiet() -> None:
    now = [0.0]
    # e1: busy for 2 s, then idle; e2: idle but serves one more request at t=1 (it arrived late from the router).
    script = {"e1": lambda t: (1.0 if t < 2 else 0.0, (5.0,)),
              "e2": lambda t: (0.0, (3.0 if t < 1 else 4.0,))}
    got = wait_drained([_ep("e1"), _ep("e2")], timeout=60, quiet=3.0, sample=lambda ep: script[ep.engine](now[0]),
                       clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert got["timed_out"] == [] and 4.5 <= got["seconds"] <= 5.5  # e1 busy until t=2, then 3 s quiet


def test_drain_timeout_names_the_busy_endpoints_and_a_dead_one_counts_as_drained() -> None:
    now = [0.0]
    got = wait_drained([_ep("busy"), _ep("dead")], timeout=4, quiet=1.0,
                       sample=lambda ep: None if ep.engine == "dead" else (2.0, (1.0,)),
                       clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert got["timed_out"] == ["busy"] and got["seconds"] >= 4


# --- the recorded release and the whole static half --------------------------------------------------


def test_release_id_is_the_one_deploy_and_rollout_record(base, tmp_path: Path, monkeypatch) -> None:
    from kimictl.deploy import Deployer, DeployOptions
    from kimictl.rollout.run import Rollout, RolloutInputs, RolloutOptions
    from kimictl.state import ReleaseRecord

    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path / "state"))
    inv, topo, r = base
    rid = release_id(r.releases)
    assert len(rid) == 16 and rid != release_id({**r.releases, "atlas-01": "other"})
    assert Deployer(inv, r.plan, r, DeployOptions(), print).release == rid
    ro = Rollout(RolloutInputs(inv, ReleaseRecord(release="old"), r, r, topo, []), RolloutOptions(), print)
    assert ro.release == rid and ro.previous == "old"


def _record_deploy(tmp_path: Path, inv_path: Path, monkeypatch) -> str:
    state = tmp_path / "state"
    monkeypatch.setenv("KIMICTL_STATE_DIR", str(state))
    inv = load_inventory(inv_path)
    topo = load_topology("a3-pd")
    r = render(make_plan(inv, topo), inv, topo)
    run = state / "ro-unit" / "runs" / "x"
    run.mkdir(parents=True)
    (run / "rendered.json").write_text(r.model_dump_json())
    rel = release_id(r.releases)
    (state / "ro-unit" / "current.json").write_text(json.dumps({"release": rel, "hosts": r.releases,
                                                                "run_dir": str(run), "result": "deployed"}))
    return rel


def test_prepare_rollout_uses_the_recorded_topology_and_applies_sets(tmp_path: Path, monkeypatch) -> None:
    inv_path = _inventory(tmp_path)
    rel = _record_deploy(tmp_path, inv_path, monkeypatch)
    got = prepare_rollout(inv_path, None, ["decode.serve.max-num-seqs=16"])
    record, new, topo = got.record, got.new, got.topology
    assert record.release == rel and release_id(got.old.releases) == rel
    assert topo.roles["decode"].serve["max-num-seqs"] == 16 and [s.raw for s in got.sets] == [
        "decode.serve.max-num-seqs=16"]
    dec = next(e for e in new.engines if e.id == "decode-0-dp0")
    assert dec.argv[dec.argv.index("--max-num-seqs") + 1] == "16"
    assert release_id(new.releases) != rel
    # a rollout's effective topology (run_dir/topology.yml) becomes the default for the next one
    (Path(record.run_dir) / "topology.yml").write_text(effective_topology_yaml(topo))
    again = prepare_rollout(inv_path, None, []).new
    assert release_id(again.releases) == release_id(new.releases)


runner = CliRunner()


def test_cli_bad_set_is_exit_2_before_touching_anything(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path / "empty-state"))
    inv = str(_inventory(tmp_path))
    r = runner.invoke(app, ["rollout", "-i", inv, "-t", "a3-pd", "--set", "decod.serve.max-num-seqs=1",
                            "--output", "json"])
    assert r.exit_code == 2, r.output
    err = json.loads(r.stdout)["error"]
    assert "decod.serve.max-num-seqs" in err["message"] and "did you mean 'decode'" in err["message"]
    assert "Traceback" not in r.output
    assert not (tmp_path / "empty-state").exists()

    r = runner.invoke(app, ["rollout", "-i", inv, "-t", "a3-pd", "--set", "decode.serve.max-num-seqs=16"])
    assert r.exit_code == 2 and "no current release" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["rollout", "-i", inv, "--set", "decode.serve.max-num-seqs=16", "--serial", "0"])
    assert r.exit_code == 2


def test_cli_refuses_an_incompatible_change_before_touching_hosts(tmp_path: Path, monkeypatch) -> None:
    inv_path = _inventory(tmp_path)
    _record_deploy(tmp_path, inv_path, monkeypatch)
    monkeypatch.setattr(hostops, "observe", lambda *a, **k: pytest.fail("hosts were contacted"))
    for items, needle in ((["kimi_vllm_ascend_version=0.18.0"], "incompatible"),
                          (["decode.tp=8", "decode.dp=2"], "slice by slice"),
                          (["proxy.routers=3"], "--allow-proxy-restart")):
        args = ["rollout", "-i", str(inv_path), "--yes", "--output", "json"]
        for it in items:
            args += ["--set", it]
        r = runner.invoke(app, args)
        assert r.exit_code == 2, r.output
        doc = json.loads(r.stdout)["error"]
        assert needle in doc["message"] + (doc["hint"] or ""), doc
