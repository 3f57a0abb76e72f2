"""`status --output json` is a user contract (docs/contract.md): a representative report keeps every key's name and
place. The hosts' probe is faked; every HTTP call (engines, proxy, router copies, Prometheus) goes to one fake."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kimictl import health, status
from kimictl.inventory import load_inventory
from kimictl.observe_up import record
from kimictl.ssh import SSHError
from kimictl.state import ReleaseRecord, record_release

PROM = "http://10.0.0.9:9090"
METRICS = """\
vllm:num_requests_running 2
vllm:num_requests_waiting 1
vllm:kv_cache_usage_perc 0.25
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1"} 5
vllm:time_to_first_token_seconds_bucket{le="1.0"} 10
vllm:time_to_first_token_seconds_bucket{le="+Inf"} 10
vllm:time_to_first_token_seconds_count 10
vllm:time_to_first_token_seconds_sum 3
"""


def _http(method: str, url: str, body: Any = None, timeout: float = 10.0, headers: Any = None,
          api_key: str | None = None) -> tuple[int, str]:
    path = "/" + url.split("//", 1)[1].partition("/")[2]
    answers = {"/health": "ok", "/v1/models": json.dumps({"data": [{"id": "kimi"}]}), "/metrics": METRICS,
               "/-/ready": "Prometheus Server is Ready.",
               "/api/v1/alerts": json.dumps({"data": {"alerts": [
                   {"labels": {"alertname": "KimiEngineDown", "cluster": "st-unit"}, "state": "firing"}]}}),
               "/kimictl/router/0/workers": json.dumps({"workers": [{"url": f"http://10.0.0.{i}:7100"}
                                                                    for i in (1, 2, 7)]})}
    if method == "GET" and path in answers:
        return 200, answers[path]
    return 500, "KV transfer failed"  # the pair probe's completion, router copy 1's membership


def _probe(name: str, engines: list[dict[str, Any]], *, proxy: bool = False, sup: dict[str, Any] | None = None,
           front: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"manifest": {"release": f"rel-{name}", "served_model_name": "kimi", "engines": engines,
                         "proxy": {"port": 8000, "routers": 2, "admin_key": True, "router": "vllm-router"}
                         if proxy else None},
            "supervised": sup or {}, "hbm_used_mb": {0: 30000, 1: 31000}, "front": front}


def _engine(eid: str, role: str, port: int, serves_http: bool = True) -> dict[str, Any]:
    return {"id": eid, "role": role, "port": port, "serves_http": serves_http, "devices": [0, 1]}


RUNNING = {"state": "running", "restarts": 1, "child_pid": 4242, "child_started_at": "2025-01-01T00:00:00Z"}


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path / "state"))
    hosts = {f"atlas-0{i}": {"ansible_host": f"10.0.0.{i}", "kimi_hardware": "atlas-800-a3"} for i in (1, 2, 3)}
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump({"all": {"vars": {
        "kimi_cluster": "st-unit", "kimi_model_dir": "/data/models/Kimi-K2.5-W4A8",
        "kimi_vllm_ascend_version": "0.23.0", "kimi_runtime": "host", "kimi_nic": "eth0"}, "hosts": hosts}}))
    record_release("st-unit", ReleaseRecord(release="r", result="deployed",
                                            hosts={"atlas-01": "rel-atlas-01", "atlas-02": "rel-old"}))
    record("st-unit", {"prometheus_url": PROM, "monitor_host": "atlas-03", "targets": 7})
    monkeypatch.setattr(health, "http_request", _http)
    return load_inventory(path)


def _report(monkeypatch, inv, probes: dict[str, Any], **kw) -> dict[str, Any]:
    monkeypatch.setattr(status, "_probe", lambda inv, timeout: probes)
    doc = status.collect_status(inv, **kw).to_json()
    assert status.StatusReport.model_validate(doc).to_json() == doc  # the model reads its own document back
    return json.loads(json.dumps(doc))


def _keys(doc: dict[str, Any]) -> dict[str, Any]:
    """Each object's keys in order, per engine, membership entry and pair."""
    proxy = doc["proxy"]
    return {"report": list(doc), "engines": {e["id"]: list(e) for e in doc["engines"]},
            "metrics": [list(e["metrics"]) for e in doc["engines"] if "metrics" in e][:1],
            "proxy": list(proxy), "membership": [list(m) for m in proxy.get("membership", [])],
            "pairs": [list(p) for p in doc["pairs"]], "drift": [list(d) for d in doc["drift"]],
            "monitoring": list(doc["monitoring"])}


