"""`kimictl heal` without hosts: detection (dead, hung by the progress rule, failing, mis-paired, stale peers, missing
from a router), the action planner, flap damping over started actions, the event log, a role's only instance,
router holds with an owner, --dry-run and the exit codes. Host operations, HTTP and the routers are the fakes of
test_orchestration (they record what was asked and keep the supervisor's view of every host)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kimictl import heal, health, state
from kimictl.cli.main import app
from kimictl.errors import HostError, InvalidInput, StateError
from kimictl.heal import Healer, HealInputs, HealOptions, prepare_heal
from kimictl.hostops import desired_procs
from kimictl.lease import Attempt, Holder
from kimictl.plan import make_plan
from kimictl.render import render
from kimictl.rundir import save_run
from kimictl.topology import Heal as TopologyHeal
from kimictl.topology import load_topology
from tests.unit.test_orchestration import CLUSTER, FakeFront, FakeHttp, FakeInstances, FakeOps, _inventory, _running

T0 = "2025-12-01T10:00:00.000Z"
NOW = 1_764_600_000.0  # 2025-12-01T14:40Z: long after T0 (no start-up grace applies)


class HealHttp(FakeHttp):
    """FakeHttp whose endpoints can be down (no /health), hung (health answers, completions time out, requests run
    and no token counter moves), queued (completions time out, requests run, tokens advance: a busy engine), failing
    (completions answer 500) or unable to hand KV over (pair probes fail, plain completions answer). A process the
    fake ops started again is healthy: the flags are on the supervisor's record of the process."""

    def __init__(self, ops: FakeOps, eps: dict[str, Any]):
        super().__init__()
        self.ops, self.eps = ops, eps
        self.completion_timeouts: list[float] = []
        self.direct: list[str] = []  # the engine of every completion sent straight to one engine (no hand-over)
        self.busy: set[str] = set()  # engines running requests whose tokens advance (a drain waits for them)
        self.gone: list[str] = []  # every request to an engine on a host that is down (ops.down)

    def _flag(self, url: str) -> str | None:
        e = self.eps.get(url.split("/v1/", 1)[0].split("/metrics", 1)[0].rstrip("/"))
        if e is None:
            return None
        if e.host in self.ops.down:
            self.gone.append(e.id)
            return "gone"
        st = self.ops.procs[e.host].get(e.id, {})
        return st.get("fault") or ("down" if st.get("state") in ("dead", "stopped") else None)

    def engine_ready(self, ip: str, port: int, served: str, timeout: float = 3.0, api_key: str | None = None):
        ok = self._flag(f"http://{ip}:{port}") not in ("down", "gone")
        return health.Ready(ok, "ready" if ok else "/health unreachable: connection refused")

    def metric_totals(self, ip: str, port: int, timeout: float = 3.0) -> dict[str, float]:
        if self._flag(f"http://{ip}:{port}") in ("gone", "down"):
            return {}  # no process, or no host, answers there
        totals = super().metric_totals(ip, port, timeout)
        n = totals[health.PREFILL_COUNTER]
        totals.update({"vllm:prompt_tokens_total": n, "vllm:generation_tokens_total": n})
        flag = self._flag(f"http://{ip}:{port}")
        if flag == "hung":
            totals = {k: 7.0 for k in totals}  # nothing moves
            totals["vllm:num_requests_running"] = 3.0
        elif flag == "queued" or self.eps[f"http://{ip}:{port}"].id in self.busy:
            totals.update({"vllm:num_requests_running": 16.0, "vllm:num_requests_waiting": 40.0})
        return totals

    def http_request(self, method: str, url: str, body: Any = None, timeout: float = 10.0,
                     headers: dict | None = None, api_key: str | None = None) -> tuple[int, str]:
        flag = self._flag(url)
        if flag == "gone":
            return 0, "connection refused"
        if flag in ("hung", "queued"):
            return 0, "timed out"
        if flag == "failing":
            return 500, "EngineCore died"
        if flag == "no-kv" and body and ("kv_transfer_params" in body):
            return 500, "KV transfer failed: handshake with the remote engine timed out"
        return super().http_request(method, url, body, timeout, headers, api_key)

    def http_post_json(self, url: str, body: dict, timeout: float = 60.0, api_key: str | None = None):
        if url.split("/v1/", 1)[0] in self.eps and "kv_transfer_params" not in body:  # the probe of one engine
            self.completion_timeouts.append(timeout)
            self.direct.append(self.eps[url.split("/v1/", 1)[0]].id)
        code, text = self.http_request("POST", url, body, timeout)
        return code, json.loads(text) if code == 200 else text


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state" / CLUSTER


