"""bench/deploy_overhead.py takes engine start-up from deploy's own timings. The sample is what `deploy --output json`
prints for the bench's deploy (a fresh 2-host A3 sandbox, its own inventory, a3-pd): the real Deployer and HostOps
run it; Ansible, the hosts' supervisors, the engines' HTTP and the clock are stand-ins, and engines answer a fixed
load time after the playbook that starts them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from prerequisites import require_or_skip
from test_orchestration import FakeHttp

from kimictl import deploy as deploy_mod
from kimictl import health, state
from kimictl import hostops as hostops_mod
from kimictl.ansible import PlaybookResult, RunSpec
from kimictl.hostops import HostObservation, HostOps, desired_procs
from kimictl.pipeline import prepare
from kimictl.render import render
from kimictl.router_kinds import router_kind
from kimictl.sandbox import client, layout

REPO = Path(__file__).resolve().parents[2]
LOAD_S = 120.0   # the engines' start-up (as the bench sets it with --load-seconds)
PLAYBOOK_S = {"release.yml": 4.0, "engines.yml": 6.0, "switch.yml": 2.0, "record.yml": 1.0}
PROXY_PLAYBOOK_S = 1.5   # engines.yml starting only the proxy
PREFLIGHT_S = 3.0


def _bench():
    spec = importlib.util.spec_from_file_location("deploy_overhead", REPO / "bench" / "deploy_overhead.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Clock:
    """time for kimictl.deploy and kimictl.hostops: monotonic() and sleep(), nothing waits."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Hosts:
    """The supervisors' view of each host and what Ansible's playbooks do to it (on the clock)."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.procs: dict[str, dict[str, dict[str, Any]]] = {}
        self.current: dict[str, str] = {}
        self.loaded_at: float | None = None   # when the engines answer

    def run_playbook(self, spec: RunSpec, on_event=None) -> PlaybookResult:
        kimi = spec.extravars["kimi"]
        name = Path(spec.playbook).name
        starts = {a["id"]: (h, a) for h, acts in (kimi.get("actions") or {}).items() for a in acts.get("start", [])}
        self.clock.sleep(PROXY_PLAYBOOK_S if set(starts) == {"proxy"} else PLAYBOOK_S[name])
        for pid, (host, a) in starts.items():
            self.procs.setdefault(host, {})[pid] = {"name": pid, "state": "running", "tag": a["tag"], "cmd": a["cmd"],
                                                    "restarts": 0}
        if starts and self.loaded_at is None:
            self.loaded_at = self.clock.now + LOAD_S
        if name == "switch.yml":
            self.current.update({h: v["release"] for h, v in kimi["hosts"].items()})
        return PlaybookResult("successful", 0)


class LoadingHttp(FakeHttp):
    """Engines answer once loaded; so does the proxy's /health (vllm-ascend's proxy: it lists them)."""

    def __init__(self, hosts: Hosts):
        super().__init__()
        self.hosts = hosts

    def loaded(self) -> bool:
        return self.hosts.loaded_at is not None and self.hosts.clock.now >= self.hosts.loaded_at

    def engine_ready(self, ip: str, port: int, served: str, timeout: float = 3.0, api_key: str | None = None):
        return health.Ready(self.loaded(), "ready" if self.loaded() else "loading")

    def http_get(self, url: str, timeout: float = 3.0, api_key: str | None = None) -> tuple[int, str]:
        if url.endswith("/health"):
            return (200, json.dumps({"prefill_instances": 1, "decode_instances": 1})) if self.loaded() else (0, "")
        return super().http_get(url, timeout, api_key)


class SandboxOps(HostOps):
    """HostOps as deploy builds it; only reading the hosts over SSH is replaced."""

    hosts: Hosts

    def observe(self, hosts: list[str] | None = None) -> dict[str, HostObservation]:
        return {h.name: HostObservation(dict(self.hosts.procs.get(h.name, {})), self.hosts.current.get(h.name))
                for h in self.inv.hosts if hosts is None or h.name in hosts}

    def log_tail(self, host: str, pid: str, lines: int = 30) -> str:
        return f"(log of {pid} on {host})"

    def close(self) -> None:
        pass


class PreflightOk:
    ok = True

    def to_json(self) -> dict[str, Any]:
        return {"ok": True}


@pytest.fixture
def deploy_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`deploy(...)` runs the bench's deploy and returns its `--output json` document."""
    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path / "state"))
    clock = Clock()
    hosts = Hosts(clock)
    for mod in (deploy_mod, hostops_mod):
        monkeypatch.setattr(mod, "time", clock)
    monkeypatch.setattr("kimictl.ansible.run_playbook", hosts.run_playbook)

    def preflight(*args: Any, **kwargs: Any) -> PreflightOk:
        clock.sleep(PREFLIGHT_S)
        return PreflightOk()

    monkeypatch.setattr("kimictl.preflight.run_preflight", preflight)
    if client.proxy_python() is None:   # the sandbox's inventory names vllm-ascend's proxy only with them
        require_or_skip(f"vllm-ascend's proxy needs {', '.join(router_kind('vllm-ascend-proxy').python_modules)} "
                        "(the test extra)")
    d = tmp_path / "sb"
    specs = layout.plan_hosts(2, "atlas-800-a3", "netns", 0, d)
    script = f"{layout.VLLM_ASCEND_TREE}/{router_kind('vllm-ascend-proxy').script}"   # as `sandbox up` sets it
    inv_doc = client.inventory(specs, "atlas-800-a3", d, mode="netns", cluster="bench", proxy_script=script)
    (tmp_path / "inventory.yml").write_text(yaml.safe_dump(inv_doc, sort_keys=False))
    p = prepare(tmp_path / "inventory.yml", "a3-pd")   # as `kimictl deploy` does
    rendered = render(p.plan, p.inventory, p.topology)
    http = LoadingHttp(hosts)
    http.endpoints = {f"{x.ip}:{x.port}": x.role for x in desired_procs(rendered, p.inventory)
                      if x.kind == "engine" and x.serves_http}   # the router copies list every engine

    def deploy() -> dict[str, Any]:
        ops = SandboxOps(p.inventory, p.plan.served_model_name, state.new_run_dir("bench", "run"), say=lambda m: None,
                         http=http)
        ops.hosts = hosts
        run = deploy_mod.Deployer(p.inventory, p.plan, rendered, deploy_mod.DeployOptions(), lambda m: None, ops=ops,
                                  http=http)
        return run.run().to_json()

    return deploy


