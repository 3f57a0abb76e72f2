"""Supervisor: real detached processes in tmp dirs; teardown kills everything a test started."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kimictl.remote import supervisor as sv

SUP = Path(sv.__file__).resolve()
PY = sys.executable
# Hosts run it with their own python3: KIMICTL_HOST_PYTHON=/path/python3.9 checks another one (scripts/test.sh).
SUP_PY = os.environ.get("KIMICTL_HOST_PYTHON") or PY

# Children get the test's marker as argv[1] (and hand it to their own children) so teardown can find them.
SLEEPER = """
import sys, time
print("hello out", flush=True)
print("hello err", file=sys.stderr, flush=True)
time.sleep(600)
"""
CRASHER = """
import sys
print("boom", flush=True)
sys.exit(3)
"""
TERM_AWARE = """
import signal, sys, time
terms = []
signal.signal(signal.SIGTERM, lambda *_: terms.append(1))
print("ready", flush=True)
while not terms:
    time.sleep(0.01)
time.sleep(0.5)  # a slow graceful shutdown: any further SIGTERM would arrive meanwhile
open(sys.argv[2], "w").write(f"{len(terms)} term")
"""
TERM_DEAF = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(600)
"""
FAMILY = """
import json, subprocess, sys, time
nap = [sys.executable, "-c", "import time; time.sleep(600)", sys.argv[1]]
same_group = subprocess.Popen(nap)
own_session = subprocess.Popen(nap, start_new_session=True)
open(sys.argv[2], "w").write(json.dumps([same_group.pid, own_session.pid]))
print("ready", flush=True)
time.sleep(600)
"""
CHATTY = """
import sys, time
for i in range(300):
    print(f"line {i:04d} " + "x" * 89, flush=True)
print("done", flush=True)
time.sleep(600)
"""