def _cluster(tmp_path: Path, hosts: int = 4, opts: HealOptions | None = None, clock: float = NOW):
    """a3-pd on `hosts` A3 hosts runs its recorded release (2P2D on four); the routers are vllm-ascend proxy copies
    behind kimictl's front, each listing every endpoint. Returns (make_healer, ops, rendered, router log)."""
    inv = _inventory(tmp_path, hosts)
    topo = load_topology("a3-pd")
    rendered = render(make_plan(inv, topo), inv, topo)
    run_dir = tmp_path / "runs" / "deploy"
    save_run(run_dir, rendered, rendered)
    rec = state.ReleaseRecord.now(release=state.release_id(rendered.releases), cluster=CLUSTER, topology="a3-pd",
                                  hosts=rendered.releases, result="deployed", run_dir=str(run_dir))
    state.record_release(CLUSTER, rec)
    procs = _running(desired_procs(rendered, inv))
    for per_host in procs.values():
        for st in per_host.values():
            st.update(child_started_at=T0, restarts=0)
    ops = FakeOps(inv, tmp_path / "run", procs, dict(rendered.releases))
    eps = {f"http://{e.host_ip}:{e.port}": e for e in rendered.engines if e.serves_http}
    http = HealHttp(ops, eps)
    log: list[tuple[str, str, str]] = []
    front = FakeFront(log)
    copies: dict[str, FakeInstances] = {}

    def instances(url: str, api_key: str | None = None, http: Any = None) -> FakeInstances:
        # one membership per router copy, kept across heal rounds (as the proxy keeps it)
        if url not in copies:
            copies[url] = FakeInstances(url, {u: e.role for u, e in eps.items()}, log, front)
        return copies[url]

    def make(o: HealOptions | None = None) -> Healer:
        # a short hang deadline: a drain gives up on requests stuck that long (real time)
        o = o or opts or HealOptions.resolve(drain_quiet=0.0, drain_timeout=5.0, hang_deadline=0.5)
        return Healer(HealInputs(inv, rec, rendered), o, lambda m: None, ops=ops, http=http, instances=instances,
                      front=lambda url, api_key=None, http=None: front, clock=lambda: clock, sleep=lambda s: None,
                      hold=make.hold)

    make.http, make.copies, make.front = http, copies, front
    make.hold = free_lease
    return make, ops, rendered, log


def _engines(rendered, instance: str) -> list[Any]:
    return [e for e in rendered.engines if e.instance == instance]


def _set(ops: FakeOps, engines: list[Any], **fields: Any) -> None:
    for e in engines:
        ops.procs[e.host][e.id].update(fields)


def _restarted(ops: FakeOps) -> list[list[str]]:
    return [sorted(i for ids in c[3].values() for i in ids) for c in ops.actions()
            if c[1] == "restart on the current release"]


def _urls(engines: list[Any]) -> set[str]:
    return {f"http://{e.host_ip}:{e.port}" for e in engines if e.serves_http}


# --- detection and healing -----------------------------------------------------------------------------------


def test_a_healthy_cluster_needs_nothing_and_nothing_is_touched(tmp_path: Path) -> None:
    make, ops, _rendered, log = _cluster(tmp_path)
    res = make().run()
    assert (res.result, res.findings, res.actions, res.exit_code) == ("healthy", [], [], 0)
    assert not ops.actions() and not [x for x in log if x[1] in ("remove", "add")]
    assert state.heal_events(CLUSTER) == []


def test_a_hung_decode_is_drained_restarted_pair_smoked_and_readded(tmp_path: Path) -> None:
    make, ops, rendered, log = _cluster(tmp_path)
    d0 = _engines(rendered, "decode-0")
    _set(ops, d0, fault="hung")
    h = make()
    res = h.run()
    assert res.result == "healed" and res.exit_code == 0, res.error
    assert {(f.kind, f.slice) for f in res.findings} == {("hung", "decode-0")}
    assert sorted(f.engine for f in res.findings) == sorted(e.id for e in d0 if e.serves_http)
    assert "3 request(s) run on it and no token counter moved within 0.5s" in res.findings[0].detail
    # no completion of its own to a decode engine (a local prefill there crashes vllm-ascend, #11882): each prefill
    # engine got one straight, the decode engines only P/D hand-overs
    prefill_eps = sorted(e.id for e in rendered.engines if e.serves_http and e.role == "prefill")
    assert sorted(make.http.direct) == prefill_eps and set(make.http.completion_timeouts) == {0.5 + 2.0}
    [a] = res.actions
    assert (a.slice, a.reasons, a.steps, a.result) == ("decode-0", ["hung"], ["drain", "restart", "pair-smoke",
                                                                               "readd"], "healed")
    assert _restarted(ops) == [sorted(e.id for e in d0)]  # only that slice, on the release it runs
    assert {p["decode"] for p in a.probes} == {e.id for e in d0 if e.serves_http} and all(p["ok"] for p in a.probes)
    # drained from both router copies first, re-added (one held copy at a time) after the restart
    copy0 = [(op, u) for who, op, u in log if who.endswith("/kimictl/router/0")]
    n = len(_urls(d0))
    assert {op for op, _ in copy0[:n]} == {"remove"} and {u for _, u in copy0[:n]} == _urls(d0)
    assert {op for op, _ in copy0[n:]} == {"add"} and {u for _, u in copy0[n:]} == _urls(d0)
    assert [(op, i) for who, op, i in log if who == "front"] == [("hold", "0"), ("release", "0"), ("hold", "1"),
                                                                  ("release", "1")]
    assert res.proxy_gate and res.proxy_gate["ok"]
    started, ended = state.heal_events(CLUSTER)  # "started" before anything was touched, then the end
    assert [(e["event"], e["slice"], e["result"], e["reasons"]) for e in (started, ended)] == [
        ("action", "decode-0", "started", ["hung"]), ("action", "decode-0", "healed", ["hung"])]
    assert started["id"] == ended["id"] and started["findings"] and "seconds" in ended
    # heal held each copy as its own owner and released only that
    assert set(make.front.owners) == {f"heal:{os.getpid()}"} and make.front.held == set()
    # the next round finds nothing: the restart cured it
    assert make().run().result == "healthy"


def test_queueing_under_load_is_not_a_hang_and_nothing_restarts(tmp_path: Path) -> None:
    """decode-0 queues: its probes get no answer within the deadline (requests wait behind a full batch) while its
    token counters advance. Slow is not hung: no finding, nothing touched."""
    make, ops, rendered, log = _cluster(tmp_path)
    _set(ops, _engines(rendered, "decode-0"), fault="queued")
    res = make().run()
    assert (res.result, res.findings, res.actions) == ("healthy", [], [])
    assert not ops.actions() and not [x for x in log if x[1] in ("remove", "add")]


