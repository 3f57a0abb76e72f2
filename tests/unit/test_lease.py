"""The cluster lease: kimictl/remote/lease.py (the flock on the lock host, run here by the hosts' python:
KIMICTL_HOST_PYTHON, scripts/test.sh's second pass uses Python 3.9) and kimictl/lease.py (the control node's side,
the --wait option of every command that changes hosts, and `status`)."""

from __future__ import annotations

import json
import os
import queue
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from fake_sessions import fake_sessions
from typer.testing import CliRunner

from kimictl import lease, status
from kimictl.cli.main import app
from kimictl.errors import EXIT_INVALID, HostError, KimictlError
from kimictl.inventory import load_inventory
from kimictl.remote import lease as remote_lease

SCRIPT = Path(remote_lease.__file__)
OTHER = {"hostname": "ci-runner-7", "user": "alice", "pid": 4242, "command": "rollout",
         "since": "2025-01-01T00:00:00Z"}


# --- the host side: kimictl/remote/lease.py under the hosts' python ------------------------------------------------


class Holding:
    """`python3 lease.py hold ...` as a process: its stdin is the lifeline, its stdout lines the outcome."""

    def __init__(self, py: str, state_dir: Path, holder: dict | None = None, wait: float = 0.0, ttl: float = 60.0,
                 boot: bool = False):
        args = json.dumps({"state_dir": str(state_dir), "holder": holder or OTHER, "wait": wait, "ttl": ttl})
        argv = [py, "-c", lease.BOOT] if boot else [py, str(SCRIPT)]
        self.proc = subprocess.Popen([*argv, "hold", args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        if boot:
            self.send(lease.script_line())
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def send(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def next(self, timeout: float = 15.0) -> Any:
        return self.lines.get(timeout=timeout)

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def holding(host_python: str):
    started: list[Holding] = []

    def start(state_dir: Path, **kw: Any) -> Holding:
        h = Holding(host_python, state_dir, **kw)
        started.append(h)
        return h

    yield start
    for h in started:
        h.end()


def peek(py: str, state_dir: Path) -> dict:
    out = subprocess.run([py, str(SCRIPT), "peek", json.dumps({"state_dir": str(state_dir)})], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return json.loads(out)


def test_a_second_hold_is_refused_at_once_naming_the_first_holder(holding, host_python: str, tmp_path: Path) -> None:
    sd = tmp_path / "var" / "lib" / "kimi"   # no state dir yet on a fresh host: the script makes it
    first = holding(sd)
    got = first.next()
    assert got["ok"] is True and got["holder"] == {**OTHER, "lock_pid": first.proc.pid}
    assert (sd / "lease.lock").stat().st_mode & 0o777 == 0o600
    second = holding(sd, holder={**OTHER, "hostname": "laptop", "pid": 1})
    refused = second.next()
    assert refused == {"ok": False, "holder": {**OTHER, "lock_pid": first.proc.pid}}
    assert second.proc.wait(10) == 0   # it did not wait: refused, and the script ended
    assert peek(host_python, sd) == {"state": "held", "holder": {**OTHER, "lock_pid": first.proc.pid}}


def test_a_holder_killed_with_sigkill_frees_the_lease_at_once(holding, host_python: str, tmp_path: Path) -> None:
    first = holding(tmp_path)
    assert first.next()["ok"] is True
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait(10)
    assert peek(host_python, tmp_path) == {"state": "free"}
    second = holding(tmp_path, holder={**OTHER, "hostname": "runner-2"})
    assert second.next() == {"ok": True, "holder": {**OTHER, "hostname": "runner-2", "lock_pid": second.proc.pid}}


def test_eof_on_stdin_releases_the_lease(holding, host_python: str, tmp_path: Path) -> None:
    """The control node closed the channel or died: sshd closes the script's stdin and the script ends."""
    first = holding(tmp_path)
    assert first.next()["ok"] is True
    first.send(b"\n")   # a heartbeat keeps it
    time.sleep(0.3)
    assert first.proc.poll() is None and peek(host_python, tmp_path)["state"] == "held"
    first.proc.stdin.close()
    assert first.proc.wait(10) == 0
    assert peek(host_python, tmp_path) == {"state": "free"}
    assert (tmp_path / "lease.lock").read_bytes() == b""   # no record of a holder that is gone


def test_a_silent_holder_loses_the_lease_after_its_ttl(holding, host_python: str, tmp_path: Path) -> None:
    """A control node cut off (no EOF ever comes) stops its heartbeats: the lock host lets go after the TTL."""
    beating = holding(tmp_path / "a", ttl=1.5)
    silent = holding(tmp_path / "b", ttl=1.5)
    assert beating.next()["ok"] is True and silent.next()["ok"] is True
    for _ in range(12):   # 3.6 s of heartbeats every 0.3 s
        beating.send(b"\n")
        time.sleep(0.3)
    assert beating.proc.poll() is None and peek(host_python, tmp_path / "a")["state"] == "held"
    assert silent.proc.wait(10) == 0 and peek(host_python, tmp_path / "b") == {"state": "free"}


def test_wait_queues_behind_the_holder_and_says_whom_it_waits_for(holding, tmp_path: Path) -> None:
    first = holding(tmp_path)
    assert first.next()["ok"] is True
    second = holding(tmp_path, holder={**OTHER, "hostname": "runner-2"}, wait=30)
    assert second.next() == {"waiting": True, "holder": {**OTHER, "lock_pid": first.proc.pid}}
    first.proc.stdin.close()
    got = second.next()
    assert got["ok"] is True and got["holder"]["hostname"] == "runner-2"
    third = holding(tmp_path, wait=2)   # a wait that runs out is a refusal naming the holder
    assert third.next(timeout=20) == {"waiting": True, "holder": got["holder"]}
    assert third.next(timeout=20) == {"ok": False, "holder": got["holder"]}


def test_peeks_never_fail_a_hold(holding, host_python: str, tmp_path: Path) -> None:
    """status peeks with a shared lock for an instant; a hold that meets it retries instead of reporting it held."""
    assert peek(host_python, tmp_path) == {"state": "free"}   # no lock file: free, and none is made
    assert not (tmp_path / "lease.lock").exists()
    stop = threading.Event()

    def peeker() -> None:
        import fcntl

        (tmp_path / "lease.lock").touch()
        lock = os.open(tmp_path / "lease.lock", os.O_RDONLY)
        while not stop.is_set():   # 50 peeks a second, each far longer than a real one (microseconds)
            fcntl.flock(lock, fcntl.LOCK_SH)
            time.sleep(0.002)
            fcntl.flock(lock, fcntl.LOCK_UN)
            time.sleep(0.018)
        os.close(lock)

    t = threading.Thread(target=peeker)
    t.start()
    try:
        time.sleep(0.1)
        for _ in range(3):
            h = holding(tmp_path)
            assert h.next()["ok"] is True
            h.proc.stdin.close()
            h.proc.wait(10)
    finally:
        stop.set()
        t.join()


def test_a_symlink_planted_as_the_lock_file_is_refused(holding, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / "lease.lock").symlink_to(target)
    h = holding(tmp_path)
    assert h.next() == {"error": f"{tmp_path / 'lease.lock'}: Too many levels of symbolic links"}
    assert h.proc.wait(10) == 1 and target.read_text() == "keep"


def test_the_boot_line_runs_the_script_as_ssh_sends_it(holding, tmp_path: Path) -> None:
    """`python3 -c BOOT hold ARGS` with the script as the first stdin line, the lifeline after it."""
    h = holding(tmp_path, boot=True)
    assert h.next() == {"ok": True, "holder": {**OTHER, "lock_pid": h.proc.pid}}
    h.send(b"\n")
    h.proc.stdin.close()
    assert h.proc.wait(10) == 0


# --- the control node's side ---------------------------------------------------------------------------------------


class LocalLink:
    """lease.Link over a local process instead of an SSH channel: the command kimictl would send, run here."""

    def __init__(self, command: str, python: str):
        argv = shlex.split(command)
        assert argv[0] == "python3"
        self.proc = subprocess.Popen([python, *argv[1:]], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [*map(self.lines.put, self.proc.stdout), self.lines.put(b"")],
                         daemon=True).start()

    def send(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def readline(self, timeout: float) -> bytes:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return b""

    def stderr(self) -> str:
        self.proc.wait(10)
        return self.proc.stderr.read().decode()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)


def _inventory(tmp_path: Path, state: Path, **lock_host: Any) -> Path:
    data = {"all": {"vars": {"kimi_cluster": "lease-unit", "kimi_model_dir": "/data/models/Kimi-K2.5-W4A8",
                             "kimi_vllm_ascend_version": "0.23.0", "kimi_runtime": "host", "kimi_nic": "eth0",
                             "kimi_model_source": "local", "kimi_proxy_script": "/opt/vllm-ascend/proxy.py"},
                    # the file lists atlas-02 first: the lock host is the name that sorts first, atlas-01
                    "hosts": {f"atlas-0{i}": {"ansible_host": f"10.9.0.{10 + i}", "kimi_hardware": "atlas-800-a3",
                                              **({"kimi_state_dir": str(state), **lock_host} if i == 1 else {})}
                              for i in (2, 1, 4, 3)}}}
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch, host_python: str):
    """An inventory whose lock host's state dir is here, and SSH replaced by local processes."""
    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path / "control"))
    links: list[LocalLink] = []

    def ssh_link(host, command: str, *, timeout: float, accept_new_keys: bool) -> LocalLink:
        assert host.name == "atlas-01"
        links.append(LocalLink(command, host_python))
        return links[-1]

    monkeypatch.setattr(lease, "SshLink", ssh_link)
    path = _inventory(tmp_path, tmp_path / "host-state")
    yield path
    for link in links:
        if link.proc.poll() is None:
            link.proc.kill()


def test_the_lock_host_is_the_first_name_whatever_the_file_order_or_limit(cluster: Path) -> None:
    inv = load_inventory(cluster)
    assert [h.name for h in inv.hosts][:2] == ["atlas-02", "atlas-01"]
    assert lease.lock_host(inv).name == "atlas-01"
    # --limit narrows what a command changes, never where the lease lives: the CLI passes the whole inventory
    assert lease.lock_host(inv.limited(["atlas-03"])).name == "atlas-03"


def test_a_second_lease_raises_lease_held_naming_the_holder(cluster: Path) -> None:
    inv = load_inventory(cluster)
    with lease.held(inv, "deploy") as mine:
        assert mine.holder is not None and mine.holder.command == "deploy" and mine.holder.pid == os.getpid()
        with pytest.raises(lease.LeaseHeld) as err:
            lease.Lease(inv, "stop").acquire()
        assert err.value.code == EXIT_INVALID
        assert err.value.holder == mine.holder
        assert f"`deploy` of {mine.holder.user}@{mine.holder.hostname} (pid {os.getpid()}, since " \
               f"{mine.holder.since})" in err.value.message
        with lease.try_hold(inv, "heal: restart decode-0") as got:
            assert not got.ours and got.holder == mine.holder
    with lease.try_hold(inv, "heal: restart decode-0") as got:   # released when `held` ended
        assert got.ours and got.holder.command == "heal: restart decode-0"
        with lease.try_hold(inv, "heal: restart decode-1") as other:
            assert not other.ours and other.holder.command == "heal: restart decode-0"
    with lease.held(inv, "start"):   # try_hold released it too
        pass


def test_a_lock_host_that_cannot_take_the_lease_is_exit_1_naming_it(cluster: Path, tmp_path: Path) -> None:
    inv = load_inventory(cluster)
    (tmp_path / "host-state").mkdir()
    (tmp_path / "host-state" / "lease.lock").symlink_to(tmp_path / "x")
    with pytest.raises(HostError) as err:
        lease.Lease(inv, "deploy").acquire()
    assert err.value.code == 1 and "lock host atlas-01" in err.value.message
    assert "Too many levels of symbolic links" in err.value.message and "lease.lock" in err.value.message


def test_an_unreachable_lock_host_is_exit_1_naming_it(tmp_path: Path, monkeypatch) -> None:
    inv = load_inventory(_inventory(tmp_path, tmp_path / "s", ansible_host="127.0.0.1", ansible_port=9))
    with pytest.raises(HostError, match="cannot take the cluster lease on its lock host atlas-01: cannot reach"):
        lease.Lease(inv, "deploy", timeout=5).acquire()


def _hold_as_other(host_python: str, state: Path) -> Holding:
    h = Holding(host_python, state)
    assert h.next()["ok"] is True
    return h


def _record_releases(tmp_path: Path, inv_path: Path) -> None:
    """Two deployed releases with their render snapshots: enough for rollout and rollback to get to the lease."""
    from kimictl import state
    from kimictl.plan import make_plan
    from kimictl.render import render
    from kimictl.topology import load_topology

    inv = load_inventory(inv_path)
    topo = load_topology("a3-pd")
    r = render(make_plan(inv, topo), inv, topo)
    run = state.control_dir("lease-unit") / "runs" / "x"
    run.mkdir(parents=True)
    (run / "rendered.json").write_text(r.model_dump_json())
    for rel in ("r1", "r2"):
        state.record_release("lease-unit", state.ReleaseRecord(release=rel, result="deployed", hosts=r.releases,
                                                               run_dir=str(run)))


# command -> (its options after -i INV, the function that changes hosts, which must not run)
CHANGING = {
    "deploy": (["--topology", "a3-pd", "--skip-weights", "--yes"], "kimictl.deploy.Deployer.run"),
    "rollback": (["--yes"], "kimictl.deploy.Deployer.run"),
    "rollout": (["--set", "decode.serve.max-num-seqs=16", "--yes"], "kimictl.rollout.run.Rollout.run"),
    "stop": (["--limit", "atlas-03", "--yes"], "kimictl.lifecycle.stop"),   # a --limit still takes the lease
    "start": (["--yes"], "kimictl.lifecycle.start"),
    "weights pull": (["--mode", "shared"], "kimictl.weights.stage.pull"),
    "observe up": (["--topology", "a3-pd"], "kimictl.observe_up.observe_up"),
}


@pytest.mark.parametrize("command", list(CHANGING))
def test_every_command_that_changes_hosts_refuses_with_exit_2_naming_the_holder(
        cluster: Path, tmp_path: Path, host_python: str, monkeypatch, command: str) -> None:
    args, stage = CHANGING[command]
    _record_releases(tmp_path, cluster)
    monkeypatch.setattr(stage, lambda *a, **k: pytest.fail("the command ran without the lease"))
    other = _hold_as_other(host_python, tmp_path / "host-state")
    try:
        for output in ([], ["--output", "json"]):
            r = CliRunner().invoke(app, [*command.split(), "-i", str(cluster), *args, *output])
            assert r.exit_code == EXIT_INVALID, r.output
            text = json.loads(r.stdout)["error"]["message"] if output else r.stderr
            assert ("cluster lease-unit is leased to `rollout` of alice@ci-runner-7 (pid 4242, since "
                    "2025-01-01T00:00:00Z); nothing was changed") in text, text
            assert "Traceback" not in r.output
    finally:
        other.end()


def test_wait_waits_for_the_holder_then_runs(cluster: Path, tmp_path: Path, host_python: str, monkeypatch) -> None:
    from kimictl import lifecycle

    ran: list[float] = []

    def stop(inv, **_kw):
        ran.append(time.monotonic())
        # the command runs holding the lease: the record on the lock host names it
        held = json.loads((tmp_path / "host-state" / "lease.lock").read_text())
        assert held["command"] == "stop" and held["pid"] == os.getpid()
        return lifecycle.LifecycleResult(inv.cluster.name, "stop", "stopped", {}, None)

    monkeypatch.setattr(lifecycle, "stop", stop)
    other = _hold_as_other(host_python, tmp_path / "host-state")
    released = []

    def release_later() -> None:
        time.sleep(3)
        released.append(time.monotonic())
        other.proc.stdin.close()

    threading.Thread(target=release_later, daemon=True).start()
    try:
        r = CliRunner().invoke(app, ["stop", "-i", str(cluster), "--yes", "--wait", "60"])
    finally:
        other.end()
    assert r.exit_code == 0, r.output
    assert ("waiting up to 60s for the cluster lease: `rollout` of alice@ci-runner-7 (pid 4242, since "
            "2025-01-01T00:00:00Z) holds it\n") in r.stderr   # one line, however long (CI logs are searched)
    assert ran and released and ran[0] >= released[0]
    assert (tmp_path / "host-state" / "lease.lock").read_bytes() == b""   # given back when the command ended


def test_wait_is_one_option_of_every_changing_command_and_of_no_read_only_one() -> None:
    import typer.main

    root = typer.main.get_command(app)

    def cmd(path: str):
        c = root
        for word in path.split():
            c = c.commands[word]
        return c

    shapes = set()
    for path in CHANGING:
        opts = [p for p in cmd(path).params if "--wait" in getattr(p, "opts", [])]
        assert len(opts) == 1, path
        shapes.add((tuple(opts[0].opts), opts[0].help))
    assert len(shapes) == 1
    for path in ("status", "plan", "validate", "render", "preflight", "logs", "weights status", "weights verify",
                 "observe render", "heal"):
        assert not any("--wait" in getattr(p, "opts", []) for p in cmd(path).params), path


def test_check_runs_take_no_lease(cluster: Path, tmp_path: Path, host_python: str, monkeypatch) -> None:
    """deploy --check and rollout --check change nothing: they run while another command holds the lease."""
    from kimictl.deploy import Deployer

    _record_releases(tmp_path, cluster)
    checked = []

    def run(self):
        checked.append(self.opts.check)
        raise KimictlError("the check ran")

    monkeypatch.setattr(Deployer, "run", run)
    other = _hold_as_other(host_python, tmp_path / "host-state")
    try:
        r = CliRunner().invoke(app, ["deploy", "-i", str(cluster), "--topology", "a3-pd", "--skip-weights",
                                     "--check"])
    finally:
        other.end()
    assert checked == [True] and "error: the check ran" in r.stderr and "leased" not in r.output


# --- status shows it ------------------------------------------------------------------------------------------------


class LocalSession:
    """An ssh.Session whose commands run here, so peek_on runs the real script."""

    def __init__(self, python: str):
        self.python = python

    def run(self, command: str, timeout: float | None = None, stdin: str | None = None):
        argv = shlex.split(command)
        return subprocess.run([self.python, *argv[1:]], input=stdin, capture_output=True, text=True,
                              timeout=timeout, check=False)


def test_peek_on_reports_free_then_the_holder(cluster: Path, tmp_path: Path, host_python: str) -> None:
    inv = load_inventory(cluster)
    host = inv.host("atlas-01")
    s = LocalSession(host_python)
    assert lease.peek_on(s, host, 30) == {"state": "free"}
    other = _hold_as_other(host_python, tmp_path / "host-state")
    try:
        assert lease.peek_on(s, host, 30) == {"state": "held", "holder": OTHER}
    finally:
        other.end()
    assert lease.peek_on(s, host, 30) == {"state": "free"}

    class Garbled:
        def run(self, *_a, **_k):
            return subprocess.CompletedProcess([], 0, "bash: python3: command not found\n", "")

    got = lease.peek_on(Garbled(), host, 30)
    assert got["state"] == "unknown" and "command not found" in got["detail"]


def test_status_probes_the_lease_on_the_lock_host_only(cluster: Path, monkeypatch) -> None:
    held = json.dumps({"state": "held", "holder": {**OTHER, "pid": "4242; rm -rf /", "user": "a\x1b[31m"}})
    commands: dict[str, list[str]] = {}

    def answer(host: str, cmd: str) -> str:
        commands.setdefault(host, []).append(cmd)
        return held if " peek " in cmd else "null\n@@kimi\n[]\n@@kimi\n\n@@kimi\n"

    monkeypatch.setattr(status, "Sessions", fake_sessions(answer))
    inv = load_inventory(cluster)
    probes = status._probe(inv, 5)
    assert [len(commands[h]) for h in ("atlas-01", "atlas-02", "atlas-03", "atlas-04")] == [2, 1, 1, 1]
    # what a host reports is checked: a pid that is no number and a user with control characters are not printed
    assert probes["atlas-01"]["lease"] == {"state": "held", "holder": {**OTHER, "pid": None, "user": "?"}}
    assert "lease" not in probes["atlas-02"]


def _status(monkeypatch, inv_path: Path, probes: dict[str, Any], *args: str):
    from kimictl import health

    monkeypatch.setattr(status, "_probe", lambda inv, timeout: probes)
    monkeypatch.setattr(health, "http_request", lambda *a, **k: pytest.fail("no engine to ask"))
    return CliRunner().invoke(app, ["status", "-i", str(inv_path), *args])


@pytest.mark.parametrize(("got", "line", "doc"), [
    ({"state": "free"}, "lease: free (lock host atlas-01)", {"host": "atlas-01", "state": "free"}),
    ({"state": "held", "holder": OTHER},
     "lease: held by `rollout` of alice@ci-runner-7 (pid 4242, since 2025-01-01T00:00:00Z) (lock host atlas-01)",
     {"host": "atlas-01", "state": "held", "holder": OTHER}),
    (None, "lease: unknown: atlas-01: connection refused (lock host atlas-01)",
     {"host": "atlas-01", "state": "unknown", "detail": "atlas-01: connection refused"}),
], ids=["free", "held", "unreachable"])
def test_status_shows_the_lease_in_text_and_json(cluster: Path, monkeypatch, got, line: str, doc: dict) -> None:
    from kimictl.ssh import SSHError

    empty = {"manifest": None, "supervised": {}, "hbm_used_mb": {}, "front": None}
    probes = {h: dict(empty) for h in ("atlas-02", "atlas-03", "atlas-04")}
    probes["atlas-01"] = SSHError("atlas-01: connection refused") if got is None else {**empty, "lease": got}
    r = _status(monkeypatch, cluster, probes, "--output", "json")
    report = json.loads(r.stdout)
    assert report["lease"] == doc
    assert list(report)[-2:] == ["at", "lease"]   # a new key at the end; the others keep their places
    text = _status(monkeypatch, cluster, probes)
    assert line in text.stdout, text.stdout
