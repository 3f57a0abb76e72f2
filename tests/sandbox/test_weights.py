"""`kimictl weights` on a 3-host sandbox fed by its fake hub: sharded pull + peer all-gather, verify, repair,
resume after a kill, the locks, refused listings and a token that never shows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import ArgvWatch, SandboxHandle, _bring_up, kimictl

pytestmark = pytest.mark.sandbox
MODEL_DIR = "/var/lib/kimi/models/Kimi-K2.5-W4A8"


@pytest.fixture(scope="module")
def sb(tmp_path_factory):
    yield from _bring_up(tmp_path_factory.mktemp("sb-w"), "--hosts", "3", "--hardware", "atlas-800-a3")


def hub_url(sb: SandboxHandle) -> str:
    return json.loads(subprocess.run([sys.executable, "-m", "kimictl", "sandbox", "status", "--dir", str(sb.dir),
                                      "-o", "json"], capture_output=True, text=True, check=True).stdout)["hub"]["url"]


def hub(sb: SandboxHandle, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(hub_url(sb) + path, data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"{}")


def hub_file_bytes(sb: SandboxHandle) -> dict[str, int]:
    """Bytes of each checkpoint file the hub sent since the last reset, over all clients."""
    out: dict[str, int] = {}
    for c in hub(sb, "/_admin/stats?wait=1")["clients"].values():
        for f, n in c["files"].items():
            name = f.split("/", 2)[2]
            out[name] = out.get(name, 0) + n
    return out


def expected(sb: SandboxHandle) -> dict[str, str]:
    return {f["path"]: f["sha256"] for f in json.loads((sb.dir / "checkpoint.json").read_text())["files"]}


def host_files(sb: SandboxHandle, host: str) -> dict[str, str]:
    out = sb.ssh(host, f"cd {MODEL_DIR} 2>/dev/null && find . -type f -not -path './.kimi*' -printf '%P\\n' "
                       "| sort | xargs -r sha256sum").stdout
    return {line.split()[1]: line.split()[0] for line in out.splitlines()}


def wipe(sb: SandboxHandle) -> None:
    for h in sb.hosts:
        sb.ssh(h, f"rm -rf {MODEL_DIR}")


def pull(sb: SandboxHandle, *args: str, inventory: Path | None = None) -> subprocess.CompletedProcess:
    return kimictl("weights", "pull", "-i", str(inventory or sb.inventory), "-o", "json", *args)


def test_sharded_pull_stages_identical_copies_from_one_hub_copy(sb):
    wipe(sb)
    hub(sb, "/_admin/stats/reset", {})
    r = pull(sb)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["changed"]
    want = expected(sb)
    for h in sb.hosts:
        assert host_files(sb, h) == want, h
        marker = json.loads(sb.ssh(h, f"cat {MODEL_DIR}/.kimi-complete").stdout)
        assert marker["digest"] == doc["manifest_digest"]
        assert sb.ssh(h, f"test ! -e {MODEL_DIR}/.kimi-staging").returncode == 0
        # the run's peer key is gone again
        assert "kimictl-weights" not in sb.ssh(h, "cat ~/.ssh/authorized_keys 2>/dev/null").stdout
    sent = hub_file_bytes(sb)
    sizes = {f["path"]: f["size"] for f in json.loads((sb.dir / "checkpoint.json").read_text())["files"]}
    # every weight file left the hub once (not once per host); the rest moved peer to peer. The control node
    # itself reads the small index and quant description to check the checkpoint's shape.
    assert set(sent) == set(sizes)
    for p, n in sent.items():
        assert n == sizes[p] or (n == 2 * sizes[p] and not p.endswith(".safetensors")), p
    peers = sum(v for host in doc["hosts"] for k, v in host["received"].items() if k != "hub")
    assert peers == (len(sb.hosts) - 1) * sum(sizes.values())
    # the run's timeline: every file handed to one host's hub pull once, every host complete
    runs = sorted((Path(os.environ["KIMICTL_STATE_DIR"]) / sb.cluster / "runs").glob("*-weights/timeline.jsonl"))
    timeline = [json.loads(x) for x in runs[-1].read_text().splitlines()]
    from_hub = [p for e in timeline if e["ev"] == "hub" for p in e["paths"]]
    assert sorted(from_hub) == sorted(sizes)
    assert {e["host"] for e in timeline if e["ev"] == "complete"} == set(sb.hosts)

    v = kimictl("weights", "verify", "-i", str(sb.inventory), "--full", "-o", "json")
    assert v.returncode == 0, v.stderr
    assert all(h["bytes_read"] > 0 for h in json.loads(v.stdout)["hosts"])

    # again: nothing to do, nothing read from the hub, stamps spare re-reading
    hub(sb, "/_admin/stats/reset", {})
    again = pull(sb)
    assert again.returncode == 0, again.stderr
    doc = json.loads(again.stdout)
    assert not doc["changed"] and all(h["bytes_read"] == 0 for h in doc["hosts"])
    assert sum(hub_file_bytes(sb).values()) == 0


def test_flipped_byte_is_found_and_fetched_again(sb):
    assert pull(sb).returncode == 0
    victim = sb.hosts[1]
    shard = sorted(p for p in expected(sb) if p.endswith(".safetensors"))[2]
    flip = (f"python3 -c \"f=open('{MODEL_DIR}/{shard}','r+b'); f.seek(4096); b=f.read(1); f.seek(4096); "
            f"f.write(bytes([b[0]^1]))\"")
    assert sb.ssh(victim, flip).returncode == 0
    v = kimictl("weights", "verify", "-i", str(sb.inventory))
    assert v.returncode == 1
    assert f"{victim}: corrupt {shard}" in v.stdout
    # a marker that lies is dropped, so preflight and deploy see the host as not staged
    assert sb.ssh(victim, f"test -e {MODEL_DIR}/.kimi-complete").returncode != 0

    r = pull(sb)
    assert r.returncode == 0, r.stderr
    doc = {h["host"]: h for h in json.loads(r.stdout)["hosts"]}
    assert doc[victim]["bad"] == [shard]
    size = next(f["size"] for f in json.loads((sb.dir / "checkpoint.json").read_text())["files"]
                if f["path"] == shard)
    assert sum(doc[victim]["received"].values()) == size
    assert all(not doc[h]["received"] for h in sb.hosts if h != victim)
    assert host_files(sb, victim) == expected(sb)


def test_killed_pull_resumes_without_resending_finished_files(sb):
    wipe(sb)
    hub(sb, "/_admin/rate", {"rate": "3MB/s"})
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kimictl", "weights", "pull", "-i", str(sb.inventory)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:   # kill once some, but not all, files are in place somewhere
            done = sum(len(host_files(sb, h)) for h in sb.hosts)
            if done >= 3:
                break
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(10)
        hub(sb, "/_admin/rate", {"rate": None})
    before = {h: set(host_files(sb, h)) for h in sb.hosts}
    assert 0 < sum(map(len, before.values())) < len(sb.hosts) * len(expected(sb))
    # the hosts' agents died with their SSH channel: nothing holds the lock
    for h in sb.hosts:
        assert "kimi_weights_agent" not in sb.ssh(h, "ps -eo args").stdout
    hub(sb, "/_admin/stats/reset", {})
    r = pull(sb)
    assert r.returncode == 0, r.stderr
    sizes = {f["path"]: f["size"] for f in json.loads((sb.dir / "checkpoint.json").read_text())["files"]}
    for host in json.loads(r.stdout)["hosts"]:
        missing = sum(s for p, s in sizes.items() if p not in before[host["host"]])
        assert sum(host["received"].values()) == missing, host
    staged_somewhere = set().union(*before.values())
    assert not set(hub_file_bytes(sb)) & staged_somewhere
    for h in sb.hosts:
        assert host_files(sb, h) == expected(sb)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def test_a_host_whose_agent_dies_ends_failed_and_the_others_finish(sb):
    wipe(sb)
    hub(sb, "/_admin/rate", {"rate": "3MB/s"})
    victim = sb.hosts[1]
    proc = subprocess.Popen([sys.executable, "-m", "kimictl", "weights", "pull", "-i", str(sb.inventory), "-o",
                             "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        agent = None
        deadline = time.monotonic() + 120
        while agent is None and time.monotonic() < deadline:   # the victim's agent, under its sshd
            for pid in _descendants(sb.host(victim)["launcher_pid"]):
                try:
                    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if any(b"kimi_weights_agent" in a for a in args) and b"serve" in args:
                    agent = pid
            time.sleep(0.5)
        assert agent, "no agent on the victim"
        while not host_files(sb, sb.hosts[0]) and time.monotonic() < deadline:
            time.sleep(0.5)
        os.kill(agent, signal.SIGKILL)
    finally:
        hub(sb, "/_admin/rate", {"rate": None})
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err
    doc = json.loads(out)
    states = {h["host"]: h for h in doc["hosts"]}
    assert states[victim]["state"] == "failed" and "weights transfer" in states[victim]["error"]
    for h in sb.hosts:
        if h != victim:
            assert states[h]["state"] == "complete", states[h]
            assert host_files(sb, h) == expected(sb)
    again = pull(sb)   # the next pull brings the victim up to date
    assert again.returncode == 0, again.stderr
    assert host_files(sb, victim) == expected(sb)


def test_concurrent_pulls_are_refused_with_the_holder(sb):
    wipe(sb)
    hub(sb, "/_admin/rate", {"rate": "2MB/s"})
    first = subprocess.Popen([sys.executable, "-m", "kimictl", "weights", "pull", "-i", str(sb.inventory)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(4)
        # the cluster lease comes first: one command that changes hosts at a time, named (exit 2, nothing changed)
        second = kimictl("weights", "pull", "-i", str(sb.inventory))
        assert second.returncode == 2, second.stderr[-2000:]
        assert "is leased to `weights pull`" in second.stderr and f"pid {first.pid}" in second.stderr
        # another control node (its own state dir) meets the same lease on the cluster's lock host
        other = subprocess.run([sys.executable, "-m", "kimictl", "weights", "pull", "-i", str(sb.inventory)],
                               capture_output=True, text=True, timeout=300,
                               env={**os.environ, "KIMICTL_STATE_DIR": str(sb.dir / "other-control")}, check=False)
        assert other.returncode == 2, other.stderr[-2000:]
        assert f"pid {first.pid}" in other.stderr and "Traceback" not in other.stderr
    finally:
        hub(sb, "/_admin/rate", {"rate": None})
        first.wait(300)
    assert first.returncode == 0


def test_unsafe_listing_is_refused_before_any_byte_is_written(sb):
    wipe(sb)
    hub(sb, "/_admin/faults", {"malicious_names": True})
    try:
        r = kimictl("weights", "pull", "-i", str(sb.inventory))
    finally:
        hub(sb, "/_admin/faults", {})
    assert r.returncode == 2, r.stderr
    assert "'../x'" in r.stderr and "Traceback" not in r.stderr
    for h in sb.hosts:
        assert sb.ssh(h, f"test -e {MODEL_DIR}").returncode != 0
        assert sb.ssh(h, "ls /var/lib/kimi/x /etc/cron.d/evil 2>/dev/null").stdout == ""


def test_hub_token_never_shows(sb, tmp_path):
    """From the environment or a token file, the token reaches the hub and nothing else: no output, no file on the
    control node (Ansible's artifacts included) or a host, no process's command line while the pulls run."""
    from kimictl.sandbox.fakehub import FakeHub

    token = "kimi-secret-7f3a9c1e5b"
    inv = yaml.safe_load(sb.inventory.read_text())
    bridge = inv["all"]["vars"]["kimi_model_endpoint"].split("//")[1].split(":")[0]
    state = Path(os.environ["KIMICTL_STATE_DIR"])
    with FakeHub({"Eco-Tech/Kimi-K2.5-W4A8": sb.dir / "checkpoint"}, bridge, 0, token=token) as h:
        inv["all"]["vars"]["kimi_model_endpoint"] = h.url
        inv["all"]["vars"]["kimi_model_dir"] = "/var/lib/kimi/models/tokened"
        path = tmp_path / "inventory.yml"
        path.write_text(yaml.safe_dump(inv))
        no_token = kimictl("weights", "pull", "-i", str(path))
        assert no_token.returncode == 1 and "Traceback" not in no_token.stderr
        tok = tmp_path / "token"
        tok.write_text(token + "\n")
        tok.chmod(0o644)
        loose = kimictl("weights", "pull", "-i", str(path), "--token-file", str(tok))
        assert loose.returncode == 2 and "chmod 600" in loose.stderr
        tok.chmod(0o600)
        runs = []
        # the client's variable; then a token file, with the token also lying in an unrelated variable
        for args, env in (((), {"MODELSCOPE_API_TOKEN": token}), (("--token-file", str(tok)), {"HF_TOKEN": token})):
            h.reset_stats()
            before = set(state.rglob("weights-prepare/command"))
            with ArgvWatch(token) as watch:
                r = kimictl("weights", "pull", "-i", str(path), *args, env=env)
            assert r.returncode == 0, r.stderr
            reqs = [req for req in h.requests() if req["path"].startswith("/api/v1/models/")]
            assert reqs and all(req["auth"] for req in reqs)
            assert watch.samples > 10 and watch.hits == []
            assert set(state.rglob("weights-prepare/command")) - before, "the peer-key playbook did not run"
            runs.append(r)
            for host in sb.hosts:
                assert sb.ssh(host, f"grep -rl {token} /var/lib/kimi /root 2>/dev/null").stdout == ""
                sb.ssh(host, "rm -rf /var/lib/kimi/models/tokened")
    for out in (no_token.stdout, no_token.stderr, *(x for r in runs for x in (r.stdout, r.stderr))):
        assert token not in out
    leaks = subprocess.run(["grep", "-rl", token, str(state)], check=False, capture_output=True, text=True)
    assert leaks.stdout == ""


def test_peer_key_serves_only_kimictls_rsync_from_cluster_hosts_and_a_killed_runs_key_goes(sb, tmp_path):
    """The run's key, taken from a host while a pull runs: an extra rsync option through its forced command is
    refused and writes nothing; it only works from the cluster's hosts (from=) and carries an expiry. The pull is
    killed, so the key stays: the next `weights status` reports and removes it."""
    import uuid

    wipe(sb)
    hub(sb, "/_admin/rate", {"rate": "2MB/s"})
    proc = subprocess.Popen([sys.executable, "-m", "kimictl", "weights", "pull", "-i", str(sb.inventory)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    kd = "/var/lib/kimi/weights"
    try:
        deadline = time.monotonic() + 120
        while not all(sb.ssh(h, f"test -s {kd}/peer_key && grep -q kimictl-weights:{sb.cluster} ~/.ssh/authorized_keys"
                                ).returncode == 0 for h in sb.hosts):
            assert time.monotonic() < deadline and proc.poll() is None, "the pull never installed its peer key"
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(10)
        hub(sb, "/_admin/rate", {"rate": None})
    a, b = sb.hosts[0], sb.hosts[1]
    ips = sorted(sb.host(h)["ip"] for h in sb.hosts)
    line = sb.ssh(b, "grep kimictl-weights ~/.ssh/authorized_keys").stdout
    assert line.startswith('restrict,expiry-time="') and f'from="{",".join(ips)}"' in line, line

    b_ip = sb.host(b)["ip"]
    peer_ssh = (f"ssh -i {kd}/peer_key -o UserKnownHostsFile={kd}/known_hosts -o StrictHostKeyChecking=yes "
                "-o BatchMode=yes -o IdentitiesOnly=yes")
    canary = f"/tmp/kimictl-peer-canary-{uuid.uuid4().hex[:8]}"   # /tmp is this machine's, on every host
    attack = sb.ssh(a, f"{peer_ssh} root@{b_ip} 'rsync --server --sender -Re.LsfxCIvu --timeout=60 . "
                       f"--log-file={canary} .kimi-lock'")
    assert attack.returncode != 0 and "refused rsync arguments" in attack.stderr, attack
    assert not Path(canary).exists()
    assert f"--log-file={canary}" in sb.ssh(b, "cat /var/lib/kimi/logs/weights-peer.log").stdout
    # what kimictl itself sends still goes through (the lock file exists on every host the pull reached)
    fetched = sb.ssh(a, f"rm -rf /var/lib/kimi/fetch-test && rsync -R --timeout=60 -e '{peer_ssh}' "
                        f"root@{b_ip}:.kimi-lock /var/lib/kimi/fetch-test/ && cat /var/lib/kimi/fetch-test/.kimi-lock")
    assert fetched.returncode == 0 and "weights pull" in fetched.stdout, fetched
    sb.ssh(a, "rm -rf /var/lib/kimi/fetch-test")
    # the same key from this machine, which is not a cluster host: sshd refuses it (from=)
    key = tmp_path / "peer_key"
    key.write_text(sb.ssh(a, f"cat {kd}/peer_key").stdout)
    key.chmod(0o600)
    outside = subprocess.run(["ssh", "-i", str(key), "-o", f"UserKnownHostsFile={sb.dir / 'known_hosts'}",
                              "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", f"root@{b_ip}",
                              "rsync --server --sender -Re.LsfxCIvu --timeout=60 . .kimi-lock"],
                             capture_output=True, text=True, timeout=60, check=False)
    assert outside.returncode == 255 and "Permission denied" in outside.stderr, outside

    st = kimictl("weights", "status", "-i", str(sb.inventory), "-o", "json")
    keys = {h["host"]: h["peer_key"] for h in json.loads(st.stdout)["hosts"]}
    assert all(k and k["state"] == "removed" and k["expires"] for k in keys.values()), keys
    for h in sb.hosts:
        assert "kimictl-weights" not in sb.ssh(h, "cat ~/.ssh/authorized_keys").stdout
        assert sb.ssh(h, f"test -e {kd}").returncode != 0
    text = kimictl("weights", "status", "-i", str(sb.inventory))
    assert "peer key" not in text.stdout   # gone: nothing left to report