def test_a_drain_waits_for_progressing_requests_up_to_the_drain_timeout(tmp_path: Path) -> None:
    """A failing prefill slice whose other requests still advance is drained the way a rollout drains: heal waits
    for them up to --drain-timeout (not a fixed 2 s), then cuts them."""
    make, ops, rendered, _ = _cluster(tmp_path)
    p0 = _engines(rendered, "prefill-0")
    _set(ops, p0[:1], fault="failing")
    make.http.busy = {e.id for e in p0}
    said: list[str] = []
    h = make(HealOptions.resolve(drain_quiet=0.0, drain_timeout=3.0, hang_deadline=0.5))
    h.say = h.steps.say = said.append
    res = h.run()
    assert res.result == "healed", res.error
    assert res.actions[0].seconds["drain"] >= 3.0
    assert any(m.startswith("drain timeout (3s)") for m in said), said


def test_a_drain_gives_up_on_requests_that_make_no_progress() -> None:
    from kimictl.slices.model import Endpoint
    from kimictl.slices.probes import wait_drained

    now = [0.0]
    eps = [Endpoint(e, "h", "10.0.0.1", 1, "decode") for e in ("stuck", "slow")]
    samples = {"stuck": lambda: (3.0, (7.0,), 3.0), "slow": lambda: (3.0, (now[0],), 3.0)}

    def sleep(s: float) -> None:
        now[0] += s

    got = wait_drained(eps, timeout=10, quiet=1.0, sample=lambda ep: samples[ep.engine](), clock=lambda: now[0],
                       sleep=sleep, stuck=2.0)
    assert (got["stuck"], got["timed_out"]) == (["stuck"], ["slow"]) and got["seconds"] > 10
    # without `stuck` (a rollout's drain), both are waited for until the timeout
    now[0] = 0.0
    got = wait_drained(eps, timeout=10, quiet=1.0, sample=lambda ep: samples[ep.engine](), clock=lambda: now[0],
                       sleep=sleep)
    assert (got["stuck"], got["timed_out"]) == ([], ["slow", "stuck"])


def test_a_dead_engine_restarts_its_whole_slice_and_a_lone_supervisor_restart_counts_as_dead(tmp_path) -> None:
    make, ops, rendered, _ = _cluster(tmp_path)
    p1, d1 = _engines(rendered, "prefill-1"), _engines(rendered, "decode-1")
    _set(ops, p1[:1], state="failed", last_exit={"code": 1})
    _set(ops, d1[1:2], restarts=2, last_exit={"signal": 9, "signal_name": "SIGKILL"})
    res = make().run()
    assert res.result == "healed", res.error
    kinds = {(f.slice, f.engine): f.kind for f in res.findings}
    assert kinds == {("prefill-1", p1[0].id): "dead", ("decode-1", d1[1].id): "dead"}
    assert "supervisor state failed" in next(f.detail for f in res.findings if f.slice == "prefill-1")
    assert "killed by SIGKILL" in next(f.detail for f in res.findings if f.slice == "decode-1")
    assert _restarted(ops) == [sorted(e.id for e in p1), sorted(e.id for e in d1)]  # plan order, one at a time


def test_an_engine_that_does_not_answer_health_is_dead_unless_a_playbook_just_started_it(tmp_path) -> None:
    make, ops, rendered, _ = _cluster(tmp_path)
    d1 = _engines(rendered, "decode-1")
    _set(ops, d1[:1], fault="down", child_started_at="2025-12-01T14:35:00.000Z")  # NOW - 5 min, no crash
    res = make(HealOptions.resolve(dry_run=True)).run()
    assert [(f.kind, f.engine) for f in res.findings] == [("starting", d1[0].id)] and res.actions == []
    assert res.result == "healthy"
    _set(ops, d1[:1], child_started_at=T0)  # loading for days: dead
    res = make(HealOptions.resolve(dry_run=True)).run()
    assert [(f.kind, f.engine) for f in res.findings] == [("dead", d1[0].id)]
    assert [a.slice for a in res.actions] == ["decode-1"] and res.result == "planned" and res.exit_code == 3


def test_an_engine_answering_errors_is_failing(tmp_path: Path) -> None:
    make, ops, rendered, _ = _cluster(tmp_path)
    p0 = _engines(rendered, "prefill-0")
    _set(ops, p0[:1], fault="failing")
    res = make(HealOptions.resolve(dry_run=True)).run()
    assert [(f.kind, f.slice) for f in res.findings] == [("failing", "prefill-0")]
    assert "HTTP 500: EngineCore died" in res.findings[0].detail


def test_a_pair_that_fails_the_handover_while_both_look_healthy_is_localized(tmp_path: Path) -> None:
    make, ops, rendered, _ = _cluster(tmp_path)
    d1 = _engines(rendered, "decode-1")
    _set(ops, d1[:1], fault="no-kv")
    res = make().run()
    assert [(f.kind, f.slice, f.engine) for f in res.findings] == [("pair", "decode-1", d1[0].id)]
    assert "KV transfer failed" in res.findings[0].detail
    assert res.result == "healed" and _restarted(ops) == [sorted(e.id for e in d1)]