def _degraded() -> dict[str, Any]:
    """P/D: a ready prefill and proxy; a ready, a headless and a stopped decode engine; an unreachable host."""
    return {"atlas-01": _probe("atlas-01", [_engine("prefill-0-dp0", "prefill", 7100)], proxy=True,
                               sup={"prefill-0-dp0": RUNNING, "proxy": RUNNING}),
            "atlas-02": _probe("atlas-02", [_engine("decode-0-dp0", "decode", 7100),
                                            _engine("decode-0-n1", "decode", 7101, serves_http=False),
                                            _engine("decode-0-dp9", "decode", 7109)],
                               sup={"decode-0-dp0": RUNNING, "decode-0-n1": RUNNING}),
            "atlas-03": SSHError("atlas-03: connection refused")}


def test_the_status_json_keys_are_a_contract(cluster, monkeypatch) -> None:
    doc = _report(monkeypatch, cluster, _degraded())
    row = ["id", "host", "role", "port", "ip", "release", "serves_http", "hbm_used_mb"]
    sup = ["restarts", "pid", "since"]
    assert _keys(doc) == {
        "report": ["schema_version", "cluster", "state", "served_model_name", "release", "engines", "proxy", "pairs",
                   "drift", "monitoring", "at"],
        "engines": {"atlas-03:*": ["id", "host", "role", "state", "detail"],
                    "prefill-0-dp0": [*row, *sup, "state", "metrics"], "decode-0-dp0": [*row, *sup, "state", "metrics"],
                    "decode-0-n1": [*row, *sup, "state"], "decode-0-dp9": [*row, "state"]},
        "metrics": [["requests_running", "requests_waiting", "kv_cache_usage", "ttft_s", "itl_s"]],
        "proxy": ["host", "ip", "port", "routers", "router", "state", "membership"],
        "membership": [["router", "members", "missing", "unknown"], ["router", "error"]],
        "pairs": [["prefill", "decode", "state", "detail", "hint"]],
        "drift": [["host", "recorded", "current"]],
        "monitoring": ["prometheus_url", "monitor_host", "targets", "state", "alerts_firing"]}
    engines = {e["id"]: e for e in doc["engines"]}
    assert doc["schema_version"] == 1 and doc["cluster"] == "st-unit" and doc["state"] == "degraded"
    assert doc["served_model_name"] == "kimi" and doc["release"] == "r"
    assert engines["prefill-0-dp0"] | {"metrics": None} == {
        "id": "prefill-0-dp0", "host": "atlas-01", "role": "prefill", "port": 7100, "ip": "10.0.0.1",
        "release": "rel-atlas-01", "serves_http": True, "hbm_used_mb": {"total": 61000, "max_per_npu": 31000},
        "restarts": 1, "pid": 4242, "since": "2025-01-01T00:00:00Z", "state": "ready", "metrics": None}
    assert engines["prefill-0-dp0"]["metrics"] == {
        "requests_running": 2.0, "requests_waiting": 1.0, "kv_cache_usage": 0.25,
        "ttft_s": {"p50": 0.1, "p90": pytest.approx(0.82), "p99": pytest.approx(0.982)},
        "itl_s": {"p50": None, "p90": None, "p99": None}}
    assert [engines[i]["state"] for i in ("atlas-03:*", "decode-0-n1", "decode-0-dp9")] == [
        "unreachable", "ready", "stopped"]
    assert engines["atlas-03:*"]["detail"] == "atlas-03: connection refused"
    assert doc["proxy"]["membership"] == [
        {"router": 0, "members": 3, "missing": ["decode-0-dp9"], "unknown": ["http://10.0.0.7:7100"]},
        {"router": 1, "error": "GET /workers -> 500: KV transfer failed"}]
    assert doc["proxy"] | {"membership": None} == {"host": "atlas-01", "ip": "10.0.0.1", "port": 8000, "routers": 2,
                                                   "router": "vllm-router", "state": "ready", "membership": None}
    assert doc["pairs"][0]["state"] == "failed" and doc["pairs"][0]["hint"] == "docs/operators.md#t-pair-probe"
    assert doc["pairs"][0]["prefill"] == ["prefill-0-dp0"] and doc["pairs"][0]["decode"] == ["decode-0-dp0",
                                                                                              "decode-0-n1"]
    assert doc["drift"] == [{"host": "atlas-02", "recorded": "rel-old", "current": "rel-atlas-02"}]
    assert doc["monitoring"] == {"prometheus_url": PROM, "monitor_host": "atlas-03", "targets": 7, "state": "ready",
                                 "alerts_firing": ["KimiEngineDown"]}


