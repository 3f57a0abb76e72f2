"""Deploy pieces without hosts: process tags, change computation, the ansible-runner spec."""

from __future__ import annotations

from pathlib import Path

from kimictl.ansible import build_run_spec
from kimictl.hostops import HostObservation, compute_changes, desired_procs
from kimictl.inventory import load_inventory
from kimictl.plan import make_plan
from kimictl.render import render
from kimictl.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]


def _procs(inventory: Path):
    inv = load_inventory(inventory)
    topo = load_topology("a3-pd")
    return inv, desired_procs(render(make_plan(inv, topo), inv, topo), inv)


def test_desired_procs_cover_engines_and_proxy() -> None:
    _, procs = _procs(ROOT / "inventories/a3-pd.yml")
    assert [p.id for p in procs] == ["prefill-0-dp0", "prefill-0-dp1", "decode-0-dp0", "decode-0-dp1",
                                     "decode-0-dp2", "decode-0-dp3", "proxy"]
    eng = procs[0]
    assert eng.cmd[0] == "bash" and eng.cmd[1].startswith("/var/lib/kimi/releases/")
    assert eng.cmd[1].endswith("/engines/prefill-0-dp0.container.sh")


def test_one_flag_change_changes_only_that_role(tmp_path: Path) -> None:
    inv_path = ROOT / "inventories/a3-pd.yml"
    _, before = _procs(inv_path)
    changed = inv_path.read_text().replace("kimi_nic: enp189s0f0", "kimi_nic: enp189s0f0\n    kimi_media_dir: /srv/m")
    (tmp_path / "inv.yml").write_text(changed)
    _, after = _procs(tmp_path / "inv.yml")
    tags_before = {p.id: p.tag for p in before}
    # media dir reaches every engine's argv, never the proxy
    assert all(p.tag != tags_before[p.id] for p in after if p.kind == "engine")
    assert next(p for p in after if p.id == "proxy").tag == tags_before["proxy"]


def test_compute_changes() -> None:
    _, procs = _procs(ROOT / "inventories/a3-pd.yml")
    p0, d0 = procs[0], procs[2]
    observed = {
        p0.host: HostObservation({p0.id: {"state": "running", "tag": p0.tag, "cmd": p0.cmd},
                                  "old-engine": {"state": "running", "tag": "x", "cmd": ["bash", "/old.sh"]}},
                                 "r1"),
        d0.host: HostObservation({d0.id: {"state": "running", "tag": "stale", "cmd": ["bash", "/o.sh"]},
                                  "decode-0-dp1": {"state": "stopped", "tag": "t"}}, "r1"),
    }
    actions = {(c.host, c.id): c.action for c in compute_changes(procs, observed)}
    assert actions[(p0.host, p0.id)] == "keep"
    assert actions[(p0.host, "old-engine")] == "stop"
    assert actions[(d0.host, d0.id)] == "replace"
    assert actions[(d0.host, "decode-0-dp1")] == "start"
    assert actions[(p0.host, "proxy")] == "start"


def test_build_run_spec_is_pure(tmp_path: Path) -> None:
    spec = build_run_spec(tmp_path, "engines.yml", ROOT / "inventories/a3-pd.yml", {"kimi": {"x": 1}},
                          ident="02-engines", hosts=[f"h{i}" for i in range(9)], limit=["h1", "h2"], check=True)
    assert spec.forks == 9 and spec.limit == "h1,h2" and spec.cmdline == "--check --diff"
    assert spec.playbook.endswith("playbooks/engines.yml")
    assert spec.envvars["ANSIBLE_HOST_KEY_CHECKING"] == "True" and spec.envvars["ANSIBLE_PIPELINING"] == "True"
    assert spec.envvars["ANSIBLE_SSH_CONTROL_PATH_DIR"] == str(tmp_path / "cp")
    assert spec.extravars == {"kimi": {"x": 1}}


def test_deployed_diff(tmp_path: Path, monkeypatch) -> None:
    import json

    from kimictl.state import control_dir, deployed_diff

    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path))
    assert deployed_diff("c1", {"a": "r1"}) == {"release": None, "changed_hosts": ["a"], "removed_hosts": []}
    control_dir("c1").mkdir(parents=True)
    (control_dir("c1") / "current.json").write_text(json.dumps({"release": "R", "at": "t",
                                                                 "hosts": {"a": "r1", "b": "r2", "c": "r3"}}))
    d = deployed_diff("c1", {"a": "r1", "b": "new"})
    assert (d["release"], d["changed_hosts"], d["removed_hosts"]) == ("R", ["b"], ["c"])


def test_histogram_quantile() -> None:
    from kimictl.health import quantile

    buckets = [(0.1, 50.0), (0.5, 90.0), (1.0, 100.0), (float("inf"), 100.0)]
    assert quantile(buckets, 0.5) == 0.1
    assert abs(quantile(buckets, 0.7) - 0.3) < 1e-9
    assert abs(quantile(buckets, 0.95) - 0.75) < 1e-9
    assert quantile([(0.1, 0.0), (float("inf"), 0.0)], 0.5) is None


def test_bench_summary_and_slo() -> None:
    from kimictl.bench import BenchResult, BenchSpec, Sample

    spec = BenchSpec(requests=4, concurrency=2, slo_tpot_ms=50.0)
    res = BenchResult("http://x:8000/v1/completions", spec, [
        Sample(True, ttft_s=0.1, tpot_s=0.02, output_tokens=64),
        Sample(True, ttft_s=0.2, tpot_s=0.03, output_tokens=64),
        Sample(True, ttft_s=0.3, tpot_s=0.04, output_tokens=64),
        Sample(False, error="HTTP 500")], wall_s=2.0)
    doc = res.summary()
    assert doc["succeeded"] == 3 and doc["output_tokens_per_s"] == 96.0
    assert 20 <= doc["tpot_ms"]["p50"] <= 40 and doc["slo"]["met"] is False
    assert doc["slo"]["misses"] == ["1 request(s) failed"] and doc["errors"] == ["HTTP 500"]
    res.samples = res.samples[:3]
    assert res.summary()["slo"]["met"] is True
    spec.slo_tpot_ms = 10
    assert "TPOT p90" in res.summary()["slo"]["misses"][0]