def test_a_peer_restarted_under_partners_that_cached_it_restarts_the_partners_too(tmp_path: Path) -> None:
    """prefill-0's engine restarted (later start) and now every hand-over with it fails, while both decode slices
    hand over with prefill-1: the decodes hold its old state (stale peer) and restart as well, one at a time."""
    make, ops, rendered, _ = _cluster(tmp_path)
    p0 = _engines(rendered, "prefill-0")
    _set(ops, p0[:1], fault="no-kv", child_started_at="2025-12-01T14:00:00.000Z")
    res = make(HealOptions.resolve(dry_run=True)).run()
    kinds = {(f.kind, f.slice) for f in res.findings}
    assert ("pair", "prefill-0") in kinds
    assert {s for k, s in kinds if k == "stale-peer"} == {"decode-0", "decode-1"}
    assert [a.slice for a in res.actions] == ["prefill-0", "decode-0", "decode-1"]
    assert not ops.actions()  # dry run


def test_unplaceable_pair_failures_escalate(tmp_path: Path) -> None:
    make, ops, rendered, _ = _cluster(tmp_path)
    _set(ops, [e for e in rendered.engines if e.role == "decode"], fault="no-kv")
    res = make().run()
    assert res.result == "escalated" and res.exit_code == 1 and res.actions == []
    assert "no single engine can be blamed" in res.escalations[0]
    assert not ops.actions()
    assert [e["event"] for e in state.heal_events(CLUSTER)] == ["escalate"]


def test_an_endpoint_a_router_dropped_is_readded_without_a_restart(tmp_path: Path) -> None:
    make, ops, rendered, _log = _cluster(tmp_path)
    h = make()
    h.steps.connect_routers()
    d1 = _engines(rendered, "decode-1")
    url = sorted(_urls(d1))[0]
    make.copies[h.steps.routers[1].url]._members.pop(url)
    res = make().run()
    assert [(f.kind, f.slice) for f in res.findings] == [("missing", "decode-1")]
    assert "router 1" in res.findings[0].detail
    assert res.actions[0].steps == ["readd"] and res.result == "healed"
    assert not ops.actions() and url in make.copies[h.steps.routers[1].url].members()


def test_a_role_s_only_instance_is_never_restarted_automatically_heal_escalates(tmp_path: Path) -> None:
    make, ops, rendered, log = _cluster(tmp_path, hosts=2)
    d0 = _engines(rendered, "decode-0")
    _set(ops, d0, fault="hung")
    res = make().run()
    [a] = res.actions
    assert (res.result, res.exit_code, a.result) == ("escalated", 1, "escalated")
    assert "decode-0 is the only decode instance: heal would have restarted it (hung)" in a.error
    assert res.escalations == [a.error]
    assert not ops.actions() and not [x for x in log if x[1] in ("remove", "add", "hold")]
    assert [e["event"] for e in state.heal_events(CLUSTER)] == ["escalate"]  # no action started


# --- failures, flap damping, dry run ----------------------------------------------------------------------------


def test_a_failed_restart_stops_the_round_and_is_recorded(tmp_path: Path) -> None:
    make, ops, rendered, _log = _cluster(tmp_path)
    d0, p1 = _engines(rendered, "decode-0"), _engines(rendered, "prefill-1")
    _set(ops, d0, fault="hung")
    _set(ops, p1[:1], state="failed")
    ops.fail_ready = {ops.procs[p1[0].host][p1[0].id]["tag"]}
    res = make().run()
    assert res.result == "failed" and res.exit_code == 1
    assert "did not become ready" in res.error
    assert [(a.slice, a.result) for a in res.actions] == [("prefill-1", "failed"), ("decode-0", "planned")]
    assert [(e["slice"], e["result"]) for e in state.heal_events(CLUSTER)] == [("prefill-1", "started"),
                                                                                ("prefill-1", "failed")]
    # the failed slice stays drained: it must not get requests
    copy0 = make.copies[next(iter(make.copies))]
    assert not _urls(p1) & set(copy0.members())


def test_flap_damping_escalates_after_max_actions_per_slice_within_the_window(tmp_path: Path) -> None:
    make, ops, rendered, _ = _cluster(tmp_path)
    d0 = _engines(rendered, "decode-0")
    for ts in (NOW - 7200, NOW - 100, NOW - 50):  # the first is outside the 3600 s window
        state.append_heal_event(CLUSTER, {"event": "action", "slice": "decode-0", "result": "healed", "ts": ts})
    _set(ops, d0, fault="hung")
    res = make(HealOptions.resolve(drain_quiet=0.0, max_actions=3, hang_deadline=0.5)).run()
    assert res.result == "healed"  # two within the window: a third action is allowed
    assert make().recent_actions() == {"decode-0": 3}  # its "started" and end events are one action
    _set(ops, d0, fault="hung")
    res = make(HealOptions.resolve(drain_quiet=0.0, max_actions=3, hang_deadline=0.5)).run()
    assert res.result == "escalated" and res.exit_code == 1
    assert res.actions[0].result == "escalated"
    assert "decode-0: 3 heal action(s) started within the last 3600s (at most 3)" in res.escalations[0]
    assert len(_restarted(ops)) == 1  # nothing was touched the second time
    assert state.heal_events(CLUSTER)[-1]["event"] == "escalate"
    # a wider limit from the topology lets it act again
    res = make(HealOptions.resolve(TopologyHeal(max_actions=5), drain_quiet=0.0, hang_deadline=0.5)).run()
    assert res.result == "healed"