def test_stale_prefill_ids_and_a_stopped_proxy(cluster, monkeypatch) -> None:
    """A proxy front whose routers know old prefill engine ids: the pair fails at once, naming why (no probe); a stopped
    proxy has no membership; no manifest on a host means nothing to list for it."""
    urls = {"http://10.0.0.1:36000/query": ["e1"]}
    probes = {"atlas-01": _probe("atlas-01", [_engine("prefill-0-dp0", "prefill", 7100)], proxy=True,
                                 sup={"prefill-0-dp0": RUNNING, "proxy": {"state": "backoff"}},
                                 front={"watch": {"engine_ids": urls, "routers_know": {u: ["e0"] for u in urls}}}),
              "atlas-02": _probe("atlas-02", [_engine("decode-0-dp0", "decode", 7100)], sup={"decode-0-dp0": RUNNING}),
              "atlas-03": {"manifest": None, "supervised": {}, "hbm_used_mb": {}, "front": None}}
    doc = _report(monkeypatch, cluster, probes)
    assert list(doc["proxy"]) == ["host", "ip", "port", "routers", "router", "state", "stale_engine_ids"]
    assert doc["proxy"]["state"] == "failed" and "10.0.0.1:36000" in doc["proxy"]["stale_engine_ids"]
    assert doc["pairs"] == [{"prefill": ["prefill-0-dp0"], "decode": ["decode-0-dp0"], "state": "failed",
                             "detail": doc["proxy"]["stale_engine_ids"]}]
    assert doc["state"] == "down" and [e["id"] for e in doc["engines"]] == ["prefill-0-dp0", "decode-0-dp0"]
    assert doc["drift"] == [{"host": "atlas-02", "recorded": "rel-old", "current": "rel-atlas-02"}]
    no_probe = _report(monkeypatch, cluster, {**probes, "atlas-01": _probe(
        "atlas-01", [_engine("prefill-0-dp0", "prefill", 7100)], proxy=True,
        sup={"prefill-0-dp0": RUNNING, "proxy": RUNNING})}, probe_pairs=False)
    assert no_probe["pairs"] == [] and no_probe["proxy"]["state"] == "ready" and "membership" in no_probe["proxy"]


def test_the_status_command_prints_the_report(cluster, monkeypatch, tmp_path: Path) -> None:
    """`status --output json` prints the report's document; the text view reads the same report; degraded exits 3."""
    from typer.testing import CliRunner

    from kimictl.cli.main import app

    monkeypatch.setattr(status, "_probe", lambda inv, timeout: _degraded())
    got = CliRunner().invoke(app, ["status", "-i", str(tmp_path / "inv.yml"), "--output", "json"])
    assert got.exit_code == 3, got.output
    doc = json.loads(got.stdout)
    assert list(doc) == ["schema_version", "cluster", "state", "served_model_name", "release", "engines", "proxy",
                         "pairs", "drift", "monitoring", "at"]
    assert doc["state"] == "degraded" and len(doc["engines"]) == 5 and "admin_key" not in doc["proxy"]
    text = CliRunner().invoke(app, ["status", "-i", str(tmp_path / "inv.yml")])
    assert text.exit_code == 3
    assert "router 0 behind the proxy lacks decode-0-dp9, lists unknown http://10.0.0.7:7100" in text.stdout
    assert "drift: atlas-02 runs rel-atlas-02, recorded rel-old" in text.stdout