def wait_for(pred, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def gone(pid: int) -> bool:
    st = sv.proc_stat(pid)
    return st is None or st[0] in ("Z", "X")


def wait_gone(*pids: int) -> None:
    # Polled: the kernel drops the lock (which stop waits for) just before the holder becomes a zombie.
    wait_for(lambda: all(gone(p) for p in pids), f"pids {pids} gone")


def ppid_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


class Harness:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.run_dir = tmp_path / "run"
        self.log = tmp_path / "logs" / "eng.log"
        self.marker = f"sup-test-{uuid.uuid4().hex}"

    def sup(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
        # -I -S: no site-packages, so the supervisor has to live on the standard library alone.
        return subprocess.run(
            [SUP_PY, "-I", "-S", str(SUP), *args], capture_output=True, text=True, timeout=timeout, check=False
        )

    def start(self, script: str, *opts: str, name: str = "eng", extra: tuple[str, ...] = ()):
        return self.sup(
            "start", "--name", name, "--run-dir", str(self.run_dir), "--log", str(self.log), *opts,
            "--", PY, "-c", script, self.marker, *extra,
        )  # fmt: skip

    def started(self, script: str, *opts: str, name: str = "eng", extra: tuple[str, ...] = ()) -> dict:
        r = self.start(script, *opts, name=name, extra=extra)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["state"] == "running" and doc["child_pid"], doc
        return doc

    def stop(self, *opts: str, name: str | None = "eng") -> subprocess.CompletedProcess:
        target = ["--name", name] if name else ["--all"]
        return self.sup("stop", *target, "--run-dir", str(self.run_dir), *opts)

    def status(self, name: str | None = None) -> list[dict]:
        r = self.sup("status", "--run-dir", str(self.run_dir), *(["--name", name] if name else []))
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def state(self, name: str = "eng") -> dict:
        return json.loads((self.run_dir / f"{name}.json").read_text())

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def printed(self, line: str) -> bool:
        # Whole lines only: the supervisor's "started" event quotes the script, which contains the text too.
        return line in self.log_text().splitlines()

    def marked_pids(self) -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if self.marker.encode() in f.read():
                            pids.append(int(entry))
                except OSError:
                    pass
        return pids

    def cleanup(self) -> None:
        for _ in range(100):
            pids = self.marked_pids()
            if not pids:
                return
            # Supervisors first, or they would restart the children we kill.
            sups = [p for p in pids if str(SUP) in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
            for p in sups + [p for p in pids if p not in sups]:
                with contextlib.suppress(OSError):
                    os.kill(p, signal.SIGKILL)
            time.sleep(0.05)


@pytest.fixture
def h(tmp_path: Path):
    harness = Harness(tmp_path)
    yield harness
    try:
        harness.stop("--grace", "0", name=None)
    finally:
        harness.cleanup()


def test_start_returns_at_once_and_detaches(h: Harness) -> None:
    doc = h.started(SLEEPER, "--tag", "rel-1")  # capture_output: would hang if the daemon kept our pipes
    sup, child = doc["supervisor_pid"], doc["child_pid"]
    assert not gone(child) and not gone(sup)
    assert doc["name"] == "eng" and doc["tag"] == "rel-1" and doc["restarts"] == 0
    assert doc["cmd"][-1] == h.marker and doc["cmd_hash"].startswith("sha256:")
    assert os.getsid(sup) != os.getsid(0)
    assert ppid_of(sup) != os.getpid()
    for fd in (0, 1, 2):
        assert os.readlink(f"/proc/{sup}/fd/{fd}") == "/dev/null"
    assert os.readlink(f"/proc/{sup}/cwd") == "/"
    assert ppid_of(child) == sup
    assert os.getpgid(child) == child != os.getpgid(sup)
    wait_for(lambda: h.printed("hello out") and h.printed("hello err"), "child output in the log")
    (st,) = h.status()
    assert st["state"] == "running" and st["alive"] is True and st["child_alive"] is True


def fake_systemd_run(h: Harness, monkeypatch) -> Path:
    """systemd-run on PATH is tests/unit/data/fake_systemd_run.sh; the file it records its arguments in."""
    bin_dir = h.tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemd-run").symlink_to(Path(__file__).parent / "data" / "fake_systemd_run.sh")
    launched = h.tmp / "systemd-run.args"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SYSTEMD_RUN_LOG", str(launched))
    return launched


def test_under_systemd_the_supervisor_is_a_transient_unit(h: Harness, monkeypatch) -> None:
    launched = fake_systemd_run(h, monkeypatch)
    doc = h.started(SLEEPER, "--tag", "rel-1", "--grace", "3", "--systemd", "yes")
    args = launched.read_text().splitlines()
    unit = sv.unit_name(str(h.run_dir), "eng")
    assert doc["unit"] == unit and f"--unit={unit}" in args
    stop_after = f"--property=TimeoutStopSec={3 + int(sv.KILL_WAIT) + 5}"
    assert {"--collect", "--property=KillMode=mixed", stop_after} <= set(args)
    # The unit runs this supervisor in the foreground with the same settings, then the command.
    cut = args.index("--")
    assert args[cut + 2:cut + 4] == [str(SUP), "run"] and args[-1] == h.marker
    assert args[args.index("--tag") + 1] == "rel-1" and args[args.index("--grace") + 1] == "3.0"
    assert ppid_of(doc["child_pid"]) == doc["supervisor_pid"]
    # Same state, status and stop as without systemd; starting again is a no-op.
    assert h.start(SLEEPER, "--tag", "rel-1", "--grace", "3", "--systemd", "yes").stdout.strip() == "unchanged"
    (st,) = h.status()
    assert st["state"] == "running" and st["tag"] == "rel-1"
    assert h.stop().returncode == 0
    wait_gone(doc["child_pid"], doc["supervisor_pid"])
    assert h.status()[0]["state"] == "stopped"


def test_systemd_yes_without_systemd_run_is_a_usage_error(h: Harness, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(h.tmp))
    r = h.start(SLEEPER, "--systemd", "yes")
    assert r.returncode == 2 and "systemd-run is not on PATH" in r.stderr


def test_env_file_and_cwd_reach_the_child(h: Harness) -> None:
    env_file = h.tmp / "eng.env"
    env_file.write_text(
        "# rendered by kimictl (do not edit)\nGREETING='hello world'\nexport OTHER=\"a b\"\nMULTI='x\ny'\n"
    )
    wd = h.tmp / "wd"
    wd.mkdir()
    script = "import json, os; print(json.dumps([os.getcwd(), os.environ['GREETING'], os.environ['OTHER'], "
    script += "os.environ['MULTI']]), flush=True); import time; time.sleep(600)"
    h.started(script, "--env-file", str(env_file), "--cwd", str(wd))
    expected = json.dumps([str(wd), "hello world", "a b", "x\ny"])
    wait_for(lambda: h.printed(expected), "env and cwd printed by the child")


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs a root supervisor")
def test_user_runs_the_command_as_that_user_while_the_supervisor_stays_root(h: Harness) -> None:
    import pwd

    nobody = pwd.getpwnam("nobody")
    cmd = ("start", "--name", "eng", "--run-dir", str(h.run_dir), "--log", str(h.log))
    script = 'echo "ids $(id -u) $(id -g) [$(id -G)] $HOME $USER"; sleep 600'
    r = h.sup(*cmd, "--user", "nobody", "--", "/bin/sh", "-c", script, h.marker)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["user"] == "nobody" and doc["state"] == "running"
    expected = f"ids {nobody.pw_uid} {nobody.pw_gid} [{' '.join(map(str, os.getgrouplist('nobody', nobody.pw_gid)))}]"
    wait_for(lambda: h.printed(f"{expected} {nobody.pw_dir} nobody"), "the child's ids in the log")
    with open(f"/proc/{doc['child_pid']}/status") as f:
        ids = {ln.split(":")[0]: ln.split()[1:] for ln in f if ln.startswith(("Uid:", "Gid:"))}
    assert ids == {"Uid": [str(nobody.pw_uid)] * 4, "Gid": [str(nobody.pw_gid)] * 4}
    with open(f"/proc/{doc['supervisor_pid']}/status") as f:
        assert next(ln for ln in f if ln.startswith("Uid:")).split()[1:] == ["0"] * 4
    assert h.log.stat().st_uid == 0 and h.state()["user"] == "nobody"
    # the user is part of "the same command": the same argv as root is another command
    again = h.sup(*cmd, "--", "/bin/sh", "-c", script, h.marker)
    assert again.returncode == 3 and "different command" in again.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs a root supervisor")
def test_user_reaches_the_supervisor_of_a_transient_unit(h: Harness, monkeypatch) -> None:
    import pwd

    launched = fake_systemd_run(h, monkeypatch)
    r = h.sup("start", "--name", "eng", "--run-dir", str(h.run_dir), "--log", str(h.log), "--systemd", "yes",
              "--user", "nobody", "--", "/bin/sh", "-c", "sleep 600", h.marker)
    assert r.returncode == 0, r.stderr
    args = launched.read_text().splitlines()
    last_cut = len(args) - 1 - args[::-1].index("--")  # the unit's supervisor options end here, the command follows
    assert args.index("run") < args.index("--user") < last_cut and args[args.index("--user") + 1] == "nobody"
    with open(f"/proc/{json.loads(r.stdout)['child_pid']}/status") as f:
        assert next(ln for ln in f if ln.startswith("Uid:")).split()[1] == str(pwd.getpwnam("nobody").pw_uid)


@pytest.mark.parametrize(("user", "message"), [("root", "--user root: is root"),
                                               ("no-such-user-kimi", "--user no-such-user-kimi: no such user")])
def test_user_that_is_root_or_unknown_is_a_usage_error(h: Harness, user: str, message: str) -> None:
    r = h.start(SLEEPER, "--user", user)
    assert r.returncode == 2 and message in r.stderr and not h.marked_pids()


def test_crashing_child_restarts_with_growing_backoff(h: Harness) -> None:
    h.started(CRASHER, "--backoff-min", "0.2", "--backoff-max", "0.8")
    seen: list[dict] = []

    def enough() -> bool:
        seen.append(h.state())
        return seen[-1]["restarts"] >= 4

    wait_for(enough, "four restarts")
    backoff = [s for s in seen if s["state"] == "backoff"]
    assert backoff, "backoff state never visible"
    assert all(s["last_exit"]["code"] == 3 and s["child_pid"] is None for s in backoff)
    assert {s["backoff_s"] for s in backoff} <= {0.2, 0.4, 0.8}
    # The log keeps every delay (polling could miss a short backoff on a loaded machine).
    delays = [line.rsplit(" ", 1)[1] for line in h.log_text().splitlines() if "] restarting in " in line]
    assert delays[:4] == ["0.2s", "0.4s", "0.8s", "0.8s"]  # doubling, capped at --backoff-max
    # a new child each time (from the log: a child that exits at once may never be seen "running" by polling)
    pids = re.findall(r"\] started pid (\d+): ", h.log_text())
    assert len(set(pids)) == len(pids) >= 4
    assert h.log_text().splitlines().count("boom") >= 4


def test_backoff_resets_after_the_child_stayed_up(h: Harness) -> None:
    script = "import sys, time; time.sleep(1.0); sys.exit(1)"
    h.started(script, "--backoff-min", "0.1", "--backoff-reset", "0.5")
    seen: list[dict] = []

    def enough() -> bool:
        seen.append(h.state())
        return seen[-1]["restarts"] >= 3

    wait_for(enough, "three restarts")
    delays = [line.rsplit(" ", 1)[1] for line in h.log_text().splitlines() if "] restarting in " in line]
    assert delays[:3] == ["0.1s", "0.1s", "0.1s"]
    assert {s["backoff_s"] for s in seen if s["state"] == "backoff"} <= {0.1}


def test_max_restarts_ends_failed(h: Harness) -> None:
    h.started(CRASHER, "--max-restarts", "2", "--restart-window", "60", "--backoff-min", "0.05")
    st = wait_for(lambda: [s for s in h.status() if s["state"] == "failed" and not s["alive"]], "failed")[0]
    assert st["restarts"] == 2 and st["last_exit"]["code"] == 3 and st["child_pid"] is None
    assert "--max-restarts 2" in st["error"]
    wait_gone(st["supervisor_pid"])
    assert h.log_text().splitlines().count("boom") == 3


def test_stop_sends_sigterm_first(h: Harness) -> None:
    flag = h.tmp / "term"
    doc = h.started(TERM_AWARE, extra=(str(flag),))
    wait_for(lambda: h.printed("ready"), "child ready")
    r = h.stop()
    assert r.returncode == 0 and r.stdout.strip() == "stopped", r.stderr
    assert flag.read_text() == "1 term"  # exactly one SIGTERM: a second one makes servers skip their cleanup
    st = h.state()
    assert st["state"] == "stopped" and st["last_exit"]["code"] == 0 and st["child_pid"] is None
    wait_gone(doc["child_pid"], doc["supervisor_pid"])
    assert h.status()[0]["state"] == "stopped"


def test_stop_sigkills_a_child_that_ignores_sigterm(h: Harness) -> None:
    doc = h.started(TERM_DEAF)
    wait_for(lambda: h.printed("ready"), "child ready")
    r = h.stop("--grace", "0.5")
    assert r.returncode == 0, r.stderr
    st = h.state()
    assert st["state"] == "stopped" and st["last_exit"]["signal"] == signal.SIGKILL
    assert st["last_exit"]["signal_name"] == "SIGKILL"
    wait_gone(doc["child_pid"])
    assert "grace period over: SIGKILL" in h.log_text()


def test_sigterm_to_supervisor_is_a_clean_stop_and_sighup_is_ignored(h: Harness) -> None:
    doc = h.started(TERM_DEAF, "--grace", "0.3")
    wait_for(lambda: h.printed("ready"), "child ready")
    os.kill(doc["supervisor_pid"], signal.SIGHUP)
    time.sleep(0.3)  # a default SIGHUP would have killed it by now
    assert h.status()[0]["alive"] is True and h.state()["child_pid"] == doc["child_pid"]
    os.kill(doc["supervisor_pid"], signal.SIGTERM)
    wait_for(lambda: h.status()[0]["state"] == "stopped", "stopped after SIGTERM")
    st = h.state()
    assert st["last_exit"]["signal"] == signal.SIGKILL and st["restarts"] == 0  # --grace from start applied
    wait_gone(doc["child_pid"])


def test_stop_kills_grandchildren_in_and_out_of_the_group(h: Harness) -> None:
    pids_file = h.tmp / "pids"
    doc = h.started(FAMILY, "--grace", "30", extra=(str(pids_file),))
    wait_for(lambda: h.printed("ready"), "child ready")
    same_group, own_session = json.loads(pids_file.read_text())
    assert os.getpgid(same_group) == doc["child_pid"] and os.getpgid(own_session) != doc["child_pid"]
    r = h.stop()
    assert r.returncode == 0, r.stderr
    wait_for(lambda: gone(same_group) and gone(own_session) and gone(doc["child_pid"]), "whole family gone")
    assert "grace period over" not in h.log_text()  # SIGTERM was enough; nobody waited for the grace


def test_log_rotation_keeps_at_most_k_files(h: Harness) -> None:
    h.started(CHATTY, "--max-log-bytes", "2000", "--keep-logs", "2")
    wait_for(lambda: h.printed("done"), "all output written")
    files = [h.log, Path(f"{h.log}.1"), Path(f"{h.log}.2")]
    assert all(f.exists() for f in files)
    assert not Path(f"{h.log}.3").exists()
    numbers = []
    for f in reversed(files):  # oldest first
        text = f.read_text()
        assert len(text.encode()) <= 2000 and text.endswith("\n")  # lines are never cut in two
        numbers += [int(line.split()[1]) for line in text.splitlines() if line.startswith("line ")]
    assert numbers == list(range(numbers[0], 300)) and numbers[0] > 0  # in order, oldest dropped


def test_start_is_idempotent(h: Harness) -> None:
    doc = h.started(SLEEPER, "--tag", "r1")
    r = h.start(SLEEPER, "--tag", "r1")
    assert r.returncode == 0 and r.stdout.strip() == "unchanged", r.stderr
    (st,) = h.status()
    assert st["child_pid"] == doc["child_pid"] and st["supervisor_pid"] == doc["supervisor_pid"]


def test_different_command_or_tag_conflicts_unless_replace(h: Harness) -> None:
    doc = h.started(SLEEPER, "--tag", "r1")
    r = h.start(SLEEPER, "--tag", "r2")
    assert r.returncode == 3 and "--replace" in r.stderr and "tag" in r.stderr
    other = SLEEPER.replace("hello out", "hello again")
    r = h.start(other, "--tag", "r1")
    assert r.returncode == 3 and "different command" in r.stderr
    assert h.state()["child_pid"] == doc["child_pid"]
    r = h.start(other, "--tag", "r2", "--replace")
    assert r.returncode == 0, r.stderr
    new = json.loads(r.stdout)
    assert new["child_pid"] != doc["child_pid"] and new["supervisor_pid"] != doc["supervisor_pid"]
    assert new["tag"] == "r2" and new["state"] == "running"
    wait_gone(doc["child_pid"], doc["supervisor_pid"])
    wait_for(lambda: h.printed("hello again"), "new command's output")


def test_lock_refuses_a_second_supervisor(h: Harness) -> None:
    doc = h.started(SLEEPER)
    r = h.sup("run", "--name", "eng", "--run-dir", str(h.run_dir), "--log", str(h.log), "--",
              PY, "-c", SLEEPER, h.marker)  # fmt: skip
    assert r.returncode == 3 and "already supervised" in r.stderr
    assert str(doc["supervisor_pid"]) in r.stderr
    assert h.state()["child_pid"] == doc["child_pid"] and h.state()["state"] == "running"


def test_concurrent_starts_make_one_supervisor(h: Harness) -> None:
    args = [SUP_PY, "-I", "-S", str(SUP), "start", "--name", "eng", "--run-dir", str(h.run_dir), "--log",
            str(h.log), "--", PY, "-c", SLEEPER, h.marker]  # fmt: skip
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=90) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert sorted(o.strip() == "unchanged" for o, _ in outs) == [False, True, True]
    children = [p for p in h.marked_pids() if str(SUP) not in Path(f"/proc/{p}/cmdline").read_text()]
    assert children == [h.state()["child_pid"]]


def test_status_reports_dead_and_stop_cleans_up_the_orphan(h: Harness) -> None:
    doc = h.started(SLEEPER)
    wait_for(lambda: h.printed("hello err"), "child output")  # later writes would SIGPIPE it: it is now idle
    os.kill(doc["supervisor_pid"], signal.SIGKILL)
    wait_for(lambda: h.status()[0]["state"] == "dead", "dead state")
    (st,) = h.status()
    assert st["recorded_state"] == "running" and st["alive"] is False and st["child_alive"] is True
    r = h.stop("--grace", "1")
    assert r.returncode == 0 and "supervisor was dead" in r.stdout, r.stdout
    wait_gone(doc["child_pid"])
    assert h.status()[0]["state"] == "stopped"


def test_status_ignores_other_programs_json_in_the_run_dir(h: Harness) -> None:
    h.started(SLEEPER)
    (h.run_dir / "front.json").write_text(json.dumps({"pid": 1, "routers": []}))
    assert [s["name"] for s in h.status()] == ["eng"]


def test_restart_after_a_dead_supervisor_replaces_its_orphan(h: Harness) -> None:
    doc = h.started(SLEEPER)
    wait_for(lambda: h.printed("hello err"), "child output")  # later writes would SIGPIPE it: it is now idle
    os.kill(doc["supervisor_pid"], signal.SIGKILL)
    wait_for(lambda: h.status()[0]["state"] == "dead", "dead state")
    new = h.started(SLEEPER)
    assert new["child_pid"] != doc["child_pid"]
    wait_for(lambda: gone(doc["child_pid"]), "orphan killed")
    assert "left behind by a dead supervisor" in h.log_text()


@pytest.mark.parametrize("kind", ["missing", "not-executable", "bad-cwd"])
def test_command_that_cannot_run_fails_at_start(h: Harness, kind: str) -> None:
    cmd, extra = [str(h.tmp / "nope")], []
    if kind == "not-executable":
        (h.tmp / "nope").write_text("#!/bin/sh\n")
    elif kind == "bad-cwd":
        cmd, extra = ["/bin/true"], ["--cwd", str(h.tmp / "missing-dir")]
    r = h.sup("start", "--name", "eng", "--run-dir", str(h.run_dir), "--log", str(h.log), *extra, "--", *cmd)
    assert r.returncode == 1
    assert "cannot execute" in r.stderr
    assert json.loads(r.stdout)["state"] == "failed"
    wait_for(lambda: h.status()[0]["alive"] is False, "supervisor gone")
    assert h.status()[0]["state"] == "failed"


def test_stop_is_idempotent_and_stop_all(h: Harness) -> None:
    r = h.stop(name="never-started")
    assert r.returncode == 0 and r.stdout.strip() == "already stopped"
    a = h.started(SLEEPER, name="a")
    b = h.started(SLEEPER, name="b")
    r = h.stop(name=None)
    assert r.returncode == 0 and r.stdout.splitlines() == ["a: stopped", "b: stopped"], r.stderr
    wait_gone(a["child_pid"], a["supervisor_pid"], b["child_pid"], b["supervisor_pid"])
    r = h.stop(name="a")
    assert r.returncode == 0 and r.stdout.strip() == "already stopped"
    assert [s["state"] for s in h.status()] == ["stopped", "stopped"]
    assert h.status("zzz") == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["start", "--name", "e", "--run-dir", "R", "--log", "L"], "missing command"),
        (["start", "--name", "../e", "--run-dir", "R", "--log", "L", "--", "true"], "invalid ID"),
        (["start", "--name", "e", "--run-dir", "R", "--log", "L", "--backoff-min", "0", "--", "true"], "backoff"),
        (["start", "--name", "e", "--run-dir", "R", "--log", "L", "--restart-window", "5", "--", "true"], "needs"),
        (["stop", "--run-dir", "R"], "exactly one"),
        (["status", "--run-dir", "R", "--", "true"], "takes no command"),
    ],
)
def test_usage_errors_exit_2(h: Harness, args: list[str], message: str) -> None:
    args = [str(h.tmp / a) if a in ("R", "L") else a for a in args]
    r = h.sup(*args)
    assert r.returncode == 2 and message in r.stderr
    assert not h.run_dir.exists() or not list(h.run_dir.iterdir())


