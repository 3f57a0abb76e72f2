"""docs/operators.md run as a new user would, against the shared 2-host A3 sandbox: every ```bash sandbox``` block
in order in one shell session - the inventory is written from what npu-smi and hccn_tool print on the hosts over
ssh (never copied from the sandbox's own file), then validate, plan, preflight, weights, deploy, status, bench,
monitoring, logs, stop/start, an upgrade and its rollback - with each block's exit code and documented output
checked. Then the troubleshooting rows the sandbox can cause: each fault's message must lead to its row."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import kimictl

pytestmark = pytest.mark.sandbox

_spec = importlib.util.spec_from_file_location("guide_doc", Path(__file__).resolve().parents[1] / "guide_doc.py")
doc = importlib.util.module_from_spec(_spec)
sys.modules["guide_doc"] = doc
_spec.loader.exec_module(doc)

BLOCKS = [b for b in doc.blocks(doc.GUIDE) if b.lang == "bash" and "sandbox" in b.marks]
SD = "/var/lib/kimi"


@dataclass
class Ran:
    rc: int | None     # None: the session ended before the block
    output: str


def _script(blocks: list, sandbox_dir: str) -> str:
    """One bash session: each block between markers, `set -e` inside it; an `exit=N` block's last command must
    exit N (the ones before it must succeed)."""
    parts = ["exec 2>&1"]
    for n, b in enumerate(blocks):
        text = b.text.replace(doc.SANDBOX_DIR, sandbox_dir).rstrip("\n")
        parts.append(f"printf '\\n@@guide-block {n}\\n'")
        if b.exit:
            head, _, last = text.rpartition("\n")
            parts += ["set -e", head, "set +e", f"__rc=0; {last} || __rc=$?"]
        else:
            parts += ["set -e", text, "set +e", "__rc=0"]
        parts.append(f"printf '\\n@@guide-end {n} %s %s\\n' \"$__rc\" \"$SECONDS\"")
        parts.append(f"[ \"$__rc\" -eq {b.exit} ] || exit 97")
    return "\n".join(parts) + "\n"


def _split(out: str, count: int) -> list[Ran]:
    ran = [Ran(None, "") for _ in range(count)]
    for m in re.finditer(r"^@@guide-block (\d+)\n(.*?)(?:^@@guide-end \1 (\d+) \d+\n|\Z)", out, flags=re.S | re.M):
        ran[int(m.group(1))] = Ran(int(m.group(3)) if m.group(3) is not None else None, m.group(2))
    return ran


@pytest.fixture(scope="module")
def guide(sandbox_a3, tmp_path_factory):
    """The guide's sandbox blocks run once, in a fresh working directory, with kimictl's venv first on PATH (as
    after `source .venv/bin/activate`)."""
    work = tmp_path_factory.mktemp("operator")
    # deep on purpose: runs/<run>/cp under it is too long for Ansible's SSH control sockets, which kimictl then
    # keeps in a short private directory (kimictl.ansible.control_socket_dir)
    state = str(tmp_path_factory.mktemp("kimictl-state-deeper-than-a-socket-path-allows"))
    sandbox_a3.env = {"KIMICTL_STATE_DIR": state}
    env = {**os.environ, **sandbox_a3.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", _script(BLOCKS, str(sandbox_a3.dir))], cwd=work, env=env,
                          capture_output=True, text=True, timeout=2400, check=False)
    sandbox_a3.work = work
    sandbox_a3.ran = _split(proc.stdout, len(BLOCKS))
    sandbox_a3.session = proc.stdout
    print("guide session, seconds at the end of each block:",
          " ".join(f"{BLOCKS[int(n)].line}:{t}" for n, t in re.findall(r"^@@guide-end (\d+) \d+ (\d+)$", proc.stdout,
                                                                       flags=re.M)))
    yield sandbox_a3
    # leave the shared sandbox as it was: no engine, proxy or monitoring process, no fault
    sandbox_a3.fault("clear:all", check=False)
    if (work / "inventory.yml").exists():
        kimictl("stop", "-i", str(work / "inventory.yml"), "--yes", env=sandbox_a3.env)
    for h in sandbox_a3.hosts:
        sandbox_a3.ssh(h, f"python3 {SD}/bin/supervisor.py stop --all --run-dir {SD}/observe/run")
    shutil.rmtree(state, ignore_errors=True)


@pytest.mark.parametrize("n", range(len(BLOCKS)), ids=[b.where for b in BLOCKS])
def test_guide_block_runs_on_the_sandbox(guide, n: int) -> None:
    block, ran = BLOCKS[n], guide.ran[n]
    assert ran.rc is not None, f"{block.where} did not run: an earlier block failed\n{guide.session[-3000:]}"
    assert ran.rc == block.exit, f"{block.where} exited {ran.rc}, expected {block.exit}:\n{ran.output[-4000:]}"
    if block.output:
        missing = doc.missing_lines(block.output.text, ran.output)
        assert not missing, (f"{block.where}: the output documented at {block.output.where} is not what it printed;"
                             f" missing:\n" + "\n".join(missing) + f"\n--- output ---\n{ran.output[-4000:]}")


def _inventory(guide) -> dict:
    return yaml.safe_load((guide.work / "inventory.yml").read_text())


def test_the_inventory_was_written_from_the_hosts_not_copied(guide) -> None:
    mine, generated = _inventory(guide), yaml.safe_load(guide.inventory.read_text())
    assert mine["all"]["vars"]["kimi_cluster"] == "kimi-a3" != generated["all"]["vars"]["kimi_cluster"]
    for name, host in mine["all"]["hosts"].items():
        assert host == {"ansible_host": guide.host(name)["ip"], "kimi_hardware": "atlas-800-a3",
                        "kimi_device_ips": guide.host(name)["device_ips"]}
    # and the cluster it deployed serves
    status = kimictl("status", "-i", str(guide.work / "inventory.yml"), "--output", "json", env=guide.env)
    assert status.returncode == 0 and json.loads(status.stdout)["state"] == "healthy", status.stdout[-2000:]


def _guide_inventory(guide) -> str:
    for ran in guide.ran:
        assert ran.rc is not None, "the guide's session did not finish"
    return str(guide.work / "inventory.yml")


def _start_failure(guide, inv: str, fault: str, *start: str) -> tuple[dict, str]:
    """With the cluster stopped: inject a fault, start (which must fail), clear it, stop what started."""
    guide.fault(fault)
    try:
        proc = kimictl("start", "-i", inv, "--yes", "--output", "json", *start, env=guide.env)
    finally:
        guide.fault("clear:all")
        assert kimictl("stop", "-i", inv, "--yes", env=guide.env).returncode == 0
    assert proc.returncode == 1, proc.stderr[-3000:]
    return json.loads(proc.stdout)["error"], proc.stderr


def test_engines_that_fail_at_start_lead_to_their_rows(guide) -> None:
    inv = _guide_inventory(guide)
    assert kimictl("stop", "-i", inv, "--yes", env=guide.env).returncode == 0
    try:
        # a taken kv_port: prefill-0's range starts at 36000 on atlas-01 (the guide's plan output shows it)
        err, tail = _start_failure(guide, inv, "port-taken:atlas-01:36000")
        assert "prefill-0-dp0 crashed during start-up" in err["message"], err
        assert err["hint"].endswith("docs/operators.md#t-engine-start")
        assert "Address already in use (addr='tcp://" in tail        # the log tail, the key of row t-kv-port
        assert "Address already in use" in doc.row("t-kv-port")
        assert "[Engine log lines](#engine-log-lines)" in doc.row("t-engine-start")
        # an engine that hangs while loading
        err, _ = _start_failure(guide, inv, "engine-hang:atlas-02:decode", "--ready-timeout", "8")
        assert re.search(r"decode-0-dp\d did not become ready within \d+s", err["message"]), err
        assert err["hint"].endswith("docs/operators.md#t-readiness")
        assert "did not become ready within" in doc.row("t-readiness")
        # the proxy port taken since the deploy (start runs no preflight): the front cannot listen
        err, tail = _start_failure(guide, inv, "port-taken:atlas-01:8000")
        assert "proxy proxy crashed during start-up" in err["message"], err
        assert "(host atlas-01, step proxy)" in tail and err["hint"].endswith("docs/operators.md#t-proxy-start")
        assert "[Errno 98] Address already in use" in tail
        row = doc.row("t-proxy-start")
        assert "proxy proxy crashed during start-up" in row and "[Errno 98] Address already in use" in row
    finally:
        back = kimictl("start", "-i", inv, "--yes", env=guide.env)
        assert back.returncode == 0, back.stderr[-3000:]


def test_a_link_down_under_a_serving_cluster_leads_to_the_pair_probe_row(guide) -> None:
    inv = _guide_inventory(guide)
    guide.fault("link-down:atlas-01:0", "link-down:atlas-01:8")   # one NPU of each prefill engine (0-7, 8-15)
    try:
        proc = kimictl("status", "-i", inv, env=guide.env)
        assert proc.returncode == 3, proc.stdout[-3000:]
        # vllm-ascend's proxy has answered 200 before decode fails the request: the answer is empty; kimictl's front
        # sends it once more to the other router copy, which fails it the same way, and answers 502 saying so
        assert "P/D pair probe: failed - HTTP 502;" in proc.stdout, proc.stdout[-3000:]
        assert ("router 0 answered 200 with an empty body, then router 1 answered 200 with an empty body"
                in proc.stdout and "hint: docs/operators.md#t-pair-probe" in proc.stdout), proc.stdout[-3000:]
        row = doc.row("t-pair-probe")
        assert "HTTP 502" in row and "answered 200 with an empty body" in row and "(#t-kv-transfer)" in row
        # the row sends the operator to decode's log, whose hint names the KV-transfer row
        logs = kimictl("logs", "-i", inv, "--role", "decode", "--lines", "200", env=guide.env)
        assert re.search(r"KV transfer for request \S+ from prefill engine .* failed", logs.stdout), logs.stdout[-3000:]
        assert re.search(r"^hint: decode-0-dp\d.*; see docs/operators\.md#t-kv-transfer$", logs.stdout, flags=re.M)
        kv_row = doc.row("t-kv-transfer")
        assert "`KV transfer for request <id> from prefill engine <id> at <host>:<port> failed`" in kv_row
    finally:
        guide.fault("clear:all")
    assert kimictl("status", "-i", inv, env=guide.env).returncode == 0


def test_a_device_ip_mismatch_leads_to_net_004(guide, tmp_path) -> None:
    inv = _inventory(guide)
    ips = inv["all"]["hosts"]["atlas-02"]["kimi_device_ips"]
    ips[3], ips[4] = ips[4], ips[3]                 # two NPUs swapped: a copy-paste slip
    path = tmp_path / "swapped.yml"
    path.write_text(yaml.safe_dump(inv))
    proc = kimictl("preflight", "-i", str(path), "--topology", "a3-pd", "--output", "json", env=guide.env)
    assert proc.returncode == 1
    failed = [r for r in json.loads(proc.stdout)["results"] if r["status"] == "fail" and r["severity"] == "error"]
    assert [(r["host"], r["id"]) for r in failed] == [("atlas-02", "NET-004")]
    assert f"NPU 3: host has {ips[4]}, inventory says {ips[3]}" in failed[0]["message"]
    assert failed[0]["fix"].endswith("docs/operators.md#t-net-004")
    assert "host has" in doc.row("t-net-004") and "device IP mismatch" in doc.row("t-net-004")



def test_a_decode_out_of_kv_leads_to_its_row_through_the_logs(guide) -> None:
    """kv-pressure: every decode engine runs out of KV after 4 tokens; the recompute scheduler hands the request
    back and the proxy replays it (the client gets all its tokens); `kimictl logs` names the row of the line."""
    inv = _guide_inventory(guide)
    guide.fault("kv-pressure:atlas-02")
    try:
        body = {"model": "kimi-k2.5", "prompt": "a request under KV pressure", "max_tokens": 16, "ignore_eos": True}
        req = urllib.request.Request(f"http://{guide.host('atlas-01')['ip']}:8000/v1/completions", method="POST",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["finish_reason"] == "length"
    finally:
        guide.fault("clear:atlas-02")
    proc = kimictl("logs", "-i", inv, "--role", "decode", "--lines", "400", env=guide.env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # (earlier tests' faults may have left other known lines in these tails, each with its own hint)
    hint = [ln for ln in proc.stdout.splitlines() if ln.startswith("hint: ") and ln.endswith("#t-kv-recompute")]
    assert len(hint) == 1 and hint[0].endswith("see docs/operators.md#t-kv-recompute"), proc.stdout[-3000:]
    assert re.match(r"hint: decode-0-dp\d(, decode-0-dp\d)*: \d+ line\(s\) like '.*\[RecomputeScheduler\] "
                    r"Recompute triggered for request ", hint[0]), hint[0]
    row = doc.row("t-kv-recompute")
    assert "[RecomputeScheduler] Recompute triggered for request" in row and "(#the-pd-proxy)" in row