def test_status_heal_puts_the_heal_report_last(cluster, monkeypatch, tmp_path: Path) -> None:
    """`status --heal` on a cluster that is not healthy adds the heal round's report under `heal`; escalated exits 1."""
    from typer.testing import CliRunner

    from kimictl.cli import status as status_cli
    from kimictl.cli.main import app

    monkeypatch.setattr(status, "_probe", lambda inv, timeout: _degraded())
    heal = {"result": "escalated", "actions": [{"slice": "decode-0", "reasons": ["dead"], "result": "escalated"}]}
    monkeypatch.setattr(status_cli, "_heal_round", lambda inventory: heal)
    got = CliRunner().invoke(app, ["status", "-i", str(tmp_path / "inv.yml"), "--output", "json", "--heal"])
    assert got.exit_code == 1, got.output
    doc = json.loads(got.stdout)
    assert list(doc)[-2:] == ["at", "heal"] and doc["heal"] == heal
    text = CliRunner().invoke(app, ["status", "-i", str(tmp_path / "inv.yml"), "--heal"])
    assert text.exit_code == 1 and "heal: escalated; decode-0 dead -> escalated" in text.stdout


def _naps(monkeypatch, rounds: int) -> list[float]:
    """`status --watch`'s sleeps, recorded; Ctrl-C (KeyboardInterrupt) after `rounds` of them."""
    from kimictl.cli import status as status_cli

    naps: list[float] = []

    def nap(s: float) -> None:
        naps.append(s)
        if len(naps) == rounds:
            raise KeyboardInterrupt

    monkeypatch.setattr(status_cli.time, "sleep", nap)
    return naps


def test_an_unreachable_host_is_exit_3_once_and_a_watch_goes_on(cluster, monkeypatch, tmp_path: Path) -> None:
    """Issue 34: one look at a cluster with a host that does not answer reports it (exit 3, degraded, no traceback);
    `--watch` keeps watching it - also past a round that fails on a host - until Ctrl-C."""
    from typer.testing import CliRunner

    from kimictl.cli.main import app
    from kimictl.errors import HostError, StateError

    monkeypatch.setattr(status, "_probe", lambda inv, timeout: _degraded())
    once = CliRunner().invoke(app, ["status", "-i", str(tmp_path / "inv.yml")])
    assert once.exit_code == 3 and "atlas-03: unreachable: atlas-03: connection refused" in once.stdout
    assert "Traceback" not in once.output
    rounds = iter([HostError("cannot read the current state of 1 host(s)", host="atlas-03", step="observe"),
                   StateError("the current release of c, 0123abcd has no render snapshot (rendered.json)")])

    def probe(inv, timeout):
        err = next(rounds, None)
        if err:
            raise err
        return _degraded()

    monkeypatch.setattr(status, "_probe", probe)
    naps = _naps(monkeypatch, 4)
    watch = CliRunner().invoke(app, ["status", "-i", str(tmp_path / "inv.yml"), "--watch", "5"])
    assert watch.exit_code == 130 and naps == [5.0] * 4, watch.output  # only Ctrl-C ended it
    assert "error: cannot read the current state of 1 host(s) (host atlas-03, step observe) (watching on)" in \
        watch.stderr
    # a record another control node is rewriting does not end it either
    assert "has no render snapshot (rendered.json) (watching on)" in watch.stderr
    assert watch.stdout.count("atlas-03: unreachable") == 2 and "Traceback" not in watch.output
    rounds = iter([HostError("cannot read the current state of 1 host(s)", host="atlas-03", step="observe")])
    one = CliRunner().invoke(app, ["status", "-i", str(tmp_path / "inv.yml")])
    assert one.exit_code == 1 and "error: cannot read" in one.stderr and "Traceback" not in one.output


def test_status_watch_heal_goes_on_while_a_host_does_not_answer(cluster, monkeypatch, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kimictl.cli import status as status_cli
    from kimictl.cli.main import app

    monkeypatch.setattr(status, "_probe", lambda inv, timeout: _degraded())
    heal = iter([{"result": "unreachable", "unreachable": {"atlas-03": "atlas-03: connection refused"},
                  "actions": [{"slice": "decode-1", "reasons": ["unreachable"], "result": "routed-out"}]},
                 {"result": "unreachable", "unreachable": {"atlas-03": "atlas-03: connection refused"}, "actions": []}])
    monkeypatch.setattr(status_cli, "_heal_round", lambda inventory: next(heal))
    naps = _naps(monkeypatch, 2)
    got = CliRunner().invoke(app, ["status", "-i", str(tmp_path / "inv.yml"), "--watch", "5", "--heal"])
    assert got.exit_code == 130 and naps == [5.0, 5.0], got.output
    assert "heal: unreachable (atlas-03 does not answer); decode-1 unreachable -> routed-out\n" in got.stdout
    assert got.stdout.endswith("heal: unreachable (atlas-03 does not answer)\n")