def test_dry_run_plans_and_changes_nothing(tmp_path: Path, state_dir: Path) -> None:
    make, ops, rendered, log = _cluster(tmp_path)
    _set(ops, _engines(rendered, "decode-0"), fault="hung")
    res = make(HealOptions.resolve(dry_run=True)).run()
    assert res.result == "planned" and res.exit_code == 3 and res.dry_run
    assert [(a.slice, a.result) for a in res.actions] == [("decode-0", "planned")]
    assert not ops.actions() and not [x for x in log if x[1] in ("remove", "add", "hold")]
    assert not state.heal_events_path(CLUSTER).exists() and res.run_dir is None


def test_options_come_from_heal_yml_then_the_topology_then_the_command_line() -> None:
    d = HealOptions.resolve()
    assert (d.hang_deadline, d.max_actions, d.window) == (20.0, 3, 3600.0)
    t = HealOptions.resolve(TopologyHeal(hang_deadline_s=5, window_s=60))
    assert (t.hang_deadline, t.max_actions, t.window) == (5, 3, 60)
    c = HealOptions.resolve(TopologyHeal(hang_deadline_s=5), hang_deadline=2.5, max_actions=None)
    assert (c.hang_deadline, c.max_actions) == (2.5, 3)


def test_a_round_starts_from_the_current_release_and_its_topologys_heal_section(tmp_path: Path) -> None:
    from kimictl.rollout.overrides import effective_topology_yaml

    _make, _ops, rendered, _ = _cluster(tmp_path)
    got = prepare_heal(tmp_path / "inv.yml")
    assert got.record.release == state.release_id(rendered.releases) and got.rendered == rendered
    assert got.topology_heal == load_topology("a3-pd").heal
    # a rollout's effective topology in the release's run directory comes first
    topo = load_topology("a3-pd").model_copy(update={"heal": TopologyHeal(max_actions=5)})
    (Path(got.record.run_dir) / "topology.yml").write_text(effective_topology_yaml(topo))
    assert prepare_heal(tmp_path / "inv.yml").topology_heal == TopologyHeal(max_actions=5)


def test_heal_stands_beside_the_rollout_and_imports_none_of_it() -> None:
    code = "import sys, kimictl.heal; print(*(m for m in sys.modules if m.startswith('kimictl.rollout')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    assert out.strip() == ""


@contextlib.contextmanager
def free_lease(command: str):
    """The cluster lease, free: taken for the action (kimictl.lease.try_hold without a lock host)."""
    yield Attempt(True, Holder(command=command))


def test_heal_needs_a_pd_cluster(tmp_path: Path) -> None:
    inv = _inventory(tmp_path, 1)
    topo = load_topology("a3-colocated")
    rendered = render(make_plan(inv, topo), inv, topo)
    rec = state.ReleaseRecord.now(release="r", cluster=CLUSTER, hosts=rendered.releases, result="deployed")
    with pytest.raises(InvalidInput, match="colocated"):
        Healer(HealInputs(inv, rec, rendered), HealOptions(), lambda m: None, ops=FakeOps(inv, tmp_path, {}, {}))


def test_the_event_log_is_jsonl_and_a_damaged_line_is_named(state_dir: Path) -> None:
    state.append_heal_event(CLUSTER, {"event": "action", "slice": "decode-0"})
    path = state.heal_events_path(CLUSTER)
    with path.open("a") as f:
        f.write('{"event": "oops"}\n{"event": "action", "slice": "decode-1", "ts": 1}\n')  # line 2 has no ts
    with pytest.raises(StateError, match=r"heal-events.jsonl \(line 2\) is damaged"):
        state.heal_events(CLUSTER)


def test_a_torn_last_line_of_the_event_log_is_ignored_and_cut_away_by_the_next_event(tmp_path: Path) -> None:
    """A heal killed while it wrote an event leaves a cut-off last line: the next round reads the log without it,
    acts, and its first event replaces the torn tail (a torn line never ends up in the middle)."""
    make, ops, rendered, _ = _cluster(tmp_path)
    state.append_heal_event(CLUSTER, {"event": "action", "id": "a1", "slice": "decode-0", "result": "started"})
    path = state.heal_events_path(CLUSTER)
    with path.open("a") as f:
        f.write('{"at":"2025-12-01T14:39:00+00:00","ts":1764600000,"event":"act')  # killed mid-line
    assert [e["id"] for e in state.heal_events(CLUSTER)] == ["a1"]
    _set(ops, _engines(rendered, "decode-1"), fault="hung")
    res = make().run()
    assert res.result == "healed", res.error
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(x)["event"] == "action" for x in lines)
    assert [e["result"] for e in state.heal_events(CLUSTER)] == ["started", "started", "healed"]
    # an intact event that only lost its newline keeps its place
    path.write_text(path.read_text().rstrip("\n"))
    state.append_heal_event(CLUSTER, {"event": "escalate", "reason": "x"})
    assert [e["event"] for e in state.heal_events(CLUSTER)] == ["action"] * 3 + ["escalate"]


def test_an_action_killed_midway_counts_towards_flap_damping(tmp_path: Path) -> None:
    """The "started" event is on disk before heal touches the slice: a round killed during its restart (Ctrl-C, a
    lost runner) still counts, so a slice whose restart kills or stalls heal cannot be restarted forever."""
    make, ops, rendered, _ = _cluster(tmp_path)
    d0 = _engines(rendered, "decode-0")

    def killed(*_a: Any, **_k: Any) -> None:
        raise KeyboardInterrupt

    _set(ops, d0, fault="hung")
    real = ops.apply_actions
    ops.apply_actions = killed
    with pytest.raises(KeyboardInterrupt):
        make().run()
    [ev] = state.heal_events(CLUSTER)
    assert (ev["slice"], ev["result"]) == ("decode-0", "started")
    ops.apply_actions = real
    res = make(HealOptions.resolve(drain_quiet=0.0, max_actions=1, hang_deadline=0.5)).run()
    assert res.result == "escalated" and "decode-0: 1 heal action(s) started" in res.escalations[0]
    assert not ops.actions()


