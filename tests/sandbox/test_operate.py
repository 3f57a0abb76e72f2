"""Operate a deployed a3-pd sandbox: logs tails, a redacted --bundle with planted secrets, stop and start."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import ArgvWatch, _bring_up

from kimictl.ansible import close_control_masters

pytestmark = pytest.mark.sandbox

HF_PLANTED = "hf_plantedOperateTest0123456789abcdefXYZ"
API_PLANTED = "planted-api-key-7d1c0ffee42"
FILE_PLANTED = "planted-from-secrets-file-31415"
ENGINES = ["decode-0-dp0", "decode-0-dp1", "decode-0-dp2", "decode-0-dp3", "prefill-0-dp0", "prefill-0-dp1"]
SD = "/var/lib/kimi"
ROOT = Path(__file__).resolve().parents[2]

# Until the lead registers these commands in kimictl/cli/main.py, drive them through a small app.
_RUNNER = ("import sys, typer; from kimictl.cli import lifecycle, logs; app = typer.Typer(); "
           "app.command()(logs.logs); app.command()(lifecycle.stop); app.command()(lifecycle.start); "
           "from kimictl.cli import status; app.command()(status.status); sys.exit(app())")


def _prefix() -> list[str]:
    from kimictl.cli import main

    names = {c.callback.__name__ for c in main.app.registered_commands if c.callback}
    if {"logs", "stop", "start"} <= names:
        return [sys.executable, "-m", "kimictl"]
    return [sys.executable, "-c", _RUNNER]


def ops(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*_prefix(), *args], capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, **(env or {})})


def kimictl(*args: str, timeout: float = 900, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kimictl", *args], capture_output=True, text=True,
                          timeout=timeout, check=False, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """This module's own 2-host A3 sandbox with a3-pd deployed once."""
    gen = _bring_up(tmp_path_factory.mktemp("sb-operate"), "--hosts", "2", "--hardware", "atlas-800-a3")
    sb = next(gen)
    proc = kimictl("deploy", "-i", str(sb.inventory), "--topology", "a3-pd", "--yes", "--output", "json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    yield sb
    gen.close()


def _supervised(sb, host: str) -> dict[str, dict]:
    out = sb.ssh(host, f"python3 {SD}/bin/supervisor.py status --run-dir {SD}/run").stdout
    return {s["name"]: s for s in json.loads(out)}


def _ports(sb) -> list[tuple[str, int]]:
    out = []
    for h in sb.hosts:
        man = json.loads(sb.ssh(h, f"cat {SD}/current/manifest.json").stdout)
        out += [(sb.host(h)["ip"], e["port"]) for e in man["engines"] if e["serves_http"]]
        if man["proxy"]:
            out.append((sb.host(h)["ip"], man["proxy"]["port"]))
    return out


def _open(ip: str, port: int) -> bool:
    try:
        socket.create_connection((ip, port), timeout=2).close()
        return True
    except OSError:
        return False


def _complete(sb) -> dict:
    ip = sb.host("atlas-01")["ip"]
    req = urllib.request.Request(f"http://{ip}:8000/v1/completions", method="POST",
                                 headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "kimi-k2.5", "prompt": "after start", "max_tokens": 4})
                                 .encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_logs_tails_every_engine_and_the_proxy(deployed) -> None:
    proc = ops("logs", "-i", str(deployed.inventory), "--lines", "5", "--output", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    got = {e["id"]: e for e in doc["logs"]}
    assert sorted(got) == sorted([*ENGINES, "proxy"])
    assert all(0 < len(e["lines"]) <= 5 and not e["missing"] for e in got.values())
    assert {e["host"] for e in got.values() if e["role"] == "decode"} == {"atlas-02"}

    text = ops("logs", "-i", str(deployed.inventory), "--role", "decode", "--lines", "3")
    assert text.returncode == 0, text.stderr[-2000:]
    headers = [ln for ln in text.stdout.splitlines() if ln.startswith("==> ")]
    assert [h.split()[2] for h in headers] == ENGINES[:4]

    one = ops("logs", "-i", str(deployed.inventory), "--engine", "prefill-0-dp1", "--host", "atlas-01",
              "--lines", "2", "--output", "json")
    assert [(e["id"], len(e["lines"])) for e in json.loads(one.stdout)["logs"]] == [("prefill-0-dp1", 2)]

    bad = ops("logs", "-i", str(deployed.inventory), "--engine", "prefill-9-dp0")
    assert bad.returncode == 2 and "prefill-9-dp0" in bad.stderr and "Traceback" not in bad.stderr


def test_bundle_has_every_host_and_no_secret(deployed, tmp_path: Path) -> None:
    sb = deployed
    plant = {
        "atlas-01": f"echo 'fetching weights with HF_TOKEN={HF_PLANTED} and bare {HF_PLANTED}' >> "
                    f"{SD}/logs/prefill-0-dp0.log; echo 'raw {FILE_PLANTED} in the proxy log' >> {SD}/logs/proxy.log",
        "atlas-02": f"echo 'argv: vllm serve /m --api-key {API_PLANTED} --port 8100' >> {SD}/logs/decode-0-dp1.log.1",
    }
    for host, cmd in plant.items():
        assert sb.ssh(host, cmd).returncode == 0
    secrets = tmp_path / "secrets.txt"
    secrets.write_text(f"{FILE_PLANTED}\n")
    dest = tmp_path / "diag.tar.gz"
    proc = ops("logs", "-i", str(sb.inventory), "--bundle", str(dest), "--secrets-file", str(secrets),
               "--output", "json", env={"HF_TOKEN": HF_PLANTED})
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    assert summary["redactions"] >= 4 and summary["hosts"] == {"atlas-01": "ok", "atlas-02": "ok"}
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600

    out = tmp_path / "x"
    with tarfile.open(dest) as tar:
        names = tar.getnames()
        tar.extractall(out, filter="data")
    c = sb.cluster
    for host, ids in (("atlas-01", ["prefill-0-dp0", "prefill-0-dp1", "proxy"]), ("atlas-02", ENGINES[:4])):
        for rel in ("npu-smi-info.txt", "hccn/npu00-link.txt", "hccn/npu15-net_health.txt", "host.json",
                    "release/manifest.json", *[f"logs/{i}.log" for i in ids], *[f"run/{i}.json" for i in ids],
                    *[f"release/engines/{i}.env" for i in ids if i != "proxy"]):
            assert f"{c}/{host}/{rel}" in names, rel
        # deploy staged the weights from the sandbox's hub: their verify record travels too
        assert f"{c}/{host}/weights/kimi-complete" in names and f"{c}/{host}/weights/kimi-stamps.json" in names
    assert f"{c}/atlas-01/release/proxy/proxy.sh" in names
    assert f"{c}/atlas-02/logs/decode-0-dp1.log.1" in names
    for rel in ("releases.jsonl", "current.json", "plan.json", "preflight.json", "weights-manifest.json"):
        assert f"{c}/_control-node/{rel}" in names
    assert all(n.startswith(f"{c}/") for n in names)
    assert "Ascend910" in (out / c / "atlas-01/npu-smi-info.txt").read_text()

    for secret in (HF_PLANTED, API_PLANTED, FILE_PLANTED):
        hits = subprocess.run(["grep", "-rlF", secret, str(out)], capture_output=True, text=True, check=False)
        assert hits.stdout == "", f"{secret} leaked into {hits.stdout}"
    assert "[REDACTED]" in (out / c / "atlas-01/logs/prefill-0-dp0.log").read_text()
    assert "--api-key [REDACTED]" in (out / c / "atlas-02/logs/decode-0-dp1.log.1").read_text()
    assert HF_PLANTED not in proc.stdout + proc.stderr


def test_stop_stops_everything_keeps_current_and_is_idempotent(deployed) -> None:
    sb = deployed
    current = {h: sb.ssh(h, f"readlink {SD}/current").stdout.strip() for h in sb.hosts}
    ports = _ports(sb)
    assert ports and all(_open(ip, p) for ip, p in ports)
    proc = ops("stop", "-i", str(sb.inventory), "--yes", "--output", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["result"] == "stopped"
    assert sorted(i for h in doc["hosts"].values() for i in h["stopped"]) == sorted([*ENGINES, "proxy"])
    for h in sb.hosts:
        states = _supervised(sb, h)
        assert states and all(s["state"] == "stopped" for s in states.values()), states
        assert sb.ssh(h, f"readlink {SD}/current").stdout.strip() == current[h]
    assert not any(_open(ip, p) for ip, p in ports)
    status = kimictl("status", "-i", str(sb.inventory), "--output", "json", "--no-pair-probe")
    assert status.returncode == 1 and json.loads(status.stdout)["state"] == "down"

    again = ops("stop", "-i", str(sb.inventory), "--yes", "--output", "json")
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout)["result"] == "already-stopped"


def test_start_brings_current_back_ready_and_is_idempotent(deployed) -> None:
    sb = deployed
    proc = ops("start", "-i", str(sb.inventory), "--yes", "--output", "json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["result"] == "started"
    assert sorted(i for h in doc["hosts"].values() for i in h["started"]) == sorted([*ENGINES, "proxy"])
    status = kimictl("status", "-i", str(sb.inventory), "--output", "json")
    assert status.returncode == 0, status.stdout[-2000:]
    assert json.loads(status.stdout)["state"] == "healthy"
    assert _complete(sb)["choices"]
    # same tags as deploy gave them: a deploy of the same topology now has nothing to do
    dep = kimictl("deploy", "-i", str(sb.inventory), "--topology", "a3-pd", "--yes", "--output", "json",
                  "--skip-preflight", "test")
    assert dep.returncode == 0 and json.loads(dep.stdout)["result"] == "no-changes", dep.stderr[-2000:]

    pids = {h: {n: s["child_pid"] for n, s in _supervised(sb, h).items()} for h in sb.hosts}
    again = ops("start", "-i", str(sb.inventory), "--yes", "--output", "json")
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout)["result"] == "already-running"
    assert {h: {n: s["child_pid"] for n, s in _supervised(sb, h).items()} for h in sb.hosts} == pids


def test_start_and_stop_limit_to_one_host(deployed) -> None:
    sb = deployed
    proc = ops("stop", "-i", str(sb.inventory), "--limit", "atlas-02", "--yes", "--output", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(json.loads(proc.stdout)["hosts"]) == ["atlas-02"]
    assert all(s["state"] == "running" for s in _supervised(sb, "atlas-01").values())
    assert all(s["state"] == "stopped" for s in _supervised(sb, "atlas-02").values())
    proc = ops("start", "-i", str(sb.inventory), "--limit", "atlas-02", "--yes", "--output", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(json.loads(proc.stdout)["hosts"]["atlas-02"]["started"]) == ENGINES[:4]
    assert ops("stop", "-i", str(sb.inventory), "--limit", "atlas-9").returncode == 2


def test_start_failure_names_host_step_and_log_tail(deployed) -> None:
    sb = deployed
    assert ops("stop", "-i", str(sb.inventory), "--limit", "atlas-02", "--yes").returncode == 0
    sb.fault("engine-crash:atlas-02:decode")
    try:
        proc = ops("start", "-i", str(sb.inventory), "--limit", "atlas-02", "--yes", "--output", "json")
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert "host atlas-02" in proc.stderr and "--- log tail ---" in proc.stderr
        assert "engine_crash_at_start" in proc.stderr and "Traceback" not in proc.stderr
        assert json.loads(proc.stdout)["error"]["type"] == "HostError"
        assert json.loads(proc.stdout)["error"]["hint"].endswith("docs/operators.md#t-engine-start")
    finally:
        sb.fault("clear:all")
    assert ops("stop", "-i", str(sb.inventory), "--limit", "atlas-02", "--yes").returncode == 0
    proc = ops("start", "-i", str(sb.inventory), "--yes", "--output", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert kimictl("status", "-i", str(sb.inventory), "--output", "json").returncode == 0


@pytest.fixture
def fresh_known_hosts(deployed, tmp_path):
    """`fresh_known_hosts(name, head="")`: a copy of the inventory whose hosts are checked against a new known_hosts
    file (starting with `head`, or missing) and whose Ansible opens its own SSH connections (no master of the
    sandbox's may answer for it). Returns (inventory, known_hosts)."""
    cpd = Path(tempfile.mkdtemp(prefix="kcp-", dir="/tmp"))   # short: ssh's socket paths are limited

    def make(name: str, head: str = "") -> tuple[Path, Path]:
        kh = tmp_path / name
        if head:
            kh.write_text(head)
        doc = yaml.safe_load(deployed.inventory.read_text())
        v = doc["all"]["vars"]
        v["ansible_ssh_common_args"] = f"-o UserKnownHostsFile={kh} -o StrictHostKeyChecking=yes -o IdentitiesOnly=yes"
        v["ansible_control_path_dir"] = str(cpd / "cp")
        inv = tmp_path / f"{name}.yml"
        inv.write_text(yaml.safe_dump(doc, sort_keys=False))
        return inv, kh

    yield make
    close_control_masters(cpd)
    shutil.rmtree(cpd, ignore_errors=True)


KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDKU1pVvVmTq2QOV2l7Hz7vrbQJb6+UyxyuPJ6jTz4vE"
KH_HEAD = f"# hosts we trust\n@cert-authority *.corp.example {KEY}\nold.example.com {KEY} old\n\n# end"


def _host_key_lines(sb) -> set[str]:
    return set((sb.dir / "known_hosts").read_text().splitlines())


def test_new_host_keys_are_learnt_for_probes_and_playbooks(deployed, fresh_known_hosts) -> None:
    sb = deployed
    inv, kh = fresh_known_hosts("kh-refused")
    proc = ops("stop", "-i", str(inv), "--yes")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    # the first contact of a command that changes hosts is the cluster lease on its lock host (the first name)
    lock = min(sb.hosts)
    assert f"cannot take the cluster lease on its lock host {lock}" in proc.stderr, proc.stderr[-2000:]
    assert f"unknown host key for {lock} ({sb.host(lock)['ip']}, ssh-ed25519 SHA256:" in proc.stderr
    assert "--accept-new-host-keys" in proc.stderr and not kh.exists()
    assert all(s["state"] == "running" for h in sb.hosts for s in _supervised(sb, h).values())

    # stop and start run playbooks; preflight connects to every host: each learns the keys into its own file
    inv, kh = fresh_known_hosts("kh-ops", KH_HEAD)
    proc = ops("stop", "-i", str(inv), "--yes", "--accept-new-host-keys", "--output", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["result"] == "stopped"
    text = kh.read_text()
    assert text.startswith(KH_HEAD + "\n") and set(text[len(KH_HEAD) + 1:].splitlines()) == _host_key_lines(sb)
    inv_pf, kh_pf = fresh_known_hosts("kh-preflight")
    proc = kimictl("preflight", "-i", str(inv_pf), "--topology", "a3-pd", "--accept-new-host-keys", "--output", "json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert set(kh_pf.read_text().splitlines()) == _host_key_lines(sb)
    inv, kh = fresh_known_hosts("kh-start")
    proc = ops("start", "-i", str(inv), "--yes", "--accept-new-host-keys", "--output", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["result"] == "started"
    assert set(kh.read_text().splitlines()) == _host_key_lines(sb)


def test_deploy_with_an_api_key_and_hub_tokens_about_leaks_neither(deployed, fresh_known_hosts, tmp_path) -> None:
    """Last in this module: it leaves the proxy behind an API key."""
    sb = deployed
    api_key, hub_token = "sk-canary-api-5e8a1f", "hf_canaryHubToken0c9b7d2e"
    inv, kh = fresh_known_hosts("kh-deploy")
    key_file = tmp_path / "api-key"
    key_file.write_text(api_key + "\n")
    key_file.chmod(0o600)
    doc = yaml.safe_load(inv.read_text())
    doc["all"]["vars"]["kimi_api_key_file"] = str(key_file)
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    topo = tmp_path / "a3-pd-tuned.yml"
    topo.write_text((ROOT / "kimictl/data/topologies/a3-pd.yml").read_text()
                    .replace("name: a3-pd", "name: a3-pd-tuned").replace("max-num-seqs: 32", "max-num-seqs: 24"))
    with ArgvWatch(api_key, hub_token) as watch:
        proc = kimictl("deploy", "-i", str(inv), "--topology", str(topo), "--yes", "--skip-preflight", "test",
                       "--accept-new-host-keys", "--output", "json",
                       env={"HF_TOKEN": hub_token, "MODELSCOPE_API_TOKEN": hub_token})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["result"] == "deployed"
    assert watch.samples > 10 and watch.hits == []
    assert set(kh.read_text().splitlines()) == _host_key_lines(sb)
    state = Path(os.environ["KIMICTL_STATE_DIR"])
    assert list(state.rglob("artifacts/*/command"))   # the playbooks ran and left their artifacts
    leaks = subprocess.run(["grep", "-rlF", "-e", api_key, "-e", hub_token, str(state)], capture_output=True,
                           text=True, check=False)
    assert leaks.stdout == ""
    for h in sb.hosts:
        assert sb.ssh(h, f"grep -rl -- {hub_token} {SD} /root 2>/dev/null").stdout == ""
    assert api_key not in proc.stdout + proc.stderr and hub_token not in proc.stdout + proc.stderr