@pytest.mark.parametrize(("text", "message"), [("A='unterminated\n", "quotation"), ("just words\n", "KEY=value")])
def test_bad_env_file_exits_2(h: Harness, text: str, message: str) -> None:
    env_file = h.tmp / "bad.env"
    env_file.write_text(text)
    r = h.start(SLEEPER, "--env-file", str(env_file))
    assert r.returncode == 2 and message in r.stderr


def test_log_writer_splits_overlong_lines_and_truncates_with_keep_0(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    w = sv.LogWriter(str(path), 10, 0)
    w.write(b"abcdefghijklmnop\n")  # longer than the limit: split, and keep-logs 0 means no archives
    w.close()
    assert path.read_bytes() == b"klmnop\n"
    assert not Path(f"{path}.1").exists()


def test_log_writer_follows_a_moved_file(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    w = sv.LogWriter(str(path), 0, 3)
    w.write(b"one\n")
    path.rename(tmp_path / "moved.log")  # logrotate without copytruncate
    w.write(b"two\n")
    w.event("note")
    w.close()
    assert (tmp_path / "moved.log").read_bytes() == b"one\n"
    lines = path.read_text().splitlines()
    assert lines[0] == "two" and lines[1].startswith("[supervisor ") and lines[1].endswith("] note")


def test_log_writer_drops_archives_beyond_keep(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    for i in range(1, 6):
        Path(f"{path}.{i}").write_text(f"old {i}\n")
    w = sv.LogWriter(str(path), 8, 2)
    w.write(b"aaaaaaa\nbbbbbbb\n")
    w.close()
    assert path.read_text() == "bbbbbbb\n" and Path(f"{path}.1").read_text() == "aaaaaaa\n"
    assert Path(f"{path}.2").read_text() == "old 1\n"
    assert not any(Path(f"{path}.{i}").exists() for i in (3, 4, 5))


def test_env_file_parsing(tmp_path: Path) -> None:
    f = tmp_path / "e.env"
    f.write_text('# c\nA=1\nexport B=\'x y\'  # trailing\nC="q\\"z"\nD=\n')
    assert sv.read_env_file(str(f)) == {"A": "1", "B": "x y", "C": 'q"z', "D": ""}