def test_heal_never_releases_a_hold_another_command_placed(tmp_path: Path) -> None:
    """A rollout holds router copy 0 while heal re-adds a slice: heal holds and releases as "heal:<pid>", so the
    rollout's hold stays; copy 1 cannot be held while copy 0 is (no copy would be left for clients): the action
    fails rather than take it."""
    make, ops, rendered, _log = _cluster(tmp_path)
    make.front.holders[0] = {"rollout:4242"}
    _set(ops, _engines(rendered, "decode-0"), fault="hung")
    res = make().run()
    assert res.result == "failed" and "409" in res.error
    assert make.front.holders[0] == {"rollout:4242"}
    assert make.front.owners == [f"heal:{os.getpid()}"] * 2  # hold and release of copy 0, both its own


# --- the command line ------------------------------------------------------------------------------------------


def _cli(monkeypatch, make, *args: str):
    import functools

    monkeypatch.setattr(heal, "Healer", functools.partial(
        Healer, ops=make().ops, http=make.http, instances=lambda url, api_key=None, http=None: make.copies[url],
        front=lambda url, api_key=None, http=None: FakeFront([]), sleep=lambda s: None, hold=make.hold))
    return CliRunner().invoke(app, ["heal", *args])


def test_cli_exit_codes_and_json(tmp_path: Path, monkeypatch) -> None:
    make, ops, rendered, _ = _cluster(tmp_path)
    make().steps.connect_routers()  # the copies exist before the CLI's Healer asks for them
    inv = str(tmp_path / "inv.yml")
    ok = _cli(monkeypatch, make, "-i", inv, "--once", "--output", "json")
    assert ok.exit_code == 0, ok.output
    doc = json.loads(ok.stdout)
    assert (doc["schema_version"], doc["result"], doc["cluster"]) == (1, "healthy", CLUSTER)
    _set(ops, _engines(rendered, "decode-1"), fault="hung")
    planned = _cli(monkeypatch, make, "-i", inv, "--dry-run", "--hang-deadline", "3")
    assert planned.exit_code == 3, planned.output
    assert "would heal" in planned.stdout and "decode-1" in planned.stdout and "within 3s" in planned.stdout
    assert not ops.actions()
    for _ in range(2):
        state.append_heal_event(CLUSTER, {"event": "action", "slice": "decode-1", "result": "healed"})
    esc = _cli(monkeypatch, make, "-i", inv, "--once", "--max-actions", "2", "--output", "json")
    assert esc.exit_code == 1
    assert json.loads(esc.stdout)["result"] == "escalated" and "decode-1: 2 heal action(s) started" in esc.stderr
    assert "Traceback" not in esc.output


def test_cli_bad_input_is_exit_2(tmp_path: Path) -> None:
    missing = CliRunner().invoke(app, ["heal", "-i", str(tmp_path / "nope.yml"), "--once"])
    assert missing.exit_code == 2
    _inventory(tmp_path, 2)
    never = CliRunner().invoke(app, ["heal", "-i", str(tmp_path / "inv.yml"), "--once"])
    assert never.exit_code == 2 and "no current release" in never.output
    assert "Traceback" not in never.output


def test_a_host_error_while_reading_the_hosts_is_exit_1(tmp_path: Path, monkeypatch) -> None:
    make, ops, _, _ = _cluster(tmp_path)

    def unreachable(hosts=None):
        raise HostError("cannot read the current state of 1 host(s)", host="atlas-02", step="observe")

    monkeypatch.setattr(ops, "observe", unreachable)
    res = _cli(monkeypatch, make, "-i", str(tmp_path / "inv.yml"), "--once")
    assert res.exit_code == 1 and "atlas-02" in res.output and "Traceback" not in res.output


def test_heal_takes_the_lease_per_action_and_skips_while_another_command_holds_it(tmp_path) -> None:
    """Issue 34: a heal action runs only under the cluster lease; held by a rollout (or its lock host silent),
    the action is skipped, saying who holds it, and nothing restarts."""
    make, ops, rendered, _ = _cluster(tmp_path)
    p1 = _engines(rendered, "prefill-1")
    _set(ops, p1[:1], state="failed", last_exit={"code": 1})
    taken: list[str] = []

    @contextlib.contextmanager
    def held(command: str):
        taken.append(command)
        yield Attempt(False, Holder(hostname="ci-7", user="ci", pid=42, command="kimictl rollout"))

    make.hold = held
    res = make().run()
    assert taken == ["heal prefill-1: " + ", ".join(res.actions[0].steps)]
    assert res.actions[0].result == "skipped" and "ci-7" in res.actions[0].note and "holds the cluster lease" in \
        res.actions[0].note
    assert _restarted(ops) == [] and (res.result, res.exit_code) == ("deferred", 3)

    def unreachable(command: str):
        raise HostError("cannot reach the lock host", host="a3-node-01", step="lease")

    make.hold = unreachable
    res = make().run()
    assert res.actions[0].result == "skipped" and "cannot reach the lock host" in res.actions[0].note
    assert _restarted(ops) == []


# --- a host that does not answer, and comes back -----------------------------------------------------------------


def _host_events() -> list[tuple[str, str, list[str]]]:
    return [(e["host"], e["result"], e["slices"]) for e in state.heal_events(CLUSTER) if e["event"] == "host"]