def test_engine_start_is_the_wait_after_the_engines_playbook(deploy_json) -> None:
    doc = deploy_json()
    assert doc["result"] == "deployed"
    secs = doc["seconds"]
    # the sample: every step deploy times, the proxy's own engines.yml run after the engines answer
    assert list(secs) == ["preflight", "01-release", "02-engines", "engines_ready", "03-engines", "smoke",
                          "04-switch", "05-record", "total"]
    assert secs["02-engines"] == PLAYBOOK_S["engines.yml"] and secs["03-engines"] == PROXY_PLAYBOOK_S
    start, after = _bench().engine_start(secs)
    assert after == "02-engines"
    assert LOAD_S <= start <= LOAD_S + 0.31   # readiness is polled every 0.3 s
    assert secs["engines_ready"] >= start + PLAYBOOK_S["engines.yml"]


def test_a_deploy_that_started_no_engines_has_no_engine_start(deploy_json) -> None:
    deploy_json()
    again = deploy_json()
    assert again["result"] == "no-changes"
    with pytest.raises(ValueError, match=r"deploy started no engines .*seconds: none\)"):
        _bench().engine_start(again["seconds"])


def test_playbook_runs_count_past_nine() -> None:
    start, after = _bench().engine_start({"01-ports": 1.0, "09-engines": 9.0, "10-engines": 2.0,
                                          "engines_ready": 40.0, "11-engines": 3.0})
    assert (start, after) == (31.0, "09-engines")