def _listed(make, urls: set[str]) -> list[set[str]]:
    """Per router copy, which of `urls` it lists."""
    return [urls & set(c.members()) for c in make.copies.values()]


def _take_down(ops, rendered, instance: str) -> tuple[str, list[Any]]:
    engines = _engines(rendered, instance)
    host = engines[0].host
    assert {e.host for e in engines} == {host}
    ops.down.add(host)
    return host, engines


def _reboot(ops, host: str) -> None:
    """The host answers again; its supervisors died with it (their records say "dead")."""
    ops.down.discard(host)
    for st in ops.procs[host].values():
        st.update(state="dead", fault=None)


def test_a_host_that_does_not_answer_is_reported_and_routed_out_once_and_nothing_else_restarts(tmp_path) -> None:
    """decode-1's host goes down: the round returns (no exception), reports it, routes decode-1 out of every router
    copy (under the lease: deferred while another command holds it), asks its engines nothing and restarts nothing;
    one "unreachable" event however many rounds it stays away."""
    make, ops, rendered, log = _cluster(tmp_path)
    host, d1 = _take_down(ops, rendered, "decode-1")
    urls = _urls(d1)
    dry = make(HealOptions.resolve(dry_run=True)).run()
    assert (dry.result, [(a.slice, a.steps) for a in dry.actions]) == ("unreachable", [("decode-1", ["route-out"])])
    assert not state.heal_events_path(CLUSTER).exists() and _listed(make, urls) == [urls, urls]

    @contextlib.contextmanager
    def held(command: str):
        yield Attempt(False, Holder(hostname="ci-7", user="ci", pid=42, command="kimictl rollout"))

    make.hold = held
    res = make().run()
    assert (res.result, res.exit_code, res.error) == ("unreachable", 1, None)
    assert set(res.unreachable) == {host} and "Connection refused" in res.unreachable[host]
    assert {(f.kind, f.slice) for f in res.findings} == {("unreachable", "decode-1")}
    assert sorted(f.engine for f in res.findings) == sorted(e.id for e in d1)
    assert [(a.slice, a.result) for a in res.actions] == [("decode-1", "skipped")] and "ci-7" in res.actions[0].note
    assert _listed(make, urls) == [urls, urls]
    assert _host_events() == [(host, "unreachable", ["decode-1"])]

    make.hold = free_lease
    res = make().run()
    [a] = res.actions
    assert (a.slice, a.reasons, a.steps, a.result) == ("decode-1", ["unreachable"], ["route-out"], "routed-out")
    assert res.result == "unreachable" and _listed(make, urls) == [set(), set()]
    assert not [x for x in log if x[1] in ("add", "hold")]  # no re-add, no held copy: a remove is enough
    for _ in range(2):  # it stays away: reported every round, acted on and logged once
        res = make().run()
        assert (res.result, res.actions, set(res.unreachable)) == ("unreachable", [], {host})
    assert _host_events() == [(host, "unreachable", ["decode-1"])]
    assert not ops.actions() and not [e for e in state.heal_events(CLUSTER) if e["event"] != "host"]
    assert make.http.gone == []  # its engines were asked nothing (no readiness, probe, drain sample)


def test_while_a_host_is_away_another_slice_heals_with_live_partners_only(tmp_path: Path) -> None:
    """decode-0's host is down and prefill-1 crashes: prefill-1 alone restarts; its pair smoke and the proxy gate
    use decode-1 and never wait on the host that is away."""
    make, ops, rendered, _ = _cluster(tmp_path)
    _take_down(ops, rendered, "decode-0")
    assert [a.result for a in make().run().actions] == ["routed-out"]
    p1 = _engines(rendered, "prefill-1")
    _set(ops, p1[:1], state="failed", last_exit={"code": 1})
    res = make().run()
    assert res.result == "unreachable" and res.error is None
    assert [(a.slice, a.result) for a in res.actions] == [("prefill-1", "healed")]
    assert _restarted(ops) == [sorted(e.id for e in p1)]
    assert {p["decode"] for a in res.actions for p in a.probes} <= {e.id for e in _engines(rendered, "decode-1")}
    assert res.proxy_gate and res.proxy_gate["ok"] and make.http.gone == []


def test_a_host_that_comes_back_gets_its_engines_started_on_the_current_release_smoked_and_readded(tmp_path) -> None:
    make, ops, rendered, log = _cluster(tmp_path)
    host, d1 = _take_down(ops, rendered, "decode-1")
    urls = _urls(d1)
    assert make().run().result == "unreachable"
    _reboot(ops, host)
    del log[:]
    res = make().run()
    assert res.result == "healed" and res.exit_code == 0 and res.unreachable == {}, res.error
    assert {(f.kind, f.slice) for f in res.findings} == {("returned", "decode-1")}
    assert f"{host} answers again after it did not; supervisor state dead" in res.findings[0].detail
    [a] = res.actions
    assert (a.slice, a.reasons, a.steps, a.result) == ("decode-1", ["returned"], ["drain", "restart", "pair-smoke",
                                                                                  "readd"], "healed")
    assert _restarted(ops) == [sorted(e.id for e in d1)]  # that slice alone
    # started as the current render says (its tag and command, on the release recorded for that host)
    want = {p.id: p for p in desired_procs(rendered, ops.inv) if p.host == host}
    assert {i: (st["tag"], st["cmd"]) for i, st in ops.procs[host].items()} == {
        i: (p.tag, p.cmd) for i, p in want.items()}
    assert all(f"/releases/{rendered.releases[host]}/" in p.cmd[1] for p in want.values())
    # ready, then pair smoke against live prefill partners, then back into every router copy
    assert ("wait_ready", sorted(e.id for e in d1)) in ops.calls
    assert {p["decode"] for p in a.probes} == {e.id for e in d1 if e.serves_http} and all(p["ok"] for p in a.probes)
    assert _listed(make, urls) == [urls, urls] and res.proxy_gate and res.proxy_gate["ok"]
    assert [(e["event"], e.get("result")) for e in state.heal_events(CLUSTER)] == [
        ("host", "unreachable"), ("host", "back"), ("action", "started"), ("action", "healed")]
    again = make().run()
    assert (again.result, again.findings) == ("healthy", []) and len(state.heal_events(CLUSTER)) == 4


def test_a_host_whose_engines_kept_running_is_only_readded(tmp_path: Path) -> None:
    """A host cut off and back with its engines still running: nothing to restart; routed out while away, re-added
    when its engines answer (and hand over) again."""
    make, ops, rendered, _ = _cluster(tmp_path)
    host, d1 = _take_down(ops, rendered, "decode-1")
    make().run()
    ops.down.discard(host)
    res = make().run()
    assert res.result == "healed" and {f.kind for f in res.findings} == {"missing"}
    assert [a.steps for a in res.actions] == [["readd"]] and not ops.actions()
    assert _listed(make, _urls(d1)) == [_urls(d1)] * 2
    assert [e["result"] for e in state.heal_events(CLUSTER)] == ["unreachable", "back", "started", "healed"]


def test_bringing_a_host_back_waits_for_the_lease_and_is_retried_next_round(tmp_path: Path) -> None:
    make, ops, rendered, _ = _cluster(tmp_path)
    host, d1 = _take_down(ops, rendered, "decode-1")
    make().run()
    _reboot(ops, host)

    @contextlib.contextmanager
    def held(command: str):
        yield Attempt(False, Holder(hostname="ci-7", user="ci", pid=42, command="kimictl rollout"))

    make.hold = held
    res = make().run()
    assert (res.result, res.exit_code) == ("deferred", 3) and res.actions[0].result == "skipped"
    assert _restarted(ops) == []
    make.hold = free_lease
    res = make().run()
    assert res.result == "healed" and res.actions[0].reasons == ["returned"], res.error
    assert _restarted(ops) == [sorted(e.id for e in d1)]
    assert [e["result"] for e in state.heal_events(CLUSTER)] == ["unreachable", "back", "started", "healed"]


def test_the_only_instance_whose_host_came_back_is_brought_back_but_not_restarted_when_it_breaks_later(tmp_path):
    """1P1D: the decode host reboots. Its only decode instance serves nothing then, so heal starts it (that cannot
    make anything worse); once healed it is an ordinary only instance again: a later crash escalates."""
    make, ops, rendered, _ = _cluster(tmp_path, hosts=2)
    host, d0 = _take_down(ops, rendered, "decode-0")
    res = make().run()
    assert res.result == "unreachable" and [a.result for a in res.actions] == ["routed-out"]
    assert res.escalations == []
    _reboot(ops, host)
    res = make().run()
    assert res.result == "healed" and res.escalations == [], res.error
    assert _restarted(ops) == [sorted(e.id for e in d0)]
    _set(ops, d0[:1], state="failed", last_exit={"code": 1})
    res = make().run()
    assert res.result == "escalated" and "decode-0 is the only decode instance" in res.escalations[0]
    assert len(_restarted(ops)) == 1


def test_a_failed_bring_back_is_retried_then_damped(tmp_path: Path) -> None:
    """The returned slice stays "returned" until a heal of it succeeds; each try counts towards flap damping."""
    make, ops, rendered, _ = _cluster(tmp_path, hosts=2)
    host, d0 = _take_down(ops, rendered, "decode-0")
    make().run()
    _reboot(ops, host)
    ops.fail_ready = {p.tag for p in desired_procs(rendered, ops.inv) if p.host == host}
    o = HealOptions.resolve(drain_quiet=0.0, max_actions=2, hang_deadline=0.5)
    for _ in range(2):
        res = make(o).run()
        assert res.result == "failed" and res.actions[0].reasons == ["returned"] and "did not become ready" in res.error
        _set(ops, d0, state="failed", last_exit={"code": 1})  # it crashed during its start-up
    res = make(o).run()
    assert res.result == "escalated" and "decode-0: 2 heal action(s) started" in res.escalations[0]
    assert len(_restarted(ops)) == 2


def test_heal_without_once_watches_on_while_a_host_does_not_answer(tmp_path: Path, monkeypatch) -> None:
    from kimictl.cli import heal as heal_cli

    make, ops, rendered, _ = _cluster(tmp_path)
    make().steps.connect_routers()
    host, _ = _take_down(ops, rendered, "decode-1")
    naps: list[float] = []

    def nap(s: float) -> None:
        naps.append(s)
        if len(naps) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(heal_cli.time, "sleep", nap)
    got = _cli(monkeypatch, make, "-i", str(tmp_path / "inv.yml"), "--interval", "7")
    assert got.exit_code == 130 and naps == [7.0] * 3, got.output  # three rounds, stopped by Ctrl-C only
    assert got.stdout.count("host(s) do not answer") == 3 and f"unreachable host {host}:" in got.stdout
    assert "decode-1 (decode on " in got.stdout and "route-out [routed-out]" in got.stdout
    assert "Traceback" not in got.output
    once = _cli(monkeypatch, make, "-i", str(tmp_path / "inv.yml"), "--once", "--output", "json")
    assert once.exit_code == 1 and json.loads(once.stdout)["unreachable"].keys() == {host}
